"""swap_ffn on every supported timm family: counts, layouts, grids, errors."""
import pytest
import timm
import torch
from torch import nn

import vitblocks
from vitblocks.layers import IFFN

FAMILIES = [  # (timm name, kwargs, expected slots)
    ('deit_tiny_patch16_224', {}, 12),
    ('deit_tiny_distilled_patch16_224', {}, 12),
    ('vit_small_patch14_reg4_dinov2', dict(img_size=56), 12),
    ('swin_tiny_patch4_window7_224', {}, 12),
    ('poolformer_s12', {}, 12),
    ('mixer_s16_224', {}, 8),
    # vitblocks.models.backbones.lvvit, a timm VisionTransformer subclass
    ('lvvit_s', dict(img_size=32, embed_dim=64, num_heads=2), 16),
    ('ninformer_baseline_mixer_patch4_32', {}, 4),  # a VisionTransformer of timm MixerBlocks (mlp_channels)
]


@pytest.mark.parametrize('name,kwargs,expected', FAMILIES)
def test_swap_counts(name, kwargs, expected):
    model = timm.create_model(name, **kwargs)
    n_before = sum(isinstance(m, nn.Module) and type(m).__name__ == 'Mlp' for m in model.modules())
    assert vitblocks.swap_ffn(model, 'iffn') == expected
    assert sum(isinstance(m, IFFN) for m in model.modules()) == expected
    n_after = sum(type(m).__name__ == 'Mlp' for m in model.modules())
    assert n_before - n_after == expected  # Mixer keeps its token MLPs


def test_swap_sets_prefix_tokens_and_grid():
    model = timm.create_model('vit_small_patch14_reg4_dinov2', img_size=56, num_classes=10)
    vitblocks.swap_ffn(model, 'iffn')
    layout = model.blocks[0].mlp.layout
    assert layout.num_prefix_tokens == 5  # class + 4 registers
    assert layout.grid_size == (4, 4)
    assert layout is model.blocks[-1].mlp.layout  # one shared layout per ViT
    assert model(torch.randn(1, 3, 56, 56)).shape == (1, 10)


def test_a_vit_of_mixer_blocks_swaps_its_channel_mlps():
    model = timm.create_model('ninformer_baseline_mixer_patch4_32')
    assert vitblocks.swap_ffn(model, 'iffn') == 4
    assert all(isinstance(blk.mlp_channels, IFFN) and type(blk.mlp_tokens).__name__ == 'Mlp' for blk in model.blocks)
    assert model.blocks[0].mlp_channels.layout.grid_size == (8, 8)  # 32 px / patch 4, no prefix token
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_poolformer_is_channels_first():
    model = timm.create_model('poolformer_s12')
    vitblocks.swap_ffn(model, 'iffn')
    mlp = model.stages[0].blocks[0].mlp
    assert mlp.layout.channels_first and isinstance(mlp.fc1, nn.Conv2d)
    assert model(torch.randn(1, 3, 64, 96)).shape == (1, 1000)


def test_non_square_dynamic_deit():
    model = timm.create_model('deit_tiny_patch16_224', dynamic_img_size=True, num_classes=3)
    vitblocks.swap_ffn(model, 'iffn')
    out = model(torch.randn(2, 3, 224, 160))
    assert out.shape == (2, 3)
    assert model.blocks[0].mlp.grid_size == (14, 10)
    model(torch.randn(1, 3, 96, 128))  # grid follows every forward
    assert model.blocks[0].mlp.grid_size == (6, 8)


def test_swin_at_another_resolution():
    model = timm.create_model('swin_tiny_patch4_window7_224', img_size=(256, 192), num_classes=3)
    vitblocks.swap_ffn(model, 'iffn')
    assert model(torch.randn(1, 3, 256, 192)).shape == (1, 3)
    assert model.layers[0].blocks[0].mlp.grid_size == (64, 48)
    assert model.layers[3].blocks[1].mlp.grid_size == (8, 6)


def test_forward_features_tracks_grid_too():
    model = timm.create_model('deit_tiny_patch16_224', dynamic_img_size=True)
    vitblocks.swap_ffn(model, 'iffn')
    assert model.forward_features(torch.randn(1, 3, 64, 32)).shape == (1, 1 + 4 * 2, 192)


def test_mismatched_grid_raises_clear_error():
    ffn = IFFN(32, 128, grid_size=(4, 4), num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r'got 20 tokens.*1 prefix tokens \+ a 4x4 grid = 17'):
        ffn(torch.randn(1, 20, 32))
    with pytest.raises(ValueError, match='has no grid size'):
        IFFN(32, 128)(torch.randn(1, 16, 32))


def test_swap_errors():
    with pytest.raises(ValueError, match='found no channel MLP in Sequential'):
        vitblocks.swap_ffn(nn.Sequential(nn.Linear(2, 2)), 'iffn')
    model = timm.create_model('deit_tiny_patch16_224')
    with pytest.raises(ValueError, match="unknown FFN 'ifn'; did you mean iffn"):
        vitblocks.swap_ffn(model, 'ifn')
    with pytest.raises(ValueError, match='selected none'):
        vitblocks.swap_ffn(model, 'iffn', include=lambda name: False)
    with pytest.raises(TypeError, match="FFN 'iffn' has no argument 'kernel'; did you mean kernel_size?"):
        vitblocks.swap_ffn(model, 'iffn', kernel=5)  # not Python's bare 'unexpected keyword argument'
    with pytest.raises(TypeError, match="has no argument 'kernel'; did you mean kernel_size?"):
        timm.create_model('iffn_deit_tiny_patch16_224', block_cfg=dict(kernel=7))


_TINY_VIT = dict(img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=2)


@pytest.mark.parametrize('built, swap', [
    ('iffn_deit_tiny_patch16_224', lambda m: vitblocks.swap_ffn(m, 'mlp')),  # IFFN's fc1 is half the width
    ('iffn_deit_tiny_patch16_224', lambda m: vitblocks.swap_ffn(m, 'afbo')),
    ('afbo_deit_tiny_patch16_224', lambda m: vitblocks.swap_ffn(m, 'iffn')),  # AFBO has no fc1
    ('repa_deit_tiny_patch16_224', lambda m: vitblocks.swap_ffn(m, 'iffn')),  # the unit owns norm2 and the shortcut
    ('iffn_deit_tiny_patch16_224', lambda m: vitblocks.swap_residual_ffn(m, 'repa')),
])
def test_a_slot_vitblocks_already_swapped_is_refused(built, swap):
    """A second swap into a vitblocks model would read the first block's widths as the backbone's (IFFN
    -> MLP: hidden 2D, not 4D), fail deep inside (AFBO has no fc1), or leave a rewired RePa block with
    a plain FFN and no residual; it is an error naming the slot, and the model is left as it was."""
    model = timm.create_model(built, **_TINY_VIT)
    before = [type(b.mlp) for b in model.blocks]
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp already holds '\w+'.*freshly built timm model"):
        swap(model)
    assert [type(b.mlp) for b in model.blocks] == before
    fresh = timm.create_model('deit_tiny_patch16_224', **_TINY_VIT)
    vitblocks.swap_ffn(fresh, 'iffn', include=lambda q: q == 'blocks.0.mlp')
    assert vitblocks.swap_ffn(fresh, 'afbo', include=lambda q: q == 'blocks.1.mlp') == 1  # another slot: fine


@pytest.mark.parametrize('swap, ffn', [(vitblocks.swap_ffn, 'iffn'), (vitblocks.swap_ffn, 'mlp'),
                                       (vitblocks.swap_ffn, 'swiglu'), (vitblocks.swap_residual_ffn, 'repa')])
@pytest.mark.parametrize('ratio', [0, 0.001, -1])
def test_mlp_ratio_without_a_hidden_channel_is_an_error(swap, ffn, ratio):
    """A ratio giving no hidden channel was read by the FFNs as "width not given": 0 built IFFN at the
    MLP's 4D and timm's Mlp at D, a negative ratio failed deep in torch ("negative dimension") or was
    ignored (SwiGLU). Nothing is replaced. (RePa is a residual unit, the others plain FFNs.)"""
    model = timm.create_model('deit_tiny_patch16_224', **_TINY_VIT)
    with pytest.raises(ValueError, match=rf'mlp_ratio={ratio} gives blocks\.0\.mlp \(width 48\) no hidden channel'):
        swap(model, ffn, mlp_ratio=ratio)
    assert all(type(b.mlp).__name__ == 'Mlp' and type(b).__name__ == 'Block' for b in model.blocks)
    assert swap(model, ffn, mlp_ratio=0.05) == 2  # 48 x 0.05 = 2.4: two channels (IFFN: one per AGeLU)


def test_include_and_mlp_ratio():
    model = timm.create_model('deit_tiny_patch16_224')
    n = vitblocks.swap_ffn(model, 'iffn', include=lambda name: name in ('blocks.0.mlp', 'blocks.11.mlp'),
                           mlp_ratio=2, kernel_size=5)
    assert n == 2
    assert model.blocks[0].mlp.hidden_features == 384 and model.blocks[0].mlp.fc1.out_features == 192
    assert type(model.blocks[1].mlp).__name__ == 'Mlp'


def test_swap_keeps_mode_device_dtype():
    model = timm.create_model('deit_tiny_patch16_224').eval().double()
    vitblocks.swap_ffn(model, 'mlp', act_layer='softplus')
    mlp = model.blocks[0].mlp
    assert not mlp.training and mlp.fc1.weight.dtype == torch.float64
    assert isinstance(mlp.act, nn.Softplus)


def test_deepcopy_keeps_grid_tracking_separate():
    import copy
    model = timm.create_model('deit_tiny_patch16_224', dynamic_img_size=True)
    vitblocks.swap_ffn(model, 'iffn')
    clone = copy.deepcopy(model)
    clone(torch.randn(1, 3, 64, 48))
    assert clone.blocks[0].mlp.grid_size == (4, 3)
    assert model.blocks[0].mlp.grid_size == (14, 14)


def test_swap_carries_dropout_and_activation_over_where_the_block_has_the_knob():
    with torch.device('meta'):
        model = timm.create_model('deit_tiny_patch16_224', proj_drop_rate=0.1, act_layer='silu')
        vitblocks.swap_ffn(model, 'iffn')  # IFFN's base activation is the FFN's (Eq. 3-4, Table 3)
    mlp = model.blocks[0].mlp
    assert (mlp.drop1.p, mlp.drop2.p) == (0.1, 0.1)
    assert mlp.act.base == 'silu' and mlp.spatial.act_name == 'silu'
    with torch.device('meta'):
        model = timm.create_model('deit_tiny_patch16_224', proj_drop_rate=0.1, act_layer='silu')
        vitblocks.swap_ffn(model, 'afbo', act_layer='gelu', drop=0.2)  # explicit values win
        mlp = model.blocks[0].mlp
        assert (mlp.drop1.p, mlp.act_name) == (0.2, 'gelu')
        model = timm.create_model('deit_tiny_patch16_224', proj_drop_rate=0.1, act_layer='relu')
        vitblocks.swap_ffn(model, 'afbo')  # AFBO's sigma is its own (SiLU, Table 6): only dropout carries over
    mlp = model.blocks[0].mlp
    assert (mlp.drop1.p, mlp.drop2.p, mlp.act_name) == (0.1, 0.1, 'silu')


def test_locality_ffn_carries_the_mlps_dropout_over_but_keeps_its_hswish():
    """LocalViT's FFN takes timm's Mlp dropout (both points), as every FFN that has one; its activation stays
    LocalViT's h-swish. It used to drop a backbone's proj_drop_rate silently."""
    with torch.device('meta'):
        model = timm.create_model('deit_tiny_patch16_224', proj_drop_rate=0.1, depth=2)
        vitblocks.swap_ffn(model, 'locality')
        mlp = model.blocks[1].mlp
        assert (mlp.drop1.p, mlp.drop2.p) == (0.1, 0.1) and isinstance(mlp.act1, nn.Hardswish)
        model = timm.create_model('deit_tiny_patch16_224', proj_drop_rate=0.1, depth=2)
        vitblocks.swap_ffn(model, 'locality', drop=0.5)  # explicit wins
        assert (model.blocks[0].mlp.drop1.p, model.blocks[0].mlp.drop2.p) == (0.5, 0.5)
    localvit = timm.create_model('ninformer_baseline_localvit_patch4_32', proj_drop_rate=0.2)
    assert {(b.mlp.drop1.p, b.mlp.drop2.p) for b in localvit.blocks} == {(0.2, 0.2)}


def test_swap_names_an_activation_it_cannot_carry_over():
    model = timm.create_model('deit_tiny_patch16_224', act_layer='tanh', depth=1)
    with pytest.raises(ValueError, match=r"'iffn' takes over the activation .* pass act_layer= explicitly"):
        vitblocks.swap_ffn(model, 'iffn')
    assert vitblocks.swap_ffn(model, 'iffn', act_layer='gelu') == 1


def _decay_by_name(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g['weight_decay'] for g in optimizer.param_groups for p in g['params']}


@pytest.mark.parametrize('name,kwargs,own', [
    ('iffn_deit_tiny_patch16_224', dict(img_size=32, depth=2), 'pos_embed'),  # swap_ffn
    ('iffn_lvt', {}, 'cls_token'),  # swap_ffn + LVT's class-attention blocks
])
def test_timm_optimizer_factory_keeps_agelu_shifts_out_of_weight_decay(name, kwargs, own):
    """timm's create_optimizer_v2 asks model.no_weight_decay() only; the swapped IFFNs' stacked (2, C) AGeLU
    shifts must be named there (the authors' (1, 1, C) '.bias' tensors were not decayed), scales decayed."""
    import copy
    from timm.optim import create_optimizer_v2
    model = timm.create_model(name, **kwargs)
    decay = _decay_by_name(model, create_optimizer_v2(model, 'adamw', weight_decay=0.05))
    acts = sorted({n.rsplit('.', 1)[0] for n in decay if n.endswith('.act.gamma')})
    assert len(acts) == sum(isinstance(m, IFFN) for m in model.modules()) > 0
    assert {decay[f'{a}.{k}'] for a in acts for k in ('gamma', 'theta')} == {0.0}
    assert {decay[f'{a}.{k}'] for a in acts for k in ('alpha', 'beta')} == {0.05}
    assert decay[own] == 0.0 and len(decay) == len(dict(model.named_parameters()))
    assert copy.deepcopy(model).no_weight_decay() == model.no_weight_decay()  # a plain attribute, copied


def test_a_model_without_exclusions_keeps_its_own_no_weight_decay():
    model = timm.create_model('deit_tiny_patch16_224', img_size=32, depth=1)
    vitblocks.swap_ffn(model, 'afbo')  # nothing AFBO keeps out of weight decay by name
    assert 'no_weight_decay' not in vars(model) and model.no_weight_decay() == type(model).no_weight_decay(model)


def test_swap_carries_each_dropout_rate_to_its_own_place():
    """The MLP's drop1 (after the activation) and drop2 (after fc2) are two knobs: each keeps its own rate."""
    with torch.device('meta'):
        model = timm.create_model('deit_tiny_patch16_224', depth=2)
        for blk in model.blocks:
            blk.mlp.drop1.p, blk.mlp.drop2.p = 0.1, 0.3
        assert vitblocks.swap_ffn(model, 'iffn') == 2
    assert [(b.mlp.drop1.p, b.mlp.drop2.p) for b in model.blocks] == [(0.1, 0.3)] * 2


def test_caformer_channels_last_stages_get_a_channels_last_layout():
    """CAFormer's convolution stages are channels-first (1x1-conv MLPs); timm runs its attention stages on
    tokens (B, H*W, C) with Linear MLPs: each swapped FFN reads the layout of its own stage, with the grid."""
    with torch.device('meta'):
        model = timm.create_model('caformer_s18', num_classes=3)
        linear = [isinstance(b.mlp.fc1, nn.Linear) for s in model.stages for b in s.blocks]
        assert vitblocks.swap_ffn(model, 'afbo') == len(linear) == 18 and 0 < sum(linear) < 18
        assert [b.mlp.layout.channels_first for s in model.stages for b in s.blocks] == [not li for li in linear]
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 3)
        assert model(torch.randn(1, 3, 160, 192)).shape == (1, 3)  # the grid follows the input: 1/32 in the last stage
        assert model.stages[3].blocks[0].mlp.grid_size == (5, 6)
