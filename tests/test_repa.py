"""RePa: channel-idle FFN unit, its exact folding (Eq. 5-7), residual surgery and registered models.

Every fold is checked RepVGG-style: BatchNorm statistics and affine parameters, layer-scales and
residual scales are randomized first (default BatchNorm is an identity and hides folding bugs),
and the test asserts that the randomization changed the output.
"""
import copy
import math
import pickle
from unittest import mock

import pytest
import timm
import torch
from timm.models import metaformer, mlp_mixer
from timm.utils import reparameterize_model
from torch import nn

import vitblocks
from vitblocks.layers import RePaDeployedFFN, RePaFFN, TokenBatchNorm, active_channels
from vitblocks.models import get_variant, swap_residual_ffn
from vitblocks.profile import count_macs, count_params
from _helpers import randomize_batchnorm_

REPA_MODELS = vitblocks.list_models(method='repa')

# The registered width and block type, but few blocks and a small input, so the suite stays fast.
_SMALL = {  # base-name prefix -> (timm kwargs, input size)
    'deit': (dict(depth=2, img_size=32), 32),
    'vit': (dict(depth=2, img_size=32), 32),
    'swin': (dict(depths=(2, 1, 1, 1), img_size=64), 64),  # block 2 of stage 1 has shifted windows
    'lvvit': (dict(depth=2, img_size=32), 32),  # vitblocks.models.backbones.lvvit
}
# timm's PoolFormer / Mixer entry points fix their depth, so these are built from the entry point's
# own kwargs (captured with the family builder stubbed out) with fewer blocks
_FIXED_DEPTH = {  # prefix -> (timm module, family builder, class, small-depth kwargs, input size)
    'poolformer': (metaformer, '_create_metaformer', metaformer.MetaFormer, dict(depths=(1, 1, 1, 1)), 64),
    'mixer': (mlp_mixer, '_create_mixer', mlp_mixer.MlpMixer, dict(num_blocks=2, img_size=32), 32),
}


def _entry_kwargs(module, builder, base):
    captured = {}
    with mock.patch.object(module, builder, lambda variant, pretrained=False, **kwargs: captured.update(kwargs)):
        getattr(module, base)()
    return captured


def _small(name, **block_cfg):
    spec = get_variant(name)
    family = spec.base.split('_')[0]
    if family in _FIXED_DEPTH:
        module, builder, cls, small, size = _FIXED_DEPTH[family]
        model = cls(**{**_entry_kwargs(module, builder, spec.base), **small, 'num_classes': 10})
        spec.build(model, {**spec.cfg, **block_cfg})
        return model, size
    kwargs, size = _SMALL[family]
    return timm.create_model(name, num_classes=10, block_cfg=block_cfg or None, **kwargs), size


@torch.no_grad()
def _randomize(model):
    """Random BN running stats + affine params, layer-scales and residual scales (in place)."""
    randomize_batchnorm_(model)
    for m in model.modules():
        if isinstance(m, RePaFFN):
            if m.layer_scale is not None:
                m.layer_scale.normal_(0., 1.)
            if m.res_scale is not None:
                m.res_scale.normal_(1., 0.5)
    return model


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _unit_params(c, hidden, k, bias=True, layer_scale=False):
    """Exact parameter counts of one unit (training form, deployed form)."""
    train = 2 * c + (hidden * c + hidden * bias) + 2 * hidden + (hidden * c + c * bias) + c * layer_scale
    deployed = (c * c + c if k < hidden else c) + (k * c + k + k * c)
    return train, deployed


# --- registered models -------------------------------------------------------------------------

def test_every_table1_backbone_timm_has_is_registered():
    expected = {f'repa_{b}' for b in (
        'deit_tiny_patch16_224', 'deit_small_patch16_224', 'deit_base_patch16_224', 'vit_large_patch16_224',
        'vit_huge_patch16_224', 'swin_tiny_patch4_window7_224', 'swin_small_patch4_window7_224',
        'swin_base_patch4_window7_224', 'poolformer_s12', 'poolformer_s24', 'poolformer_s36', 'poolformer_m36',
        'poolformer_m48', 'mixer_b16_224', 'mixer_l16_224', 'lvvit_s', 'lvvit_m')}
    # the authors' RePaViT architecture, for their released checkpoints (tests/test_authors_checkpoints.py)
    expected |= {f'repa_prenorm_{b}' for b in ('deit_tiny_patch16_224', 'deit_small_patch16_224',
                                               'deit_base_patch16_224', 'vit_large_patch16_224',
                                               'vit_huge_patch16_224')}
    assert set(REPA_MODELS) == expected
    huge = get_variant('repa_vit_huge_patch16_224')
    assert huge.base == 'vit_huge_patch14_224' and huge.base_kwargs == {'patch_size': 16}


@pytest.mark.parametrize('name', REPA_MODELS)
def test_registered_model_trains_and_fuses_exactly(name):
    model, size = _small(name)
    x = torch.randn(2, 3, size, size)

    # training form: every parameter gets a finite gradient
    model.train()(x).square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f'{name}: {pname} received no gradient'
        assert torch.isfinite(p.grad).all(), f'{name}: {pname} has a non-finite gradient'

    model.eval()
    with torch.no_grad():
        default = model.forward_features(x)
        out = _randomize(model).forward_features(x)
    assert _rel(out, default) > 1e-2, 'randomizing BN / layer-scale did not change the output'

    fused = reparameterize_model(model)  # timm's walker calls .fuse() on every child; copies
    units = [m for m in model.modules() if isinstance(m, RePaFFN)]
    assert units and not any(isinstance(m, RePaFFN) for m in fused.modules())
    assert sum(isinstance(m, RePaDeployedFFN) for m in fused.modules()) == len(units)
    with torch.no_grad():
        assert _rel(fused.forward_features(x), out) < 1e-5

    # Sec. 4.3: per FFN the weights drop to 1 - theta + 1 / (2 rho) of 2 rho C^2; all params exactly
    drop = 0
    for u in units:
        c, hid, k = u.in_features, u.hidden_features, u.active_features
        assert (2 * k * c + c * c) / (2 * hid * c) == pytest.approx(1 - u.idle_ratio + 1 / (2 * hid / c))
        train, deployed = _unit_params(c, hid, k, layer_scale=u.layer_scale is not None)
        drop += train - deployed
    assert count_params(model) - count_params(fused) == drop

    # deployed form built directly from dims: the fused state_dict loads strictly, same output
    deployed, _ = _small(name, deploy=True)
    deployed.load_state_dict(fused.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(deployed.eval().forward_features(x), fused.forward_features(x))

    # idempotent: re-parameterizing a deployed model changes nothing
    again = reparameterize_model(fused)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), fused.state_dict().values()))


def test_deit_tiny_complexity_matches_both_tables():
    """Full-size RePa-DeiT-Ti. Table 2 (1.3 -> 0.8 GMACs) counts the attention matmuls, as we do;
    Table 1 (1.1 -> 0.6) leaves them out. Params 5.7 -> 3.5 M in both."""
    model = timm.create_model('repa_deit_tiny_patch16_224').eval()
    fused = reparameterize_model(model)
    assert round(count_params(model) / 1e6, 1) == 5.7 and round(count_params(fused) / 1e6, 1) == 3.5
    before, after = count_macs(model), count_macs(fused)
    assert (round(before.gmacs, 1), round(after.gmacs, 1)) == (1.3, 0.8)  # Table 2
    def attention(r):
        return sum(v for k, v in r.by_op.items() if 'scaled_dot_product' in k) / 1e9
    assert (round(before.gmacs - attention(before), 1), round(after.gmacs - attention(after), 1)) == (1.1, 0.6)
    # fusing removes exactly 12 blocks x 197 tokens x (2*4 - 3) C^2 MACs (Sec. 4.3)
    assert before.total - after.total == 12 * 197 * 5 * 192 ** 2


# --- the unit ----------------------------------------------------------------------------------

_LAYOUTS = {  # name -> (channels_first, input shape)
    'tokens': (False, (2, 7, 16)),
    'nhwc': (False, (2, 3, 5, 16)),
    'nchw': (True, (2, 16, 3, 5)),
}


@pytest.mark.parametrize('layout', sorted(_LAYOUTS))
@pytest.mark.parametrize('theta', [0., 0.25, 0.5, 0.75, 1.])
@pytest.mark.parametrize('scales', ['none', 'layer_scale', 'res_scale'])
def test_unit_fold_is_exact(layout, theta, scales):
    cf, shape = _LAYOUTS[layout]
    unit = RePaFFN(16, 64, idle_ratio=theta, channels_first=cf,
                   layer_scale_init_value=1e-5 if scales == 'layer_scale' else None,
                   res_scale_init_value=1. if scales == 'res_scale' else None).eval()
    x = torch.randn(shape)
    with torch.no_grad():
        default = unit(x)
        out = _randomize(unit)(x)
        assert _rel(out, default) > 1e-2
        fused = unit.fuse()
        y = fused(x)
    shortcut = x * (unit.res_scale.view(-1, 1, 1) if cf else unit.res_scale) if unit.res_scale is not None else x
    assert _rel(y - shortcut, out - shortcut) < 1e-5  # the FFN branch alone, not hidden by the shortcut
    assert fused.fuse() is fused
    k = active_channels(64, theta)
    assert fused.active_features == k
    train, deployed = _unit_params(16, 64, k, layer_scale=scales == 'layer_scale')
    assert count_params(unit) == train + 16 * (scales == 'res_scale')
    assert count_params(fused) == deployed + (16 * 16 if scales == 'res_scale' and theta == 0 else 0)


def test_fold_in_float64_is_exact_to_double_precision():
    unit = _randomize(RePaFFN(24, 96, layer_scale_init_value=1e-5).double().eval())
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    fused = unit.fuse()
    assert fused.in_proj.weight.dtype == torch.float64
    with torch.no_grad():
        assert _rel(fused(x) - x, unit(x) - x) < 1e-12


def test_theta_one_is_a_single_linear_layer():
    unit = _randomize(RePaFFN(16, 64, idle_ratio=1.).eval())
    fused = unit.fuse()
    assert fused.fc2 is None and fused.act is None
    assert [n for n, _ in fused.named_parameters()] == ['in_proj.weight', 'in_proj.bias']
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.allclose(fused(x), fused.in_proj(x)) and _rel(fused(x) - x, unit(x) - x) < 1e-5


def test_theta_zero_has_no_linear_path():
    unit = _randomize(RePaFFN(16, 64, idle_ratio=0.).eval())
    fused = unit.fuse()
    assert fused.linear_features == 0 and fused.in_proj.weight.shape == (64, 16) and fused.bias.shape == (16,)
    assert fused.active_features == 64
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert _rel(fused(x) - x, unit(x) - x) < 1e-5


@pytest.mark.parametrize('layout', sorted(_LAYOUTS))
@pytest.mark.parametrize('theta', [0., 0.75, 1.])
def test_deployed_unit_is_one_gemm_and_agrees_with_its_autograd_path(layout, theta):
    """in_proj = [W~ | W~in] (Eq. 6-7): one layer reads x; the in-place no-grad path equals the
    out-of-place autograd path and leaves its input untouched."""
    cf, shape = _LAYOUTS[layout]
    unit = _randomize(RePaFFN(16, 64, idle_ratio=theta, channels_first=cf).eval())
    fused, k = unit.fuse(), active_channels(64, theta)
    assert fused.in_proj.weight.shape[0] == (16 if theta > 0 else 0) + k
    assert sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in fused.modules()) == 1 + (k > 0)
    x = torch.randn(shape)
    x0 = x.clone()
    with torch.no_grad():
        fast = fused(x)
    assert torch.equal(x, x0)
    slow = fused(x.requires_grad_())  # autograd on: the out-of-place path
    slow.sum().backward()
    assert torch.allclose(fast, slow.detach(), rtol=1e-6, atol=1e-6)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in fused.parameters())


@pytest.mark.parametrize('cf', [False, True])
@pytest.mark.parametrize('theta', [0., 0.75, 1.])
def test_deployed_unit_loads_the_split_layout_of_older_checkpoints(cf, theta):
    """Checkpoints written before in_proj stored W~ as ``linear.*`` and W~in as ``fc1.*``."""
    fused = _randomize(RePaFFN(16, 64, idle_ratio=theta, channels_first=cf).eval()).fuse()
    lin = fused.linear_features
    old = {k: v for k, v in fused.state_dict().items() if not k.startswith('in_proj.')}
    for name in ('weight', 'bias'):
        w = fused.state_dict()[f'in_proj.{name}']
        if lin:
            old[f'linear.{name}'] = w[:lin].clone()
        if fused.active_features:
            old[f'fc1.{name}'] = w[lin:].clone()
    fresh = RePaDeployedFFN.from_config(16, 64, idle_ratio=theta, channels_first=cf)
    fresh.load_state_dict(old)  # strict
    x = torch.randn(_LAYOUTS['nchw' if cf else 'tokens'][1])
    with torch.no_grad():
        assert torch.equal(fresh(x), fused(x))
    assert not any(k.startswith('in_proj.') for k in old)  # load_state_dict converted its own copy


def test_activation_never_sees_idle_channels():
    for cf, shape, dim in ((False, (2, 5, 16), -1), (True, (2, 16, 3, 3), 1)):
        unit = RePaFFN(16, 64, idle_ratio=0.75, channels_first=cf)
        seen = []
        unit.act.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[dim]))
        unit.train()(torch.randn(shape)).sum().backward()
        with torch.no_grad():
            unit.eval()(torch.randn(shape))
        assert seen == [16, 16]  # K = ceil(64 * 0.25) channels, in training and in eval


def test_training_form_matches_concat_reference_with_gradients():
    """The in-place partial activation equals Eq. 3 written with a concat, values and gradients."""
    unit = RePaFFN(16, 64, idle_ratio=0.75, layer_scale_init_value=0.5).train()
    ref = copy.deepcopy(unit)
    x = torch.randn(3, 6, 16)
    out = unit(x)
    h = ref.fc1(ref.norm_in(x))
    a = torch.cat([nn.functional.gelu(h[..., :16]), h[..., 16:]], dim=-1)
    expected = x + ref.layer_scale * ref.fc2(ref.norm_hidden(a))
    assert torch.allclose(out, expected, atol=1e-6)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (n, p), q in zip(unit.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n


@pytest.mark.parametrize('momentum', [0.1, None])
def test_token_batchnorm_uses_tokens_as_the_batch(momentum):
    bn, ref = TokenBatchNorm(8, momentum=momentum), nn.BatchNorm1d(8, momentum=momentum)
    for _ in range(3):
        x = torch.randn(4, 10, 8)
        assert torch.allclose(bn(x), ref(x.transpose(1, 2)).transpose(1, 2), atol=1e-5)  # (B, C, N), authors' way
    assert torch.allclose(bn.running_mean, ref.running_mean) and torch.allclose(bn.running_var, ref.running_var)
    assert bn.num_batches_tracked == ref.num_batches_tracked == 3
    x = torch.randn(2, 3, 5, 8)  # channels-last map, eval mode
    assert torch.allclose(bn.eval()(x), ref.eval()(x.reshape(-1, 8)).view(x.shape), atol=1e-6)



def test_token_batchnorm_defaults_are_batchnorm1d_defaults():
    """The authors' BatchNorm1d(C) with torch's defaults (eps 1e-5, momentum 0.1): the running statistics
    after one training step are 0.9 * init + 0.1 * batch statistics (unbiased variance)."""
    unit = RePaFFN(8, 32)
    for bn in (TokenBatchNorm(8), unit.norm_in, unit.norm_hidden):
        assert (bn.eps, bn.bn.momentum, bn.bn.affine, bn.bn.track_running_stats) == (1e-5, 0.1, True, True)
    bn = TokenBatchNorm(8).train()
    x = torch.randn(4, 10, 8)
    bn(x)
    flat = x.reshape(-1, 8)
    torch.testing.assert_close(bn.running_mean, 0.1 * flat.mean(0))
    torch.testing.assert_close(bn.running_var, 0.9 + 0.1 * flat.var(0, unbiased=True))


def test_token_batchnorm_loads_the_state_dict_of_its_earlier_subclass_form():
    """Checkpoints saved when TokenBatchNorm was a BatchNorm1d subclass hold <name>.weight, not <name>.bn.weight."""
    old = {'weight': torch.randn(8), 'bias': torch.randn(8), 'running_mean': torch.randn(8),
           'running_var': torch.rand(8) + 0.5, 'num_batches_tracked': torch.tensor(7)}
    bn = TokenBatchNorm(8)
    bn.load_state_dict(dict(old))
    for key, value in old.items():
        torch.testing.assert_close(getattr(bn.bn, key), value)

@pytest.mark.parametrize('name', ['repa_deit_tiny_patch16_224', 'repa_poolformer_s12'])
def test_torchscript_training_and_deployed_forms(name):
    model, size = _small(name)
    model.eval()
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        for m in (_randomize(model), reparameterize_model(model)):
            assert torch.allclose(torch.jit.script(m)(x), m(x), atol=1e-5)


@pytest.mark.parametrize('bad', [-0.1, 1.5, float('nan'), '0.5', True, None])
def test_bad_idle_ratio_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r'idle_ratio \(theta.*must be a number in \[0, 1\]'):
        RePaFFN(16, 64, idle_ratio=bad)


def test_active_channels_rounding():
    assert active_channels(768, 0.75) == 192 and active_channels(100, 0.7) == 30
    assert active_channels(10, 0.75) == 3 and active_channels(64, 1.) == 0 and active_channels(64, 0.) == 64


def test_unit_errors():
    with pytest.raises(ValueError, match='residual unit: out_features'):
        RePaFFN(16, 64, 32)
    with pytest.raises(ValueError, match='needs active channels or a linear path'):
        RePaDeployedFFN(16, 0, linear_path=False)


def test_fold_refuses_batchnorm_without_running_stats():
    unit = RePaFFN(8, 32)
    unit.norm_in = TokenBatchNorm(8, track_running_stats=False)
    with pytest.raises(ValueError, match='without running statistics'):
        unit.fuse()


# --- surgery -----------------------------------------------------------------------------------

_FAMILIES = [  # timm model, kwargs, input size, expected blocks
    ('deit_tiny_patch16_224', dict(depth=2, img_size=32), 32, 2),
    ('swin_tiny_patch4_window7_224', dict(depths=(2, 2, 2, 2), img_size=64), 64, 8),
    ('poolformer_s12', {}, 64, 12),
    ('poolformerv2_s12', {}, 64, 12),  # layer-scale and res-scale
    ('mixer_s16_224', dict(img_size=32), 32, 8),
]


class _OriginalFFNHalf(nn.Module):
    """The block's own FFN half, ``res_scale(x) + ls(mlp(norm(x)))``, packaged as a residual unit."""

    def __init__(self, norm, mlp, ls=None, rs=None):
        super().__init__()
        self.norm, self.mlp, self.ls, self.rs = norm, mlp, ls or nn.Identity(), rs or nn.Identity()

    def forward(self, x):
        return self.rs(x) + self.ls(self.mlp(self.norm(x)))


@pytest.mark.parametrize('name,kwargs,size,expected', _FAMILIES)
def test_rewired_blocks_keep_timms_token_mixer_half(name, kwargs, size, expected):
    """Rewire each block with a 'unit' that is the block's own FFN half: outputs must not change."""
    from vitblocks.models.slots import residual_recipe
    model = timm.create_model(name, **kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # layer-scales of 1e-5 would hide a broken FFN half
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        ref = model.forward_features(x)
    n = 0
    for block in list(model.modules()):
        recipe = residual_recipe(type(block))
        if recipe is None:
            continue
        def get(attr):
            return getattr(block, attr) if attr else None
        unit = _OriginalFFNHalf(get(recipe.norm), get(recipe.unit), get(recipe.layer_scale), get(recipe.res_scale))
        setattr(block, recipe.unit, unit)
        for attr in (recipe.norm, recipe.layer_scale, recipe.res_scale):
            if attr:
                setattr(block, attr, nn.Identity())
        block.__class__ = recipe.rewired
        n += 1
    assert n == expected
    with torch.no_grad():
        assert torch.allclose(model.forward_features(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('name,kwargs,size,expected', _FAMILIES)
def test_swap_residual_ffn_on_each_family(name, kwargs, size, expected):
    model = timm.create_model(name, drop_path_rate=0.1, **kwargs)
    assert swap_residual_ffn(model, 'repa', idle_ratio=0.5) == expected
    units = [m for m in model.modules() if isinstance(m, RePaFFN)]
    assert len(units) == expected and all(u.active_features * 2 == u.hidden_features for u in units)
    assert units[-1].drop_path.drop_prob > 0  # drop-path rate moved into the unit
    assert not any(type(m).__name__ in ('Mlp', 'LayerNorm', 'GroupNorm1') and n.endswith(('.norm2', '.mlp'))
                   for n, m in model.named_modules())
    if name.startswith('poolformer'):
        v2 = name.startswith('poolformerv2')  # v2: no layer-scale, res-scale in stages 3 and 4
        assert units[0].channels_first and (units[0].layer_scale is None) == v2
        assert (units[-1].res_scale is not None) == v2
    model.eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        out = _randomize(model).forward_features(x)
        assert _rel(reparameterize_model(model).forward_features(x), out) < 1e-5
    clone = pickle.loads(pickle.dumps(model))  # static rewired classes pickle
    with torch.no_grad():
        assert torch.equal(clone.forward_features(x), out)


def test_per_layer_idle_schedule():
    schedule = [1., 0.75, 0.5, 0.]
    model = timm.create_model('repa_deit_tiny_patch16_224', depth=4, img_size=32,
                              block_cfg=dict(idle_ratio=schedule)).eval()
    assert [b.mlp.active_features for b in model.blocks] == [0, 192, 384, 768]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = _randomize(model).forward_features(x)
        fused = reparameterize_model(model)
        assert _rel(fused.forward_features(x), out) < 1e-5
    deployed = timm.create_model('repa_deit_tiny_patch16_224', depth=4, img_size=32,
                                 block_cfg=dict(idle_ratio=schedule, deploy=True))
    deployed.load_state_dict(fused.state_dict(), strict=True)
    with pytest.raises(ValueError, match='idle_ratio has 3 values but 4 blocks are replaced'):
        timm.create_model('repa_deit_tiny_patch16_224', depth=4, block_cfg=dict(idle_ratio=[0.5] * 3))


def test_reparameterize_model_copies_and_inplace_works():
    model, size = _small('repa_deit_tiny_patch16_224')
    fused = reparameterize_model(model)
    assert isinstance(model.blocks[0].mlp, RePaFFN) and isinstance(fused.blocks[0].mlp, RePaDeployedFFN)
    assert reparameterize_model(model, inplace=True) is model and isinstance(model.blocks[0].mlp, RePaDeployedFFN)


def test_swap_residual_ffn_errors():
    with pytest.raises(ValueError, match='found no supported block in Sequential'):
        swap_residual_ffn(nn.Sequential(nn.Linear(2, 2)), 'repa')
    model = timm.create_model('deit_tiny_patch16_224', depth=2, img_size=32)
    with pytest.raises(ValueError, match="unknown residual FFN 'rep'; did you mean repa"):
        swap_residual_ffn(model, 'rep')
    with pytest.raises(ValueError, match='selected none'):
        swap_residual_ffn(model, 'repa', include=lambda name: False)
    with pytest.raises(ValueError, match=r'idle_ratio \(theta'):
        swap_residual_ffn(model, 'repa', idle_ratio=2)
    assert swap_residual_ffn(model, 'repa', include=lambda name: name == 'blocks.1') == 1
    assert isinstance(model.blocks[0].mlp, nn.Module) and type(model.blocks[0].mlp).__name__ == 'Mlp'
    with pytest.raises(ValueError, match='already holds a residual FFN'):
        swap_residual_ffn(model, 'repa')


def test_swap_and_fuse_keep_mode_and_dtype():
    model = timm.create_model('deit_tiny_patch16_224', depth=1, img_size=32).eval().double()
    swap_residual_ffn(model, 'repa')
    unit = model.blocks[0].mlp
    assert not unit.training and unit.fc1.weight.dtype == torch.float64
    fused = unit.fuse()
    assert not fused.training and fused.in_proj.weight.dtype == torch.float64
    assert math.isclose(unit.idle_ratio, 0.75)
