"""timm conformance of the registered models: the checks timm's own model tests make (forward,
backward, pretrained config, features_only, forward_intermediates, torch.fx, TorchScript), written
for vitblocks. A representative subset runs by default, every registered model under ``slow``.

Not covered, by design (see docs/dense.md): a model family that timm itself leaves out of a check
(features_only for ViT/MLP-Mixer uses timm's getter wrapper, tested in test_dense.py).
"""
import math

import pytest
import timm
import torch
from timm.models import get_notrace_functions, get_notrace_modules, get_pretrained_cfg_value
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import vitblocks

ALL = vitblocks.list_models() + vitblocks.models.list_backbones()  # + the backbones vitblocks adds (LV-ViT, LVT, ...)
# the default run: small models that still cover a swapped FFN with grid tracking (LocalViT), the
# gating unit and Mixer blocks in a ViT. test_dense.py runs features_only / forward_intermediates
# for the 224 px families (ViT/DeiT, Swin, PoolFormer, PVTv2) and a detector by default.
SUBSET = ['ninformer_vit_patch4_32', 'ninformer_baseline_localvit_patch4_32', 'ninformer_baseline_mixer_patch4_28']
# TorchScript by default also for the 32 px IFFN, AFBO and MABViT-GLU ViTs (the gating unit and LocalityFFN
# are in SUBSET); every model under slow
SCRIPT_SUBSET = SUBSET + ['bench_iffn_vit_tiny_patch4_32', 'bench_afbo_vit_tiny_patch4_32',
                          'bench_mabvit_glu_vit_tiny_patch4_32']
CFG_KEYS = ('input_size', 'fixed_input_size', 'interpolation', 'crop_pct', 'mean', 'std', 'num_classes', 'pool_size',
            'first_conv', 'classifier')


def _slow_unless_subset(names):
    return [n if n in SUBSET else pytest.param(n, marks=pytest.mark.slow) for n in names]


def _input(model, batch=1):
    return torch.randn(batch, *model.pretrained_cfg['input_size'])


@pytest.mark.parametrize('name', _slow_unless_subset(ALL))
def test_forward_backward(name):
    model = timm.create_model(name, num_classes=7).train()
    out = model(_input(model, 2))
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    out.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f'no gradient for {missing[:5]}'


@pytest.mark.parametrize('name', _slow_unless_subset(ALL))
def test_pretrained_cfg(name):
    model = timm.create_model(name).eval()
    cfg = model.pretrained_cfg
    assert all(k in cfg for k in CFG_KEYS)
    # the registry's config (what timm's data pipeline reads before building) is the model's
    assert get_pretrained_cfg_value(name, 'input_size') == cfg['input_size']
    state = model.state_dict()
    classifiers = cfg['classifier'] if isinstance(cfg['classifier'], (tuple, list)) else (cfg['classifier'],)
    assert f"{cfg['first_conv']}.weight" in state
    # the classifier's weights, unless the model is built headless like its timm base (ViT-H: num_classes 0)
    assert all((f'{c}.weight' in state) == (model.num_classes > 0) for c in classifiers)
    x = _input(model)
    with torch.no_grad():
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
    assert pre.shape == (1, model.head_hidden_size)
    if cfg['pool_size'] is not None:  # the unpooled grid, on the axes timm's tests read from `output_fmt`
        nhwc = getattr(model, 'output_fmt', 'NCHW') == 'NHWC'
        grid, channels = (feats.shape[1:3], feats.shape[3]) if nhwc else (feats.shape[2:], feats.shape[1])
        assert (tuple(grid), channels) == (tuple(cfg['pool_size']), model.num_features)
    model.reset_classifier(0)
    with torch.no_grad():
        assert model(x).shape == (1, model.head_hidden_size)


@pytest.mark.parametrize('name', _slow_unless_subset(ALL))
def test_forward_intermediates_and_features(name):
    model = timm.create_model(name).eval()
    x = _input(model)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
    assert len(inter) == len(model.feature_info) >= 3
    feats = timm.create_model(name, features_only=True).eval()
    with torch.no_grad():
        outs = feats(x)
    nhwc = getattr(feats, 'output_fmt', 'NCHW') == 'NHWC'
    size = x.shape[-1]
    for o, c, r in zip(outs, feats.feature_info.channels(), feats.feature_info.reduction()):
        assert o.shape[-1 if nhwc else 1] == c
        assert o.shape[1 if nhwc else 2] == math.ceil(size / r)


def _fx(model, train=False):
    kw = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
              param_shapes_constant=True)
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=kw)
    return create_feature_extractor(model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]],
                                    tracer_kwargs=kw)


@pytest.mark.parametrize('name', _slow_unless_subset(ALL))
def test_fx(name):
    model = timm.create_model(name, num_classes=7).eval()
    x = _input(model)
    with torch.no_grad():
        ref = model(x)
        got = next(iter(_fx(model)(x).values()))
    assert torch.equal(got, ref)
    traced = _fx(model.train(), train=True)
    out = next(iter(traced(_input(model, 2)).values()))
    out.mean().backward()
    assert all(p.grad is not None for p in traced.parameters())


@pytest.mark.parametrize('name', [n if n in SCRIPT_SUBSET else pytest.param(n, marks=pytest.mark.slow) for n in ALL])
def test_torchscript(name):
    """Every registered model scripts, and the scripted model computes the eager one's outputs, in eval
    mode (grad off: the deploy forms' eager fast paths against the scripted reference path) and in
    train mode with gradients (dropout is 0 in every registered model; stochastic depth, on by default in timm's
    Swin (0.1), is turned off, as a random draw in each model would differ)."""
    with timm.layers.set_scriptable(True):
        model = timm.create_model(name).eval()
    for m in model.modules():
        if isinstance(m, timm.layers.DropPath):
            m.drop_prob = 0.
    scripted = torch.jit.script(model)
    x = _input(model)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))
    model.train(), scripted.train()
    torch.testing.assert_close(scripted(x), model(x))


def test_torchscript_deployed_form():
    """A re-parameterized model (IFFN's BatchNorm folded: ``deploy=True`` layers) scripts too; TorchScript
    runs the reference path of the deploy form, which equals the eager inference path."""
    model = timm.create_model('bench_iffn_vit_tiny_patch4_32').eval()
    _randomize_bn(model)
    deployed = vitblocks.deploy.reparameterize(model)
    assert deployed.blocks[0].mlp.deploy
    scripted = torch.jit.script(deployed)
    x = _input(model, 2)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x), rtol=1e-4, atol=1e-5)


def _randomize_bn(model):
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-.5, .5), m.running_var.uniform_(.5, 2.)


def test_scripted_vit_keeps_its_grid():
    """The grid hooks are eager-only: a scripted ViT runs at the grid it was scripted with and names a
    mismatch; the eager model follows the input size (dynamic_img_size)."""
    model = timm.create_model('bench_iffn_vit_tiny_patch4_32', dynamic_img_size=True).eval()
    scripted = torch.jit.script(model)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 48, 48)).shape == (1, 10)  # 12x12 grid, tracked by the hook
        assert scripted(torch.randn(1, 3, 32, 32)).shape == (1, 10)  # the 8x8 grid it was scripted with
    with pytest.raises(torch.jit.Error, match=r'got 14\d tokens, but its layout expects \d prefix tokens \+ a 8x8'):
        scripted(torch.randn(1, 3, 48, 48))


@pytest.mark.parametrize('ffn', ['afbo', 'iffn'])
def test_pvt_v2_grid_needs_no_prior_forward(ffn):
    """PVTv2 passes each block's grid to its MLP (``feat_size``): a swapped model traced by torch.fx before it
    ever ran eagerly trains (timm's backward_fx case), and traced and scripted models follow the input size."""
    model = timm.create_model('pvt_v2_b0', num_classes=5)
    vitblocks.swap_ffn(model, ffn)
    assert model.stages[0].blocks[0].mlp.layout.grid_size is None  # nothing ran yet
    traced = _fx(model.train(), train=True)
    out = next(iter(traced(torch.randn(2, 3, 64, 64)).values()))
    out.mean().backward()
    assert all(p.grad is not None for p in traced.parameters())
    model.eval()
    scripted = torch.jit.script(model)
    eval_traced = _fx(model)
    for size in (64, 96):  # grids 16x16 / 24x24 in the first stage
        x = torch.randn(1, 3, size, size)
        with torch.no_grad():
            ref = model(x)
            torch.testing.assert_close(next(iter(eval_traced(x).values())), ref)
            torch.testing.assert_close(scripted(x), ref)
        assert model.stages[0].blocks[0].mlp.layout.grid_size == (size // 4, size // 4)


def test_variant_config_overrides_are_checked():
    from vitblocks.models import VariantSpec, register_variant
    spec = dict(name='test_only_swin_tiny', method='test', base='swin_tiny_patch4_window7_224', build=lambda m, c: 0)
    with pytest.raises(ValueError, match='give pool_size too'):  # Swin declares its 7x7 feature grid
        register_variant(VariantSpec(**spec, pretrained_cfg=dict(input_size=(3, 256, 256))))
    with pytest.raises(ValueError, match="not data/model fields"):
        register_variant(VariantSpec(**spec, pretrained_cfg=dict(hf_hub_id='x/y')))
    assert 'test_only_swin_tiny' not in vitblocks.list_models()


def test_feature_kwargs_need_features_only():
    with pytest.raises(ValueError, match='features_only=True'):
        timm.create_model('ninformer_vit_patch4_32', out_indices=(1, 2))


def test_pretrained_cfg_overlay():
    """timm.create_model's pretrained_cfg_overlay updates the registered config, as for timm's models: data
    settings reach the model's config (features_only wrapper included), and a new input_size builds a
    fixed-size family at that size."""
    overlay = dict(mean=(0.1, 0.2, 0.3), crop_pct=0.5, input_size=(3, 48, 48))
    model = timm.create_model('bench_iffn_vit_tiny_patch4_32', pretrained_cfg_overlay=overlay).eval()
    assert {k: model.pretrained_cfg[k] for k in overlay} == overlay
    assert model.pretrained_cfg['architecture'] == 'bench_iffn_vit_tiny_patch4_32'
    assert timm.data.resolve_data_config({}, model=model)['mean'] == (0.1, 0.2, 0.3)
    assert model.patch_embed.grid_size == (12, 12) and model.blocks[0].mlp.layout.grid_size == (12, 12)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 48, 48)).shape == (1, 10)
    plain = timm.create_model('bench_iffn_vit_tiny_patch4_32')
    assert plain.pretrained_cfg['mean'] != (0.1, 0.2, 0.3) and plain.patch_embed.grid_size == (8, 8)
    feats = timm.create_model('ninformer_vit_patch4_32', features_only=True,
                              pretrained_cfg_overlay=dict(std=(1., 1., 1.)))
    assert feats.pretrained_cfg['std'] == (1., 1., 1.)
    with pytest.raises(RuntimeError, match='no pretrained tag'):
        timm.create_model('ninformer_vit_patch4_32.in1k')
