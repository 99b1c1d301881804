"""LV-ViT (lvvit_s, lvvit_m, lvvit_l): architecture counts, RePa surgery and its exact fold, timm interface."""
import pytest
import timm
import torch
from torch import nn

import vitblocks
from vitblocks.deploy import reparameterize
from vitblocks.layers import RePaFFN
from vitblocks.models.backbones.lvvit import ConstantScale, LVViT
from vitblocks.profile import count_macs, count_params

TABLE1_COUNTER = dict(include_attention=False, include_norms=True, norm_macs_per_element=5)
SMALL = dict(embed_dim=64, depth=3, num_heads=2, img_size=32)  # the real widths only on the meta device


def _lvvit_params(dim, depth, classes=1000, patches=196, stem=64):
    """LV-ViT parameters from its definition: conv stem, class token + position embedding, blocks
    (no qkv bias, MLP ratio 3), final norm, class head and token-labeling aux head."""
    hidden = 3 * dim
    stem_params = 3 * stem * 7 * 7 + 2 * stem * stem * 3 * 3 + 3 * 2 * stem + stem * dim * 8 * 8 + dim
    block = 2 * dim + 3 * dim * dim + dim * dim + dim + 2 * dim + dim * hidden + hidden + hidden * dim + dim
    return stem_params + dim + (patches + 1) * dim + depth * block + 2 * dim + 2 * (dim * classes + classes)


@pytest.mark.parametrize('name, dim, depth, params_m, gmacs', [
    ('lvvit_s', 384, 16, 26.2, 6.1),  # RePa Table 2 (LV-ViT paper: 26 M)
    ('lvvit_m', 512, 20, 55.8, 11.9),
])
def test_backbone_matches_definition_and_published_counts(name, dim, depth, params_m, gmacs):
    with torch.device('meta'):
        model = timm.create_model(name)
    assert count_params(model) == _lvvit_params(dim, depth)
    assert count_params(model) / 1e6 == pytest.approx(params_m, rel=0.01)
    assert count_macs(model, **TABLE1_COUNTER).gmacs == pytest.approx(gmacs, rel=0.01)


@pytest.mark.slow
def test_lvvit_l_matches_definition_and_published_counts():
    """LV-ViT-L at 288 px: 150 M parameters and 58.9 GMACs (LV-ViT paper / TokenLabeling README)."""
    with torch.device('meta'):
        model = timm.create_model('lvvit_l')
    assert count_params(model) == _lvvit_params(768, 24, patches=18 * 18, stem=128)
    assert count_params(model) / 1e6 == pytest.approx(150, rel=0.01)
    assert count_macs(model).gmacs == pytest.approx(58.9, rel=0.01)  # attention matmuls counted


def test_lvvit_l_architecture():
    model = timm.create_model('lvvit_l', embed_dim=48, depth=2, num_heads=2, img_size=32, num_classes=3)
    assert model.patch_embed.proj[0].out_channels == 128 and model.blocks[1].ls2.value == pytest.approx(1 / 3)
    assert model.pretrained_cfg['input_size'] == (3, 288, 288) and model.pretrained_cfg['crop_pct'] == 1.0
    with torch.device('meta'):
        assert timm.create_model('lvvit_l').patch_embed.grid_size == (18, 18)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)


def _randomize_batchnorms(model):
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.normal_(0, .5)
            m.running_var.uniform_(.5, 2.)
            nn.init.normal_(m.weight, 1., .2)
            nn.init.normal_(m.bias, 0., .2)


def test_repa_surgery_moves_the_constant_branch_scale_and_folds_exactly():
    torch.manual_seed(0)
    model = timm.create_model('repa_lvvit_s', num_classes=10, **SMALL).eval()
    blk = model.blocks[2]
    assert isinstance(blk.mlp, RePaFFN) and blk.mlp.branch_scale == 0.5 and blk.mlp.active_features == 64
    assert isinstance(blk.ls1, ConstantScale) and blk.ls1.value == 0.5  # attention branch keeps 1/skip_lam
    assert isinstance(blk.ls2, nn.Identity) and isinstance(blk.norm2, nn.Identity)
    with torch.no_grad():
        _randomize_batchnorms(model)
        x = torch.randn(2, 3, 32, 32)
        ref = model(x)
        fused = reparameterize(model)
        torch.testing.assert_close(fused(x), ref, rtol=1e-4, atol=1e-5)
        deployed = timm.create_model('repa_lvvit_s', num_classes=10, block_cfg=dict(deploy=True), **SMALL)
        deployed.load_state_dict(fused.state_dict())
        torch.testing.assert_close(deployed.eval()(x), ref, rtol=1e-4, atol=1e-5)


def test_branch_scale_scales_only_the_ffn_branch():
    torch.manual_seed(0)
    full, half = RePaFFN(8, 24, idle_ratio=2 / 3), RePaFFN(8, 24, idle_ratio=2 / 3, branch_scale=0.5)
    half.load_state_dict(full.state_dict())
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(half(x) - x, 0.5 * (full(x) - x))


def test_swap_ffn_finds_every_block():
    model = timm.create_model('lvvit_s', num_classes=3, **dict(SMALL, img_size=(32, 48)))
    assert vitblocks.swap_ffn(model, 'iffn') == 3
    assert model(torch.randn(1, 3, 32, 48)).shape == (1, 3)
    assert model.blocks[0].mlp.grid_size == (2, 3)


def test_head_is_class_token_plus_half_the_aux_max():
    torch.manual_seed(0)
    model = timm.create_model('lvvit_s', num_classes=4, **SMALL).eval()
    x = torch.randn(2, 3, 32, 32)
    feats = model.forward_features(x)  # (B, 1 + 4, 64)
    expected = model.head(feats[:, 0]) + 0.5 * model.aux_head(feats[:, 1:]).max(dim=1).values
    torch.testing.assert_close(model(x), expected)
    model.reset_classifier(7)
    assert model.aux_head.out_features == 7 and model(x).shape == (2, 7)
    model.reset_classifier(0)
    assert model.aux_head is None and model(x).shape == (2, 64)
    assert timm.create_model('lvvit_s', aux_head=False, **SMALL).aux_head is None


def test_timm_interface():
    model = timm.create_model('lvvit_m', **SMALL)
    cfg = model.pretrained_cfg
    assert cfg['classifier'] == ('head', 'aux_head') and cfg['first_conv'] == 'patch_embed.proj.0'
    assert cfg['crop_pct'] == 1.0 and cfg['num_classes'] == 1000 and 'pool_size' in cfg
    assert model.get_submodule(cfg['first_conv']).in_channels == 3
    feats = timm.create_model('lvvit_s', features_only=True, out_indices=(1, 2), **SMALL)
    assert [f.shape for f in feats(torch.randn(1, 3, 32, 32))] == [(1, 64, 2, 2)] * 2
    assert {'lvvit_s', 'lvvit_m', 'lvvit_l'} <= set(vitblocks.models.list_backbones())


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match='LV-ViT fixes init_values'):
        timm.create_model('lvvit_s', init_values=1e-5, **SMALL)
    with pytest.raises(ValueError, match='patch size must be even'):
        LVViT(patch_size=15, img_size=60, embed_dim=32, depth=1, num_heads=2)
    with pytest.raises(ValueError, match='LV-ViT fixes block_fn'):
        LVViT(block_fn=nn.Identity)
    with pytest.raises(RuntimeError, match='ships no weights'):
        timm.create_model('lvvit_s', pretrained=True, **SMALL)


@pytest.mark.parametrize('name', ['lvvit_s', 'repa_lvvit_s'])
def test_small_forward_backward_every_parameter_gets_a_gradient(name):
    """The registry loop's check at a small width (the full-size loop over LV-ViT is `slow`)."""
    model = timm.create_model(name, num_classes=10, **SMALL)
    model(torch.randn(2, 3, 32, 32)).square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
