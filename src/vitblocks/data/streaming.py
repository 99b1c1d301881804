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

The sample count per shard (an epoch's length) and the class names come from MANIFEST.json next
to the shards; nothing is read from the shards before training starts. Evaluation reads the val
split map-style (exact, every image once).
"""
import logging
import os
from itertools import islice
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader

from .base import DataError, ImageDataset
from .loader import DeviceBatches, derive_seed
from .shards import find_shards, manifest_counts, read_manifest

__all__ = ['StreamingShards', 'StreamLoader']


class StreamingShards(ImageDataset):
    """A streamed split as far as the run needs to know it before reading: shards, size, classes."""

    def __init__(self, path: str, split: str = 'train'):
        self.shards = find_shards(str(path), split)
        self.source = str(path) + (f' [{split}]' if Path(path).is_dir() else '')
        classes, manifest = read_manifest(self.shards[0].parent)
        counts = manifest_counts(manifest)
        unknown = [f for f in self.shards if counts.get(f.name) is None]
        if unknown:
            raise DataError(f'{unknown[0]}: streaming=true takes each shard\'s number of samples (the epoch length) '
                            f'from MANIFEST.json next to the shards ({{"splits": {{"{split}": {{"shards": [{{"file": '
                            f'"{unknown[0].name}", "num_samples": N}}, ...]}}}}}}), and it lists none for this shard; '
                            f'add it, or drop streaming=true (the indexed reader counts samples itself)')
        if not classes:
            raise DataError(f'{self.shards[0].parent}: streaming=true takes the class names from MANIFEST.json '
                            f'("classes") or classes.txt next to the shards, and there are none; add one')
        bad = [f for f in self.shards if not f.name.endswith(('.tar', '.tar.gz'))]
        if bad:
            raise DataError(f'{bad[0]}: timm\'s WebDataset reader takes .tar / .tar.gz names; rename the shard')
        self.classes = list(classes)
        self.num_samples = sum(counts[f.name] for f in self.shards)

    def __len__(self) -> int:
        return self.num_samples

    def load(self, index: int):
        raise DataError(f'{self.source}: a streamed split has no random access (streaming=true)')

    def subset(self, indices: Sequence[int]) -> ImageDataset:
        raise DataError(f'{self.source}: a streamed split cannot be subset (streaming=true); drop train_subset')

    def describe(self) -> str:
        return (f'{self.num_samples} images, {self.num_classes} classes streamed from {self.source} '
                f'({len(self.shards)} shards, timm WebDataset reader)')


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
        if len(data.shards) < readers:
            raise DataError(f'{data.source}: streaming=true deals whole shards to {world_size} process(es) x '
                            f'{max(1, workers)} loader worker(s) = {readers} readers, but there are only '
                            f'{len(data.shards)} shards; use workers={max(1, len(data.shards) // world_size)} or '
                            f'fewer, or cut the set into more shards')
        from timm.data import create_dataset
        root = os.path.commonpath([str(f.resolve().parent) for f in data.shards])
        names = '::'.join(os.path.relpath(f.resolve(), root) for f in data.shards)  # timm's split string
        wds_log = logging.getLogger('timm.data.readers.reader_wds')
        level = wds_log.level
        wds_log.setLevel(logging.ERROR)  # its "no _info.json" warning: our counts come from MANIFEST.json
        try:
            self.dataset = create_dataset('wds/', root=root, split=f'{names}|{data.num_samples}', is_training=True,
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
