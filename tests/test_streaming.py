"""streaming=true: the training split streamed through timm's WebDataset reader (create_dataset('wds/...')).
The 2-process run (shards split by rank) is in test_scale.py (slow)."""
import json
import math

import pytest
import torch

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.data import DataError, ShardDataset, StreamingShards, StreamLoader, build_pil_transform
from vitblocks.data.streaming import expand_shard_url
from vitblocks.experiments import merge, train
from vitblocks.experiments.config import ConfigError

from _train_helpers import SHARED_DATA, TINY_VIT, tiny_dataset

RAW = build_pil_transform((3, 8, 8), (0.5,) * 3, (0.5,) * 3, training=False, uint8=True)  # 8x8 in, uint8 out


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp('stream_data'), n_train=64, n_test=16, per_shard=16)  # 4 shards


def _cfg(data, out, **kw):
    return merge({**dict(model='vit_tiny_patch16_224', data=str(data), model_kwargs=TINY_VIT, batch_size=8, epochs=2,
                         lr=1e-3, threads=1, progress='none', tensorboard=False, output=str(out), name='run',
                         streaming=True), **kw})


def _rows(images: torch.Tensor):
    return sorted(bytes(img.contiguous().view(-1).numpy()) for img in images)  # (B, C, H, W): one key per image


@pytest.mark.parametrize('workers', [0, 2])
def test_an_epoch_streams_every_sample_once_in_a_new_order_each_epoch(data, workers):
    split = StreamingShards(str(data), 'train')
    assert (len(split), split.num_classes, len(split.urls)) == (64, 4, 4)  # from MANIFEST.json, nothing read
    loader = StreamLoader(split, RAW, batch_size=8, seed=1, workers=workers)
    assert len(loader) == 8
    epochs = [list(loader.epoch(e)) for e in (0, 1)]
    want = ShardDataset(str(data), 'train')
    for batches in epochs:
        assert len(batches) == 8 and all(x.dtype == torch.uint8 and x.shape == (8, 3, 8, 8) for x, _ in batches)
        images = torch.cat([x for x, _ in batches])
        assert _rows(images) == _rows(want.images)  # each of the 64 images once
        assert sorted(torch.cat([y for _, y in batches]).tolist()) == sorted(want.targets.tolist())
    assert not torch.equal(epochs[0][0][0], epochs[1][0][0])  # shards and samples reshuffled per epoch
    assert len(list(loader.epoch(2, start=5))) == 3  # a resumed epoch: its stream again, cut to the steps left


def test_streaming_run_resumed_mid_epoch_restarts_the_epoch(data, tmp_path, capsys):
    first = train(_cfg(data, tmp_path, max_steps=5, progress='log', log_interval=5))
    out = ''.join(capsys.readouterr())
    assert 'streamed from' in out and '(4 shards, timm WebDataset reader); 8 steps/epoch' in out
    result = train(_cfg(data, tmp_path, progress='log'), resume=first.run_dir)
    assert result.global_step == 16 and result.epochs_done == 2 and result.final.num_images == 16
    assert 'resumed at step 5 of epoch 0, which restarts from the beginning of its stream for its 3 remaining ' \
           'steps' in ''.join(capsys.readouterr())


@pytest.mark.parametrize('kw,fragment', [
    (dict(pipeline='tensor'), 'streaming=true cannot go with pipeline=tensor'),
    (dict(train_subset=16), 'cannot go with train_subset=16'),
    (dict(mean='dataset'), 'cannot go with mean/std=dataset'),
    (dict(checkpoint_interval=2), 'cannot go with checkpoint_interval=2 (exact mid-epoch resume'),
])
def test_streaming_with_what_needs_random_access_is_refused(data, tmp_path, kw, fragment):
    with pytest.raises(ConfigError, match=fragment.replace('(', r'\(')):
        _cfg(data, tmp_path, **kw)


def test_streaming_errors_say_what_to_fix(data, tmp_path):
    with pytest.raises(DataError, match=r'2 loader worker\(s\) = 2 readers, but there are only 1 shards'):
        StreamLoader(StreamingShards(str(data / 'tiny-train-0000.tar.gz')), RAW, 8, workers=2)
    bare = tmp_path / 'bare'
    bare.mkdir()
    (bare / 'tiny-train-0000.tar.gz').write_bytes((data / 'tiny-train-0000.tar.gz').read_bytes())
    with pytest.raises(DataError, match='takes each shard\'s number of samples .* from MANIFEST.json'):
        StreamingShards(str(bare), 'train')
    manifest = json.loads((data / 'MANIFEST.json').read_text())
    (bare / 'MANIFEST.json').write_text(json.dumps({**manifest, 'classes': manifest['classes'][:2], 'num_classes': 2}))
    loader = StreamLoader(StreamingShards(str(bare), 'train'), RAW, 8)
    with pytest.raises(DataError, match='a sample has class [23] but the dataset has 2 classes'):
        list(loader.epoch(0))


# --- shards given as URLs (train_url): pipe:cat of the local shards stands in for object storage -------------

def _url(data):
    return f'pipe:cat {data}/tiny-train-{{0000..0003}}.tar.gz'  # a brace pattern: 4 URLs


def test_url_shards_stream_every_sample_once_counted_by_the_local_manifest(data):
    split = StreamingShards(str(data), url=_url(data))
    assert split.urls == [f'pipe:cat {data}/tiny-train-{i:04d}.tar.gz' for i in range(4)]
    assert (len(split), split.classes, split.classes_named) == (64, [f'class{i}' for i in range(4)], True)
    batches = list(StreamLoader(split, RAW, batch_size=8, seed=1, workers=2).epoch(0))
    want = ShardDataset(str(data), 'train')
    assert _rows(torch.cat([x for x, _ in batches])) == _rows(want.images)  # each of the 64 images once
    assert sorted(torch.cat([y for _, y in batches]).tolist()) == sorted(want.targets.tolist())


def test_url_sample_and_class_counts_come_from_the_config_or_the_manifest(data, tmp_path):
    bare = tmp_path / 'bare'  # a local folder without MANIFEST.json / classes.txt
    bare.mkdir()
    with pytest.raises(DataError, match=r'tiny-train-0000.tar.gz: .* from MANIFEST.json in .*bare.* set '
                                        r'train_samples=N'):
        StreamingShards(str(bare), url=_url(data), num_classes=4)
    with pytest.raises(DataError, match='there are none; add one, or set num_classes=N'):
        StreamingShards(str(bare), url=_url(data), num_samples=64)
    split = StreamingShards(str(bare), url=_url(data), num_samples=40, num_classes=3)
    assert (len(split), split.classes, split.classes_named) == (40, ['0', '1', '2'], False)
    assert len(StreamingShards(str(data), url=_url(data), num_samples=64)) == 64  # agrees with the manifest
    with pytest.raises(DataError, match='train_samples=60, but MANIFEST.json in .* counts 64 samples in these 4'):
        StreamingShards(str(data), url=_url(data), num_samples=60)


def test_s3_https_and_pipe_urls_are_expanded_without_touching_the_network(tmp_path):
    assert expand_shard_url('s3://bucket/in1k/train-{000..002}.tar') == [
        f'pipe:aws s3 cp s3://bucket/in1k/train-{i:03d}.tar -' for i in range(3)]
    assert expand_shard_url('https://host/a-{0..1}.tar?sig=x::pipe:cat /b.tar') == [
        'https://host/a-0.tar?sig=x', 'https://host/a-1.tar?sig=x', 'pipe:cat /b.tar']
    manifest = {'classes': ['a', 'b'], 'splits': {'train': {'shards': [
        {'file': f'train-{i:03d}.tar', 'num_samples': 10 + i} for i in range(3)]}}}
    (tmp_path / 'MANIFEST.json').write_text(json.dumps(manifest))
    assert len(StreamingShards(str(tmp_path), url='s3://bucket/in1k/train-{000..002}.tar')) == 33  # by shard name
    with pytest.raises(DataError, match='a "|" cannot go through timm'):
        expand_shard_url('pipe:curl -s https://host/a.tar | cat')
    with pytest.raises(DataError, match='names no .tar / .tar.gz shard'):
        StreamingShards(str(tmp_path), url='https://host/shard-0001', num_samples=10)


def test_training_streams_url_shards_and_evaluates_the_local_split(data, tmp_path, capsys):
    result = train(_cfg(data, tmp_path, epochs=1, train_url=_url(data), progress='log', log_interval=8))
    assert result.global_step == 8 and result.final.num_images == 16  # 64 streamed / 8; the 16 local test images
    assert f'64 images, 4 classes streamed from {_url(data)} (4 shards' in ''.join(capsys.readouterr())
    with pytest.raises(ConfigError, match='train_url=.* describes a streamed training split; set streaming=true'):
        _cfg(data, tmp_path, streaming=False, train_url=_url(data))
    with pytest.raises(ConfigError, match='train_samples=64 describes a streamed'):
        _cfg(data, tmp_path, streaming=False, train_samples=64)


@pytest.mark.skipif(not (SHARED_DATA / 'cifar10' / 'MANIFEST.json').is_file(), reason='needs ../shared/data')
def test_streams_the_cifar10_shards():
    split = StreamingShards(str(SHARED_DATA / 'cifar10'), 'train')
    assert (len(split), split.num_classes, len(split.urls)) == (50000, 10, 10)
    tf = build_pil_transform((3, 32, 32), (0.5,) * 3, (0.25,) * 3, training=True, crop_padding=4, uint8=True)
    loader = StreamLoader(split, tf, batch_size=32, workers=2, normalize=((0.5,) * 3, (0.25,) * 3))
    assert len(loader) == 2 * math.ceil(25000 / 32)  # 2 readers of ceil(50000 / 2) samples, in whole batches
    for _, (x, y) in zip(range(2), loader.epoch(0)):
        assert x.dtype == torch.float32 and x.shape == (32, 3, 32, 32) and -2.01 <= float(x.min()) < 0 < float(x.max())
        assert y.dtype == torch.long and 0 <= int(y.min()) and int(y.max()) < 10
