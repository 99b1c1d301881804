"""Hire-MLP (hiremlp_tiny..large, afbo_hiremlp_tiny): published counts, the hierarchical rearrangement,
surgery, timm interface."""
import math

import pytest
import timm
import torch

import vitblocks
from _helpers import randomize_batchnorm_
from _mlp_backbone_checks import (agrees, features_only_maps, forward_backward_every_parameter,
                                  fx_and_torchscript_match_eager, swap_counts)
from vitblocks.models.backbones.hiremlp import HireMLPNet, RegionRearrangedMLP
from vitblocks.profile import count_macs, count_params

REGIONS = (4, 3, 3, 2)
# (name, depths, widths, published params M, published GMACs): the Hire-MLP paper's Table (ImageNet)
HIREMLP = [
    ('hiremlp_tiny', (2, 2, 4, 2), (64, 128, 320, 512), 18, 2.1),
    ('hiremlp_small', (3, 4, 10, 3), (64, 128, 320, 512), 33, 4.2),
    ('hiremlp_base', (4, 6, 24, 3), (64, 128, 320, 512), 58, 8.1),
    ('hiremlp_large', (4, 6, 24, 3), (96, 192, 384, 768), 96, 13.4),
]
TINY = dict(depths=(1, 2, 1, 1), embed_dims=(16, 32, 48, 64))  # Tiny's code paths (a shifted block too), fast


def _definition_macs(depths, widths, classes=1000, side=224, mlp_ratio=4):
    """MACs as defined (no norms): stem, downsampling convs; per block the two rearranged branches
    (C*r -> C/2 -> C*r on the map padded to a multiple of r: C^2 per padded position each), the channel
    FC and proj (2 C^2 per position), the MLP (2 r C^2) and the reweighting MLP (C^2, once)."""
    macs, c_prev = 7 * 7 * 3 * widths[0] * (side // 4) ** 2, None
    for s, (depth, c, r) in enumerate(zip(depths, widths, REGIONS)):
        n = side // 4 // 2 ** s
        padded = math.ceil(n / r) * r
        if c_prev:
            macs += 9 * c_prev * c * n * n
        macs += depth * (2 * padded * n * c * c + (2 + 2 * mlp_ratio) * c * c * n * n + c * c)
        c_prev = c
    return macs + widths[-1] * classes


@pytest.mark.parametrize('name, depths, widths, params_m, gmacs', [
    pytest.param(*row, marks=[] if row[0] == 'hiremlp_tiny' else [pytest.mark.slow]) for row in HIREMLP])
def test_published_counts(name, depths, widths, params_m, gmacs):
    """Counts equal the architecture's definition, and agree with the paper's table (integer M, 0.1 G):
    within 1%, or rounding to the printed number (Tiny: 2.149 G for 2.1, +2.3%)."""
    with torch.device('meta'):
        model = timm.create_model(name)
    assert count_macs(model).total == _definition_macs(depths, widths)
    assert count_params(model) / 1e6 == pytest.approx(params_m, rel=0.01)
    assert agrees(count_macs(model, include_norms=True).total / 1e9, gmacs, decimals=1)


def _reference_branch(mod: RegionRearrangedMLP, x: torch.Tensor) -> torch.Tensor:
    """The rearrangement written out position by position: roll by ``shift``, pad circularly, stack each
    region's ``r`` positions into the channels (channel c*r + k = position k), mix, put back, crop, roll back."""
    dim = 2 if mod.axis == 'height' else 3
    size, r, s = x.shape[dim], mod.region, mod.shift
    rolled = [(p - s) % size for p in range(size)]  # rolled position p holds input position p - s
    n = math.ceil(size / r)
    source = [rolled[p % size] for p in range(n * r)]  # circular padding repeats the first positions
    out = torch.zeros(*x.shape[:dim], n * r, *x.shape[dim + 1:])
    for j in range(n):
        region = x.index_select(dim, torch.tensor(source[j * r:(j + 1) * r]))  # r positions of region j
        region = region.movedim(dim, 2)  # (B, C, r, L): k-th position next to channel c
        B, C, _, L = region.shape
        mixed = mod.fc2(mod.act(mod.norm(mod.fc1(region.reshape(B, C * r, 1, L)))))  # (B, C*r, 1, L)
        out.narrow(dim, j * r, r).copy_(mixed.reshape(B, C, r, L).movedim(2, dim))
    back = [(p + s) % size for p in range(size)]  # roll back by -s (positions past `size` are cropped)
    return out.index_select(dim, torch.tensor(back))


@pytest.mark.parametrize('axis', ['height', 'width'])
@pytest.mark.parametrize('size, region, shift', [(7, 3, 0), (7, 3, 2), (8, 4, 2), (5, 2, 1)])
def test_region_rearrangement_matches_the_definition(axis, size, region, shift):
    torch.manual_seed(0)
    mod = randomize_batchnorm_(RegionRearrangedMLP(6, region, shift, axis)).eval()
    x = torch.randn(2, 6, size, size + 1)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), _reference_branch(mod, x))


def test_shift_schedule_and_regions():
    """Block i of stage s shifts by (i mod period) * dilation: periods 2, 2, 3, 2, dilations 2, 2, 1, 1."""
    with torch.device('meta'):
        model = timm.create_model('hiremlp_tiny')
    shifts = [[b.attn.mlp_h.shift for b in stage.blocks] for stage in model.stages]
    assert shifts == [[0, 2], [0, 2], [0, 1, 2, 0], [0, 1]]
    assert [stage.blocks[0].attn.mlp_w.region for stage in model.stages] == list(REGIONS)


@pytest.mark.parametrize('name', ['hiremlp_tiny', 'afbo_hiremlp_tiny'])
def test_forward_backward_every_parameter_gets_a_gradient(name):
    forward_backward_every_parameter(name, **TINY)


def test_swap_ffn_and_afbo_variant():
    swap_counts('hiremlp_tiny', 5, channels_first=True, **TINY)
    with torch.device('meta'):
        base, model = timm.create_model('hiremlp_tiny'), timm.create_model('afbo_hiremlp_tiny')
    assert sum(isinstance(m, vitblocks.layers.AFBO) for m in model.modules()) == 10
    # AFBO Table 2 prints the change: -0.2 M (G1 = G2 = 4: -0.26 M); 16.8 M absolute is off with the baseline
    assert (count_params(model) - count_params(base)) / 1e6 == pytest.approx(-0.26, abs=0.005)


def test_features_only_and_intermediates():
    features_only_maps('hiremlp_tiny', TINY['embed_dims'], **TINY)
    model = timm.create_model('hiremlp_tiny', **TINY).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        normed = model.forward_intermediates(x, indices=1, norm=True, intermediates_only=True)
    torch.testing.assert_close(normed[0], final)
    assert [tuple(t.shape[1:]) for t in inter] == [(16, 16, 16), (32, 8, 8), (48, 4, 4), (64, 2, 2)]


def test_fx_and_torchscript():
    fx_and_torchscript_match_eager('hiremlp_tiny', **TINY)


def test_timm_interface():
    model = timm.create_model('hiremlp_tiny', num_classes=5, **TINY).eval()
    cfg = model.pretrained_cfg
    assert cfg['pool_size'] == (7, 7) and cfg['crop_pct'] == 0.9 and cfg['first_conv'] == 'stem.conv'
    assert model.get_submodule(cfg['classifier']) is model.get_classifier()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x)  # (B, C, H/32, W/32), BatchNorm applied
        assert feats.shape == (2, 64, 2, 2)
        torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats.mean((2, 3)))
        model.reset_classifier(0)
        assert model(x).shape == (2, 64)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match=r'one entry per stage in each of depths \(2\)'):
        HireMLPNet(depths=(2, 2))
    with pytest.raises(ValueError, match="axis must be 'height' or 'width'"):
        RegionRearrangedMLP(4, 2, 0, 'depth')
    with pytest.raises(ValueError, match='cannot be padded circularly'):
        RegionRearrangedMLP(4, 4, 0, 'height').eval()(torch.randn(1, 4, 1, 3))
    with pytest.raises(RuntimeError, match='ships no weights'):
        timm.create_model('hiremlp_tiny', pretrained=True)
