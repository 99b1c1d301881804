"""Shard sets bigger than this machine's in miniature: many shards under a low open-file limit, an
index walked once per node, variable-size images, and a bounded ``mean=dataset``."""
import resource
import tarfile

import numpy as np
import pytest
import torch

from vitblocks.data import EpochOrder, PILLoader, ShardDataset, build_pil_transform, dataset_mean_std
from vitblocks.data import shards as shards_module
from vitblocks.data.base import ImageDataset

from _train_helpers import add_member, png_bytes, write_shards


@pytest.fixture(autouse=True)
def index_cache(tmp_path, monkeypatch):
    monkeypatch.setenv('VITBLOCKS_CACHE', str(tmp_path / 'cache'))


def test_1200_shards_read_under_a_256_open_file_limit(tmp_path):
    # 1,200 one-sample shards: before the bounded LRU every worker kept every shard it touched open
    write_shards(tmp_path / 'set', 'train', n=1200, per_shard=1, num_classes=4, size=4, gz=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        ds = ShardDataset(str(tmp_path / 'set'), 'train', in_memory=False, max_open_shards=16)
        assert ds.images is None and len(ds) == 1200
        tf = build_pil_transform((3, 4, 4), (0.5,) * 3, (0.5,) * 3, training=False)
        loader = PILLoader(ds, EpochOrder(len(ds), 100, shuffle=False), tf, workers=2)
        labels = torch.cat([y for _, y in loader.epoch(0)])
        for i in range(len(ds)):  # the main process too, in order
            ds.load(i)
        assert len(ds._open) == 16
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert torch.equal(labels, ds.targets)


def test_index_is_walked_once_and_redone_when_a_shard_changes(tmp_path, monkeypatch):
    made = write_shards(tmp_path, 'train', n=10, per_shard=5, gz=False)
    walks = []
    real = shards_module._iter_samples
    monkeypatch.setattr(shards_module, '_iter_samples',
                        lambda shard, decode: walks.append(shard) or real(shard, decode))
    first = ShardDataset(str(tmp_path), 'train', in_memory=False)
    assert len(walks) == 2
    second = ShardDataset(str(tmp_path), 'train', in_memory=False)  # another rank / another start: no walk
    assert len(walks) == 2
    assert torch.equal(first.targets, second.targets)
    assert np.array_equal(np.asarray(second.load(7)), made['images'][7])
    write_shards(tmp_path, 'train', n=10, per_shard=5, gz=False, seed=3)  # rewritten shards: a new index
    third = ShardDataset(str(tmp_path), 'train', in_memory=False)
    assert len(walks) == 4
    assert not torch.equal(third.targets, first.targets)


def _variable_size_shard(path, gz):
    sizes = [(5, 7), (9, 4), (6, 6)]
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    with tarfile.open(path, 'w:gz' if gz else 'w') as tf:
        for i, a in enumerate(images):
            add_member(tf, f's{i}.cls', str(i).encode())
            add_member(tf, f's{i}.png', png_bytes(a))
    return images


@pytest.mark.parametrize('gz,in_memory', [(False, None), (True, None), (False, False)])
def test_variable_size_images_open(tmp_path, gz, in_memory):
    images = _variable_size_shard(tmp_path / ('v.tar.gz' if gz else 'v.tar'), gz)
    ds = ShardDataset(str(tmp_path / ('v.tar.gz' if gz else 'v.tar')), None, in_memory=in_memory)
    assert ds.images is None and ds.targets.tolist() == [0, 1, 2]
    for i, a in enumerate(images):
        assert np.array_equal(np.asarray(ds.load(i)), a)
    assert 'different sizes' not in ds.describe()


class _CountingSet(ImageDataset):
    """A million virtual images of two sizes; counts how many it was asked for."""

    def __init__(self):
        self.targets, self.classes, self.source, self.loaded = torch.zeros(10 ** 6, dtype=torch.long), ['a'], 'v', []

    def load(self, index):
        from PIL import Image
        self.loaded.append(index)
        h = 3 if index % 2 else 5
        return Image.fromarray(np.full((h, 4, 3), index % 251, np.uint8))


def test_dataset_mean_samples_a_bounded_number_one_at_a_time(monkeypatch):
    ds = _CountingSet()
    # no concatenation of the sampled pixels (tens of GB on ImageNet): fail if one is attempted
    monkeypatch.setattr(torch, 'cat', lambda *a, **k: pytest.fail('pixels were concatenated'))
    monkeypatch.setattr(torch, 'stack', lambda *a, **k: pytest.fail('images were stacked'))
    mean, std = dataset_mean_std(ds, 3, max_images=1000)
    assert len(ds.loaded) == 1000 and ds.loaded[:3] == [0, 1000, 2000]
    pixels = np.concatenate([np.full((3 if i % 2 else 5) * 4, i % 251) for i in ds.loaded]) / 255
    assert mean == pytest.approx((round(pixels.mean(), 4),) * 3, abs=1e-4)
    assert std == pytest.approx((round(pixels.std(), 4),) * 3, abs=1e-4)


def _worker_pid(img):
    import os
    return torch.tensor(os.getpid())


def test_loader_workers_persist_across_epochs(tmp_path):
    write_shards(tmp_path, 'train', n=8, per_shard=4, gz=False)
    ds = ShardDataset(str(tmp_path), 'train')
    loader = PILLoader(ds, EpochOrder(len(ds), 4), _worker_pid, workers=1)
    pids = [{int(p) for x, _ in loader.epoch(epoch) for p in x} for epoch in range(2)]
    assert pids[0] == pids[1] and len(pids[0]) == 1  # one worker, started once (before: re-forked every epoch)
