"""``build_dataset(PATH|NAME, split)``: find out what a path holds and open it.

Recognised, in this order: WebDataset shards (a ``.tar``/``.tar.gz`` file, a glob or
``{0000..0009}`` pattern, or a folder of shards), torchvision's CIFAR-10/100 and MNIST
folders, the ImageNet layout (``root/train/<wnid>/...``, ``root/val/<wnid>/...``) and any
ImageFolder tree (``root/<class>/<image>``, or ``root/<split>/<class>/<image>``).

A bare NAME (``mnist``, ``cifar10``) is looked up as a folder under each root in the
``VITBLOCKS_DATA`` environment variable (``os.pathsep``-separated), then under ``./data``.
"""
import os
from pathlib import Path
from typing import List, Optional, Sequence

from .base import DataError, ImageDataset
from .folders import SPLIT_DIRS, FolderDataset, is_image_folder, open_torchvision, torchvision_kind
from .shards import ShardDataset, find_shards, is_shard_path

__all__ = ['build_dataset', 'resolve_data_path', 'data_roots', 'eval_split_of']

DATA_ENV = 'VITBLOCKS_DATA'


def data_roots() -> List[Path]:
    roots = [Path(p) for p in os.environ.get(DATA_ENV, '').split(os.pathsep) if p]
    return roots + [Path('data')]


def resolve_data_path(data: str) -> str:
    """A path as given if it exists (or is a pattern), else ``<root>/<data>`` for the first data root holding it."""
    if Path(data).exists() or any(c in data for c in '*?{'):
        return data
    if os.sep not in data and '/' not in data:
        for root in data_roots():
            if (root / data).exists():
                return str(root / data)
        roots = ', '.join(str(r) for r in data_roots())
        raise DataError(f'{data}: no such file or folder, and no dataset of that name under the data roots '
                        f'({roots}); give a path or set {DATA_ENV}=/path/to/datasets')
    raise DataError(f'{data}: no such file or directory')


def _split_dirs(root: Path, split: str) -> Sequence[str]:
    return [d for d in SPLIT_DIRS.get(split, (split,)) if (root / d).is_dir()]


def eval_split_of(data: str) -> str:
    """The held-out split a dataset has: 'val' (ImageNet layout), else 'test'."""
    path = resolve_data_path(data)
    p = Path(path)
    if p.is_dir() and not is_shard_path(path):
        return 'val' if (p / 'val').is_dir() or (p / 'validation').is_dir() else 'test'
    for split in ('val', 'validation', 'test'):
        try:
            find_shards(path, split)
            return split
        except DataError:
            continue
    return 'test'


def build_dataset(data: str, split: str = 'train', classes: Optional[Sequence[str]] = None,
                  in_memory: Optional[bool] = None) -> ImageDataset:
    """Open ``split`` of the dataset at ``data`` (a path or a name; see the module docstring)."""
    path = resolve_data_path(str(data))
    p = Path(path)
    if is_shard_path(path):
        if p.is_dir() and not _shards_or_none(path, split):
            for alias in SPLIT_DIRS.get(split, ()):
                if alias != split and _shards_or_none(path, alias):
                    return ShardDataset(path, alias, classes, in_memory)
        return ShardDataset(path, split, classes, in_memory)
    kind = torchvision_kind(p)
    if kind:
        return open_torchvision(p, kind, split)
    for d in _split_dirs(p, split):
        if is_image_folder(p / d):
            return FolderDataset(p / d, list(classes) if classes else None)
    if is_image_folder(p):  # one tree, no split folders: it is the split asked for
        return FolderDataset(p, list(classes) if classes else None)
    if p.is_dir():
        subs = sorted(d.name for d in p.iterdir() if d.is_dir())[:8]
        raise DataError(f'{path}: no {split!r} data found: not a folder of .tar/.tar.gz shards, a torchvision '
                        f'CIFAR/MNIST folder, or an ImageFolder tree (<split>/<class>/<image> or <class>/<image>); '
                        f'sub-folders: {subs or "none"}')
    raise DataError(f'{path}: not a dataset (expected a shard, a pattern of shards or a folder)')


def _shards_or_none(path: str, split: str):
    try:
        return find_shards(path, split)
    except DataError:
        return []
