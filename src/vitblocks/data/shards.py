"""WebDataset shards (``.tar`` / ``.tar.gz``) read with Python's ``tarfile``.

A shard is a tar file whose members are grouped into samples by key (the member name up to
the first dot of its base name): ``<key>.jpg|jpeg|png|webp|bmp|ppm`` holds the image and
``<key>.cls`` the class index as ASCII digits. A folder of shards may carry ``MANIFEST.json``
(class names, per-split sample counts per shard) or ``classes.txt``; both are checked.

Small datasets (MNIST, CIFAR) are decoded once into one ``(N, C, H, W)`` uint8 tensor and
cached in this process, since decoding every JPEG/PNG every epoch dominates a CPU run (small
sets of images of several sizes are kept decoded as one array per image). Sets of up to
``MAX_DISK_CACHED_SHARD_BYTES`` are decoded once per node: the first process writes the decoded
set to ``$VITBLOCKS_CACHE/decoded`` and every later or concurrent run, rank or test reads it
(CIFAR-10's train split: ~25 s of decoding per process on 2 cores, and minutes for eight runs
started at once on one GPU machine, against a fraction of a second to read). Large uncompressed
``.tar`` shards are indexed instead (the index cached on disk once per node) and read member by
member through a bounded set of open files (``shard_index``); a large ``.tar.gz`` cannot be read
that way (gzip has no random access), so we say so.
"""
import glob
import io
import json
import os
import re
import tarfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from ..ticker import Ticker
from .base import DataError, ImageDataset, array_to_pil, check_labels, to_pil
from .shard_index import MAX_OPEN_SHARDS, OpenShards, cached_index, cached_on_node

__all__ = ['ShardDataset', 'find_shards', 'is_shard_path', 'read_manifest', 'manifest_counts', 'manifest_folder',
           'SHARD_SUFFIXES']

SHARD_SUFFIXES = ('.tar', '.tar.gz', '.tgz')
IMAGE_EXTS = ('jpg', 'jpeg', 'png', 'webp', 'bmp', 'ppm')
# decoded-in-memory limit: above this many compressed bytes we index .tar shards instead
MAX_CACHED_SHARD_BYTES = 2 << 30
# decoded once per node, into node_cache_dir('decoded'), up to this many compressed bytes (a decoded copy of
# PNG/JPEG shards takes ~5-10x their size on disk; CIFAR-10's 20 MB of shards give 185 MB)
MAX_DISK_CACHED_SHARD_BYTES = 256 << 20
DECODED_FORMAT = 'vitblocks-decoded-shards-v1'
_MEMORY_CACHE: Dict[Tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
_MEMORY_CACHE_SLOTS = 4


def _is_shard_file(p: Path) -> bool:
    return p.is_file() and p.name.endswith(SHARD_SUFFIXES)


def _expand_braces(pattern: str) -> List[str]:
    """WebDataset-style ``name-{0000..0009}.tar`` -> the ten names (one brace group per pass)."""
    m = re.search(r'\{(\d+)\.\.(\d+)\}', pattern)
    if not m:
        return [pattern]
    lo, hi, width = int(m.group(1)), int(m.group(2)), len(m.group(1))
    out = []
    for i in range(lo, hi + 1):
        out += _expand_braces(pattern[:m.start()] + str(i).zfill(width) + pattern[m.end():])
    return out


def is_shard_path(path: str) -> bool:
    """True if ``path`` is a shard file, a glob/brace pattern, or a folder holding shards (directly or in
    ``<split>/`` sub-folders, or with a MANIFEST.json)."""
    if any(c in path for c in '*?{'):
        return True
    p = Path(path)
    if _is_shard_file(p):
        return True
    if not p.is_dir():
        return False
    if (p / 'MANIFEST.json').is_file():
        return True
    children = list(p.iterdir())  # shards in the folder, or in its <split>/ sub-folders
    return any(_is_shard_file(c) or (c.is_dir() and any(_is_shard_file(g) for g in c.iterdir())) for c in children)


def find_shards(path: str, split: Optional[str]) -> List[Path]:
    """The shard files of ``split`` under ``path``.

    ``path`` is one shard, a glob or brace pattern (used as given, ``split`` ignored), or a
    folder: then ``<folder>/<split>/*.tar*`` or the shards whose file name has ``split`` as a
    ``-``/``_``/``.``-separated word (``cifar10-train-0000.tar.gz``).
    """
    if any(c in path for c in '*?{'):
        names = _expand_braces(path)
        absent = [n for n in names if not any(c in n for c in '*?[') and not Path(n).is_file()]
        if absent and len(absent) < len(names):  # a brace range names each shard: one missing is an error
            raise DataError(f'{absent[0]}: missing ({len(absent)} of the {len(names)} shards {path} names)')
        files = sorted({Path(f) for pat in names for f in glob.glob(pat)})
        if not files:
            raise DataError(f'{path}: the pattern matches no shard file')
        missing = [f for f in files if not _is_shard_file(f)]
        if missing:
            raise DataError(f'{missing[0]}: not a .tar/.tar.gz shard')
        return files
    p = Path(path)
    if not p.exists():
        raise DataError(f'{path}: no such file or directory')
    if p.is_file():
        if not _is_shard_file(p):
            raise DataError(f'{path}: not a shard (expected a file ending in {", ".join(SHARD_SUFFIXES)})')
        return [p]
    if split and (p / split).is_dir():
        p = p / split
        files = sorted(f for f in p.iterdir() if _is_shard_file(f))
    else:
        all_files = sorted(f for f in p.iterdir() if _is_shard_file(f))
        files = [f for f in all_files if split is None or split in re.split(r'[-_.]', f.name)]
        if not files and all_files:
            splits = sorted({w for f in all_files for w in re.split(r'[-_.]', f.name)
                             if w in ('train', 'val', 'validation', 'test')})
            raise DataError(f'{path}: no shard of split {split!r}; found {len(all_files)} shards'
                            + (f' of split(s) {", ".join(splits)}' if splits else ' with no split name in their names'))
    if not files:
        raise DataError(f'{path}: no .tar/.tar.gz shards in this folder')
    return files


def read_manifest(folder: Path) -> Tuple[Optional[List[str]], Dict]:
    """(class names, manifest dict) from MANIFEST.json or classes.txt, if the folder has them."""
    manifest, classes = {}, None
    mpath = folder / 'MANIFEST.json'
    if mpath.is_file():
        try:
            manifest = json.loads(mpath.read_text(encoding='utf-8'))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f'{mpath}: not valid JSON ({e})') from None
        except OSError as e:
            raise DataError(f'{mpath}: cannot read it ({e.strerror or e}); check its permissions') from None
        classes = manifest.get('classes')
        if classes is not None and manifest.get('num_classes') not in (None, len(classes)):
            raise DataError(f'{mpath}: num_classes={manifest["num_classes"]} but {len(classes)} class names')
    cpath = folder / 'classes.txt'
    if classes is None and cpath.is_file():
        try:
            text = cpath.read_text(encoding='utf-8')
        except UnicodeDecodeError as e:
            raise DataError(f'{cpath}: not UTF-8 text ({e.reason} at byte {e.start}); one class name a line') from None
        except OSError as e:
            raise DataError(f'{cpath}: cannot read it ({e.strerror or e}); check its permissions') from None
        classes = [line.strip() for line in text.splitlines() if line.strip()]
    return classes, manifest


def manifest_folder(path: str, shards: Sequence[Path]) -> Path:
    """The folder whose MANIFEST.json / classes.txt describe ``shards`` (found under ``path``): theirs, or,
    for shards in a ``<path>/<split>/`` sub-folder that has neither file, ``path`` itself."""
    folder, root = shards[0].parent, Path(path)
    if root.is_dir() and folder.parent == root and folder != root \
            and not any((folder / name).is_file() for name in ('MANIFEST.json', 'classes.txt')):
        return root
    return folder


def manifest_counts(manifest: Dict) -> Dict[str, Optional[int]]:
    """{shard file name: its number of samples} over every split of a MANIFEST.json (a listed
    ``<split>/<name>`` counts for ``<name>``)."""
    return {Path(sh['file']).name: sh.get('num_samples')
            for info in (manifest.get('splits') or {}).values() for sh in info.get('shards', [])}


def _decode(data: bytes, shard: Path, name: str) -> np.ndarray:
    try:
        im = Image.open(io.BytesIO(data))
        im.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f'{shard}: member {name!r} is not a decodable image ({type(e).__name__}: {e})') from None
    if im.mode not in ('L', 'RGB'):
        im = im.convert('L' if im.mode in ('1', 'I', 'I;16', 'F') else 'RGB')
    return np.asarray(im)


def _parse_cls(data: bytes, shard: Path, name: str) -> int:
    text = data.decode('ascii', errors='replace').strip()
    if not text.isdigit():
        raise DataError(f'{shard}: member {name!r} should hold a class index as ASCII digits, got {data[:20]!r}')
    return int(text)


def _check_end_of_archive(tf: tarfile.TarFile, shard: Path, last: Optional[str]) -> None:
    """A tar archive ends with two zero blocks. Cut exactly at a member boundary it reads without an error in
    tarfile, as a shorter shard; the missing end marker is what tells."""
    blocks = 2 * tarfile.BLOCKSIZE
    tf.fileobj.seek(tf.offset)
    end = tf.fileobj.read(blocks)
    if len(end) < blocks or end.count(0) != len(end):
        after = f'after member {last!r}' if last else 'at its start'
        raise DataError(f'{shard}: truncated shard: it ends {after} without the end-of-archive blocks a tar file '
                        f'ends with (cut short at a member boundary?); copy it again')


def _iter_samples(shard: Path, decode: bool):
    """Yield (key, image array or (offset, size, member name), label) in member order."""
    pending: Dict[str, Dict] = {}
    last = None
    order: List[str] = []
    try:
        with tarfile.open(shard, 'r:*') as tf:
            for member in tf:
                if not member.isfile():
                    continue
                last = member.name
                base = os.path.basename(member.name)
                if '.' not in base:
                    continue
                key = os.path.join(os.path.dirname(member.name), base.split('.', 1)[0])
                ext = base.split('.', 1)[1].lower()
                if ext not in IMAGE_EXTS and ext != 'cls':
                    continue  # other fields (.json, .txt) are not ours to read
                entry = pending.setdefault(key, {})
                if not entry:
                    order.append(key)
                if ext == 'cls':
                    entry['cls'] = _parse_cls(tf.extractfile(member).read(), shard, member.name)
                elif decode:
                    entry['img'] = _decode(tf.extractfile(member).read(), shard, member.name)
                else:
                    entry['img'] = (member.offset_data, member.size, member.name)
                # WebDataset shards keep a sample's members together: emit complete samples early
                if 'cls' in entry and 'img' in entry:
                    pending.pop(key)
                    yield key, entry['img'], entry['cls']
            _check_end_of_archive(tf, shard, last)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        where = f' after member {last!r}' if last else ' at its start'
        raise DataError(f'{shard}: corrupt or truncated shard: {type(e).__name__}: {e} ({where.strip()})') from None
    for key, entry in pending.items():
        missing = '.cls' if 'cls' not in entry else 'image (.jpg/.png/...)'
        raise DataError(f'{shard}: sample {key!r} has no {missing} member')


def _read_shard(shard: Path) -> Tuple[List[np.ndarray], List[int], List[str]]:
    images, labels, keys = [], [], []
    for key, img, label in _iter_samples(shard, decode=True):
        images.append(img)
        labels.append(label)
        keys.append(key)
    if not images:
        raise DataError(f'{shard}: empty shard (no <key>.<image> + <key>.cls samples)')
    return images, labels, keys


def _stack(images: List[np.ndarray]) -> Optional[torch.Tensor]:
    """One ``(N, C, H, W)`` uint8 tensor, or None when the images differ in size (kept as arrays)."""
    channels = 3 if any(a.ndim == 3 for a in images) else 1
    if len({a.shape[:2] for a in images}) > 1:
        return None
    out = np.empty((len(images), *images[0].shape[:2], channels), dtype=np.uint8)
    for i, a in enumerate(images):
        out[i] = a[:, :, None] if a.ndim == 2 else a  # grayscale broadcasts to RGB when the set is mixed
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()  # (N, H, W, C) -> (N, C, H, W)


class ShardDataset(ImageDataset):
    """Labelled images from WebDataset shards (see the module docstring).

    Args:
        path: a shard, a glob/brace pattern, or a folder of shards.
        split: 'train', 'test', ... (ignored for a file or pattern).
        classes: class names; default from MANIFEST.json / classes.txt next to the shards, else
            ``0..max label``.
        in_memory: decode everything once (default: when the shards are under
            ``MAX_CACHED_SHARD_BYTES``): into one uint8 tensor, or a list of arrays when the images
            differ in size. Otherwise uncompressed ``.tar`` shards are indexed (the index cached once
            per node, see ``shard_index``) and read sample by sample.
        max_open_shards: at most this many shard files open per process (index path).
    """

    def __init__(self, path: str, split: Optional[str] = 'train', classes: Optional[Sequence[str]] = None,
                 in_memory: Optional[bool] = None, max_open_shards: int = MAX_OPEN_SHARDS):
        self.shards = find_shards(str(path), split)
        found_classes, manifest = read_manifest(manifest_folder(str(path), self.shards))
        self.source = str(path) + (f' [{split}]' if split and Path(path).is_dir() else '')
        self._check_manifest(manifest, split, whole_split=Path(path).is_dir())
        total = sum(f.stat().st_size for f in self.shards)
        if in_memory is None:
            in_memory = total <= MAX_CACHED_SHARD_BYTES
        self._index, self._arrays, self._open = None, None, OpenShards(max_open_shards)
        if in_memory:
            decoded, self.targets, self._keys = self._load_cached()
            if isinstance(decoded, torch.Tensor):
                self.images = decoded
            else:  # images of several sizes: kept one array each, read through the PIL pipeline
                self.images, self._arrays = None, decoded
        else:
            self._index_members()
        if classes is not None and found_classes and list(classes) != list(found_classes):
            self.targets = self._remapped(self.targets, list(found_classes), list(classes), path)
        self.classes = list(classes or found_classes or [str(i) for i in range(int(self.targets.max()) + 1)])
        self._check_labels()

    @staticmethod
    def _remapped(targets: torch.Tensor, found: List[str], wanted: List[str], path) -> torch.Tensor:
        """Labels of the shards' own class list (their ``classes.txt``) renumbered by name into ``wanted``'s order
        (a checkpoint's classes): the same class keeps its name whatever its index. A new tensor: the decoded
        shards may be shared by other datasets."""
        unknown = [c for c in found if c not in wanted]
        if unknown:
            raise DataError(f'{path}: classes {unknown[:4]}{"..." if len(unknown) > 4 else ""} are not among the '
                            f'{len(wanted)} classes given ({", ".join(wanted[:4])}, ...)')
        check_labels(targets, len(found), str(path))  # a label outside the shards' own list cannot be renamed
        index = {name: i for i, name in enumerate(wanted)}
        mapping = torch.tensor([index[name] for name in found], dtype=torch.long)
        return mapping[targets]

    def _check_manifest(self, manifest: Dict, split: Optional[str], whole_split: bool) -> None:
        splits = manifest.get('splits') or {}
        self._expected = manifest_counts(manifest)
        info = splits.get(split) if split else None
        if not whole_split or not info:  # a file or pattern picks its shards itself
            return
        have = {f.name for f in self.shards}
        for sh in info.get('shards', []):
            if Path(sh['file']).name not in have:
                raise DataError(f'{self.shards[0].parent / Path(sh["file"]).name}: missing (listed in MANIFEST.json '
                                f'for split {split!r})')

    def _load_cached(self) -> Tuple[Union[torch.Tensor, List[np.ndarray]], torch.Tensor, List[Tuple[int, str]]]:
        key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in self.shards)
        if key in _MEMORY_CACHE:  # decoded before; the manifest it is checked against may be another one
            images, targets, keys = _MEMORY_CACHE[key]
        else:
            if sum(k[1] for k in key) <= MAX_DISK_CACHED_SHARD_BYTES:
                decoded = cached_on_node('decoded', DECODED_FORMAT, self.shards, self._decode,
                                         f'decoding {self.source}')
            else:
                decoded = self._decode()
            images, targets = decoded['images'], decoded['targets']
            if not isinstance(images, torch.Tensor):  # several sizes: one (H, W[, C]) array each
                images = [t.numpy() for t in images]
            keys = [(int(i), str(k)) for i, k in decoded['keys']]
            if len(_MEMORY_CACHE) >= _MEMORY_CACHE_SLOTS:
                _MEMORY_CACHE.pop(next(iter(_MEMORY_CACHE)))
            _MEMORY_CACHE[key] = (images, targets, keys)
        counts = np.bincount([i for i, _ in keys], minlength=len(self.shards))
        for shard, count in zip(self.shards, counts.tolist()):
            self._check_count(shard, count)
        return images, targets, keys

    def _decode(self) -> Dict[str, Any]:
        """Every shard decoded: {'images': (N, C, H, W) uint8 tensor, or a list of one tensor per image when
        they differ in size; 'targets': (N,) int64; 'keys': [(shard index, sample key)] in order}."""
        ticker = Ticker(len(self.shards), 'shards', f'decoding {self.source}', interval_s=5.0)
        with ThreadPoolExecutor(max_workers=min(len(self.shards), os.cpu_count() or 1)) as pool:
            parts = []
            for part in pool.map(_read_shard, self.shards):  # in order; each finished shard ticks
                parts.append(part)
                ticker.update(1)
        ticker.close()
        for shard, (imgs, _, _) in zip(self.shards, parts):
            self._check_count(shard, len(imgs))
        arrays = [a for imgs, _, _ in parts for a in imgs]
        stacked = _stack(arrays)
        return {'images': stacked if stacked is not None else [torch.tensor(a) for a in arrays],
                'targets': torch.tensor([c for _, labels, _ in parts for c in labels], dtype=torch.long),
                'keys': [(i, k) for i, (_, _, ks) in enumerate(parts) for k in ks]}

    def _check_count(self, shard: Path, count: int) -> None:
        expected = getattr(self, '_expected', {}).get(shard.name)
        if expected is not None and expected != count:
            raise DataError(f'{shard}: holds {count} samples but MANIFEST.json says {expected}; the shard is '
                            f'truncated or corrupt (re-copy it)')

    def _index_members(self) -> None:
        gz = [f for f in self.shards if not f.name.endswith('.tar')]
        if gz:
            raise DataError(f'{gz[0]}: too large to decode in memory, and a gzip-compressed shard cannot be read '
                            f'sample by sample; decompress the shards (gunzip -k) and point to the .tar files')
        index = cached_index(self.shards, self._build_index)
        counts = torch.bincount(index['shard'].long(), minlength=len(self.shards))
        for shard, n in zip(self.shards, counts.tolist()):
            self._check_count(shard, n)
        self._index, self.targets, self.images = index, index['label'], None

    def _build_index(self) -> Dict[str, Any]:
        """Every sample's (shard, byte offset, size, member name) and label, from one walk of the headers."""
        shard_ids, offsets, sizes, labels, names = [], [], [], [], []
        for i, shard in enumerate(self.shards):
            n = 0
            for _, (offset, size, name), label in _iter_samples(shard, decode=False):
                shard_ids.append(i)
                offsets.append(offset)
                sizes.append(size)
                labels.append(label)
                names.append(name)
                n += 1
            if not n:
                raise DataError(f'{shard}: empty shard (no <key>.<image> + <key>.cls samples)')
        return {'shard': torch.tensor(shard_ids, dtype=torch.int32), 'offset': torch.tensor(offsets),
                'size': torch.tensor(sizes), 'label': torch.tensor(labels, dtype=torch.long), 'names': names}

    def _check_labels(self) -> None:
        n = len(self.classes)
        bad = (self.targets < 0) | (self.targets >= n)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            where = self._where(i)
            raise DataError(f'{where}: class {int(self.targets[i])} but the dataset has {n} classes '
                            f'({"MANIFEST.json/classes.txt" if n and self.classes[0] != "0" else "given"}); '
                            f'the shards and the class list do not match')

    def _where(self, i: int) -> str:
        if self._index is not None:
            return f'{self.shards[int(self._index["shard"][i])]}: member {self._index["names"][i]!r}'
        shard, key = self._keys[i]
        return f'{self.shards[shard]}: member {key + ".cls"!r}'

    def load(self, index: int) -> Image.Image:
        if self.images is not None:
            return to_pil(self.images[index])
        if self._arrays is not None:
            return array_to_pil(self._arrays[index])
        shard = self.shards[int(self._index['shard'][index])]
        data = self._open.read(shard, int(self._index['offset'][index]), int(self._index['size'][index]))
        return array_to_pil(_decode(data, shard, self._index['names'][index]))
