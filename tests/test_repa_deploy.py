"""Deployed RePa models: safetensors save/load, torch.export (.pt2), ONNX (checked in onnxruntime) and TorchScript.

Every model has its BatchNorm statistics and affine parameters randomized before it is deployed
(default BatchNorm is an identity and would hide a wrong fold or a wrong load).
"""
import importlib.util
import json
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

import vitblocks  # noqa: F401  (registers the repa_* models)
from vitblocks.cli import main
from vitblocks.deploy import reparameterize
from vitblocks.deploy import io as deploy_io
from vitblocks.deploy.export import check_export, export_onnx, export_pt2, export_torchscript
from vitblocks.deploy.io import (FORMAT, DeployedCheckpointError, load_deployed, read_deployed_metadata, save_deployed,
                                write_safetensors)
from vitblocks.layers import RePaDeployedFFN, RePaFFN
from _helpers import randomize_batchnorm_

# torch.jit.trace/save/load and the TorchScript-based ONNX exporter are deprecated in torch 2.x; tested on purpose
pytestmark = [pytest.mark.filterwarnings('ignore:`torch.jit.*` is deprecated:FutureWarning'),
              pytest.mark.filterwarnings('ignore:export_torchscript is deprecated:DeprecationWarning'),
              pytest.mark.filterwarnings('ignore:You are using the legacy TorchScript-based ONNX export'),
              pytest.mark.filterwarnings('ignore:The feature will be removed:DeprecationWarning')]

# small registered models: the registered width and unit, 2 blocks at 32 px (ViT); PoolFormer-S12 is
# built full size by name (timm fixes its depth), run at 32 px
SMALL = {
    'repa_deit_tiny_patch16_224': (dict(depth=2, img_size=32, num_classes=10), (3, 32, 32)),
    'repa_poolformer_s12': (dict(num_classes=10), (3, 32, 32)),
}


def _has(*packages):
    return all(importlib.util.find_spec(p) is not None for p in packages)


@torch.no_grad()
def _trained(name, **block_cfg):
    """A training-form model with random BN statistics / affine params and layer-scales, in eval mode."""
    kwargs, size = SMALL[name]
    model = timm.create_model(name, block_cfg=block_cfg or None, **kwargs).eval()
    randomize_batchnorm_(model)
    for m in model.modules():
        if isinstance(m, RePaFFN) and m.layer_scale is not None:
            m.layer_scale.normal_(0., 1.)
    return model, size


def _units(model, cls):
    return sum(isinstance(m, cls) for m in model.modules())


# --- safetensors ---------------------------------------------------------------------------------

@pytest.mark.parametrize('name', sorted(SMALL))
def test_safetensors_round_trip_builds_the_deploy_form_directly(name, tmp_path):
    model, size = _trained(name)
    deployed = reparameterize(model)
    path = save_deployed(deployed, tmp_path / 'sub' / 'model.safetensors')
    assert path.is_file() and [p.name for p in path.parent.iterdir()] == ['model.safetensors']  # no temp left over
    meta = read_deployed_metadata(path)
    assert meta['format'] == FORMAT and meta['architecture'] == name

    loaded = load_deployed(name, path, **SMALL[name][0])
    assert _units(loaded, RePaFFN) == 0 and _units(loaded, RePaDeployedFFN) == _units(model, RePaFFN) > 0
    assert not loaded.training
    x = torch.randn(2, *size)
    with torch.no_grad():
        assert torch.equal(loaded(x), deployed(x))
        ref = model(x)
        assert ((loaded(x) - ref).norm() / ref.norm()).item() < 1e-5  # and it is still the trained model


@pytest.mark.parametrize('name', sorted(SMALL))
def test_checkpoints_in_the_split_layout_still_load(name, tmp_path):
    """Deployed files written before the one-GEMM layout hold W~ as ``mlp.linear.*`` and W~in as
    ``mlp.fc1.*``; they load (strict) into today's ``mlp.in_proj = [W~ | W~in]``."""
    model, size = _trained(name)
    deployed = reparameterize(model)
    path = save_deployed(deployed, tmp_path / 'new.safetensors')
    tensors, old = load_file(path), {}
    for key, value in tensors.items():
        if '.in_proj.' in key:
            unit = deployed.get_submodule(key.split('.in_proj.')[0])
            c = unit.linear_features
            old[key.replace('.in_proj.', '.linear.')], old[key.replace('.in_proj.', '.fc1.')] = value[:c], value[c:]
        else:
            old[key] = value
    assert len(old) == len(tensors) + _units(deployed, RePaDeployedFFN) * 2  # weight and bias of each unit split
    metadata = {k: v for k, v in read_deployed_metadata(path).items() if k != 'tensor_digest'}  # none back then
    save_file(old, tmp_path / 'old.safetensors', metadata=metadata)
    loaded = load_deployed(name, tmp_path / 'old.safetensors', **SMALL[name][0])
    x = torch.randn(2, *size)
    with torch.no_grad():
        assert torch.equal(loaded(x), deployed(x))


def test_saving_a_training_form_model_saves_its_deployed_copy(tmp_path):
    model, size = _trained('repa_deit_tiny_patch16_224')
    path = save_deployed(model, tmp_path / 'm.safetensors')
    assert _units(model, RePaFFN) == 2  # the model itself is untouched
    loaded = load_deployed('repa_deit_tiny_patch16_224', path, **SMALL['repa_deit_tiny_patch16_224'][0])
    x = torch.randn(2, *size)
    with torch.no_grad():
        assert torch.equal(loaded(x), reparameterize(model)(x))


def test_load_into_a_model_instance_reparameterizes_it_first(tmp_path):
    model, size = _trained('repa_deit_tiny_patch16_224')
    path = save_deployed(model, tmp_path / 'm.safetensors')
    target = timm.create_model('repa_deit_tiny_patch16_224', **SMALL['repa_deit_tiny_patch16_224'][0])
    loaded = load_deployed(target, path)
    assert _units(loaded, RePaDeployedFFN) == 2
    x = torch.randn(2, *size)
    with torch.no_grad():
        assert torch.equal(loaded(x), reparameterize(model)(x))


def test_block_cfg_is_recorded_and_used(tmp_path):
    name, kwargs = 'repa_deit_tiny_patch16_224', SMALL['repa_deit_tiny_patch16_224'][0]
    model, _ = _trained(name, idle_ratio=0.5)
    path = save_deployed(model, tmp_path / 'm.safetensors', block_cfg={'idle_ratio': 0.5})
    assert json.loads(read_deployed_metadata(path)['block_cfg']) == {'idle_ratio': 0.5}
    loaded = load_deployed(name, path, **kwargs)  # idle ratio from the file
    assert loaded.blocks[0].mlp.active_features == 384  # ceil(768 * 0.5)
    with pytest.raises(DeployedCheckpointError, match='idle_ratio'):
        load_deployed(name, path, block_cfg={'idle_ratio': 0.75}, **kwargs)


def test_interrupted_save_keeps_the_old_file(tmp_path, monkeypatch):
    model, _ = _trained('repa_deit_tiny_patch16_224')
    path = save_deployed(model, tmp_path / 'm.safetensors')
    before = path.read_bytes()

    def crash(module, filename, metadata=None):
        Path(filename).write_bytes(b'partial')
        raise KeyboardInterrupt

    monkeypatch.setattr(deploy_io, 'save_model', crash)
    with pytest.raises(KeyboardInterrupt):
        save_deployed(model, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ['m.safetensors']


@pytest.fixture
def saved(tmp_path):
    model, _ = _trained('repa_deit_tiny_patch16_224')
    return save_deployed(model, tmp_path / 'ok.safetensors')


@pytest.mark.parametrize('case, message', [
    ('missing', 'does not exist'),
    ('folder', 'a folder, not a file; give the .safetensors file'),
    ('garbage', 'not a readable safetensors file'),
    ('truncated', 'not a readable safetensors file'),
    ('foreign', 'not a vitblocks deployed checkpoint'),
    ('other_model', 'holds weights of repa_deit_tiny_patch16_224, not repa_deit_small_patch16_224'),
    ('other_num_classes', 'was saved with num_classes=10, not 7; drop num_classes'),
    ('bit_flipped', 'is damaged: its tensors do not match the digest recorded when it was saved'),
])
def test_bad_checkpoints_are_clear_errors(saved, tmp_path, case, message):
    name, kwargs = 'repa_deit_tiny_patch16_224', dict(SMALL['repa_deit_tiny_patch16_224'][0])
    path = tmp_path / 'bad.safetensors'
    if case == 'folder':
        path = tmp_path
    elif case == 'garbage':
        path.write_bytes(b'\x00not safetensors at all' * 8)
    elif case == 'truncated':
        data = saved.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif case == 'foreign':
        save_file({'weight': torch.zeros(3)}, str(path))
    elif case == 'other_model':
        path, name = saved, 'repa_deit_small_patch16_224'
    elif case == 'other_num_classes':
        path, kwargs['num_classes'] = saved, 7
    elif case == 'bit_flipped':  # one bit of one weight, deep in the data: the header still reads, shapes fit
        data = bytearray(saved.read_bytes())
        data[-1001] ^= 0x04
        path.write_bytes(bytes(data))
        assert read_deployed_metadata(path)['format'] == FORMAT
    with pytest.raises(DeployedCheckpointError, match=message):
        load_deployed(name, path, **kwargs)


def test_the_file_records_its_sizes_and_loads_by_name_alone(tmp_path):
    """num_classes, img_size and in_chans come from the file: no sizes repeated, not even the name."""
    model = timm.create_model('repa_deit_tiny_patch16_224', img_size=48, num_classes=7, in_chans=1).eval()
    randomize_batchnorm_(model)
    path = save_deployed(model, tmp_path / 'm.safetensors')
    meta = read_deployed_metadata(path)
    assert (json.loads(meta['num_classes']), json.loads(meta['img_size']), json.loads(meta['in_chans'])) == \
        (7, [48, 48], 1)
    loaded = load_deployed(None, path)  # the name recorded in the file
    assert loaded.num_classes == 7 and loaded.patch_embed.img_size == (48, 48)
    x = torch.randn(2, 1, 48, 48)
    with torch.no_grad():
        assert torch.equal(loaded(x), reparameterize(model)(x))
    assert load_deployed('repa_deit_tiny_patch16_224', path, img_size=(48, 48), num_classes=7).num_classes == 7
    with pytest.raises(DeployedCheckpointError, match='was saved with img_size=\\[48, 48\\], not 32; drop img_size'):
        load_deployed('repa_deit_tiny_patch16_224', path, img_size=32)


def test_a_file_without_sizes_loads_with_the_sizes_given(tmp_path):
    """Files written before the sizes were recorded: the sizes given are used; none given is a clear error."""
    name, kwargs = 'repa_deit_tiny_patch16_224', dict(img_size=32, num_classes=10)
    deployed = reparameterize(timm.create_model(name, depth=2, **kwargs))
    old = write_safetensors(deployed, tmp_path / 'old.safetensors', {'format': FORMAT, 'architecture': name})
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(load_deployed(name, old, depth=2, **kwargs)(x), deployed(x))
    with pytest.raises(DeployedCheckpointError, match='records no sizes .* pass the num_classes / img_size / in_chans'):
        load_deployed(name, old, depth=2)


# --- export --------------------------------------------------------------------------------------

@pytest.mark.parametrize('name', [n if 'deit' in n else pytest.param(n, marks=pytest.mark.slow) for n in sorted(SMALL)])
def test_pt2_round_trip_equals_eager(name, tmp_path):
    """torch.export + torch.export.save, loaded back: the same outputs as the eager deployed model, any batch."""
    model, size = _trained(name)
    deployed = reparameterize(model)
    path = export_pt2(deployed, tmp_path / 'm.pt2', input_size=size, batch_size=2)
    program = torch.export.load(str(path)).module()
    with torch.no_grad():
        for batch in (1, 3):  # not the example batch 2: the batch dimension is dynamic
            x = torch.randn(batch, *size)
            assert torch.allclose(program(x), deployed(x), rtol=1e-5, atol=1e-6)
    assert check_export(path, deployed, input_size=size) < 1e-5


@pytest.mark.skipif(not _has('onnx', 'onnxscript', 'onnxruntime'), reason='needs onnx, onnxscript and onnxruntime')
def test_onnx_external_data_round_trip(tmp_path):
    """Weights as external data (what models above 2 GB get): two files, and onnxruntime reads both."""
    model, size = _trained('repa_deit_tiny_patch16_224')
    deployed = reparameterize(model)
    path = export_onnx(deployed, tmp_path / 'm.onnx', input_size=size, external_data=True)
    data = tmp_path / 'm.onnx.data'
    assert data.is_file() and data.stat().st_size > path.stat().st_size  # the weights are in the .data file
    assert check_export(path, deployed, input_size=size) < 1e-4



_ONNX_CASES = [
    pytest.param('repa_deit_tiny_patch16_224', True, id='deit-dynamo',
                 marks=pytest.mark.skipif(not _has('onnx', 'onnxscript', 'onnxruntime'),
                                          reason='needs onnx, onnxscript and onnxruntime')),
    pytest.param('repa_deit_tiny_patch16_224', False, id='deit-legacy',
                 marks=pytest.mark.skipif(not _has('onnx', 'onnxruntime'), reason='needs onnx and onnxruntime')),
    pytest.param('repa_poolformer_s12', False, id='poolformer-legacy',
                 marks=pytest.mark.skipif(not _has('onnx', 'onnxruntime'), reason='needs onnx and onnxruntime')),
]


@pytest.mark.parametrize('name, dynamo', _ONNX_CASES)
def test_onnx_export_matches_pytorch_in_onnxruntime(name, dynamo, tmp_path):
    model, size = _trained(name)
    deployed = reparameterize(model)
    path = export_onnx(deployed, tmp_path / 'm.onnx', input_size=size, batch_size=2, dynamo=dynamo)
    import onnx
    onnx.checker.check_model(str(path))
    # batch 3 != the export's example batch 2: the batch dimension must be dynamic
    err = check_export(path, deployed, input_size=size, batch_size=3)
    assert err < 1e-4
    with torch.no_grad():
        scale = deployed(torch.randn(3, *size)).abs().max().item()
    assert scale > 1e-2  # the error is small against outputs that are not


@pytest.mark.parametrize('name', sorted(SMALL))
def test_torchscript_round_trip(name, tmp_path):
    model, size = _trained(name)
    deployed = reparameterize(model)
    path = export_torchscript(deployed, tmp_path / 'm.pt', input_size=size, batch_size=2)
    loaded = torch.jit.load(str(path))
    x = torch.randn(3, *size)
    with torch.no_grad():
        assert torch.allclose(loaded(x), deployed(x), rtol=1e-5, atol=1e-6)
    assert check_export(path, deployed, input_size=size) < 1e-5


def test_export_refuses_a_model_in_training_mode(tmp_path):
    model, size = _trained('repa_deit_tiny_patch16_224')
    with pytest.raises(ValueError, match='eval mode'):
        export_torchscript(model.train(), tmp_path / 'm.pt', input_size=size)


# --- vitblocks export ----------------------------------------------------------------------------

def _cli(capsys, *argv):
    code = main(['export', *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_exports_deployed_weights_and_checks(tmp_path, capsys):
    """A deployed file of a 32 px, 10-class model exports by name alone: the sizes come from the file."""
    out = tmp_path / 'm.pt2'
    small = save_deployed(timm.create_model('repa_deit_tiny_patch16_224', img_size=32, num_classes=10),
                          tmp_path / 's.safetensors')
    code, text, err = _cli(capsys, 'repa_deit_tiny_patch16_224', '--weights', str(small), '--format', 'pt2',
                           '--out', str(out), '--batch-size', '1', '--check')
    assert code == 0 and out.is_file(), err
    # --batch-size 1 with a dynamic batch is traced at 2 (torch.export would fix a batch of 1), and says so
    assert 'deployed' in text and 'input 2x3x32x32, batch dynamic' in text
    assert 'torch.export.load, called with autograd on and under no_grad, batch 2' in text
    assert float(text.split('max abs error ')[1].split()[0]) < 1e-5


def test_cli_torchscript_still_works_with_a_deprecation_warning(tmp_path, capsys):
    out = tmp_path / 'm.pt'
    code, text, err = _cli(capsys, 'deit_tiny_patch16_224', '--img-size', '32', '--num-classes', '10', '--format',
                           'torchscript', '--out', str(out), '--batch-size', '1', '--check')
    assert code == 0 and out.is_file()
    assert '--format torchscript is deprecated' in err and 'use --format pt2' in err
    assert float(text.split('max abs error ')[1].split()[0]) < 1e-5


@pytest.mark.parametrize('argv, message', [
    (['--format', 'pt2', '--out', 'm.pt'], '--format pt2 writes a .pt2 file; name --out m.pt2'),
    (['--format', 'onnx', '--out', 'm.pt2'], '--format onnx writes a .onnx file; name --out m.onnx'),
    (['--format', 'torchscript', '--out', 'm.pt2'], 'not .pt2; name --out *.pt'),
    (['--format', 'pt2', '--out', 'm.pt2', '--opset', '17'], '--opset is an ONNX option'),
    (['--format', 'pt2', '--out', 'm.pt2', '--onnx-exporter', 'legacy'], '--onnx-exporter is an ONNX option'),
    (['--format', 'safetensors', '--out', 'm.pt2'], '--format safetensors writes a .safetensors file; name --out '
                                                    'm.safetensors'),
    (['--format', 'safetensors', '--out', 'm.safetensors', '--static-batch'], '--static-batch applies to traced '
                                                                              'formats (pt2, onnx)'),
    (['--format', 'safetensors', '--out', 'm.safetensors', '--weights', 'd.safetensors'],
     '--weights d.safetensors is a deployed safetensors file already; copy it instead'),
])
def test_cli_contradictory_format_options_are_one_line_errors(tmp_path, capsys, argv, message):
    code, out, err = _cli(capsys, 'deit_tiny_patch16_224', *argv)
    assert code == 2 and out == '' and len(err.strip().splitlines()) == 1
    assert message in err


def test_cli_bad_weights_is_a_one_line_user_error(tmp_path, capsys):
    bad = tmp_path / 'bad.safetensors'
    bad.write_bytes(b'garbage')
    code, out, err = _cli(capsys, 'repa_deit_tiny_patch16_224', '--weights', str(bad), '--format', 'onnx',
                          '--out', str(tmp_path / 'm.onnx'))
    assert code == 2 and out == '' and len(err.strip().splitlines()) == 1
    assert 'not a readable safetensors file' in err and not (tmp_path / 'm.onnx').exists()


@pytest.mark.parametrize('name', ['repa_deit_tiny_patch16_224', 'repa_poolformer_s12'])
def test_deployed_form_runs_under_bf16_autocast(name):
    """The in-place accumulate (addmm_) is outside autocast's reach: under autocast the deployed unit
    takes the out-of-place path and matches fp32 to bf16 precision."""
    kwargs = dict(img_size=64) if 'deit' in name else {}
    model = reparameterize(timm.create_model(name, num_classes=10, **kwargs).eval())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = model(x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.05 * ref.abs().max() + 0.05
