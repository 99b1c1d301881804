"""Image folders (ImageFolder trees, the ImageNet train/val layout) and torchvision's CIFAR/MNIST folders.

Nothing is ever downloaded: torchvision datasets are opened with ``download=False``.
"""
from pathlib import Path
from typing import List, Optional

import torch
from PIL import Image

from .base import DataError, ImageDataset, TensorImageDataset

__all__ = ['FolderDataset', 'is_image_folder', 'torchvision_kind', 'open_torchvision', 'SPLIT_DIRS']

IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.ppm', '.bmp', '.pgm', '.tif', '.tiff', '.webp')
# folder names a split may have on disk (ImageNet uses train/ and val/)
SPLIT_DIRS = {'train': ('train',), 'val': ('val', 'validation', 'test'), 'test': ('test', 'val', 'validation')}


def _has_images(folder: Path) -> bool:
    return any(f.suffix.lower() in IMAGE_SUFFIXES for f in folder.iterdir() if f.is_file())


def is_image_folder(path: Path) -> bool:
    """``path/<class>/<image>`` (at least one class folder holding images)."""
    return path.is_dir() and any(d.is_dir() and _has_images(d) for d in path.iterdir())


class FolderDataset(ImageDataset):
    """An ImageFolder tree: ``root/<class name>/<image>``, classes sorted by name (ImageNet's
    ``train/`` and ``val/`` folders are two such trees, with WordNet ids as class names).

    ``classes`` fixes the class list (and so the label of each folder name), e.g. to evaluate a
    200-class subset such as ImageNet-R against a 1000-class model.
    """

    def __init__(self, root: Path, classes: Optional[List[str]] = None):
        from torchvision.datasets.folder import ImageFolder  # imported here: torchvision is slow to import
        if not root.is_dir():
            raise DataError(f'{root}: no such folder')
        try:
            folder = ImageFolder(str(root), loader=_open_image)
        except (FileNotFoundError, RuntimeError) as e:
            raise DataError(f'{root}: not an ImageFolder tree (<class>/<image>): {e}') from None
        self.samples = folder.samples
        if classes is not None:
            unknown = sorted(set(folder.classes) - set(classes))
            if unknown:
                raise DataError(f'{root}: class folder(s) {unknown[:5]} are not among the {len(classes)} classes given')
            index = {c: i for i, c in enumerate(classes)}
            self.samples = [(p, index[folder.classes[t]]) for p, t in self.samples]
        self.classes = list(classes or folder.classes)
        self.targets = torch.tensor([t for _, t in self.samples], dtype=torch.long)
        self.source = str(root)

    def load(self, index: int) -> Image.Image:
        return _open_image(self.samples[index][0])


def _open_image(path: str) -> Image.Image:
    try:
        im = Image.open(path)
        im.load()
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(f'{path}: not a decodable image ({type(e).__name__}: {e})') from None
    return im if im.mode in ('L', 'RGB') else im.convert('RGB')


def torchvision_kind(path: Path) -> Optional[str]:
    """'cifar10', 'cifar100' or 'mnist' if ``path`` is (or holds) a torchvision dataset folder."""
    if (path / 'cifar-10-batches-py').is_dir() or path.name == 'cifar-10-batches-py':
        return 'cifar10'
    if (path / 'cifar-100-python').is_dir() or path.name == 'cifar-100-python':
        return 'cifar100'
    for raw in (path / 'MNIST' / 'raw', path / 'raw', path):
        if raw.is_dir() and any(raw.glob('train-images-idx3-ubyte*')):
            return 'mnist'
    return None


def open_torchvision(path: Path, kind: str, split: str) -> TensorImageDataset:
    """Open a torchvision CIFAR-10/100 or MNIST folder (never downloads) as uint8 tensors."""
    import torchvision.datasets as tvd
    train = split == 'train'
    if split not in ('train', 'test', 'val'):
        raise DataError(f'{path}: {kind} has splits train and test, not {split!r}')
    if kind in ('cifar10', 'cifar100'):
        folder = 'cifar-10-batches-py' if kind == 'cifar10' else 'cifar-100-python'
        root = path.parent if path.name == folder else path
        cls = tvd.CIFAR10 if kind == 'cifar10' else tvd.CIFAR100
    else:
        root = path
        if path.name == 'raw':
            root = path.parent.parent if path.parent.name == 'MNIST' else path.parent
        elif path.name == 'MNIST':
            root = path.parent
        cls = tvd.MNIST
    try:
        ds = cls(str(root), train=train, download=False)
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted. You can use download=True ..."
        raise DataError(f'{path}: {kind} folder is incomplete or corrupt ({e}); vitblocks never downloads: '
                        f'copy the dataset there yourself') from None
    data = torch.as_tensor(ds.data)
    images = data[:, None] if data.ndim == 3 else data.permute(0, 3, 1, 2)  # MNIST (N, H, W); CIFAR (N, H, W, C)
    return TensorImageDataset(images.contiguous(), torch.as_tensor(ds.targets), ds.classes,
                              f'{path} [{"train" if train else "test"}] (torchvision {cls.__name__})')
