"""Shared helpers for the data and training tests: tiny synthetic shards and a tiny ViT config."""
import io
import json
import tarfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
from PIL import Image

SHARED_DATA = Path(__file__).resolve().parents[2] / 'shared' / 'data'

# a ViT small enough that a training step takes milliseconds on one CPU thread
TINY_VIT = {'img_size': 8, 'patch_size': 4, 'embed_dim': 16, 'depth': 1, 'num_heads': 2}


def png_bytes(array: np.ndarray, fmt: str = 'PNG') -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return buf.getvalue()


def add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def class_images(n: int, num_classes: int, size: int = 8, channels: int = 3, seed: int = 0):
    """Learnable images whatever the flips and crops: class c has brightness about 30 + 50c, plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, n)
    shape = (size, size) if channels == 1 else (size, size, channels)
    images = [(30 + 50 * int(c) + rng.integers(0, 40, shape)).clip(0, 255).astype(np.uint8) for c in labels]
    return images, labels


def write_shards(folder: Path, split: str, n: int = 96, num_classes: int = 4, per_shard: int = 48, size: int = 8,
                 channels: int = 3, gz: bool = True, seed: int = 0, classes: Optional[Sequence[str]] = None,
                 manifest: bool = True) -> Dict:
    """WebDataset shards ``<folder>/tiny-<split>-NNNN.tar[.gz]`` like ../shared/data, with MANIFEST.json."""
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = class_images(n, num_classes, size, channels, seed)
    shards = []
    for s, start in enumerate(range(0, n, per_shard)):
        name = f'tiny-{split}-{s:04d}.tar' + ('.gz' if gz else '')
        with tarfile.open(folder / name, 'w:gz' if gz else 'w') as tf:
            for i in range(start, min(n, start + per_shard)):
                key = f'{split}_{i:06d}'
                add_member(tf, f'{key}.cls', str(int(labels[i])).encode())
                add_member(tf, f'{key}.png', png_bytes(images[i]))
        shards.append({'file': name, 'num_samples': min(n, start + per_shard) - start})
    if manifest:
        path = folder / 'MANIFEST.json'
        data = json.loads(path.read_text()) if path.exists() else {
            'name': 'tiny', 'num_classes': num_classes,
            'classes': list(classes or [f'class{i}' for i in range(num_classes)]), 'splits': {}}
        data['splits'][split] = {'num_samples': n, 'shards': shards}
        path.write_text(json.dumps(data))
    return {'images': images, 'labels': labels}


def tiny_dataset(root: Path, n_train: int = 96, n_test: int = 40, **kw) -> Path:
    write_shards(root, 'train', n_train, **kw)
    write_shards(root, 'test', n_test, seed=1, **kw)
    return root


def signal_during_evaluation(monkeypatch, evaluation: int, after_batches: int = 1, draws: bool = False) -> List[int]:
    """Make the training engine's ``evaluation``-th call of ``evaluate`` (1-based; an EMA's evaluation is a call of
    its own) send this process a SIGTERM once it has evaluated ``after_batches`` batches, as a cluster preempting
    the job mid-evaluation would. Returns the list of the batches each call got through, filled as they run.
    ``draws``: each evaluated batch also draws a number from torch's global RNG (as a loader that seeded its
    workers from it would), so an evaluation changes the RNG states training goes on with."""
    import os
    import signal

    import torch

    from vitblocks.experiments import engine
    real, evaluated = engine.evaluate, []

    def evaluate_then_signal(model, *args, **kwargs):
        evaluated.append(0)
        call = len(evaluated)

        def count(module, inputs, output):
            evaluated[call - 1] += 1
            if draws:
                torch.rand(1)
            if call == evaluation and evaluated[call - 1] == after_batches:
                os.kill(os.getpid(), signal.SIGTERM)
        hook = model.register_forward_hook(count)
        try:
            return real(model, *args, **kwargs)
        finally:
            hook.remove()
    monkeypatch.setattr(engine, 'evaluate', evaluate_then_signal)
    return evaluated
