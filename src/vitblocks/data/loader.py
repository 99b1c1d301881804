"""Loaders whose batches are a pure function of (seed, epoch, step): exact resume, any worker count.

``EpochOrder`` gives each epoch's sample order (a seeded permutation, sharded over DDP ranks
like ``DistributedSampler``). ``TensorLoader`` slices batches straight out of a dataset held in
memory as uint8 and augments them batched (no per-sample Python work); ``PILLoader`` runs
timm's per-sample PIL transforms in DataLoader workers, seeding every sample's augmentation
from (seed, epoch, index), and (in training runs, by default) hands uint8 batches to the device
(``DeviceBatches``). Both start an epoch at any step, which is how ``--resume`` continues
mid-epoch without replaying or skipping data.
"""
import math
import random
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .base import ImageDataset
from .transforms import BatchTransform

__all__ = ['EpochOrder', 'TensorLoader', 'PILLoader', 'DeviceBatches', 'derive_seed']

_MASK64 = (1 << 64) - 1


def derive_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from integers (splitmix64 steps), stable across processes and runs."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


class EpochOrder:
    """This rank's sample indices for an epoch, cut into batches.

    Training (``shuffle=True``): a permutation seeded by (seed, epoch), padded by wrapping to
    a multiple of ``world_size``, every ``world_size``-th index from ``rank``; incomplete last
    batches are dropped. Evaluation (``shuffle=False``): ``rank::world_size`` of 0..n-1, no padding
    (counts are summed across ranks, so every sample is counted exactly once), last batch kept.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1):
        if num_samples < world_size or (shuffle and num_samples < batch_size * world_size):
            raise ValueError(f'{num_samples} samples are fewer than one batch of {batch_size} per process '
                             f'x {world_size} processes; lower the batch size')
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size

    def indices(self, epoch: int) -> torch.Tensor:
        n = self.num_samples
        if not self.shuffle:
            return torch.arange(self.rank, n, self.world_size)
        g = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
        order = torch.randperm(n, generator=g)
        total = math.ceil(n / self.world_size) * self.world_size
        order = torch.cat([order, order[:total - n]])
        return order[self.rank::self.world_size]

    @property
    def batches_per_epoch(self) -> int:
        per_rank = math.ceil(self.num_samples / self.world_size) if self.shuffle else \
            len(range(self.rank, self.num_samples, self.world_size))
        return per_rank // self.batch_size if self.shuffle else math.ceil(per_rank / self.batch_size)

    @property
    def batches_on_every_rank(self) -> int:
        """The batches each rank has at least: the same as ``batches_per_epoch`` for training; in an evaluation
        the last ranks hold ``num_samples // world_size`` samples, one fewer than the first ones, maybe one batch
        fewer (what a per-batch collective such as a stop vote may count on)."""
        if self.shuffle:
            return self.batches_per_epoch
        return math.ceil(self.num_samples // self.world_size / self.batch_size)

    def batches(self, epoch: int, start: int = 0) -> List[torch.Tensor]:
        idx = self.indices(epoch)
        bs = self.batch_size
        return [idx[b * bs:(b + 1) * bs] for b in range(start, self.batches_per_epoch)]


class TensorLoader:
    """Batches sliced from ``dataset.images`` (uint8, in memory), augmented on ``device`` batched."""

    def __init__(self, dataset: ImageDataset, order: EpochOrder, transform: BatchTransform,
                 device: torch.device = torch.device('cpu'), images_on_device: bool = False):
        if dataset.images is None:
            raise ValueError('TensorLoader needs a dataset decoded in memory (dataset.images)')
        self.dataset, self.order, self.transform, self.device = dataset, order, transform, device
        self.images = dataset.images.to(device) if images_on_device else dataset.images
        self.targets = dataset.targets.to(device) if images_on_device else dataset.targets

    def __len__(self) -> int:
        return self.order.batches_per_epoch

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for step, idx in enumerate(self.order.batches(epoch, start), start):
            idx = idx.to(self.images.device, non_blocking=True)  # pageable -> staged at once, no stream sync
            x = self.images[idx].to(self.device, non_blocking=True)
            y = self.targets[idx].to(self.device, non_blocking=True)
            g = torch.Generator().manual_seed(derive_seed(self.order.seed, epoch, step, self.order.rank, 1))
            yield self.transform(x, g), y


class _SeededSamples(Dataset):
    """``dataset[(index, seed)]``: the sample transformed with python/numpy/torch RNGs seeded by
    ``seed``; the caller's RNG states are left as they were (workers=0 runs in the main process)."""

    def __init__(self, dataset: ImageDataset, transform: Callable):
        self.dataset, self.transform = dataset, transform

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        index, seed = key
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            random.seed(seed)
            np.random.seed(seed & 0xFFFFFFFF)
            torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed seeds every device (~10 ms)
            img = self.transform(self.dataset.load(index))
        random.setstate(py_state)
        np.random.set_state(np_state)
        return img, int(self.dataset.targets[index])


class _EpochBatches:
    """Batch sampler of a DataLoader kept for the whole run: set to an epoch's batches before each pass
    (samplers run in the main process, so persistent workers see the new order)."""

    def __init__(self):
        self.batches: List[List[Tuple[int, int]]] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class DeviceBatches:
    """The batches of ``dataloader`` on ``device``.

    ``normalize=(mean, std)``: the DataLoader yields uint8 images (``build_pil_transform(uint8=True)``),
    so workers hand over a quarter of the bytes of float32 batches (shared memory, pinned memory,
    host-to-device copy); timm's ``PrefetchLoader`` converts them to float and normalizes them on
    ``device`` (on CUDA overlapping the copy of the next batch), then ``erase`` (timm's
    ``RandomErasing``) runs on each batch as it is consumed, drawing from the training process's RNGs
    (checkpointed, so resume stays exact; drawn at prefetch time, one batch ahead, they would not
    be). ``normalize=None``: the DataLoader yields normalized float images (erased per sample).
    """

    def __init__(self, dataloader: DataLoader, device: torch.device,
                 normalize: Optional[Tuple[Sequence[float], Sequence[float]]] = None,
                 erase: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        if erase is not None and normalize is None:
            raise ValueError('erase acts on batches normalized on the device; without normalize the transform '
                             'erases per sample')
        self.dataloader, self.device, self.erase, self._prefetch = dataloader, device, erase, None
        if normalize is not None:
            from timm.data.loader import PrefetchLoader
            mean, std = normalize
            self._prefetch = PrefetchLoader(dataloader, mean=tuple(mean), std=tuple(std), channels=len(mean),
                                            device=device)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        if self._prefetch is None:
            for x, y in self.dataloader:
                yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            return
        for x, y in self._prefetch:
            yield (self.erase(x) if self.erase is not None else x), y


class PILLoader:
    """timm's per-sample PIL transforms in a DataLoader (``workers`` processes, started once and kept
    across epochs: ``persistent_workers``); ``normalize`` and ``erase``: see ``DeviceBatches``."""

    def __init__(self, dataset: ImageDataset, order: EpochOrder, transform: Callable, workers: int = 0,
                 device: torch.device = torch.device('cpu'),
                 normalize: Optional[Tuple[Sequence[float], Sequence[float]]] = None,
                 erase: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.order = order
        self._sampler = _EpochBatches()
        # built once (workers start at the first pass and persist); the raw uint8/float batches of the workers
        self.dataloader = DataLoader(_SeededSamples(dataset, transform), batch_sampler=self._sampler,
                                     num_workers=workers, pin_memory=device.type == 'cuda',
                                     persistent_workers=workers > 0, generator=torch.Generator().manual_seed(0))
        self._batches = DeviceBatches(self.dataloader, device, normalize, erase)

    def __len__(self) -> int:
        return self.order.batches_per_epoch

    def set_epoch(self, epoch: int, start: int = 0) -> int:
        """Point the DataLoader at ``epoch``'s batches from step ``start``; returns how many there are."""
        self._sampler.batches = [[(int(i), derive_seed(self.order.seed, epoch, int(i), 2)) for i in idx]
                                 for idx in self.order.batches(epoch, start)]
        return len(self._sampler.batches)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        if self.set_epoch(epoch, start):
            yield from self._batches
