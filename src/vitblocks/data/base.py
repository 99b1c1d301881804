"""What every vitblocks dataset provides, and the one error type for bad data."""
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

__all__ = ['DataError', 'ImageDataset', 'TensorImageDataset', 'to_pil', 'array_to_pil', 'check_labels']


class DataError(ValueError):
    """Bad or missing data: the message names the path (and the shard member) and says how to fix it."""


class ImageDataset(torch.utils.data.Dataset):
    """A labelled image dataset with random access.

    Subclasses set ``classes`` (names, index = label), ``targets`` (LongTensor of labels),
    ``source`` (a path or description, for messages) and implement ``load(i) -> PIL image``.
    ``images`` is a ``(N, C, H, W)`` uint8 tensor when the whole dataset is decoded in memory
    (small sets such as MNIST and CIFAR), which lets the training loop skip per-sample PIL work.
    """
    classes: List[str]
    targets: torch.Tensor
    source: str = ''
    images: Optional[torch.Tensor] = None

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.targets)

    def load(self, index: int) -> Image.Image:
        raise NotImplementedError

    def __getitem__(self, index: int) -> Tuple[Image.Image, int]:
        return self.load(index), int(self.targets[index])

    def subset(self, indices: Sequence[int]) -> 'ImageDataset':
        return _Subset(self, torch.as_tensor(indices, dtype=torch.long))

    def describe(self) -> str:
        cached = f', decoded in memory as {tuple(self.images.shape)} uint8' if self.images is not None else ''
        return f'{len(self)} images, {self.num_classes} classes from {self.source}{cached}'


class TensorImageDataset(ImageDataset):
    """Images held as one ``(N, C, H, W)`` uint8 tensor (C = 1 grayscale or 3 RGB)."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, classes: Sequence[str], source: str):
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] not in (1, 3):
            raise DataError(f'{source}: expected (N, 1|3, H, W) uint8 images, got {tuple(images.shape)} {images.dtype}')
        if len(images) != len(targets):
            raise DataError(f'{source}: {len(images)} images but {len(targets)} labels')
        self.images = images
        self.targets = targets.long()
        self.classes = list(classes)
        self.source = source
        check_labels(self.targets, len(self.classes), source)

    def load(self, index: int) -> Image.Image:
        return to_pil(self.images[index])


class _Subset(ImageDataset):
    def __init__(self, parent: ImageDataset, indices: torch.Tensor):
        self.parent, self.indices = parent, indices
        self.classes, self.source = parent.classes, f'{parent.source} (subset of {len(indices)})'
        self.targets = parent.targets[indices]
        self.images = parent.images[indices] if parent.images is not None else None

    def load(self, index: int) -> Image.Image:
        return self.parent.load(int(self.indices[index]))


def check_labels(targets: torch.Tensor, num_classes: int, source: str) -> None:
    """Every label must index a class: a mismatch means the wrong classes file or a mixed-up dataset."""
    if len(targets) and (int(targets.min()) < 0 or int(targets.max()) >= num_classes):
        raise DataError(f'{source}: labels range {int(targets.min())}..{int(targets.max())} but there are '
                        f'{num_classes} classes; check classes.txt / MANIFEST.json or pass the right --num-classes')


def array_to_pil(a: np.ndarray) -> Image.Image:
    """(H, W) or (H, W, 1|3) uint8 -> a PIL image in mode L or RGB."""
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    return Image.fromarray(np.ascontiguousarray(a))  # uint8 (H, W) -> L, (H, W, 3) -> RGB


def to_pil(img: torch.Tensor) -> Image.Image:
    return array_to_pil(img.permute(1, 2, 0).numpy())  # (C, H, W) -> (H, W, C)
