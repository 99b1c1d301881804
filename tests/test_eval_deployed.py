"""`vitblocks eval` on deployed safetensors files (vitblocks.deploy.io.save_deployed): built by name in
deploy form, with the file's sizes and preprocessing, equal to the training form on real CIFAR-10 images.

Nothing is trained: a 32 px, 10-class RePa-DeiT-Ti and IFFN-DeiT-Ti with random BatchNorm statistics
(default BN is an identity and would hide a folding error) are evaluated on 96 real CIFAR-10 test images.
"""
import json
import shutil
import tarfile

import pytest
import timm
import torch
from safetensors.torch import save_file

import vitblocks.cli as cli
from vitblocks.deploy.io import is_deployed_file, save_deployed
from vitblocks.experiments import merge, save_checkpoint
from vitblocks.profile import fixed_threads

from _helpers import perturb_, randomize_batchnorm_
from _train_helpers import SHARED_DATA

CIFAR = SHARED_DATA / 'cifar10'
pytestmark = pytest.mark.skipif(not (CIFAR / 'cifar10-test-0000.tar.gz').is_file(),
                                reason='needs the shared CIFAR-10 shards')

MODELS = ('repa_deit_tiny_patch16_224', 'iffn_deit_tiny_patch16_224')
IMAGES = 96


@pytest.fixture(autouse=True, scope='module')
def _one_thread():
    with fixed_threads(1):
        yield


@pytest.fixture(scope='module')
def cifar_slice(tmp_path_factory):
    """The first 96 images of the real CIFAR-10 test split as one shard (decoding all 10,000 takes ~10 s)."""
    out = tmp_path_factory.mktemp('cifar10-slice')
    shutil.copy(CIFAR / 'classes.txt', out / 'classes.txt')
    with tarfile.open(CIFAR / 'cifar10-test-0000.tar.gz', 'r:gz') as src, \
            tarfile.open(out / 'slice-test-0000.tar', 'w') as dst:
        for i, member in zip(range(2 * IMAGES), src):  # <key>.cls + <key>.jpg per image
            dst.addfile(member, src.extractfile(member))
    return out


def _model_files(name, folder):
    """(name, training-form state dict .pth, deployed .safetensors, model) of one 32 px, 10-class model with
    random BN statistics."""
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, num_classes=10).eval()
    perturb_(model, std=0.05)  # AGeLU coefficients and layer norms away from their defaults too
    randomize_batchnorm_(model)
    torch.save(model.state_dict(), folder / 'train_form.pth')
    return name, folder / 'train_form.pth', save_deployed(model, folder / 'deployed.safetensors'), model


@pytest.fixture(scope='module', params=MODELS)
def files(request, tmp_path_factory):
    return _model_files(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope='module')
def repa_files(tmp_path_factory):
    return _model_files(MODELS[0], tmp_path_factory.mktemp('repa'))


def _eval(capsys, tmp_path, *argv):
    """(exit code, stdout, stderr, the single result of --json or None)."""
    out_json = tmp_path / f'eval{len(list(tmp_path.glob("eval*.json")))}.json'
    code = cli.main(['eval', *map(str, argv), '--batch-size', '32', '--progress', 'none', '--json', str(out_json),
                     f'val_subset={IMAGES}'])
    out, err = capsys.readouterr()
    result = json.loads(out_json.read_text()) if code == 0 else None
    return code, out, err, result


def _only(result):
    (res,) = result['results'].values()
    return res


def test_deployed_file_evaluates_like_the_training_form(files, cifar_slice, tmp_path, capsys):
    name, pth, deployed, _ = files
    assert is_deployed_file(deployed) and not is_deployed_file(pth)
    sizes = 'model_kwargs={img_size: 32, num_classes: 10}'
    code, out, err, train = _eval(capsys, tmp_path, '--model', name, '--checkpoint', pth, '--data', cifar_slice, sizes)
    assert code == 0, err
    code, out, err, folded = _eval(capsys, tmp_path, '--model', name, '--checkpoint', pth, '--data', cifar_slice,
                                   sizes, '--reparam')
    assert code == 0, err
    code, out, err, dep = _eval(capsys, tmp_path, '--checkpoint', deployed, '--data', cifar_slice)  # no --model
    assert code == 0, err
    assert f'model    {name} (deployed file)' in out and 'at 3x32x32' in out
    assert "records no mean, std; using the model config's (pass mean=[...] std=[...]" in err
    assert dep['deployed_file'] and dep['reparam'] and dep['params'] == folded['params'] < train['params']
    assert dep['input_size'] == train['input_size'] == [3, 32, 32]
    for ref in (train, folded):  # the fold is exact to float rounding: same predictions, same loss
        assert _only(dep)['num_images'] == _only(ref)['num_images'] == IMAGES
        assert _only(dep)['top1'] == _only(ref)['top1'] and _only(dep)['top5'] == _only(ref)['top5']
        assert _only(dep)['per_class_top1'] == _only(ref)['per_class_top1']
        assert _only(dep)['loss'] == pytest.approx(_only(ref)['loss'], rel=1e-5, abs=1e-6)

    code, out, err, again = _eval(capsys, tmp_path, '--checkpoint', deployed, '--data', cifar_slice, '--reparam',
                                  '--model', name)  # the file's own model, and a --reparam with nothing to fold
    assert code == 0 and 'is already deployed (re-parameterized); --reparam does nothing' in err
    assert _only(again)['loss'] == _only(dep)['loss']


def test_run_checkpoint_to_deployed_file_to_eval(repa_files, cifar_slice, tmp_path, capsys):
    """train -> `export --format safetensors` -> `eval`: the run's mean/std/input size travel in the file
    (eval then needs the file alone) and give the run checkpoint's own evaluation."""
    name, _, without, model = repa_files
    cfg = merge({'model': name, 'data': str(cifar_slice), 'model_kwargs': {'img_size': 32}})
    run = tmp_path / 'best.pth'
    save_checkpoint({'model': model.state_dict(), 'config': cfg.to_dict(), 'num_classes': 10,
                     'classes': (CIFAR / 'classes.txt').read_text().split(), 'input_size': [3, 32, 32],
                     'mean': [0.5, 0.5, 0.5], 'std': [0.25, 0.25, 0.25]}, run)
    out = tmp_path / 'deployed.safetensors'
    code = cli.main(['export', name, '--checkpoint', str(run), '--format', 'safetensors', '--out', str(out),
                     '--check'])
    text, err = capsys.readouterr()
    assert code == 0, err
    assert f'{name}: 3.27 M params, deployed, weights {run}' in text
    assert ('MiB, records num_classes=10 img_size=[32, 32] in_chans=3 input_size=[3, 32, 32] mean=[0.5, 0.5, 0.5] '
            'std=[0.25, 0.25, 0.25])') in text
    assert float(text.split('max abs error ')[1].split()[0]) < 1e-5

    code, _, err, ref = _eval(capsys, tmp_path, '--checkpoint', run, '--data', cifar_slice)
    assert code == 0, err
    code, _, err, dep = _eval(capsys, tmp_path, '--checkpoint', out, '--data', cifar_slice)
    assert code == 0 and 'note' not in err, err
    assert _only(dep)['top1'] == _only(ref)['top1']
    assert _only(dep)['loss'] == pytest.approx(_only(ref)['loss'], rel=1e-5, abs=1e-6)
    code, _, err, imagenet = _eval(capsys, tmp_path, '--checkpoint', without, '--data', cifar_slice)
    assert code == 0 and 'records no mean, std' in err, err
    assert _only(imagenet)['loss'] != pytest.approx(_only(dep)['loss'], rel=1e-3)  # the statistics matter
    code, _, err, _ = _eval(capsys, tmp_path, '--checkpoint', out, '--data', cifar_slice, 'mean=[0.4, 0.4, 0.4]')
    assert code == 2 and 'records mean=[0.5, 0.5, 0.5] (the preprocessing it was trained with), not ' \
                          '[0.4, 0.4, 0.4]; drop mean=' in err


@pytest.mark.parametrize('argv, message', [
    (['--ema'], 'is a deployed file: it holds one set of weights (folded from the model it was saved from, EMA or '
                'not); drop --ema'),
    (['--model', 'deit_tiny_patch16_224'], 'holds the deployed weights of {name}, not deit_tiny_patch16_224; drop '
                                           '--model (the file names its model)'),
    (['model_kwargs={num_classes: 100}'], 'was saved with num_classes=10, not 100; drop num_classes'),
    (['num_classes=100'], 'was saved with num_classes=10, not 100; drop num_classes'),
    (['model_kwargs={img_size: 64}'], 'was saved with img_size=[32, 32], not 64; drop img_size'),
])
def test_contradictory_flags_are_one_line_errors(files, cifar_slice, tmp_path, capsys, argv, message):
    name, _, deployed, _ = files
    code, out, err, _ = _eval(capsys, tmp_path, '--checkpoint', deployed, '--data', cifar_slice, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and 'Traceback' not in err
    assert message.format(name=name) in err


def test_plain_safetensors_weights_are_not_taken_for_a_deployed_file(files, cifar_slice, tmp_path, capsys):
    name, _, _, model = files
    plain = tmp_path / 'plain.safetensors'
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(plain))
    assert not is_deployed_file(plain)
    code, out, err, _ = _eval(capsys, tmp_path, '--checkpoint', plain, '--data', cifar_slice)
    assert code == 2 and 'is not a vitblocks run checkpoint; say which model it holds with --model' in err
    code, out, err, _ = _eval(capsys, tmp_path, '--checkpoint', plain, '--data', cifar_slice, '--model', name, '--ema')
    assert code == 2 and 'EMA weights are only read from vitblocks training checkpoints' in err  # not ignored


def test_a_file_recording_mean_only_takes_std_from_the_model(repa_files, cifar_slice, tmp_path, capsys):
    name, _, _, model = repa_files
    std = list(model.pretrained_cfg['std'])
    results = []
    for pre in ({'mean': [0.4, 0.5, 0.6]}, {'mean': [0.4, 0.5, 0.6], 'std': std}):
        path = save_deployed(model, tmp_path / f'{len(pre)}.safetensors', preprocessing=pre)
        code, out, err, res = _eval(capsys, tmp_path, '--checkpoint', path, '--data', cifar_slice)
        assert code == 0, err
        results.append(_only(res))
    assert results[0]['loss'] == results[1]['loss'] and results[0]['top1'] == results[1]['top1']


def test_save_deployed_checks_the_preprocessing(tmp_path):
    model = timm.create_model('repa_deit_tiny_patch16_224', img_size=32, num_classes=10, depth=1, in_chans=1)
    with pytest.raises(ValueError, match=r"preprocessing keys \['crop_pct'\] are not recorded"):
        save_deployed(model, tmp_path / 'a.safetensors', preprocessing={'crop_pct': 0.9})
    with pytest.raises(ValueError, match=r'mean=\[0.5, 0.5, 0.5\]: expected 1 values \(one per input channel\)'):
        save_deployed(model, tmp_path / 'b.safetensors', preprocessing={'mean': [0.5] * 3})
    with pytest.raises(ValueError, match=r'input_size=\[32, 32\]: expected 3 values \(\[C, H, W\]\)'):
        save_deployed(model, tmp_path / 'c.safetensors', preprocessing={'input_size': [32, 32]})
    with pytest.raises(ValueError, match=r'input_size=\[1, 64, 64\]: the model takes 32x32 images only'):
        save_deployed(model, tmp_path / 'd.safetensors', preprocessing={'input_size': [1, 64, 64]})
    assert not list(tmp_path.iterdir())  # nothing written
