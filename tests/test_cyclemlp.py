"""CycleMLP (cyclemlp_b1..b5, afbo_cyclemlp_b1): published counts, Cycle FC, surgery, timm interface."""
import pytest
import timm
import torch
from torch import nn
from torchvision.ops import deform_conv2d

import vitblocks
from _mlp_backbone_checks import (agrees, features_only_maps, forward_backward_every_parameter,
                                  fx_and_torchscript_match_eager, swap_counts)
from vitblocks.models.backbones.cyclemlp import CycleFC, CycleMLPNet, cycle_offsets, split_attention
from vitblocks.profile import count_macs, count_params

# (name, depths, widths, MLP ratios, published params M, published GMACs): the authors' model zoo table
CYCLEMLP = [
    ('cyclemlp_b1', (2, 2, 4, 2), (64, 128, 320, 512), (4, 4, 4, 4), 15, 2.1),
    ('cyclemlp_b2', (2, 3, 10, 3), (64, 128, 320, 512), (4, 4, 4, 4), 27, 3.9),
    ('cyclemlp_b3', (3, 4, 18, 3), (64, 128, 320, 512), (8, 8, 4, 4), 38, 6.9),
    ('cyclemlp_b4', (3, 8, 27, 3), (64, 128, 320, 512), (8, 8, 4, 4), 52, 10.1),
    ('cyclemlp_b5', (3, 4, 24, 3), (96, 192, 384, 768), (4, 4, 4, 4), 76, 12.3),
]


TINY = dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 48, 64))  # B1's code paths, fast


def _definition_macs(depths, widths, ratios, classes=1000, side=224):
    """MACs of the architecture as defined (no norms): stem, downsampling convs, per block the two Cycle
    FCs, the channel FC and proj (4 C^2 per position), the MLP (2 r C^2) and the reweighting MLP (C^2, once)."""
    macs, c_prev = 7 * 7 * 3 * widths[0] * (side // 4) ** 2, None
    for s, (depth, c, r) in enumerate(zip(depths, widths, ratios)):
        hw = (side // 4 // 2 ** s) ** 2
        if c_prev:
            macs += 9 * c_prev * c * hw
        macs += depth * ((4 + 2 * r) * c * c * hw + c * c)
        c_prev = c
    return macs + widths[-1] * classes


@pytest.mark.parametrize('name, depths, widths, ratios, params_m, gmacs', [
    pytest.param(*row, marks=[] if row[0] == 'cyclemlp_b1' else [pytest.mark.slow]) for row in CYCLEMLP])
def test_published_counts(name, depths, widths, ratios, params_m, gmacs):
    """Counts equal the architecture's definition, and agree with the authors' table (integer M, 0.1 G):
    within 1%, or rounding to the printed number (B3: 38.39 M for '38M', +1.0%)."""
    with torch.device('meta'):
        model = timm.create_model(name)
    assert count_macs(model).total == _definition_macs(depths, widths, ratios)
    assert agrees(count_params(model) / 1e6, params_m, decimals=0)
    assert agrees(count_macs(model, include_norms=True).total / 1e9, gmacs, decimals=1)


def test_b1_matches_its_published_numbers():
    """CycleMLP-B1: 15.155 M params (published 15.2 M: -0.3%), 2.125 GMACs with norms, 2.122 without
    (published 2.1, printed with one decimal: +1.0%)."""
    with torch.device('meta'):
        model = timm.create_model('cyclemlp_b1')
    assert count_params(model) / 1e6 == pytest.approx(15.2, rel=0.01)
    assert count_macs(model).total / 1e9 == pytest.approx(2.1, rel=0.011)


@pytest.mark.parametrize('axis, channel_axis', [('width', 1), ('height', 0)])
def test_cycle_fc_equals_the_authors_deformable_conv(axis, channel_axis):
    """The authors' Cycle FC: torchvision's deform_conv2d with a 1x1 kernel and constant offsets
    (dy, dx) = (offset, 0) or (0, offset) per input channel. 10 channels: not a multiple of 3."""
    fc = CycleFC(10, 7, axis)
    nn.init.normal_(fc.bias)
    x = torch.randn(2, 10, 5, 6)
    offsets = torch.zeros(1, 20, 1, 1)
    for i, o in enumerate(cycle_offsets(10, 3)):
        offsets[0, 2 * i + channel_axis] = o
    ref = deform_conv2d(x, offsets.expand(2, -1, 5, 6), fc.weight[:, :, None, None], fc.bias)
    torch.testing.assert_close(fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2), ref)


def test_cycle_offsets():
    assert cycle_offsets(7, 3) == [0, 1, -1, 0, 1, -1, 0]
    assert cycle_offsets(5, 5) == [0, 1, 2, -2, -1]
    assert cycle_offsets(3, 1) == [0, 0, 0]


def test_cycle_fc_shift_reads_neighbours_and_zero_fills():
    fc = CycleFC(3, 3, 'width')
    x = torch.arange(4.).reshape(1, 1, 4, 1).expand(1, 1, 4, 3)  # (B, H, W, C): value = column index
    shifted = fc.shift(x)[0, 0]  # (W, C)
    torch.testing.assert_close(shifted[:, 0], torch.tensor([0., 1, 2, 3]))  # offset 0
    torch.testing.assert_close(shifted[:, 1], torch.tensor([1., 2, 3, 0]))  # reads x + 1, zero past the border
    torch.testing.assert_close(shifted[:, 2], torch.tensor([0., 0, 1, 2]))  # reads x - 1


def test_split_attention_is_a_per_channel_softmax_over_branches():
    branches = [torch.randn(2, 3, 4, 5) for _ in range(3)]  # channels-last, C = 5
    equal = split_attention(branches, torch.zeros(2, 15), channels_last=True)
    torch.testing.assert_close(equal, sum(branches) / 3)
    logits = torch.zeros(2, 5, 3)
    logits[:, :, 1] = 100.  # channel-major (B, C, 3) logits: every channel picks branch 1
    torch.testing.assert_close(split_attention(branches, logits.flatten(1), channels_last=True), branches[1])


@pytest.mark.parametrize('name', ['cyclemlp_b1', 'afbo_cyclemlp_b1'])
def test_forward_backward_every_parameter_gets_a_gradient(name):
    forward_backward_every_parameter(name, **TINY)


def test_swap_ffn_and_afbo_variant():
    swap_counts('cyclemlp_b1', 4, channels_first=False, **TINY)
    with torch.device('meta'):
        assert vitblocks.swap_ffn(timm.create_model('cyclemlp_b1'), 'afbo', gccm_groups=4, occm_groups=4) == 10
        model = timm.create_model('afbo_cyclemlp_b1')
    afbos = [m for m in model.modules() if isinstance(m, vitblocks.layers.AFBO)]
    assert len(afbos) == 10 and model.pretrained_cfg['architecture'] == 'afbo_cyclemlp_b1'


def test_afbo_variant_counts():
    """AFBO Table 2: CycleMLP-B1 + AFBO, printed as -0.2 M / +0.1 G against the baseline (G1 = G2 = 4)."""
    with torch.device('meta'):
        base, afbo = timm.create_model('cyclemlp_b1'), timm.create_model('afbo_cyclemlp_b1')
    assert (count_params(afbo) - count_params(base)) / 1e6 == pytest.approx(-0.26, abs=0.005)
    assert count_params(afbo) / 1e6 == pytest.approx(14.8, rel=0.01)
    assert count_macs(afbo, include_norms=True).total / 1e9 == pytest.approx(2.2, rel=0.01)


def test_features_only_and_intermediates():
    features_only_maps('cyclemlp_b1', TINY['embed_dims'], **TINY)
    with torch.device('meta'):
        assert timm.create_model('cyclemlp_b1', features_only=True).feature_info.channels() == [64, 128, 320, 512]
    model = timm.create_model('cyclemlp_b1', **TINY).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        normed = model.forward_intermediates(x, indices=1, norm=True, intermediates_only=True)
    torch.testing.assert_close(normed[0], final.permute(0, 3, 1, 2))  # the normed last stage, (B, C, H, W)
    assert [tuple(t.shape[1:]) for t in inter] == [(16, 16, 16), (32, 8, 8), (48, 4, 4), (64, 2, 2)]


def test_fx_and_torchscript():
    fx_and_torchscript_match_eager('cyclemlp_b1', **TINY)


def test_timm_interface():
    model = timm.create_model('cyclemlp_b1', num_classes=5, **TINY).eval()
    cfg = model.pretrained_cfg
    assert cfg['pool_size'] == (7, 7) and cfg['crop_pct'] == 0.9 and cfg['num_classes'] == 1000
    assert isinstance(model.get_submodule(cfg['first_conv']), nn.Conv2d)
    assert model.get_submodule(cfg['classifier']) is model.get_classifier()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x)  # (B, H/32, W/32, C), normalized
        assert feats.shape == (2, 2, 2, 64)
        torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats.mean((1, 2)))
        model.reset_classifier(0)
        assert model(x).shape == (2, 64)
        model.reset_classifier(0, '')
        assert model(x).shape == (2, 2, 2, 64)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match='one entry per stage'):
        CycleMLPNet(depths=(2, 2), embed_dims=(64, 128, 320, 512))
    with pytest.raises(ValueError, match="axis must be 'height' or 'width'"):
        CycleFC(4, 4, 'depth')
    with pytest.raises(ValueError, match='positive odd'):
        CycleFC(4, 4, 'width', kernel=2)
    with pytest.raises(RuntimeError, match='ships no weights'):
        timm.create_model('cyclemlp_b1', pretrained=True)
