"""Small shard sets are decoded once per node: the first process writes the decoded set to the node
cache, every later or concurrent one (other runs, ranks, tests) reads it; the cache never changes what a
dataset holds."""
import multiprocessing
import os
import warnings

import numpy as np
import pytest
import torch

from vitblocks.data import ShardDataset
from vitblocks.data import shards as shards_module
from vitblocks.data.shard_index import node_cache_dir

from _train_helpers import write_shards
from test_shards_large import _variable_size_shard


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv('VITBLOCKS_CACHE', str(tmp_path / 'cache'))
    monkeypatch.setattr(shards_module, '_MEMORY_CACHE', {})  # each construction below is a fresh process's


@pytest.fixture
def decodes(monkeypatch):
    """The shards this process decoded, in order."""
    seen = []
    real = shards_module._read_shard
    monkeypatch.setattr(shards_module, '_read_shard', lambda shard: seen.append(shard.name) or real(shard))
    return seen


def _fresh(path, split='train'):
    shards_module._MEMORY_CACHE.clear()  # as another process: nothing decoded in memory
    return ShardDataset(str(path), split)


def test_a_second_process_reads_the_decoded_set_instead_of_decoding(tmp_path, decodes):
    made = write_shards(tmp_path / 'set', 'train', n=30, per_shard=10)
    first = _fresh(tmp_path / 'set')
    assert decodes == ['tiny-train-0000.tar.gz', 'tiny-train-0001.tar.gz', 'tiny-train-0002.tar.gz']
    assert len(list(node_cache_dir('decoded').glob('*.pt'))) == 1
    second = _fresh(tmp_path / 'set')
    assert len(decodes) == 3  # read, not decoded
    assert torch.equal(second.images, first.images) and torch.equal(second.targets, first.targets)
    assert second._keys == first._keys == [(i // 10, f'train_{i:06d}') for i in range(30)]
    assert np.array_equal(second.images.permute(0, 2, 3, 1).numpy(), made['images'])  # (N, C, H, W) -> (N, H, W, C)
    assert torch.equal(second.targets, torch.as_tensor(made['labels'], dtype=torch.long))


def test_a_rewritten_shard_is_decoded_again(tmp_path, decodes):
    write_shards(tmp_path / 'set', 'train', n=20, per_shard=10)
    first = _fresh(tmp_path / 'set')
    write_shards(tmp_path / 'set', 'train', n=20, per_shard=10, seed=5)
    second = _fresh(tmp_path / 'set')
    assert len(decodes) == 4
    assert not torch.equal(second.images, first.images)


def test_a_cut_off_cache_file_is_decoded_again_and_replaced(tmp_path, decodes):
    write_shards(tmp_path / 'set', 'train', n=20, per_shard=10)
    first = _fresh(tmp_path / 'set')
    (cached,) = node_cache_dir('decoded').glob('*.pt')
    cached.write_bytes(cached.read_bytes()[:1000])
    second = _fresh(tmp_path / 'set')
    assert len(decodes) == 4 and torch.equal(second.images, first.images)
    third = _fresh(tmp_path / 'set')
    assert len(decodes) == 4 and torch.equal(third.images, first.images)


def test_the_cached_set_is_checked_against_the_manifest_like_a_decoded_one(tmp_path):
    write_shards(tmp_path / 'set', 'train', n=20, per_shard=10)
    _fresh(tmp_path / 'set')
    manifest = tmp_path / 'set' / 'MANIFEST.json'
    manifest.write_text(manifest.read_text().replace('"num_samples": 10', '"num_samples": 11', 1))
    with pytest.raises(shards_module.DataError, match='holds 10 samples but MANIFEST.json says 11'):
        _fresh(tmp_path / 'set')


def test_images_of_several_sizes_come_back_as_arrays(tmp_path, decodes):
    images = _variable_size_shard(tmp_path / 'v.tar', gz=False)
    _fresh(tmp_path / 'v.tar', None)
    ds = _fresh(tmp_path / 'v.tar', None)
    assert decodes == ['v.tar'] and ds.images is None
    for i, a in enumerate(images):
        assert np.array_equal(np.asarray(ds.load(i)), a)


def test_an_unwritable_cache_decodes_in_the_process_with_a_warning(tmp_path, monkeypatch, decodes):
    write_shards(tmp_path / 'set', 'train', n=10, per_shard=10)
    blocker = tmp_path / 'file'
    blocker.write_text('not a folder')
    monkeypatch.setenv('VITBLOCKS_CACHE', str(blocker))
    with pytest.warns(UserWarning, match='decoded cache .* is not writable'):
        ds = _fresh(tmp_path / 'set')
    assert len(ds) == 10 and decodes == ['tiny-train-0000.tar.gz']


def test_a_set_above_the_disk_limit_is_not_written(tmp_path, monkeypatch, decodes):
    write_shards(tmp_path / 'set', 'train', n=10, per_shard=10)
    monkeypatch.setattr(shards_module, 'MAX_DISK_CACHED_SHARD_BYTES', 100)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        _fresh(tmp_path / 'set')
        _fresh(tmp_path / 'set')
    assert len(decodes) == 2 and not node_cache_dir('decoded').exists()


def _open_in_child(path, log):
    real = shards_module._read_shard

    def counting(shard):
        with open(log, 'a') as f:
            f.write(f'{os.getpid()}\n')
        return real(shard)
    shards_module._read_shard = counting
    ds = _fresh(path)
    return ds.images.sum(dtype=torch.int64).item(), ds.targets.tolist()


def test_processes_started_at_once_decode_one_time_between_them(tmp_path):
    write_shards(tmp_path / 'set', 'train', n=40, per_shard=10)
    log = tmp_path / 'decoders.txt'
    with multiprocessing.get_context('fork').Pool(3) as pool:
        results = pool.starmap(_open_in_child, [(tmp_path / 'set', log)] * 3)
    assert len(set(log.read_text().split())) == 1  # one process decoded (its 4 shards); the others read
    assert len(log.read_text().split()) == 4
    assert results[0] == results[1] == results[2]
