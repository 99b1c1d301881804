"""MABViT: value-activation attention, parallel block, surgery, registered models vs the paper's tables."""
import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import Attention, LayerNorm, Mlp
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

import vitblocks
from vitblocks.layers import ParallelBlock, ValueActivationAttention
from vitblocks.models import add_pre_logits, get_variant, make_parallel, swap_value_attention
from vitblocks.models.mabvit import MABVIT_ARCHS, MABVIT_VARIANTS, PreLogitsVisionTransformer
from vitblocks.papers import load_paper
from vitblocks.profile import count_params
from _helpers import perturb_

MABVIT = load_paper('mabvit')


# --- value-activation attention ------------------------------------------------------------------

@pytest.mark.parametrize('fused', [True, False])
@pytest.mark.parametrize('kwargs', [dict(qkv_bias=True), dict(qkv_bias=False, proj_bias=False),
                                    dict(qkv_bias=True, qk_norm=True, norm_layer=LayerNorm)])
def test_identity_value_attention_is_timm_attention_exactly(fused, kwargs):
    timm_attn = perturb_(Attention(64, num_heads=4, **kwargs), std=0.1).eval()
    ours = ValueActivationAttention(64, num_heads=4, value_act=None, **kwargs).eval()
    ours.load_state_dict(timm_attn.state_dict())  # same module names and shapes
    timm_attn.fused_attn = ours.fused_attn = fused
    x = torch.randn(2, 17, 64)
    mask = torch.randn(2, 1, 17, 17)
    torch.testing.assert_close(ours(x), timm_attn(x), rtol=0, atol=0)
    torch.testing.assert_close(ours(x, attn_mask=mask), timm_attn(x, attn_mask=mask), rtol=0, atol=0)


def _reference_attention(attn: ValueActivationAttention, x: torch.Tensor, value_fn) -> torch.Tensor:
    """The paper's modified attention written out: Q, K, V = projections, V = Activation(V)."""
    B, N, C = x.shape
    A, H = attn.attn_dim, attn.num_heads
    w, b = attn.qkv.weight, attn.qkv.bias
    q, k, v = x @ w[:A].T + b[:A], x @ w[A:2 * A].T + b[A:2 * A], x @ w[2 * A:].T + b[2 * A:]
    v = value_fn(v)
    def heads(t):
        return t.reshape(B, N, H, A // H).transpose(1, 2)
    scores = heads(q) @ heads(k).transpose(-1, -2) / (A // H) ** 0.5
    out = (scores.softmax(-1) @ heads(v)).transpose(1, 2).reshape(B, N, A)
    return out @ attn.proj.weight.T + attn.proj.bias


@pytest.mark.parametrize('value_act, value_fn', [
    ('swiglu', lambda v: F.silu(v.chunk(2, -1)[0]) * v.chunk(2, -1)[1]),  # Swish(X W1) * X W2
    ('geglu', lambda v: F.gelu(v.chunk(2, -1)[0]) * v.chunk(2, -1)[1]),
    ('glu', lambda v: torch.sigmoid(v.chunk(2, -1)[0]) * v.chunk(2, -1)[1]),
    ('gelu', F.gelu),
])
def test_value_activation_formula(value_act, value_fn):
    attn = perturb_(ValueActivationAttention(48, num_heads=3, qkv_bias=True, value_act=value_act), std=0.1).eval()
    x = torch.randn(2, 9, 48)
    torch.testing.assert_close(attn(x), _reference_attention(attn, x, value_fn), rtol=1e-5, atol=1e-5)
    attn.fused_attn = False
    torch.testing.assert_close(attn(x), _reference_attention(attn, x, value_fn), rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize('fused', [True, False])
def test_attention_dropout_only_in_training(fused):
    """attn_drop drops attention weights while training; in eval mode the layer is deterministic and equals
    the same weights without dropout (fused SDPA gets dropout_p=0)."""
    attn = perturb_(ValueActivationAttention(32, num_heads=2, attn_drop=0.5), std=0.1).eval()
    plain = ValueActivationAttention(32, num_heads=2).eval()
    plain.load_state_dict(attn.state_dict())
    attn.fused_attn = plain.fused_attn = fused
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(attn(x), plain(x), rtol=0, atol=0)
    assert not torch.allclose(attn.train()(x), plain(x))

@pytest.mark.parametrize('dim', [192, 384])
def test_glu_widens_value_by_d_squared_plus_d(dim):
    def count(act):
        return count_params(ValueActivationAttention(dim, num_heads=3, qkv_bias=True, value_act=act))
    assert count('swiglu') - count(None) == dim * dim + dim  # "GLU Variant": V widened to 2D
    assert count('geglu') == count('glu') == count('swiglu')
    assert count('gelu') == count(None)


def test_unknown_value_activation_is_rejected():
    with pytest.raises(ValueError, match="unknown value activation 'swish'; use one of swiglu, geglu, glu"):
        ValueActivationAttention(64, value_act='swish')
    with pytest.raises(ValueError, match='not divisible by num_heads=5'):
        ValueActivationAttention(64, num_heads=5)


# --- parallel block ------------------------------------------------------------------------------

def test_parallel_block_matches_its_formula_and_loads_block_weights():
    block = perturb_(Block(32, num_heads=4, mlp_ratio=2, qkv_bias=True, init_values=0.5), std=0.1)
    par = ParallelBlock(32, num_heads=4, mlp_ratio=2, qkv_bias=True, init_values=0.5)
    par.load_state_dict(block.state_dict())  # same modules as timm's Block
    par.eval()
    x = torch.randn(2, 7, 32)
    expected = x + par.ls1(par.attn(par.norm1(x))) + par.ls2(par.mlp(par.norm2(x)))  # x + attn(LN x) + mlp(LN x)
    torch.testing.assert_close(par(x), expected, rtol=0, atol=0)
    assert not torch.allclose(par(x), block.eval()(x))  # and it is not the sequential block


def test_parallel_block_shared_norm():
    par = perturb_(ParallelBlock(32, num_heads=4, shared_norm=True), std=0.1).eval()
    assert isinstance(par.norm2, nn.Identity)
    x = torch.randn(2, 7, 32)
    y = par.norm1(x)
    torch.testing.assert_close(par(x), x + par.attn(y) + par.mlp(y), rtol=0, atol=0)
    assert count_params(par) == count_params(Block(32, num_heads=4)) - 2 * 32


def test_parallel_block_and_value_attention_plug_into_timm_vit():
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5,
                              block_fn=ParallelBlock, attn_layer=ValueActivationAttention)
    assert all(type(b) is ParallelBlock and b.attn.value_act == 'swiglu' for b in model.blocks)
    assert model.blocks[0].attn.qkv.out_features == 4 * 48  # [Q | K | V_gate | V_linear]
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 5)


# --- surgery -------------------------------------------------------------------------------------

def test_swap_value_attention_keeps_the_attention_config():
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, qkv_bias=False, qk_norm=True)
    assert swap_value_attention(model, 'gelu', include=lambda i: i < 3) == 3
    new, old = model.blocks[0].attn, model.blocks[3].attn
    assert isinstance(new, ValueActivationAttention) and type(old) is Attention
    assert new.qkv.bias is None and isinstance(new.q_norm, type(old.q_norm)) and new.q_norm.eps == old.q_norm.eps
    assert new.num_heads == old.num_heads and new.value_act == 'gelu'
    with pytest.raises(ValueError, match='supports timm VisionTransformer'):
        swap_value_attention(timm.create_model('mixer_s16_224'))


def test_make_parallel_and_pre_logits():
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, num_classes=7, class_token=False,
                              global_pool='avg', fc_norm=False)
    x = torch.randn(2, 3, 32, 32)
    assert make_parallel(model) == 12 and all(type(b) is ParallelBlock for b in model.blocks)
    add_pre_logits(model)
    assert isinstance(model, PreLogitsVisionTransformer)
    feats = model.forward_features(x)
    pre = model.forward_head(feats, pre_logits=True)
    torch.testing.assert_close(pre, torch.tanh(model.pre_logits.fc(model.norm(feats).mean(1))))  # Dense(D) + tanh
    torch.testing.assert_close(model(x), model.head(pre))
    model.reset_classifier(3)
    assert model(x).shape == (2, 3) and isinstance(model.pre_logits.fc, nn.Linear)
    with pytest.raises(ValueError, match='already has a pre-logits layer'):
        add_pre_logits(model)


# --- registered models ---------------------------------------------------------------------------

def test_all_variants_registered():
    names = vitblocks.list_models(method='mabvit')
    assert len(names) == len(MABVIT_ARCHS) * len(MABVIT_VARIANTS) == 35
    for _, arch, _, _ in MABVIT_ARCHS:
        for variant, *_ in MABVIT_VARIANTS:
            assert f'mabvit_{variant}_{arch}' in names


@pytest.mark.parametrize('variant, value_act, parallel, hidden', [
    ('standard', None, False, 4 * 384), ('parallel', None, True, 4 * 384), ('glu', 'swiglu', False, 4 * 384),
    ('glu_parallel', 'swiglu', True, 4 * 384), ('prglu', 'swiglu', False, 3 * 384),
    ('prglu_parallel', 'swiglu', True, 3 * 384), ('gelu', 'gelu', False, 4 * 384),
])
def test_variant_structure(variant, value_act, parallel, hidden):
    with torch.device('meta'):
        model = timm.create_model(f'mabvit_{variant}_vit_small_patch16_224')
    blk = model.blocks[0]
    assert type(blk) is (ParallelBlock if parallel else Block)
    if value_act is None:
        assert type(blk.attn) is Attention
    else:
        assert blk.attn.value_act == value_act
    assert blk.mlp.fc1.out_features == hidden and isinstance(blk.mlp, Mlp)
    # big_vision-style: no class token, learned position embedding, final norm, average pool, pre-logits
    assert model.cls_token is None and model.pos_embed.shape == (1, 196, 384)
    assert model.global_pool == 'avg' and isinstance(model.norm, nn.LayerNorm)
    assert isinstance(model.fc_norm, nn.Identity) and isinstance(model.pre_logits.act, nn.Tanh)


def test_medium_and_18_layer_architectures():
    with torch.device('meta'):
        m16 = timm.create_model('mabvit_standard_vit_medium_patch16_224')
        s18 = timm.create_model('mabvit_glu_vit_small_patch16_18x1_224')
    assert (m16.embed_dim, len(m16.blocks), m16.blocks[0].attn.num_heads) == (512, 12, 8)
    assert m16.blocks[0].mlp.fc1.out_features == 2048 and m16.blocks[0].attn.qkv.bias is not None
    assert isinstance(m16.blocks[0].ls1, nn.Identity) and m16.pretrained_cfg['input_size'] == (3, 224, 224)
    assert (s18.embed_dim, len(s18.blocks)) == (384, 18)


def test_block_cfg_overrides_and_errors():
    with torch.device('meta'):
        model = timm.create_model('mabvit_glu_vit_tiny_patch16_224',
                                  block_cfg=dict(value_act='geglu', parallel=True, shared_norm=True))
    assert model.blocks[0].attn.value_act == 'geglu' and model.blocks[0].shared_norm
    with pytest.raises(ValueError, match="unknown MABViT block config \\['mlp_ratio'\\]"), torch.device('meta'):
        timm.create_model('mabvit_glu_vit_tiny_patch16_224', block_cfg=dict(mlp_ratio=3))


@pytest.mark.parametrize('config', ['mabvit_glu', 'mabvit_glu_parallel', 'mabvit_parallel'])
def test_benchmark_models_build_the_value_activation_their_block_cfg_names(config):
    """The CIFAR-10 benchmark's MABViT models take ``value_act`` like the paper's models: a given
    activation is the one built (it was always SwiGLU), and parallel blocks stay parallel."""
    from vitblocks.models.blocks_bench import bench_model_name
    with torch.device('meta'):
        model = timm.create_model(bench_model_name(config), block_cfg=dict(value_act='gelu'))
    attn = model.blocks[0].attn
    assert isinstance(attn, ValueActivationAttention) and attn.value_act == 'gelu'
    assert isinstance(attn.v_act, nn.GELU) and not attn.gated_value
    assert isinstance(model.blocks[0], ParallelBlock) == config.endswith('parallel')


def _arch_params(arch: str, variant: str) -> int:
    with torch.device('meta'):
        return count_params(timm.create_model(f'mabvit_{variant}_{arch}'))


@pytest.mark.parametrize('arch, dim', [('vit_tiny_patch16_224', 192), ('vit_base_patch16_224', 768),
                                       ('vit_medium_patch16_224', 512)])
def test_parameter_arithmetic(arch, dim):
    """GLU adds 12 (D^2 + D); PR-GLU then removes 12 (2 D^2 + D); parallel and GELU change nothing."""
    base, glu, prglu = (_arch_params(arch, v) for v in ('standard', 'glu', 'prglu'))
    assert glu - base == 12 * (dim * dim + dim)
    assert prglu - glu == -12 * (2 * dim * dim + dim)
    assert _arch_params(arch, 'parallel') == _arch_params(arch, 'gelu') == base


# the one published cell the backbone misses: B/16 "Base and GELU" = 86 M (see mabvit.yaml)
B16_BASE_CELL = {'B/16 base', 'B/16 parallel', 'B/16 GELU'}


@pytest.mark.parametrize('row', [r for t in ('params', 'm16') for r in MABVIT.table(t).rows], ids=lambda r: r.label)
def test_params_match_paper_tables(row):
    with torch.device('meta'):
        ours = count_params(timm.create_model(row.model)) / 1e6
    delta = (ours - row.params_m) / row.params_m
    if row.label in B16_BASE_CELL:
        assert 0.013 < delta < 0.014 and row.note  # 87.16 M vs "86 M": documented on the row
    else:
        assert abs(delta) <= 0.01, f'{row.label}: ours {ours:.3f} M vs paper {row.params_m} M'


def test_every_yaml_row_names_a_mabvit_model():
    for table in MABVIT.tables:
        for row in table.rows:
            assert get_variant(row.model).method == 'mabvit'
    assert sum(len(t.rows) for t in MABVIT.tables) == 51
