"""Streaming a training split through timm's WebDataset reader (``create_dataset('wds/...')``).

``streaming=true`` in a training config. For sets too large to index or decode, and for shards on
a mounted object store (s3fs, gcsfuse, mountpoint-s3): each shard is read front to back once per
epoch, which such mounts do fast, instead of the indexed reader's random reads. timm's
``ReaderWds`` (webdataset's tar iterators) does the reading; its semantics are those of a stream:

- **the split over processes**: shards are dealt out to ``processes x max(1, workers)`` readers
  (reader i takes shards i, i + readers, ...), so there must be at least as many shards as readers;
- **the order**: shards shuffled per epoch from (seed, epoch), then samples through a shuffle buffer
  (``WDS_SHUFFLE_SIZE``, default 8192 samples);
- **an approximate epoch**: every reader delivers ``ceil(N / readers)`` samples rounded up to a
  whole batch (it starts its shards again if they run out first), so an epoch is about, not
  exactly, one pass over the N samples;
- **no mid-epoch resume**: a stream cannot start in its middle. A run resumed from a checkpoint
  saved mid-epoch (Ctrl-C, SIGTERM, a killed rank) restarts that epoch's stream and trains the
  epoch's remaining number of steps; ``checkpoint_interval`` is refused;
- **corrupt samples** are skipped with a warning (timm's ``log_and_continue``), not an error.

Where the shards are: ``data``'s training shards on a file system (a mounted object store
included), or ``url``, a WebDataset URL spec that webdataset opens itself: ``pipe:COMMAND``,
``http(s)://``, ``gs://``, a local path, each with brace patterns (``shard-{000000..001023}.tar``)
and ``::`` between specs. ``s3://`` URLs are read through the AWS CLI (``pipe:aws s3 cp URL -``),
since webdataset has no s3 scheme; a ``pipe:`` URL picks another client or endpoint.

The epoch length is ``num_samples`` if given (``train_samples``), else the per-shard counts in the
local MANIFEST.json (next to the shards, or in ``data`` for URLs), matched by shard file name;
the classes come from that folder's MANIFEST.json / classes.txt, else ``num_classes`` (names
``0..n-1``). Nothing is read from the shards before training starts. Evaluation reads the val
split map-style (exact, every image once).
"""
import logging
import os
import re
from itertools import islice
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader

from .base import DataError, ImageDataset
from .loader import DeviceBatches, derive_seed
from .shards import find_shards, manifest_counts, manifest_folder, read_manifest

__all__ = ['StreamingShards', 'StreamLoader', 'expand_shard_url']

# the shard file a URL reads: the last ``name.tar[.gz]`` / ``.tgz`` in it (a query string after it allowed)
_SHARD_NAME = re.compile(r'([^/\s:]+\.(?:tar|tar\.gz|tgz))(?:\?\S*)?(?=\s|$)')


def expand_shard_url(spec: str) -> List[str]:
    """One URL per shard: webdataset's ``expand_urls`` (``::``, braces), ``s3://`` through the AWS CLI."""
    from webdataset.shardlists import expand_urls
    if '|' in spec:  # timm's split string is "<urls>|<count>"
        raise DataError(f'{spec}: a "|" cannot go through timm\'s WebDataset split string; put the shell '
                        f'pipeline in a script and give pipe:/path/to/script.sh URL')
    return [f'pipe:aws s3 cp {u} -' if u.startswith('s3://') else u for u in expand_urls(spec)]


class StreamingShards(ImageDataset):
    """A streamed split as far as the run needs to know it before reading: shards, size, classes.

    Args:
        path: the dataset (a folder or pattern of shards); with ``url``, the local folder (or a shard
            in it) whose MANIFEST.json / classes.txt describes the URL's shards.
        split: which of ``path``'s shards (without ``url``).
        url: a WebDataset URL spec of the shards to stream instead (module docstring).
        num_samples: the split's number of samples (an epoch's length), when MANIFEST.json has none.
        num_classes: the number of classes, when MANIFEST.json / classes.txt have no class list.
    """

    def __init__(self, path: str, split: str = 'train', url: Optional[str] = None,
                 num_samples: Optional[int] = None, num_classes: Optional[int] = None):
        if url:
            self.urls = expand_shard_url(url)
            names = [_shard_name(u) for u in self.urls]
            folder, self.source, self.root = Path(path) if Path(path).is_dir() else Path(path).parent, url, ''
        else:
            shards = find_shards(str(path), split)
            bad = [f for f in shards if not f.name.endswith(('.tar', '.tar.gz'))]
            if bad:
                raise DataError(f'{bad[0]}: timm\'s WebDataset reader takes .tar / .tar.gz names; rename the shard')
            names, folder = [f.name for f in shards], manifest_folder(str(path), shards)
            self.source = str(path) + (f' [{split}]' if Path(path).is_dir() else '')
            self.root = os.path.commonpath([str(f.resolve().parent) for f in shards])
            self.urls = [os.path.relpath(f.resolve(), self.root) for f in shards]  # timm joins root and name
        classes, manifest = read_manifest(folder)
        self.num_samples = _epoch_length(names, manifest_counts(manifest), num_samples, folder)
        if not classes and not num_classes:
            raise DataError(f'{folder}: streaming=true takes the class names from MANIFEST.json ("classes") or '
                            f'classes.txt in {folder}, and there are none; add one, or set num_classes=N')
        self.classes = list(classes or [str(i) for i in range(num_classes)])
        self.classes_named = bool(classes)  # names of a class list, not 0..n-1 made up from num_classes

    def __len__(self) -> int:
        return self.num_samples

    def load(self, index: int):
        raise DataError(f'{self.source}: a streamed split has no random access (streaming=true)')

    def subset(self, indices: Sequence[int]) -> ImageDataset:
        raise DataError(f'{self.source}: a streamed split cannot be subset (streaming=true); drop train_subset')

    def describe(self) -> str:
        return (f'{self.num_samples} images, {self.num_classes} classes streamed from {self.source} '
                f'({len(self.urls)} shards, timm WebDataset reader)')


def _shard_name(url: str) -> str:
    found = _SHARD_NAME.findall(url)
    if not found:
        raise DataError(f'{url}: names no .tar / .tar.gz shard; timm\'s WebDataset reader takes shard URLs that '
                        f'end in (or, for pipe:, contain) such a name')
    return found[-1]


def _epoch_length(names: Sequence[str], counts: dict, num_samples: Optional[int], folder: Path) -> int:
    """``num_samples`` if given, else the sum of the shards' MANIFEST.json counts (both: they must agree)."""
    unknown = [n for n in names if counts.get(n) is None]
    listed = None if unknown else sum(counts[n] for n in names)
    if num_samples is None and listed is None:
        raise DataError(f'{unknown[0]}: streaming=true takes each shard\'s number of samples (the epoch length) '
                        f'from MANIFEST.json in {folder} ({{"splits": {{"train": {{"shards": [{{"file": '
                        f'"{unknown[0]}", "num_samples": N}}, ...]}}}}}}), and it lists none for this shard; add '
                        f'it, or set train_samples=N (the number of samples in all the shards)')
    if num_samples is not None and listed is not None and num_samples != listed:
        raise DataError(f'train_samples={num_samples}, but MANIFEST.json in {folder} counts {listed} samples in '
                        f'these {len(names)} shards; drop train_samples, or correct the manifest')
    return listed if num_samples is None else num_samples


class _CheckLabel:
    """Target transform: a label outside the class list is a data error, not a CUDA assert later."""

    def __init__(self, num_classes: int, source: str):
        self.num_classes, self.source = num_classes, source

    def __call__(self, label: int) -> int:
        if not 0 <= label < self.num_classes:
            raise DataError(f'{self.source}: a sample has class {label} but the dataset has {self.num_classes} '
                            f'classes (MANIFEST.json/classes.txt); the shards and the class list do not match')
        return label


class StreamLoader:
    """Training batches of a ``StreamingShards`` split: timm's ``create_dataset('wds/...')`` in a
    DataLoader (persistent workers), delivered by ``DeviceBatches`` (uint8 normalized on the device
    when ``normalize`` is given). ``len()``: batches per epoch, the same on every process."""

    def __init__(self, data: StreamingShards, transform: Callable, batch_size: int, seed: int = 0, workers: int = 0,
                 device: torch.device = torch.device('cpu'), rank: int = 0, world_size: int = 1, channels: int = 3,
                 normalize: Optional[Tuple[Sequence[float], Sequence[float]]] = None,
                 erase: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        readers = world_size * max(1, workers)
        if len(data.urls) < readers:
            raise DataError(f'{data.source}: streaming=true deals whole shards to {world_size} process(es) x '
                            f'{max(1, workers)} loader worker(s) = {readers} readers, but there are only '
                            f'{len(data.urls)} shards; use workers={max(1, len(data.urls) // world_size)} or '
                            f'fewer, or cut the set into more shards')
        from timm.data import create_dataset
        names = '::'.join(data.urls)  # timm's split string: "<url>::<url>...|<count>", each joined to root
        wds_log = logging.getLogger('timm.data.readers.reader_wds')
        level = wds_log.level
        wds_log.setLevel(logging.ERROR)  # its "no _info.json" warning: the count is ours
        try:
            self.dataset = create_dataset('wds/', root=data.root, split=f'{names}|{data.num_samples}', is_training=True,
                                          batch_size=batch_size, seed=seed, input_img_mode='L' if channels == 1
                                          else 'RGB', transform=transform,
                                          target_transform=_CheckLabel(data.num_classes, data.source))
        finally:
            wds_log.setLevel(level)
        self.dataset.set_loader_cfg(num_workers=workers)  # timm sizes each reader's share from it
        self.dataloader = DataLoader(self.dataset, batch_size=batch_size, num_workers=workers,
                                     pin_memory=device.type == 'cuda', persistent_workers=workers > 0,
                                     generator=torch.Generator().manual_seed(derive_seed(seed, rank, 4)))
        self._batches = DeviceBatches(self.dataloader, device, normalize, erase)

    def __len__(self) -> int:
        return len(self.dataloader)  # readers on this process x ceil(N / readers in all) / batch_size

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """Epoch ``epoch``'s stream from its beginning (a stream cannot start in its middle), cut to the
        ``len(self) - start`` batches the epoch has left."""
        self.dataset.set_epoch(epoch)  # the shard shuffle's seed is seed + epoch, in every worker
        yield from islice(self._batches, len(self) - start)
