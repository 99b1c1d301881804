"""Loader throughput: images/s that vitblocks' loaders deliver, for CIFAR-like and ImageNet-like shards.

* CIFAR-like: the in-memory path (shards decoded once into a uint8 tensor, batches cut and
  augmented as tensors: ``TensorLoader``) -- the real CIFAR-10 test split from ../shared/data when
  present, else synthetic 32x32 JPEG shards -- and 2,000 of those images through timm's
  per-sample PIL transforms (``PILLoader``, where per-sample overhead shows);
* ImageNet-like: synthetic uncompressed ``.tar`` shards of 500x375 JPEGs read sample by sample
  (``ShardDataset(in_memory=False)``) through timm's training transform (RandomResizedCrop 224,
  flip, normalize) in ``PILLoader`` with 0, 1, 2 worker processes.

``--pil-batches float,uint8``: the PIL rows run once per batch type: ``float`` (workers
normalize, float32 batches) and ``uint8`` (workers return uint8, ``PILLoader(normalize=...)``
normalizes in the main process / on the device: 4x less shared memory). Code older than the uint8
option takes ``--pil-batches float`` only.

Each setting runs ``--repeats`` epochs after one warm-up epoch; we report the median images/s
(wall clock, the whole epoch: reading, decoding, augmenting, collating). Compare two versions
of the code by running this script with each on PYTHONPATH (it uses only APIs both have):

    PYTHONPATH=src python benchmarks/loader_throughput.py
    PYTHONPATH=/path/to/old/src python benchmarks/loader_throughput.py

On a shared, loaded CPU the numbers move with the load; compare runs taken back to back.
"""
import argparse
import io
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitblocks.data import (BatchTransform, EpochOrder, PILLoader, ShardDataset, TensorLoader, build_pil_transform)

SHARED_CIFAR = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'cifar10'


def write_jpeg_shards(folder: Path, n: int, per_shard: int, size, gz: bool, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for s, start in enumerate(range(0, n, per_shard)):
        with tarfile.open(folder / f'bench-train-{s:04d}.tar{".gz" if gz else ""}', 'w:gz' if gz else 'w') as tf:
            for i in range(start, min(n, start + per_shard)):
                # smooth noise compresses like a photo, not like white noise
                small = rng.integers(0, 255, (size[0] // 8 + 1, size[1] // 8 + 1, 3), dtype=np.uint8)
                img = Image.fromarray(small).resize((size[1], size[0]), Image.BILINEAR)
                buf = io.BytesIO()
                img.save(buf, format='JPEG', quality=85)
                for name, data in ((f'{i:07d}.jpg', buf.getvalue()), (f'{i:07d}.cls', str(i % 10).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return folder


def pil_loader(ds, batch_size, input_size, mean, std, kind, workers, **augment):
    """A training PILLoader: float batches (workers normalize) or uint8 batches (normalized by the loader)."""
    if kind == 'float':  # the call older code also takes
        return PILLoader(ds, EpochOrder(len(ds), batch_size), build_pil_transform(input_size, mean, std, training=True,
                                                                                  **augment), workers=workers)
    tf = build_pil_transform(input_size, mean, std, training=True, uint8=True, **augment)
    return PILLoader(ds, EpochOrder(len(ds), batch_size), tf, workers=workers, normalize=(mean, std))


def time_epochs(loader, repeats: int) -> list:
    rates = []
    for epoch in range(repeats + 1):  # the first pass warms up (worker start, page cache)
        n, t0 = 0, time.perf_counter()
        for x, _ in loader.epoch(epoch):
            n += len(x)
        if epoch:
            rates.append(n / (time.perf_counter() - t0))
    return rates


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--imagenet-images', type=int, default=256)
    p.add_argument('--workers', default='0,1,2')
    p.add_argument('--threads', type=int, default=1)
    p.add_argument('--pil-batches', default='float,uint8', help='PILLoader batch types to time: float, uint8')
    args = p.parse_args(argv)
    kinds = args.pil_batches.split(',')
    if not kinds or set(kinds) - {'float', 'uint8'}:
        p.error(f'--pil-batches {args.pil_batches}: expected a comma-separated list of float, uint8')
    torch.set_num_threads(args.threads)
    print(f'torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats} epochs after 1 warm-up; '
          f'images/s, whole epoch')
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if (SHARED_CIFAR / 'MANIFEST.json').is_file():
            cifar, what = ShardDataset(str(SHARED_CIFAR), 'test'), 'CIFAR-10 test split (../shared/data)'
        else:
            cifar = ShardDataset(str(write_jpeg_shards(tmp / 'cifar', 10000, 2500, (32, 32), gz=True)), 'train')
            what = 'synthetic 32x32 JPEG shards'
        tf = BatchTransform((3, 32, 32), (0.5,) * 3, (0.25,) * 3, training=True, hflip=0.5, crop_padding=4)
        rates = time_epochs(TensorLoader(cifar, EpochOrder(len(cifar), 128), tf), args.repeats)
        print(f'CIFAR-like, in memory ({what}, {len(cifar)} images), TensorLoader batch 128, crop+flip: '
              f'{statistics.median(rates):10.0f} images/s')
        # the same images through timm's per-sample PIL transforms: per-sample overhead shows here
        small = cifar.subset(range(2000))
        for kind in kinds:
            loader = pil_loader(small, 128, (3, 32, 32), (0.5,) * 3, (0.25,) * 3, kind, 0, hflip=0.5, crop_padding=4)
            rates = time_epochs(loader, args.repeats)
            print(f'CIFAR-like, in memory, {len(small)} images, PILLoader {kind} batches, workers=0, crop+flip per '
                  f'sample: {statistics.median(rates):10.0f} images/s')

        folder = write_jpeg_shards(tmp / 'imagenet', args.imagenet_images, 32, (375, 500), gz=False)
        ds = ShardDataset(str(folder), 'train', in_memory=False)
        for kind in kinds:
            for workers in (int(w) for w in args.workers.split(',')):
                loader = pil_loader(ds, 32, (3, 224, 224), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), kind,
                                    workers, hflip=0.5, scale=(0.08, 1.0), interpolation='bilinear')
                rate = statistics.median(time_epochs(loader, args.repeats))
                per = f'{rate / workers:8.1f} per worker' if workers else ''
                print(f'ImageNet-like 500x375 JPEG, indexed .tar ({len(ds)} images, {len(ds) // 32} shards), '
                      f'PILLoader {kind} batches, RandomResizedCrop 224, workers={workers}: {rate:8.1f} images/s {per}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
