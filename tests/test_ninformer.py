"""NiNformer: the gating unit, the LocalViT baseline FFN, and the paper's four models."""
import re

import pytest
import timm
import torch
from timm.models.mlp_mixer import MixerBlock
from timm.models.vision_transformer import Attention
from torch import nn

import vitblocks
from vitblocks.layers import LocalityFFN, MixerGatingUnit
from vitblocks.models import get_variant, swap_ffn
from vitblocks.papers import load_paper
from vitblocks.profile import count_params
from _helpers import perturb_


# --- gating unit ---------------------------------------------------------------------------------

def test_gating_unit_is_linear_times_mixer_with_no_gate_activation():
    unit = perturb_(MixerGatingUnit(32, num_tokens=9, token_mlp_dim=16, channel_mlp_dim=64), std=0.1).eval()
    x = torch.randn(2, 9, 32)
    mx = unit.mixer
    gate = x + mx.mlp_tokens(mx.norm1(x).transpose(1, 2)).transpose(1, 2)  # token mixing (B, C, N) MLP
    gate = gate + mx.mlp_channels(mx.norm2(gate))  # channel mixing
    expected = (x @ unit.proj.weight.T + unit.proj.bias) * gate  # Eq. 8: Linear(I) * MLPMixer(I)
    torch.testing.assert_close(unit(x), expected, rtol=1e-6, atol=1e-6)
    # no squashing of the gate: it takes values a sigmoid / GELU gate could not
    assert gate.min() < -1 and gate.max() > 1
    assert isinstance(mx, MixerBlock)
    assert (mx.mlp_tokens.fc1.in_features, mx.mlp_tokens.fc1.out_features) == (9, 16)
    assert (mx.mlp_channels.fc1.in_features, mx.mlp_channels.fc1.out_features) == (32, 64)



def test_gating_unit_default_widths_are_timms_mixer():
    """Without widths the Mixer sub-unit is timm's MLP-Mixer block: token MLP C/2, channel MLP 4C, GELU."""
    mx = MixerGatingUnit(32, num_tokens=9).mixer
    assert (mx.mlp_tokens.fc1.in_features, mx.mlp_tokens.fc1.out_features, mx.mlp_tokens.fc2.out_features) == (9, 16, 9)
    assert (mx.mlp_channels.fc1.in_features, mx.mlp_channels.fc1.out_features) == (32, 128)
    assert isinstance(mx.mlp_tokens.act, nn.GELU) and isinstance(mx.mlp_channels.act, nn.GELU)

def test_gating_unit_layouts():
    unit = perturb_(MixerGatingUnit(16, num_tokens=12), std=0.1).eval()
    tokens = torch.randn(2, 12, 16)  # (B, N, C), N = 3 x 4
    out = unit(tokens)
    assert out.shape == tokens.shape
    nhwc = unit(tokens.reshape(2, 3, 4, 16))  # channels-last map (MetaFormer NHWC)
    torch.testing.assert_close(nhwc, out.reshape(2, 3, 4, 16))
    unit.channels_first = True  # (B, C, H, W), as PoolFormer
    nchw = unit(tokens.transpose(1, 2).reshape(2, 16, 3, 4))
    torch.testing.assert_close(nchw, out.transpose(1, 2).reshape(2, 16, 3, 4))


def test_gating_unit_errors():
    unit = MixerGatingUnit(16, num_tokens=12)
    with pytest.raises(ValueError, match='built for 12 tokens .* got 10; build it with num_tokens=10'):
        unit(torch.randn(1, 10, 16))
    with pytest.raises(ValueError, match='no attention matrix to mask'):
        unit(torch.randn(1, 12, 16), attn_mask=torch.zeros(12, 12))


def test_gating_unit_in_metaformer_blocks():
    """As PoolFormer's token mixer (channels-first maps; one fixed token count per stage)."""
    model = timm.create_model('poolformer_s12', num_classes=3)
    for stage, side in zip(model.stages, (16, 8, 4, 2)):  # 64 px input: 16x16, 8x8, 4x4, 2x2 tokens
        for blk in stage.blocks:
            blk.token_mixer = MixerGatingUnit(blk.norm1.num_channels, side * side, channels_first=True)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)


# --- LocalViT baseline FFN -----------------------------------------------------------------------

def test_locality_ffn_structure_and_prefix_tokens():
    ffn = perturb_(LocalityFFN(8, 16, grid_size=(3, 3), num_prefix_tokens=1), std=0.1).eval()
    assert ffn.conv.groups == 16 and ffn.conv.kernel_size == (3, 3)
    x = torch.randn(2, 10, 8)
    out = ffn(x)
    h = ffn.act1(ffn.fc1(x))
    fmap = h[:, 1:].reshape(2, 3, 3, 16).permute(0, 3, 1, 2)  # (B, 9, C') -> (B, C', 3, 3)
    local = ffn.act2(ffn.conv(fmap)).permute(0, 2, 3, 1).reshape(2, 9, 16)
    expected = ffn.fc2(torch.cat([h[:, :1], local], dim=1))  # the class token skips the conv
    torch.testing.assert_close(out, expected)



def test_locality_ffn_defaults_are_localvits():
    """LocalViT's FFN: hidden 4C, h-swish after fc1 and after the 3x3 depthwise conv, no norm."""
    ffn = LocalityFFN(8, grid_size=(2, 2))
    assert (ffn.fc1.out_features, ffn.fc2.in_features, ffn.fc2.out_features) == (32, 32, 8)
    assert isinstance(ffn.act1, nn.Hardswish) and isinstance(ffn.act2, nn.Hardswish)
    assert ffn.conv.kernel_size == (3, 3) and ffn.conv.groups == 32 and isinstance(ffn.norm, nn.Identity)

def test_locality_ffn_swaps_into_vit():
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, num_classes=4)
    assert swap_ffn(model, 'locality') == 12
    assert isinstance(model.blocks[0].mlp, LocalityFFN) and model.blocks[0].mlp.fc1.out_features == 4 * 192
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4)


# --- the paper's four models ---------------------------------------------------------------------

NIN_MODELS = vitblocks.list_models(method='ninformer')
EXPECTED_PARAMS = {  # hand-derived in the module docstring of vitblocks.models.ninformer
    'ninformer_vit_patch4_32': 2_652_170, 'ninformer_vit_patch4_28': 2_582_478,
    'ninformer_baseline_vit_patch4_32': 2_139_914, 'ninformer_baseline_vit_patch4_28': 2_127_882,
    'ninformer_baseline_mixer_patch4_32': 1_335_306, 'ninformer_baseline_mixer_patch4_28': 1_265_614,
    'ninformer_baseline_localvit_patch4_32': 2_144_010, 'ninformer_baseline_localvit_patch4_28': 2_135_818,
}


def test_four_models_for_two_input_sizes():
    assert sorted(NIN_MODELS) == sorted(EXPECTED_PARAMS)


@pytest.mark.parametrize('name', NIN_MODELS)
def test_param_counts_and_documentation(name):
    model = timm.create_model(name)
    assert count_params(model) == EXPECTED_PARAMS[name]
    documented = re.search(r'([\d,]+) params$', get_variant(name).description).group(1)
    assert int(documented.replace(',', '')) == EXPECTED_PARAMS[name]
    c, h, w = model.pretrained_cfg['input_size']
    assert (c, h, w) == ((3, 32, 32) if name.endswith('_32') else (1, 28, 28))
    assert model.patch_embed.proj.kernel_size == (4, 4) and model.embed_dim == 256 and len(model.blocks) == 4
    # the shared skeleton: no class token, no final norm, average pooling; a position embedding for ViT only
    assert model.cls_token is None and model.global_pool == 'avg'
    assert (model.pos_embed is not None) == ('baseline_vit' in name)
    assert isinstance(model.norm, nn.Identity) and isinstance(model.fc_norm, nn.Identity)
    x = torch.randn(2, c, h, w)
    assert model(x).shape == (2, 10)


def _shuffle_patches(x: torch.Tensor, patch: int = 4) -> torch.Tensor:
    """The image with its patch x patch tiles in a random order."""
    b, c, h, w = x.shape
    tiles = x.unfold(2, patch, patch).unfold(3, patch, patch)  # (B, C, H/p, W/p, p, p)
    gh, gw = tiles.shape[2:4]
    tiles = tiles.reshape(b, c, gh * gw, patch, patch)[:, :, torch.randperm(gh * gw)]  # shuffled tiles
    tiles = tiles.reshape(b, c, gh, gw, patch, patch).permute(0, 1, 2, 4, 3, 5)  # (B, C, H/p, p, W/p, p)
    return tiles.reshape(b, c, h, w)


@pytest.mark.parametrize('name', [n for n in NIN_MODELS if n.endswith('_28')])
def test_every_model_sees_where_a_patch_is(name):
    """Shuffling the patches changes every model's output; the ViT without its position embedding
    would be a bag of patches (attention + average pooling are permutation invariant)."""
    torch.manual_seed(0)
    x = torch.randn(2, 1, 28, 28)
    xs = _shuffle_patches(x)
    model = timm.create_model(name).eval()
    with torch.no_grad():
        assert not torch.allclose(model(x), model(xs), atol=1e-4)
        if 'baseline_vit' in name:
            bag = timm.create_model(name, pos_embed='none').eval()
            torch.testing.assert_close(bag(x), bag(xs), atol=1e-5, rtol=1e-4)


def test_ninformer_block_follows_the_authors_code():
    model = timm.create_model('ninformer_vit_patch4_32')
    for blk in model.blocks:
        assert isinstance(blk.attn, MixerGatingUnit) and blk.attn.num_tokens == 64
        assert blk.norm2 is blk.norm1  # one LayerNorm instance before both sub-layers
        assert blk.mlp.fc1.out_features == 512
        mixer = blk.attn.mixer
        assert mixer.mlp_tokens.fc1.out_features == 512 and mixer.mlp_channels.fc1.out_features == 512
    # the shared norm's parameters are counted once
    assert count_params(model) == sum(p.numel() for p in set(model.parameters()))


def test_baselines_structure():
    vit = timm.create_model('ninformer_baseline_vit_patch4_28')
    assert isinstance(vit.blocks[0].attn, Attention) and vit.blocks[0].attn.num_heads == 4
    assert vit.blocks[0].mlp.fc1.out_features == 512 and vit.patch_embed.proj.in_channels == 1
    mixer = timm.create_model('ninformer_baseline_mixer_patch4_32')
    assert all(type(b) is MixerBlock for b in mixer.blocks)
    assert mixer.blocks[0].mlp_tokens.fc1.weight.shape == (512, 64)  # tokens 64 -> 512
    assert mixer.blocks[0].mlp_channels.fc1.weight.shape == (512, 256)
    local = timm.create_model('ninformer_baseline_localvit_patch4_32')
    assert isinstance(local.blocks[0].mlp, LocalityFFN) and local.blocks[0].mlp.layout.grid_size == (8, 8)


def test_block_cfg_reaches_the_gating_unit():
    model = timm.create_model('ninformer_vit_patch4_32', block_cfg=dict(drop=0.5, shared_norm=False))
    assert model.blocks[0].norm2 is not model.blocks[0].norm1
    assert model.blocks[0].attn.mixer.mlp_tokens.drop1.p == 0.5


def test_torch_init_starts_every_layer_as_the_authors_script():
    """block_cfg init='torch': the script's model has no init code, so every linear starts Kaiming-uniform
    (|w| <= 1/sqrt(fan_in), std 1/sqrt(3 fan_in)) with a uniform bias; timm's init is trunc-normal 0.02, bias 0."""
    torch.manual_seed(0)
    timm_init = timm.create_model('ninformer_vit_patch4_32')
    torch.manual_seed(0)
    torch_init = timm.create_model('ninformer_vit_patch4_32', block_cfg=dict(init='torch', drop=0.5))
    assert torch_init.blocks[0].attn.mixer.mlp_tokens.drop1.p == 0.5  # the other keys still reach the build
    assert count_params(torch_init) == count_params(timm_init) == 2_652_170
    linears = [(n, m) for n, m in torch_init.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 4 * 7 + 1  # per block: proj, token fc1/fc2, channel fc1/fc2, FFN fc1/fc2; the head
    for name, m in linears:
        bound = m.in_features ** -0.5
        assert m.weight.abs().max() <= bound and m.bias.abs().max() <= bound and m.bias.abs().max() > bound / 2, name
        assert abs(m.weight.std().item() / (bound / 3 ** 0.5) - 1) < 0.1, name
    fc1 = timm_init.blocks[0].mlp.fc1
    assert abs(fc1.weight.std().item() - 0.02) < 0.002 and not fc1.bias.any()
    assert not timm_init.blocks[0].attn.mixer.mlp_tokens.fc1.bias.any()
    # the norms start as identity either way, and the shared norm is still shared
    assert torch_init.blocks[0].norm2 is torch_init.blocks[0].norm1
    assert torch.equal(torch_init.blocks[0].norm1.weight, torch.ones(256))
    with pytest.raises(ValueError, match="init='xavier'.*'timm'.*'torch'"):
        timm.create_model('ninformer_vit_patch4_32', block_cfg=dict(init='xavier'))


def test_paper_table_rows_match_their_models():
    paper = load_paper('ninformer')
    assert [t.number for t in paper.tables] == ['1-MNIST', '1-CIFAR10', '1-CIFAR100']
    for table in paper.tables:
        assert len(table.rows) == 4 and all(r.accuracy_only for r in table.rows)
        for row in table.rows:
            with torch.device('meta'):
                model = timm.create_model(row.model, **row.base_kwargs)
            assert model.pretrained_cfg['input_size'] == table.input_size
            assert model.num_classes == (100 if table.number == '1-CIFAR100' else 10)
        best = max(table.rows, key=lambda r: r.top1)  # NiNformer is the best model on every dataset
        assert best.model.startswith('ninformer_vit_patch4')
