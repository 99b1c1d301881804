"""Datasets and loaders: WebDataset shards, ImageFolder / ImageNet layout, torchvision CIFAR/MNIST
folders; timm transforms and a batched tensor pipeline; resumable, seeded sample order.

Nothing here touches the disk at import time; every path comes from the caller.
"""
from .base import DataError, ImageDataset, TensorImageDataset
from .factory import build_dataset, data_roots, eval_split_of, resolve_data_path
from .folders import FolderDataset
from .loader import DeviceBatches, EpochOrder, PILLoader, TensorLoader, derive_seed
from .shards import ShardDataset, find_shards
from .streaming import StreamingShards, StreamLoader
from .transforms import BatchTransform, build_pil_transform, dataset_mean_std, match_channels

__all__ = ['DataError', 'ImageDataset', 'TensorImageDataset', 'ShardDataset', 'FolderDataset', 'build_dataset',
           'resolve_data_path', 'data_roots', 'eval_split_of', 'find_shards', 'EpochOrder', 'TensorLoader', 'PILLoader',
           'DeviceBatches', 'StreamingShards', 'StreamLoader', 'derive_seed', 'BatchTransform', 'build_pil_transform',
           'dataset_mean_std', 'match_channels']
