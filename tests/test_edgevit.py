"""EdgeViT-XXS (edgevit_xxs, afbo_edgevit_xxs): published counts, sparse attention, surgery, timm interface."""
import pytest
import timm
import torch
from torch import nn

import vitblocks
from vitblocks.layers import AFBO
from vitblocks.models.backbones.edgevit import EdgeViT, SparseGlobalAttention
from vitblocks.papers import load_paper
from vitblocks.profile import count_macs, count_params

XXS = dict(dims=(36, 72, 144, 288), depths=(1, 1, 3, 2), sr=(4, 2, 2, 1))


def _edgevit_params(dims, depths, sr, classes=1000, ratio=4):
    """Parameters of the authors' EdgeViT definition, layer by layer."""
    total, c_in = 0, 3
    for s, (d, n, r) in enumerate(zip(dims, depths, sr)):
        p = 4 if s == 0 else 2
        total += c_in * d * p * p + d + 2 * d  # patch conv + LayerNorm
        ffn = 2 * ratio * d * d + ratio * d + d
        local = (10 * d) + 2 * d + (d * d + d) + 26 * d + (d * d + d) + 2 * d + ffn  # pos, BN, 1x1, dw5, 1x1, BN, FFN
        attn = 3 * d * d + 3 * d + d * d + d + (r * r * d + d + 2 * d if r > 1 else 0)  # qkv, proj, propagation+LN
        glob = 10 * d + 2 * d + attn + 2 * d + ffn  # pos, LN, attention, LN, FFN
        total += n * ((local if r > 1 else 0) + glob)
        c_in = d
    return total + 2 * dims[-1] + dims[-1] * classes + classes  # BatchNorm, head


def test_edgevit_xxs_matches_the_edgevit_paper():
    """4.1 M parameters (within 1%) and 0.6 GMACs as printed (one decimal: ours 0.55 rounds to it)."""
    with torch.device('meta'):
        model = timm.create_model('edgevit_xxs')
    params = count_params(model)
    assert params == _edgevit_params(XXS['dims'], XXS['depths'], XXS['sr'])
    assert params / 1e6 == pytest.approx(4.1, rel=0.01)
    gmacs = count_macs(model, input_size=(3, 224, 224)).gmacs
    assert round(gmacs, 1) == 0.6 and 0.54 < gmacs < 0.56


def test_afbo_edgevit_xxs_matches_table16():
    table = load_paper('afbo').table('16')
    rows = {r.model: r for r in table.rows}
    assert set(rows) == {'edgevit_xxs', 'afbo_edgevit_xxs'}
    with torch.device('meta'):
        model = timm.create_model('afbo_edgevit_xxs')
    assert sum(isinstance(m, AFBO) for m in model.modules()) == 12  # 5 local-aggregation + 7 token FFNs
    assert count_params(model) / 1e6 == pytest.approx(rows['afbo_edgevit_xxs'].params_m, rel=0.01)


def test_sparse_attention_reads_only_delegates():
    """With r = 2 only every 2nd row/column enters the attention; a delegate's change reaches every token."""
    torch.manual_seed(0)
    attn = SparseGlobalAttention(16, 2, sr_ratio=2).eval()
    x = torch.randn(1, 6, 6, 16)
    off = x.clone()
    off[:, 1, 3] += 1.  # (1, 3) is not a delegate
    torch.testing.assert_close(attn(off), attn(x))
    on = x.clone()
    on[:, 4, 4] += 1.  # a delegate: the attention is global, so the far corner changes too
    assert not torch.allclose(attn(on)[:, 0, 0], attn(x)[:, 0, 0])


def test_propagation_crops_odd_grids():
    attn = SparseGlobalAttention(8, 1, sr_ratio=4)
    assert attn(torch.randn(2, 9, 7, 8)).shape == (2, 9, 7, 8)  # 3 x 2 delegates, propagated to 12 x 8, cropped


def test_swap_ffn_replaces_both_ffns_of_each_block():
    model = timm.create_model('edgevit_xxs', num_classes=3)
    assert vitblocks.swap_ffn(model, 'iffn') == 12
    model = timm.create_model('edgevit_xxs', num_classes=3)
    assert vitblocks.swap_ffn(model, 'afbo', occm_groups=4, include=lambda q: 'global_attn' in q) == 7
    assert model(torch.randn(2, 3, 40, 40)).shape == (2, 3)  # stage grids 10, 5, 2, 1: 10 and 5 not multiples of r


@pytest.mark.parametrize('name', ['edgevit_xxs', 'afbo_edgevit_xxs'])
def test_small_input_forward_backward_every_parameter_gets_a_gradient(name):
    model = timm.create_model(name, num_classes=10, drop_path_rate=0.1)
    model(torch.randn(2, 3, 32, 32)).square().mean().backward()  # the registry loop runs 224 px
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


def test_timm_interface():
    model = timm.create_model('edgevit_xxs', num_classes=5).eval()
    cfg = model.pretrained_cfg
    assert cfg['pool_size'] == (7, 7) and cfg['crop_pct'] == 0.875
    assert isinstance(model.get_submodule(cfg['first_conv']), nn.Conv2d)
    assert model.get_submodule(cfg['classifier']) is model.get_classifier()
    x = torch.randn(2, 3, 64, 64)
    feats = model.forward_features(x)
    assert feats.shape == (2, 288, 2, 2)
    torch.testing.assert_close(model.forward_head(feats), model.head.fc(feats.mean((2, 3))))
    final, inter = model.forward_intermediates(x)
    torch.testing.assert_close(final, feats)
    assert [t.shape[1:] for t in inter] == [(36, 16, 16), (72, 8, 8), (144, 4, 4), (288, 2, 2)]
    for name in ('edgevit_xxs', 'afbo_edgevit_xxs'):
        extractor = timm.create_model(name, features_only=True, out_indices=(1, 3))
        assert extractor.feature_info.channels() == [72, 288] and extractor.feature_info.reduction() == [8, 32]
        assert [f.shape[1:] for f in extractor(x)] == [(72, 8, 8), (288, 2, 2)]
    model.reset_classifier(0)
    assert model(x).shape == (2, 288)


def test_head_hidden_size_is_the_pooled_width():
    """timm's ``head_hidden_size`` is the width ``forward_head(pre_logits=True)`` returns: a pool that
    concatenates ('catavgmax', at build time or through ``reset_classifier``) doubles it."""
    x = torch.randn(1, 3, 64, 64)
    for model in (timm.create_model('edgevit_xxs', num_classes=0, global_pool='catavgmax'),
                  timm.create_model('edgevit_xxs', num_classes=3).eval()):
        if model.num_classes:
            model.reset_classifier(0, 'catavgmax')
        with torch.no_grad():
            pre = model.forward_head(model.forward_features(x.clone()), pre_logits=True)
        assert pre.shape == (1, 576) and model.head_hidden_size == 576
        model.reset_classifier(4, 'avg')
        assert model.head_hidden_size == 288 and model.head.fc.in_features == 288


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match='head_dim=32 must divide every width'):
        EdgeViT(head_dim=32)
    with pytest.raises(ValueError, match='one entry per stage'):
        EdgeViT(depths=(1, 1, 3))
    with pytest.raises(RuntimeError, match='ships no weights'):
        timm.create_model('edgevit_xxs', pretrained=True)
