"""Datasets: shards (.tar/.tar.gz, patterns, MANIFEST checks, clear errors), folders, torchvision
folders, transforms (grayscale, flips, crops, normalization), seeded order and loaders."""
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitblocks.data import (BatchTransform, DataError, EpochOrder, PILLoader, ShardDataset, TensorImageDataset,
                            TensorLoader, build_dataset, build_pil_transform, dataset_mean_std, eval_split_of,
                            match_channels)

from _train_helpers import SHARED_DATA, add_member, png_bytes, write_shards


# --- shards ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('gz', [True, False])
def test_shards_decode_to_uint8_tensor(tmp_path, gz):
    made = write_shards(tmp_path, 'train', n=50, per_shard=20, gz=gz)
    ds = build_dataset(str(tmp_path), 'train')
    assert isinstance(ds, ShardDataset) and len(ds.shards) == 3
    assert ds.images.shape == (50, 3, 8, 8) and ds.images.dtype == torch.uint8
    assert torch.equal(ds.images[7].permute(1, 2, 0), torch.from_numpy(made['images'][7]))  # PNG is lossless
    assert ds.targets.tolist() == [int(c) for c in made['labels']]
    assert ds.classes == ['class0', 'class1', 'class2', 'class3']
    img, label = ds[3]
    assert img.mode == 'RGB' and img.size == (8, 8) and label == int(made['labels'][3])


def test_shard_patterns_files_and_split_dirs(tmp_path):
    write_shards(tmp_path, 'train', n=40, per_shard=20)
    assert len(build_dataset(str(tmp_path / 'tiny-train-{0000..0001}.tar.gz'))) == 40
    assert len(build_dataset(str(tmp_path / 'tiny-train-*.tar.gz'))) == 40
    assert len(build_dataset(str(tmp_path / 'tiny-train-0001.tar.gz'))) == 20
    nested = tmp_path / 'nested'
    write_shards(nested / 'val', 'x', n=10, manifest=False)
    assert len(build_dataset(str(nested), 'val')) == 10


def test_a_brace_pattern_names_every_shard(tmp_path):
    write_shards(tmp_path, 'train', n=60, per_shard=20)
    (tmp_path / 'tiny-train-0001.tar.gz').unlink()
    with pytest.raises(DataError, match=r'tiny-train-0001\.tar\.gz: missing \(1 of the 3 shards .* names\)'):
        build_dataset(str(tmp_path / 'tiny-train-{0000..0002}.tar.gz'))
    assert len(build_dataset(str(tmp_path / 'tiny-train-*.tar.gz'))) == 40  # a glob takes what is there


def test_split_folders_use_the_manifest_of_the_dataset_folder(tmp_path):
    write_shards(tmp_path / 'train', 'train', n=30, per_shard=20, manifest=False)  # <root>/train/*.tar.gz
    shards = [{'file': 'train/tiny-train-0000.tar.gz', 'num_samples': 20},
              {'file': 'train/tiny-train-0001.tar.gz', 'num_samples': 10}]
    manifest = {'classes': ['a', 'b', 'c', 'd'], 'splits': {'train': {'shards': shards}}}
    (tmp_path / 'MANIFEST.json').write_text(json.dumps(manifest))
    assert build_dataset(str(tmp_path), 'train').classes == ['a', 'b', 'c', 'd']
    shards[1]['num_samples'] = 11
    (tmp_path / 'MANIFEST.json').write_text(json.dumps(manifest))
    with pytest.raises(DataError, match='tiny-train-0001.tar.gz: holds 10 samples but MANIFEST.json says 11'):
        build_dataset(str(tmp_path), 'train', in_memory=True)


def test_val_falls_back_to_test_split(tmp_path):
    write_shards(tmp_path, 'train', n=20)
    write_shards(tmp_path, 'test', n=10)
    assert eval_split_of(str(tmp_path)) == 'test'
    assert len(build_dataset(str(tmp_path), 'val')) == 10


def test_grayscale_shards_stay_one_channel(tmp_path):
    write_shards(tmp_path, 'train', n=10, channels=1)
    ds = build_dataset(str(tmp_path), 'train')
    assert ds.images.shape == (10, 1, 8, 8)
    assert ds[0][0].mode == 'L'


def test_missing_path_and_split_errors(tmp_path):
    with pytest.raises(DataError, match='/no/where: no such file'):
        build_dataset('/no/where')
    with pytest.raises(DataError, match='no dataset of that name under the data roots'):
        build_dataset('no_such_dataset_name')
    write_shards(tmp_path, 'train', n=10, per_shard=5)
    with pytest.raises(DataError, match=r"no shard of split 'test'; found 2 shards of split\(s\) train"):
        build_dataset(str(tmp_path), 'test')
    (tmp_path / 'tiny-train-0000.tar.gz').rename(tmp_path / 'gone.bin')
    with pytest.raises(DataError, match=r'tiny-train-0000\.tar\.gz: missing \(listed in MANIFEST\.json'):
        build_dataset(str(tmp_path), 'train')


def test_truncated_gzip_shard_names_the_file(tmp_path):
    write_shards(tmp_path, 'train', n=30, per_shard=30, manifest=False)
    shard = tmp_path / 'tiny-train-0000.tar.gz'
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(DataError, match=r'tiny-train-0000\.tar\.gz: corrupt or truncated shard.*after member'):
        ShardDataset(str(tmp_path), 'train')


def test_undecodable_member_is_named(tmp_path):
    with tarfile.open(tmp_path / 'bad-train-0000.tar', 'w') as tf:
        add_member(tf, 'a.cls', b'0')
        add_member(tf, 'a.png', png_bytes(np.zeros((4, 4), np.uint8)))
        add_member(tf, 'b.cls', b'1')
        add_member(tf, 'b.png', b'this is not a png')
    with pytest.raises(DataError, match=r"bad-train-0000\.tar: member 'b\.png' is not a decodable image"):
        ShardDataset(str(tmp_path), 'train')


@pytest.mark.parametrize('members, message', [
    ([('a.png', None)], r"sample 'a' has no \.cls member"),
    ([('a.cls', b'0')], r"sample 'a' has no image"),
    ([('a.cls', b'zero'), ('a.png', None)], r"member 'a\.cls' should hold a class index"),
    ([('readme.txt', b'hi')], 'empty shard'),
])
def test_malformed_samples(tmp_path, members, message):
    with tarfile.open(tmp_path / 'm-train-0000.tar', 'w') as tf:
        for name, data in members:
            add_member(tf, name, data if data is not None else png_bytes(np.zeros((4, 4), np.uint8)))
    with pytest.raises(DataError, match=message):
        ShardDataset(str(tmp_path), 'train')


def test_class_count_mismatch_names_the_member(tmp_path):
    write_shards(tmp_path, 'train', n=20, num_classes=4, classes=['a', 'b', 'c', 'd'])
    manifest = json.loads((tmp_path / 'MANIFEST.json').read_text())
    manifest['classes'], manifest['num_classes'] = ['a', 'b'], 2
    (tmp_path / 'MANIFEST.json').write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"member 'train_\d+\.cls'.*class [23] but the dataset has 2 classes"):
        ShardDataset(str(tmp_path), 'train')


def test_manifest_count_mismatch(tmp_path):
    write_shards(tmp_path, 'train', n=20)
    manifest = json.loads((tmp_path / 'MANIFEST.json').read_text())
    manifest['splits']['train']['shards'][0]['num_samples'] = 25
    (tmp_path / 'MANIFEST.json').write_text(json.dumps(manifest))
    with pytest.raises(DataError, match='holds 20 samples but MANIFEST.json says 25'):
        ShardDataset(str(tmp_path), 'train')


def test_large_tar_shards_are_indexed_not_decoded(tmp_path):
    made = write_shards(tmp_path, 'train', n=12, per_shard=5, gz=False)
    ds = ShardDataset(str(tmp_path), 'train', in_memory=False)
    assert ds.images is None and len(ds) == 12
    assert np.array_equal(np.asarray(ds.load(11)), made['images'][11])
    write_shards(tmp_path / 'gz', 'train', n=4)
    with pytest.raises(DataError, match='gzip-compressed shard cannot be read sample by sample'):
        ShardDataset(str(tmp_path / 'gz'), 'train', in_memory=False)


# --- folders -----------------------------------------------------------------------------------------------

def _image_tree(root: Path, classes=('cat', 'dog'), n=3, size=6):
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(np.full((size, size, 3), 40 * i, np.uint8)).save(root / c / f'{i}.png')


def test_imagefolder_and_imagenet_layout(tmp_path):
    _image_tree(tmp_path / 'plain')
    ds = build_dataset(str(tmp_path / 'plain'), 'val')
    assert ds.classes == ['cat', 'dog'] and len(ds) == 6 and ds.targets.tolist() == [0, 0, 0, 1, 1, 1]
    _image_tree(tmp_path / 'imagenet' / 'train', ('n01', 'n02', 'n03'))
    _image_tree(tmp_path / 'imagenet' / 'val', ('n01', 'n02', 'n03'), n=1)
    assert len(build_dataset(str(tmp_path / 'imagenet'), 'train')) == 9
    assert eval_split_of(str(tmp_path / 'imagenet')) == 'val'
    val = build_dataset(str(tmp_path / 'imagenet'), 'val', classes=['n00', 'n01', 'n02', 'n03'])
    assert val.targets.tolist() == [1, 2, 3]  # labels follow the given class list
    (tmp_path / 'empty').mkdir()
    with pytest.raises(DataError, match='not a folder of .tar/.tar.gz shards'):
        build_dataset(str(tmp_path / 'empty'))


def _idx(path: Path, array: np.ndarray, magic: int):
    header = magic.to_bytes(4, 'big') + b''.join(d.to_bytes(4, 'big') for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_torchvision_mnist_folder_never_downloads(tmp_path):
    raw = tmp_path / 'MNIST' / 'raw'
    raw.mkdir(parents=True)
    imgs = np.random.default_rng(0).integers(0, 255, (5, 28, 28))
    _idx(raw / 'train-images-idx3-ubyte', imgs, 2051)
    _idx(raw / 'train-labels-idx1-ubyte', np.array([0, 1, 2, 3, 4]), 2049)
    _idx(raw / 't10k-images-idx3-ubyte', imgs[:2], 2051)
    _idx(raw / 't10k-labels-idx1-ubyte', np.array([5, 6]), 2049)
    ds = build_dataset(str(tmp_path), 'train')
    assert ds.images.shape == (5, 1, 28, 28) and torch.equal(ds.images[2, 0], torch.from_numpy(imgs[2]).byte())
    assert build_dataset(str(tmp_path), 'test').targets.tolist() == [5, 6]
    (raw / 't10k-labels-idx1-ubyte').unlink()
    with pytest.raises(DataError, match='incomplete or corrupt.*never downloads'):
        build_dataset(str(tmp_path), 'test')


def test_torchvision_cifar_folder(tmp_path, monkeypatch):
    import pickle
    import torchvision.datasets as tvd
    folder = tmp_path / 'cifar-10-batches-py'
    folder.mkdir()
    data = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    for name in [f'data_batch_{i}' for i in range(1, 6)] + ['test_batch']:
        with open(folder / name, 'wb') as f:
            pickle.dump({'data': data, 'labels': [1, 9]}, f)
    with open(folder / 'batches.meta', 'wb') as f:
        pickle.dump({'label_names': [f'c{i}' for i in range(10)]}, f)
    import torchvision.datasets.cifar as tv_cifar
    monkeypatch.setattr(tvd.CIFAR10, '_check_integrity', lambda self: True)  # our fake files have other md5s
    monkeypatch.setattr(tv_cifar, 'check_integrity', lambda *a, **k: True)
    ds = build_dataset(str(tmp_path), 'test')
    assert ds.images.shape == (2, 3, 32, 32) and ds.classes[9] == 'c9' and ds.targets.tolist() == [1, 9]
    assert torch.equal(ds.images[0].flatten(), torch.from_numpy(data[0]))  # CHW order kept


# --- transforms --------------------------------------------------------------------------------------------

def test_channel_conversion():
    gray = torch.randint(0, 256, (2, 1, 4, 4), dtype=torch.uint8)
    assert torch.equal(match_channels(gray, 3), gray.expand(-1, 3, -1, -1))
    rgb = torch.zeros(1, 3, 1, 1, dtype=torch.uint8)
    rgb[0, :, 0, 0] = torch.tensor([255, 0, 0], dtype=torch.uint8)
    assert match_channels(rgb, 1).item() == round(0.299 * 255)


def test_batch_transform_normalizes_flips_and_crops():
    x = torch.arange(2 * 16, dtype=torch.uint8).view(2, 1, 4, 4)
    eval_tf = BatchTransform((1, 4, 4), (0.5,), (0.25,), training=False)
    assert torch.allclose(eval_tf(x), (x.float() / 255 - 0.5) / 0.25)
    flip = BatchTransform((1, 4, 4), (0.0,), (1 / 255,), training=True, hflip=1.0)
    assert torch.allclose(flip(x), x.flip(-1).float())
    crop = BatchTransform((1, 4, 4), (0.0,), (1 / 255,), training=True, crop_padding=2)
    out = crop(x, torch.Generator().manual_seed(0))
    for b in range(2):  # every crop is a shifted window of the zero-padded image
        padded = torch.nn.functional.pad(x[b, 0].float(), (2, 2, 2, 2))
        assert any(torch.equal(out[b, 0], padded[i:i + 4, j:j + 4]) for i in range(5) for j in range(5))
    same = [crop(x, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(*same)  # a pure function of the generator's seed
    up = BatchTransform((3, 8, 8), (0.5,) * 3, (0.5,) * 3, training=False)
    assert up(x).shape == (2, 3, 8, 8)  # grayscale -> RGB, resized


def test_tensor_and_pil_pipelines_agree_without_augmentation(tmp_path):
    write_shards(tmp_path, 'train', n=16)
    ds = build_dataset(str(tmp_path), 'train')
    mean, std = dataset_mean_std(ds, 3)
    assert torch.allclose(torch.tensor(mean), ds.images.double().div(255).mean((0, 2, 3)).float(), atol=1e-4)
    order = EpochOrder(len(ds), 8, shuffle=False)
    t = TensorLoader(ds, order, BatchTransform((3, 8, 8), mean, std, training=False))
    p = PILLoader(ds, order, build_pil_transform((3, 8, 8), mean, std, training=False))
    (xt, yt), (xp, yp) = next(t.epoch(0)), next(p.epoch(0))
    assert torch.equal(yt, yp) and torch.allclose(xt, xp, atol=1e-5)


def test_tensor_pipeline_evaluates_a_center_crop_like_timm(tmp_path):
    write_shards(tmp_path, 'train', n=8)
    ds = build_dataset(str(tmp_path), 'train')
    mean, std, order = (0.5,) * 3, (0.25,) * 3, EpochOrder(len(ds), 8, shuffle=False)

    def batches(crop_pct):
        t = TensorLoader(ds, order, BatchTransform((3, 8, 8), mean, std, False, crop_pct=crop_pct))
        p = PILLoader(ds, order, build_pil_transform((3, 8, 8), mean, std, False, interpolation='bilinear',
                                                     crop_pct=crop_pct))
        return next(t.epoch(0))[0], next(p.epoch(0))[0]

    whole, _ = batches(1.0)
    xt, xp = batches(0.5)  # resize 8 -> 16, center 8x8: the middle half of the image, upsampled
    assert (xt - xp).abs().max() < 0.1 * (xt - whole).abs().max()  # timm's crop, up to the resampling filters
    mid = BatchTransform((3, 4, 4), mean, std, False, crop_pct=0.5)(ds.images[:2])  # resize 8 -> 8, center 4x4
    assert torch.allclose(mid, (ds.images[:2, :, 2:6, 2:6].float() / 255 - 0.5) / 0.25)
    with pytest.raises(ValueError, match=r'crop_pct=0: expected a number in \(0, 1\]'):
        BatchTransform((3, 8, 8), mean, std, False, crop_pct=0)


def test_tensor_pipeline_evaluates_odd_margins_and_oblong_images_like_timm(tmp_path):
    """timm's eval transform keeps the aspect ratio (shorter side to floor(size / crop_pct)) and crops the center
    with torchvision's rounding: an odd margin puts its extra pixel at the top/left, not at the bottom/right."""
    rng = np.random.default_rng(0)
    square = torch.from_numpy(rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8))
    oblong = torch.zeros(4, 3, 8, 16, dtype=torch.uint8)  # (B, C, H, W): bright left quarter, grey right quarter
    oblong[..., :4], oblong[..., 12:] = 255, 128
    mean, std = (0.5,) * 3, (0.25,) * 3
    for images, size, crop_pct in ((square, 32, 0.9), (oblong, 8, 1.0), (oblong, 8, 0.75)):
        ds = TensorImageDataset(images, torch.zeros(len(images)), ['a'], 'synthetic')
        order = EpochOrder(len(ds), 4, shuffle=False)
        xt = next(TensorLoader(ds, order, BatchTransform((3, size, size), mean, std, False, crop_pct=crop_pct,
                                                         interpolation='bilinear')).epoch(0))[0]
        xp = next(PILLoader(ds, order, build_pil_transform((3, size, size), mean, std, False, interpolation='bilinear',
                                                           crop_pct=crop_pct)).epoch(0))[0]
        assert xt.shape == xp.shape == (4, 3, size, size)
        assert (xt - xp).abs().mean() < 0.02, (tuple(images.shape), crop_pct)  # same crop, up to resampling


def test_pil_color_jitter_without_random_resized_crop_follows_timm():
    def steps(**kw):
        return [type(t).__name__ for t in build_pil_transform((3, 8, 8), (0.5,) * 3, (0.5,) * 3, True, **kw).transforms]

    assert 'ColorJitter' in steps(color_jitter=0.4)
    assert 'ColorJitter' not in steps() and 'ColorJitter' not in steps(color_jitter=0.4, auto_augment='rand-m9-mstd0.5')


def test_epoch_order_is_seeded_sharded_and_resumable():
    a = EpochOrder(10, 2, seed=1, rank=0, world_size=2)
    b = EpochOrder(10, 2, seed=1, rank=1, world_size=2)
    assert sorted(torch.cat([a.indices(0), b.indices(0)]).tolist()) == list(range(10))
    assert not torch.equal(a.indices(0), a.indices(1))
    assert torch.equal(a.indices(3), EpochOrder(10, 2, seed=1, rank=0, world_size=2).indices(3))
    assert [t.tolist() for t in a.batches(0, start=1)] == [t.tolist() for t in a.batches(0)[1:]]
    ev = [EpochOrder(7, 2, shuffle=False, rank=r, world_size=2) for r in (0, 1)]
    assert sorted(ev[0].indices(0).tolist() + ev[1].indices(0).tolist()) == list(range(7))  # no padding in eval
    with pytest.raises(ValueError, match='fewer than one batch'):
        EpochOrder(3, 4)


# --- the real shards in ../shared/data ------------------------------------------------------------------------

@pytest.mark.skipif(not (SHARED_DATA / 'mnist' / 'MANIFEST.json').exists(), reason='shared/data/mnist not present')
def test_real_mnist_test_split():
    ds = build_dataset(str(SHARED_DATA / 'mnist'), 'test')
    manifest = json.loads((SHARED_DATA / 'mnist' / 'MANIFEST.json').read_text())
    assert ds.images.shape == (10000, 1, 28, 28)
    counts = torch.bincount(ds.targets, minlength=10).tolist()
    assert counts == [manifest['splits']['test']['class_counts'][str(c)] for c in range(10)]
    mean, std = dataset_mean_std(ds, 1)
    assert mean[0] == pytest.approx(0.1325, abs=2e-3) and std[0] == pytest.approx(0.3105, abs=2e-3)


@pytest.mark.skipif(not (SHARED_DATA / 'cifar10' / 'MANIFEST.json').exists(), reason='shared/data/cifar10 not present')
def test_real_cifar10_shard():
    ds = build_dataset(str(SHARED_DATA / 'cifar10' / 'cifar10-test-0000.tar.gz'))
    assert ds.images.shape == (5000, 3, 32, 32)
    assert ds.classes[:2] == ['airplane', 'automobile'] and ds.num_classes == 10


def test_a_class_list_in_another_order_renumbers_the_labels_by_name(tmp_path):
    """Shards whose class list is another order of the checkpoint's: every image keeps its class *name* (its label
    becomes that name's index in the list given), so an evaluation counts the right classes; a class the list lacks
    is an error."""
    own = ['cat', 'dog', 'ship', 'frog']
    write_shards(tmp_path / 'd', 'test', n=24, per_shard=24, num_classes=4, classes=own)
    plain = ShardDataset(str(tmp_path / 'd'), 'test', in_memory=True)
    checkpoint = ['dog', 'frog', 'cat', 'ship']
    reordered = ShardDataset(str(tmp_path / 'd'), 'test', classes=checkpoint, in_memory=True)
    assert reordered.classes == checkpoint
    names = [plain.classes[int(t)] for t in plain.targets]
    assert [checkpoint[int(t)] for t in reordered.targets] == names
    assert not torch.equal(reordered.targets, plain.targets)
    assert torch.equal(ShardDataset(str(tmp_path / 'd'), 'test', in_memory=True).targets, plain.targets)  # cache kept
    write_shards(tmp_path / 'u', 'test', n=24, per_shard=24, num_classes=4, classes=own, gz=False)
    indexed = ShardDataset(str(tmp_path / 'u'), 'test', classes=checkpoint, in_memory=False)  # read sample by sample
    assert [checkpoint[int(t)] for t in indexed.targets] == names
    assert [checkpoint[indexed[i][1]] for i in range(len(indexed))] == names
    with pytest.raises(DataError, match=r"classes \['ship'\] are not among the 3 classes given"):
        ShardDataset(str(tmp_path / 'd'), 'test', classes=['dog', 'frog', 'cat'], in_memory=True)


@pytest.mark.parametrize('gz', [False, True])
def test_a_shard_cut_at_a_member_boundary_is_truncated_not_shorter(tmp_path, gz):
    """Without a MANIFEST nothing counts the samples: a tar cut exactly after a member read as a shard of fewer
    images (100 of 400 trained, no warning). The end-of-archive blocks it lacks tell it was cut."""
    import gzip
    write_shards(tmp_path / 'whole', 'train', n=12, per_shard=12, num_classes=2, gz=False, manifest=False)
    shard = next((tmp_path / 'whole').glob('*.tar'))
    assert len(ShardDataset(str(tmp_path / 'whole'), 'train', in_memory=True)) == 12  # a whole shard reads
    with tarfile.open(shard) as tf:
        members = tf.getmembers()
    cut_at = members[8].offset  # the header of the 9th member: 4 samples (8 members) before it
    (tmp_path / 'cut').mkdir()
    data = shard.read_bytes()[:cut_at]
    name = shard.name + ('.gz' if gz else '')
    (tmp_path / 'cut' / name).write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(DataError, match=r"truncated shard: it ends after member '.*' without the end-of-archive"):
        ShardDataset(str(tmp_path / 'cut'), 'train', in_memory=True)
