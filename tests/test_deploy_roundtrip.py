"""Every exported or saved deployed model is right, or refused: each family's tiny deployed model, exported in
every format and exporter, loaded back and called the plain way (autograd on) at another batch size than the
export's, equals the eager model; every deployed safetensors file loads by itself to the same outputs."""
import copy

import pytest
import timm
import torch

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.deploy import reparameterize
from vitblocks.deploy.export import ExportCheckError, check_export, export_onnx, export_pt2, export_torchscript
from vitblocks.deploy.io import DeployedCheckpointError, load_deployed, read_deployed_metadata, save_deployed
from vitblocks.models import swap_ffn

VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=10)  # 16 tokens + class token
EXPORT_BATCH, CHECK_BATCH = 2, 3  # the check runs another batch size than the one traced
TOL = 1e-4


def _swapped_timm():
    """timm's small test ViT (6 blocks, width 64) built at 32 px with a dynamic image size, its second MLP swapped
    for a SiLU IFFN: sizes and swap are all a file needs (a timm model's other kwargs are not recorded)."""
    model = timm.create_model('test_vit', img_size=32, num_classes=10, dynamic_img_size=True)
    swap_ffn(model, 'iffn', include=lambda name: name == 'blocks.1.mlp', act_layer='silu')
    return model


EDGEVIT = dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 32, 32), head_dim=16)  # one block per stage


def _edgevit_with_afbo():
    """A one-block-per-stage EdgeViT (a timm model vitblocks adds) with AFBO (post-activation) swapped into its first
    channels-first (NCHW) slot, the local aggregation's MLP."""
    model = timm.create_model('edgevit_xxs', num_classes=10, **EDGEVIT)
    swap_ffn(model, 'afbo', include=lambda name: name == 'stages.0.blocks.0.local_agg.mlp', act_position='post')
    return model


# family -> a tiny model in training form, built with a non-default, shape-keeping option where the family has one
FAMILIES = {
    'iffn': lambda: timm.create_model('iffn_deit_tiny_patch16_224', block_cfg={'act_layer': 'silu'}, **VIT),
    'afbo_tokens': lambda: timm.create_model('afbo_deit_tiny_patch16_224', block_cfg={'act_position': 'post'}, **VIT),
    'afbo_channels_first': _edgevit_with_afbo,
    'repa': lambda: timm.create_model('repa_deit_tiny_patch16_224', block_cfg={'idle_ratio': 0.5}, **VIT),
    'mabvit': lambda: timm.create_model('mabvit_glu_vit_tiny_patch16_224', **VIT),
    'ninformer': lambda: timm.create_model('ninformer_vit_patch4_28', depth=1, embed_dim=32, num_heads=2,
                                           num_classes=10, block_cfg={'token_mlp_dim': 16, 'channel_mlp_dim': 16}),
    'swap_ffn_timm': _swapped_timm,
}
INPUT = {'ninformer': (1, 28, 28)}
# timm kwargs of a timm model built other than its defaults: timm.create_model keeps no record of them
BUILD_KWARGS = {'afbo_channels_first': EDGEVIT}


def _randomize_batchnorm(model):
    """Non-trivial BatchNorm statistics, so a wrong fold shows (a fresh BatchNorm is an identity)."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            if m.affine:
                m.weight.data.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.data.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
    return model


_DEPLOYED = {}


def deployed(family):
    """The family's deployed model (eval mode), built once per session."""
    if family not in _DEPLOYED:
        torch.manual_seed(0)
        _DEPLOYED[family] = reparameterize(_randomize_batchnorm(FAMILIES[family]()))
    return _DEPLOYED[family]


def _input(family, batch):
    return torch.randn(batch, *INPUT.get(family, (3, 32, 32)), generator=torch.Generator().manual_seed(2))


FORMATS = ('pt2', 'onnx_dynamo', 'onnx_legacy', 'torchscript')


def _export(model, fmt, path, size):
    if fmt == 'pt2':
        return export_pt2(model, path.with_suffix('.pt2'), input_size=size, batch_size=EXPORT_BATCH)
    if fmt.startswith('onnx'):
        pytest.importorskip('onnxruntime')
        pytest.importorskip('onnxscript' if fmt == 'onnx_dynamo' else 'onnx')
        return export_onnx(model, path.with_suffix('.onnx'), input_size=size, batch_size=EXPORT_BATCH,
                           dynamo=fmt == 'onnx_dynamo')
    with pytest.warns(DeprecationWarning):
        return export_torchscript(model, path.with_suffix('.pt'), input_size=size, batch_size=EXPORT_BATCH)


@pytest.mark.parametrize('family,fmt', [pytest.param(family, fmt, id=f'{family}-{fmt}')
                                        for family in FAMILIES for fmt in FORMATS])
def test_export_loaded_back_and_called_the_plain_way_equals_eager(family, fmt, tmp_path, capfd):
    model = deployed(family)
    size = INPUT.get(family, (3, 32, 32))
    capfd.readouterr()
    path = _export(model, fmt, tmp_path / family, size)
    assert capfd.readouterr().out == ''  # no exporter log on the user's stdout (C++ writes included)
    # check_export: onnxruntime, or the loaded module called with autograd on and under no_grad, at batch 3
    err = check_export(path, model, input_size=size, batch_size=CHECK_BATCH)
    assert err < TOL, f'{family} {fmt}: max abs error {err:.3g}'


@pytest.mark.parametrize('family', list(FAMILIES))
def test_deployed_file_loads_by_itself_to_the_same_outputs(family, tmp_path):
    model = deployed(family)
    path = save_deployed(model, tmp_path / f'{family}.safetensors', build_kwargs=BUILD_KWARGS.get(family))
    loaded = load_deployed(None, path)
    x = _input(family, CHECK_BATCH)
    with torch.no_grad():
        err = (loaded(x) - model(x)).abs().max().item()
    assert err < TOL, f'{family}: max abs error {err:.3g}'


def test_file_records_block_cfg_swap_and_sizes(tmp_path):
    md = read_deployed_metadata(save_deployed(deployed('iffn'), tmp_path / 'iffn.safetensors'))
    assert md['block_cfg'] == '{"act_layer": "silu"}'
    assert '"depth": 1' in md['build_kwargs']
    md = read_deployed_metadata(save_deployed(deployed('swap_ffn_timm'), tmp_path / 'swap.safetensors'))
    assert md['architecture'] == 'test_vit'
    assert md['img_size'] == '[32, 32]' and md['dynamic_img_size'] == 'true'
    assert '"include": ["blocks.1.mlp"]' in md['surgery'] and '"act_layer": "silu"' in md['surgery']


def test_a_model_built_otherwise_than_recorded_is_refused(tmp_path):
    """A file saved without the block config it was built with (as files of older vitblocks were) builds the
    default block; its recorded output tells, and loading refuses instead of returning a wrong model."""
    path = save_deployed(deployed('iffn'), tmp_path / 'iffn.safetensors', block_cfg={})
    with pytest.raises(DeployedCheckpointError, match='does not compute what the saved model computed'):
        load_deployed(None, path)
    assert load_deployed(None, path, block_cfg={'act_layer': 'silu'}) is not None  # the right config: loads


def test_a_swap_with_python_objects_is_refused_by_the_file_alone(tmp_path):
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    swap_ffn(model, 'iffn', act_layer=torch.nn.SiLU)  # a class: a file holds names and numbers only
    path = save_deployed(model.eval(), tmp_path / 'm.safetensors', build_kwargs={'patch_size': 8, 'embed_dim': 32,
                                                                               'depth': 1, 'num_heads': 2})
    with pytest.raises(DeployedCheckpointError, match='cannot be rebuilt by the file alone: swap_ffn was called with '
                                                      'act_layer='):
        load_deployed(None, path)
    rebuilt = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    swap_ffn(rebuilt, 'iffn', act_layer=torch.nn.SiLU)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (load_deployed(rebuilt, path)(x) - reparameterize(model)(x)).abs().max().item() < TOL


def test_a_failing_plain_call_of_an_export_is_reported_not_passed(tmp_path):
    """A program whose plain call fails (autograd on) is an ExportCheckError even though it runs under no_grad."""
    class InPlace(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            out = torch.empty_like(x)
            return torch.mul(x, self.w, out=out)

    model = InPlace().eval()
    with pytest.raises(ExportCheckError, match='autograd on.*inplace.pt2 was not written'):
        export_pt2(model, tmp_path / 'inplace.pt2', input_size=(4,))  # verified before it is put in place
    assert list(tmp_path.iterdir()) == []
    path = export_pt2(model, tmp_path / 'inplace.pt2', input_size=(4,), verify=False)
    with torch.no_grad():
        assert torch.export.load(str(path)).module()(torch.randn(3, 4)).shape == (3, 4)
    with pytest.raises(ExportCheckError, match='called the plain way, with autograd on'):
        check_export(path, model, input_size=(4,))


@pytest.mark.parametrize('family', list(FAMILIES))
def test_a_deployed_model_trains_as_its_folded_form(family):
    """model.train() on a deployed model is allowed, as after timm's reparameterize_model: every parameter of the
    folded form gets a finite gradient."""
    model = copy.deepcopy(deployed(family)).train()
    model(_input(family, 2)).logsumexp(-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f'{family}: no finite gradient for {missing[:4]}'


class _OutAddcmul(torch.nn.Module):
    """An in-place ``addcmul(..., out=)``: the legacy exporter cannot convert it, and dumps its IR graph on stdout."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        out = torch.empty_like(x)
        return torch.addcmul(x, x, self.w, out=out)


def test_the_legacy_onnx_exporter_writes_nothing_on_stdout_even_when_it_fails(tmp_path, capfd):
    """torch's TorchScript-based exporter dumps its whole IR graph on stdout when a conversion fails; export_onnx
    keeps stdout clean whether the export fails (an exception says why) or succeeds."""
    pytest.importorskip('onnx')
    capfd.readouterr()
    with pytest.raises(Exception, match='addcmul'):  # a conversion that fails (the deployed IFFN of old did)
        export_onnx(_OutAddcmul().eval(), tmp_path / 'failed.onnx', input_size=(4,), dynamo=False)
    assert capfd.readouterr().out == ''
    export_onnx(deployed('iffn'), tmp_path / 'iffn.onnx', input_size=(3, 32, 32), dynamo=False)
    assert capfd.readouterr().out == ''


class BatchBakedIn(torch.nn.Module):
    """Eager: x * batch. A tracing exporter bakes the traced batch in as a constant: wrong at any other batch."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.w * float(x.shape[0])


@pytest.mark.parametrize('fmt', ['onnx_legacy', 'torchscript'])
def test_an_export_that_computes_other_outputs_is_refused_and_not_written(tmp_path, fmt):
    if fmt == 'onnx_legacy':
        pytest.importorskip('onnxruntime')
    model = BatchBakedIn().eval()
    with pytest.raises(ExportCheckError, match='computes other outputs than the model .* was not written'):
        _export(model, fmt, tmp_path / 'baked', (4,))
    assert list(tmp_path.iterdir()) == []


def test_a_file_without_the_recorded_build_loads_as_before(tmp_path):
    """Files of older vitblocks (name and sizes only: no build kwargs, surgery or reference output) load as they
    did, with the architecture kwargs given."""
    from vitblocks.deploy.io import FORMAT, write_safetensors
    model = deployed('repa')
    path = write_safetensors(model, tmp_path / 'old.safetensors', {
        'format': FORMAT, 'architecture': 'repa_deit_tiny_patch16_224', 'num_classes': '10', 'img_size': '[32, 32]',
        'in_chans': '3', 'block_cfg': '{"idle_ratio": 0.5}'})
    loaded = load_deployed(None, path, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    x = _input('repa', 2)
    with torch.no_grad():
        assert (loaded(x) - model(x)).abs().max().item() < TOL
