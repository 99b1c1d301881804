"""LVT (lvt, iffn_lvt, afbo_lvt): published counts, attention modules, surgery, timm interface."""
import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import vitblocks
from vitblocks.layers import IFFN
from vitblocks.models.backbones.lvt import LVT, AtrousDepthwiseConv, ConvSelfAttention, RecursiveAtrousSelfAttention
from vitblocks.profile import count_macs, count_params

LVT_COUNTER = dict(include_attention=False, include_norms=True)  # IFFN Table 1's LVT rows
ATROUS_MACS_PER_RECURSION = 27 * (64 * 28 * 28 + 160 * 14 * 14 + 256 * 7 * 7) * 2  # 3 dilations x 3x3 dw, 2 blocks


@pytest.mark.parametrize('recursions, gmacs', [(1, 0.76), (2, 0.84), (3, 0.92), (4, 1.00)])
def test_lvt_matches_iffn_table1(recursions, gmacs):
    """5.52 M params for every R; GMACs within 1% once the functional atrous conv (which the
    authors' counter does not see) is left out, as the yaml note says."""
    with torch.device('meta'):
        model = timm.create_model('lvt', recursions=recursions)
    assert count_params(model) == pytest.approx(5.52e6, rel=0.001)
    macs = count_macs(model, **LVT_COUNTER).total
    assert (macs - recursions * ATROUS_MACS_PER_RECURSION) / 1e9 == pytest.approx(gmacs, rel=0.01)


def test_plain_backbone_and_variants_params():
    with torch.device('meta'):
        assert count_params(timm.create_model('lvt', class_blocks=0)) == pytest.approx(3.69e6, rel=0.001)
        assert count_params(timm.create_model('iffn_lvt')) / 1e6 == pytest.approx(4.98, abs=0.005)  # IFFN Table 1
        assert count_params(timm.create_model('afbo_lvt')) / 1e6 == pytest.approx(5.2, rel=0.05)  # AFBO Table 2


def test_iffn_lvt_slots():
    model = timm.create_model('iffn_lvt', num_classes=10)
    iffns = [m for m in model.modules() if isinstance(m, IFFN)]
    assert len(iffns) == 10  # 8 stage MLPs with the 5x5 depthwise block + 2 class-attention MLPs, channel only
    assert sum(m.spatial is not None and m.spatial.conv.kernel_size == (5, 5) for m in iffns) == 8
    assert model(torch.randn(1, 3, 64, 96)).shape == (1, 10)


def test_swap_ffn_on_user_lvt():
    model = timm.create_model('lvt', class_blocks=0, num_classes=3)
    assert vitblocks.swap_ffn(model, 'iffn') == 8
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)


def test_rasa_recursion_reuses_weights():
    """R recursions: x <- SiLU(attn(x + previous)), same weights each time."""
    torch.manual_seed(0)
    one, two = RecursiveAtrousSelfAttention(16, 2, 2, recursions=1), RecursiveAtrousSelfAttention(16, 2, 2, 2)
    two.load_state_dict(one.state_dict())
    x = torch.randn(2, 8, 8, 16)
    first = F.silu(one(x))
    torch.testing.assert_close(two(x), F.silu(one(first + x)))


def test_atrous_conv_shares_one_kernel():
    conv = AtrousDepthwiseConv(4)
    x = torch.randn(1, 4, 9, 9)
    expected = sum(F.silu(F.conv2d(x, conv.weight, padding=d, dilation=d, groups=4)) for d in (1, 3, 5))
    torch.testing.assert_close(conv(x), expected)


def test_csa_is_local():
    """CSA mixes only within 3x3 windows (stride 2): a far-away change leaves a corner unchanged."""
    torch.manual_seed(0)
    csa = ConvSelfAttention(8, 2).eval()
    x = torch.randn(1, 12, 12, 8)
    y = x.clone()
    y[:, 8:, 8:] += 1.
    torch.testing.assert_close(csa(x)[:, :4, :4], csa(y)[:, :4, :4])
    assert not torch.allclose(csa(x)[:, 8:, 8:], csa(y)[:, 8:, 8:])


def test_timm_interface():
    """timm's hierarchical interface: the final map from forward_features, the class-attention blocks and the
    final norm in the head; unpooled, the normalized map, which equals the class-block path's patch tokens."""
    model = timm.create_model('lvt', num_classes=5).eval()
    for p in model.norm.parameters():  # a default LayerNorm affine is the identity and would hide a missed norm
        torch.nn.init.normal_(p)
    cfg = model.pretrained_cfg
    assert cfg['classifier'] == ('head', 'aux_head') and isinstance(model.get_submodule(cfg['first_conv']), nn.Conv2d)
    assert cfg['pool_size'] == (7, 7) and model.output_fmt == 'NHWC'
    x = torch.randn(2, 3, 64, 64)
    fmap = model.forward_features(x)  # (B, H, W, C), before the final norm
    assert fmap.shape == (2, 2, 2, 256)
    tokens = torch.cat([model.cls_token.expand(2, -1, -1), fmap.flatten(1, 2)], 1)  # (B, 1 + 2*2, 256)
    tokens = model.norm(model.post_blocks(tokens))
    torch.testing.assert_close(model.forward_head(fmap),
                               model.head(tokens[:, 0]) + 0.5 * model.aux_head(tokens[:, 1:]).amax(1))
    torch.testing.assert_close(model.forward_head(fmap, pre_logits=True), tokens[:, 0])
    feats = timm.create_model('lvt', features_only=True)
    assert [f.shape[1:] for f in feats(x)] == [(64, 16, 16), (64, 8, 8), (160, 4, 4), (256, 2, 2)]
    model.reset_classifier(0)
    assert model(x).shape == (2, 256)
    model.reset_classifier(0, '')
    unpooled = model(x)
    assert unpooled.shape == (2, 2, 2, 256)
    torch.testing.assert_close(unpooled.flatten(1, 2), tokens[:, 1:])
    model.reset_classifier(3)  # unpooled: the classifier per position
    torch.testing.assert_close(model(x), model.head(unpooled))
    model.reset_classifier(3, 'token')  # pooling again
    assert model(x).shape == (2, 3)
    built = timm.create_model('lvt', num_classes=0, global_pool='', class_blocks=0)
    assert built(x).shape == (2, 2, 2, 256) and built.forward_features(x).shape == (2, 2, 2, 256)


def test_class_token_is_kept_out_of_weight_decay():
    """The authors' ``no_weight_decay`` ({'cls_token'}), read by timm's optimizer factory (``vitblocks train``
    builds its optimizer with it): a 3-D parameter timm would otherwise decay."""
    from timm.optim import create_optimizer_v2
    model = timm.create_model('lvt', depths=(1, 1, 1, 1))
    decay = {id(p): g['weight_decay'] for g in create_optimizer_v2(model, 'adamw', weight_decay=0.05).param_groups
             for p in g['params']}
    assert decay[id(model.cls_token)] == 0. and decay[id(model.stages[1].blocks[0].mlp.fc1.weight)] == 0.05
    assert LVT(depths=(1, 1, 1, 1), class_blocks=0).no_weight_decay() == set()  # no class token


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="pools by 'token'"):
        LVT(global_pool='avg')
    model = LVT(depths=(1, 1, 1, 1))
    with pytest.raises(ValueError, match="this LVT pools by 'token' .or '' for none.; global_pool='avg'"):
        model.reset_classifier(0, 'avg')
    model.reset_classifier(0, 'token')
    assert model.head_hidden_size == 256 and isinstance(model.head, nn.Identity)
    with pytest.raises(ValueError, match='recursions must be >= 1'):
        LVT(recursions=0)
    with pytest.raises(RuntimeError, match='ships no weights'):
        timm.create_model('lvt', pretrained=True)


@pytest.mark.parametrize('name', ['lvt', 'iffn_lvt', 'afbo_lvt'])
def test_small_input_forward_backward_every_parameter_gets_a_gradient(name):
    """The registry loop's check on a 64x64 input (the 224 loop over LVT is `slow`)."""
    model = timm.create_model(name, num_classes=10)
    model(torch.randn(2, 3, 64, 64)).square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
