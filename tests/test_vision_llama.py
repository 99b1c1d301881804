"""Pyramid VisionLLaMA (pyramid_visionllama_s/b/l and their AFBO models): counts, 2-D RoPE, attention
locality, surgery, timm interface."""
import pytest
import timm
import torch
from timm.layers.pos_embed_sincos import apply_rot_embed

import vitblocks
from vitblocks.layers import AFBO
from vitblocks.models.backbones.vision_llama import LocallyGroupedRoPEAttention, PyramidVisionLLaMA, rope_2d
from vitblocks.profile import count_macs, count_params

CONFIGS = {  # widths, depths of the authors' pllama_wols_{small,base,large}_patch16
    's': ((64, 128, 256, 512), (2, 2, 10, 4)),
    'b': ((96, 192, 384, 768), (2, 2, 18, 2)),
    'l': ((128, 256, 512, 1024), (2, 2, 18, 2)),
}


def _pvllama_params(dims, depths, align=256, sr=(8, 4, 2, 1), classes=1000):
    """Parameters of the authors' definition, layer by layer."""
    total, c_in = 0, 3
    for s, (d, n, r) in enumerate(zip(dims, depths, sr)):
        p = 4 if s == 0 else 2
        total += c_in * d * p * p + d + 2 * d  # patch conv + LayerNorm
        hidden = int(8 * d / 3)
        hidden += -hidden % align if align else 0  # LLaMA's find_multiple
        block = 2 * 2 * d + 2 * d + 3 * d * hidden  # 2 LayerNorms, 2 layer scales, bias-free SwiGLU
        lsa = 4 * d * d + 4 * d  # qkv + proj
        gsa = 4 * d * d + 4 * d + (r * r * d * d + d + 2 * d if r > 1 else 0)  # q, kv, proj (+ sr conv + LN)
        total += n * block + (n + 1) // 2 * lsa + n // 2 * gsa
        c_in = d
    return total + 2 * dims[-1] + dims[-1] * classes + classes  # final LayerNorm, head


@pytest.mark.parametrize('size', ['s', 'b', 'l'])
def test_params_follow_the_authors_definition(size):
    with torch.device('meta'):
        model = timm.create_model(f'pyramid_visionllama_{size}')
    assert count_params(model) == _pvllama_params(*CONFIGS[size])


def test_published_counts_and_the_unrounded_widths():
    """B (widths need no rounding) is the published 56 M; L with the SwiGLU width not rounded to 256 is the
    published 99 M (papers/afbo.yaml has the notes for S and L as built)."""
    with torch.device('meta'):
        assert count_params(timm.create_model('pyramid_visionllama_b')) / 1e6 == pytest.approx(56.0, rel=0.01)
        assert count_params(timm.create_model('pyramid_visionllama_l', swiglu_align=0)) / 1e6 == \
            pytest.approx(99.0, rel=0.01)


def test_skeleton_costs_what_timm_twins_svt_costs():
    """With LLaMA's 8d/3 SwiGLU unrounded (= 8d^2 weights, as Twins' MLP), Pyramid VisionLLaMA-S is Twins-SVT-S
    without its position-encoding convs and MLP biases: an independent check of stages, LSA/GSA and heads."""
    with torch.device('meta'):
        ours = timm.create_model('pyramid_visionllama_s', swiglu_align=0)
        twins = timm.create_model('twins_svt_small')
    assert count_params(ours) == pytest.approx(count_params(twins), rel=0.005)
    size = (3, 224, 224)
    assert count_macs(ours, input_size=size).total == pytest.approx(count_macs(twins, input_size=size).total, rel=0.01)


def _angles(sin, cos):
    return torch.atan2(sin, cos)


def test_rope_2d_layout_and_relative_positions():
    sin, cos = rope_2d(8, 3, 3)  # head width 8: frequencies 1 and 10000^-0.5; pairs x0, y0, x1, y1
    ang = _angles(sin, cos).reshape(3, 3, 8)
    torch.testing.assert_close(ang[1, 2, :4], torch.tensor([2., 2., 1., 1.]))  # row 1, column 2: x=2, y=1
    torch.testing.assert_close(ang[1, 2, :2], ang[0, 2, :2])  # pair 0 (channels 0, 1) follows the column only
    torch.testing.assert_close(ang[1, 2, 2:4], ang[1, 0, 2:4])  # pair 1 the row only
    # q.k after the rotation depends on the offset only: (0,0)->(1,2) equals (1,0)->(2,2)
    torch.manual_seed(0)
    q, k = torch.randn(8), torch.randn(8)
    rot = lambda t, n: apply_rot_embed(t, sin[n], cos[n])  # noqa: E731
    torch.testing.assert_close(rot(q, 0) @ rot(k, 5), rot(q, 3) @ rot(k, 8))


def test_gsa_keys_sit_at_their_cell_centers():
    """A key summarizing a 2x2 cell gets the mean position (angle) of the cell's queries."""
    full = _angles(*rope_2d(4, 4, 4)).reshape(2, 2, 2, 2, 4)  # (row cell, row in cell, col cell, col in cell, ch)
    keys = _angles(*rope_2d(4, 2, 2, step=2, offset=0.5)).reshape(2, 2, 4)
    torch.testing.assert_close(keys, full.mean(dim=(1, 3)))


def test_lsa_is_local_and_pads_odd_grids():
    torch.manual_seed(0)
    lsa = LocallyGroupedRoPEAttention(16, 2, window_size=4).eval()
    x = torch.randn(1, 9, 10, 16)
    y = x.clone()
    y[:, 5, 6] += 1.  # window (1, 1)
    assert lsa(x).shape == (1, 9, 10, 16)
    torch.testing.assert_close(lsa(y)[:, :4, :4], lsa(x)[:, :4, :4])
    assert not torch.allclose(lsa(y)[:, 4:8, 4:8], lsa(x)[:, 4:8, 4:8])


def test_afbo_model_replaces_every_swiglu():
    with torch.device('meta'):
        model = timm.create_model('afbo_pyramid_visionllama_s')
    afbos = [m for m in model.modules() if isinstance(m, AFBO)]
    assert len(afbos) == 18
    assert {(m.in_features, m.hidden_features) for m in afbos} == {(d, 4 * d) for d in CONFIGS['s'][0]}  # M = 4
    model = timm.create_model('pyramid_visionllama_s', num_classes=3, depths=(1, 1, 2, 1))
    assert vitblocks.swap_ffn(model, 'iffn') == 5
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)


@pytest.mark.parametrize('name', ['pyramid_visionllama_s', 'afbo_pyramid_visionllama_s'])
def test_forward_backward_every_parameter_gets_a_gradient(name):
    """The registry loop's check, fast: 64x64 input, two blocks (one LSA, one GSA) per stage."""
    model = timm.create_model(name, num_classes=10, drop_path_rate=0.1, depths=(2, 2, 2, 2))
    model(torch.randn(2, 3, 64, 64)).square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


@pytest.mark.slow
@pytest.mark.parametrize('name', [f'{m}pyramid_visionllama_{s}' for m in ('', 'afbo_') for s in 'sbl'])
def test_full_depth_forward_backward_every_parameter_gets_a_gradient(name):
    model = timm.create_model(name, num_classes=10, drop_path_rate=0.1)
    model(torch.randn(2, 3, 64, 64)).square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


def test_timm_interface():
    model = timm.create_model('pyramid_visionllama_s', num_classes=5, depths=(1, 1, 1, 1)).eval()
    cfg = model.pretrained_cfg
    assert cfg['pool_size'] == (7, 7) and cfg['classifier'] == 'head' and cfg['first_conv'] == 'stages.0.downsample'
    x = torch.randn(2, 3, 64, 64)
    feats = model.forward_features(x)
    assert feats.shape == (2, 2, 2, 512)
    torch.testing.assert_close(model.forward_head(feats), model.head(model.norm(feats.mean((1, 2)))))
    final, inter = model.forward_intermediates(x)
    torch.testing.assert_close(final, feats)
    assert [t.shape[1:] for t in inter] == [(64, 16, 16), (128, 8, 8), (256, 4, 4), (512, 2, 2)]
    extractor = timm.create_model('pyramid_visionllama_s', features_only=True, out_indices=(0, 2), depths=(1, 1, 1, 1))
    assert extractor.feature_info.channels() == [64, 256] and extractor.feature_info.reduction() == [4, 16]
    assert [f.shape[1:] for f in extractor(x)] == [(64, 16, 16), (256, 4, 4)]
    model.reset_classifier(0)
    assert model(x).shape == (2, 512)


def test_unpooled_head_is_the_authors_head_per_position():
    """global_pool='' (timm's unpooled head, through __init__ or reset_classifier): the normalized map is
    normalized again and classified per position, (B, H, W, C) -> (B, H, W, classes); averaging it over the
    positions *before* the head is the pooled model."""
    torch.manual_seed(0)
    model = timm.create_model('pyramid_visionllama_s', num_classes=5).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x)  # (1, 2, 2, 512)
        pooled = model(x)
        model.reset_classifier(5, '')
        per_position = model(x)
        assert per_position.shape == (1, 2, 2, 5)
        torch.testing.assert_close(per_position, model.head(model.norm(feats)))
        model.reset_classifier(0, '')
        assert model(x).shape == (1, 2, 2, 512)
        model.reset_classifier(5, 'avg')
        assert model(x).shape == pooled.shape
    built = timm.create_model('pyramid_visionllama_s', num_classes=0, global_pool='').eval()
    with torch.no_grad():
        assert built(x).shape == (1, 2, 2, 512)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match='one entry per stage'):
        PyramidVisionLLaMA(depths=(2, 2, 10))
    with pytest.raises(ValueError, match='pools by averaging'):
        PyramidVisionLLaMA(global_pool='token')
    with pytest.raises(ValueError, match='head width divisible by 4'):
        rope_2d(6, 2, 2)
    with pytest.raises(RuntimeError, match='ships no weights'):
        timm.create_model('pyramid_visionllama_s', pretrained=True)
