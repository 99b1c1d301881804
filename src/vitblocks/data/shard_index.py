"""What shard sets need beyond reading a tar: a per-sample index of a large set and the decoded images
of a small one, each made once per node (``cached_on_node``), and a bounded number of open shard files
per process.

Why not ``wids`` (webdataset's indexed dataset, a separate package from ``webdataset`` 1.0.2):
its ``ShardListDataset`` copies every local shard into a cache folder (``/tmp/_wids_cache``) or,
told to read in place, writes ``.lock`` files next to the shards (fails on a read-only data
mount); it prints to stderr in every process, checks with ``assert``, re-walks a shard's tar
headers every time its LRU re-opens it, and gives no labels without reading every sample. What
we need from it is small: the index (below, cached for every rank and worker of a node) and an
LRU of open files (``OpenShards``).
"""
import fcntl
import hashlib
import os
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, Sequence

import torch

__all__ = ['OpenShards', 'cached_index', 'cached_on_node', 'index_cache_dir', 'node_cache_dir', 'MAX_OPEN_SHARDS',
           'CACHE_ENV']

CACHE_ENV = 'VITBLOCKS_CACHE'
INDEX_FORMAT = 'vitblocks-shard-index-v1'
# per process: 8 GPUs x 8 loader workers x 64 = 4,096 descriptors per node, under the usual 65,536
MAX_OPEN_SHARDS = 64


def node_cache_dir(kind: str) -> Path:
    """``$VITBLOCKS_CACHE/<kind>``, else ``$XDG_CACHE_HOME`` or ``~/.cache`` ``/vitblocks/<kind>`` (node-local by
    default, so each node builds a cached file once). Any file there may be deleted at any time."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache',
                                                     'vitblocks')
    return Path(root) / kind


def index_cache_dir() -> Path:
    """Where shard indexes are cached: ``node_cache_dir('shard-index')``."""
    return node_cache_dir('shard-index')


def _set_key(shards: Sequence[Path]) -> str:
    """Identifies a shard set's content: a changed, moved or rewritten shard gives a new key."""
    lines = []
    for f in shards:
        st = f.stat()
        lines.append(f'{f.resolve()}\t{st.st_size}\t{st.st_mtime_ns}')
    return '\n'.join(lines)


def cached_index(shards: Sequence[Path], build: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``build()``'s index of ``shards``, read from the cache when an identical set was indexed before
    (one tar walk per node, not per rank; see :func:`cached_on_node`)."""
    return cached_on_node('shard-index', INDEX_FORMAT, shards, build, f'indexing {len(shards)} shards')


def cached_on_node(kind: str, fmt: str, shards: Sequence[Path], build: Callable[[], Dict[str, Any]],
                   what: str) -> Dict[str, Any]:
    """``build()``'s dict for ``shards``, from ``node_cache_dir(kind)`` when this node made it for the same
    shard files before (same paths, sizes and modification times) in format ``fmt``.

    The first process of a node to get here builds it under an exclusive file lock and writes it
    atomically; every other rank, worker or concurrent run waits for the lock (saying so) and then
    reads the file. A cut-off or foreign file is built again. A cache that cannot be written (no
    permission, disk full) is not an error: the result is built in this process, with a warning.
    ``build()`` must return tensors, lists, tuples, numbers and strings only (``weights_only`` load).
    """
    key = _set_key(shards)
    cache = node_cache_dir(kind)
    path = cache / f'{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt'
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix('.lock'), 'a+')
    except OSError as e:
        warnings.warn(f'{kind} cache {cache} is not writable ({e}); {what} in this process (set {CACHE_ENV} to a '
                      f'writable folder to do it once per node)')
        return build()
    with lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f'waiting for another process {what} (lock {lock.name})', file=sys.stderr, flush=True)
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        if path.is_file():
            try:
                cached = torch.load(path, map_location='cpu', weights_only=True)
                if isinstance(cached, dict) and cached.get('format') == fmt and cached.get('key') == key:
                    return cached
            except Exception:  # a cut-off or foreign file: build it again
                pass
        built = {**build(), 'format': fmt, 'key': key}
        tmp = path.with_suffix(f'.{os.getpid()}.tmp')
        try:
            torch.save(built, tmp)
            os.replace(tmp, path)  # atomic: a reader never sees half a file
        except (OSError, RuntimeError) as e:  # a full disk: torch.save raises RuntimeError from its zip writer
            tmp.unlink(missing_ok=True)
            warnings.warn(f'could not write {path} ({e}); {what} again in the next process')
        return built


class OpenShards:
    """At most ``limit`` shard files open in this process; the least recently used is closed first.

    Reads use ``os.pread`` (offset given, no shared file position). A forked DataLoader worker
    drops the handles it inherited and opens its own; pickling (spawned workers) carries none.
    """

    def __init__(self, limit: int = MAX_OPEN_SHARDS):
        if limit < 1:
            raise ValueError(f'max_open_shards={limit}: expected at least 1')
        self.limit, self._files, self._pid = limit, OrderedDict(), os.getpid()

    def read(self, path: Path, offset: int, size: int) -> bytes:
        if self._pid != os.getpid():  # a forked worker: its copies of the parent's descriptors count too
            self.close()
            self._pid = os.getpid()
        f = self._files.pop(path, None)
        if f is None:
            if len(self._files) >= self.limit:
                self._files.popitem(last=False)[1].close()
            f = open(path, 'rb')
        self._files[path] = f  # most recently used last
        return os.pread(f.fileno(), size, offset)

    def __len__(self) -> int:
        return len(self._files)

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].close()

    def __getstate__(self) -> Dict[str, Any]:
        return {'limit': self.limit}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state['limit'])
