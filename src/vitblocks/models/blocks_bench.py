"""The CIFAR-10 blocks benchmark models: one small ViT, and each paper's block swapped into it.

One backbone for all nine configurations, so that accuracy differences come from the block alone:
a DeiT-Tiny-like timm ViT for 32x32 images (timm's ``vit_tiny_patch16_224`` entry with
``BENCH_BACKBONE``: width 192, 3 heads, MLP ratio 4 as DeiT-Ti; patch 4, so 8x8 = 64 tokens; 6
blocks instead of 12, so that 27 runs fit one GPU slice; learned position embedding; no class
token, average pooling, as IFFN's, MABViT's and NiNformer's models). Each configuration is that
model plus one swap with the paper's default setting (``BLOCK_CONFIGS``); registered as
``bench_<config>_vit_tiny_patch4_32``, so ``vitblocks train/eval/bench`` take them by name.

* ``vanilla``: the backbone (timm ``Mlp``, GELU, hidden 4D).
* ``iffn``: ``swap_ffn(model, 'iffn')`` (fc1 D->2D, two AGeLUs, 3x3 depthwise block, fc2 4D->D).
* ``afbo``: ``swap_ffn(model, 'afbo', gccm_groups=2, occm_groups=4)``, DeiT-T's G1/G2 (AFBO Table 2/7).
* ``swiglu``: ``swap_ffn(model, 'swiglu')``, gated width 8/3 D (parameter-matched; AFBO Table 3's
  and MABViT's GLU counterpart).
* ``repa``: ``swap_residual_ffn(model, 'repa', idle_ratio=0.75)``; evaluated after folding too.
* ``mabvit_glu``: SwiGLU on the Value tensor (``swap_value_attention(model, 'swiglu')``).
* ``mabvit_parallel``: parallel blocks ``x + attn(LN x) + mlp(LN x)`` (``make_parallel``).
* ``mabvit_glu_parallel``: both.
* ``ninformer``: NiNformer's gating unit in place of attention (``swap_gating_unit``): token MLP
  512 as the paper (which also mixes 64 tokens), channel MLP 2D = 384 (the paper's 512 at width
  256). Only the token mixer changes: the block keeps its two LayerNorms (``shared_norm=False``;
  the authors' block shares one) and the backbone's 4D outer MLP (the paper's is 2D).

Controls and the papers' ablations (``CONTROL_CONFIGS``, ``ABLATION_CONFIGS``), same backbone and recipe:

* locality controls: ``local_ffn`` / ``local_ffn_afbo``, the vanilla FFN with a 3x3 depthwise conv inside
  (LocalViT's inverted residual with GELU) at IFFN's / AFBO's parameter count (hidden 593 / 785);
  ``iffn_spatial_only`` and ``iffn_channel_only`` (IFFN Table 2), ``afbo_c`` (AFBO-C, channel maps only,
  Table 5), ``vanilla_wide`` (the vanilla MLP widened to hidden 1037, NiNformer's parameter count);
* ablations: ``iffn_k5``, ``iffn_k7`` (IFFN Table 6), ``iffn_n4`` (Table 4); ``afbo_post`` (the activation
  after the product, AFBO Table 6), ``afbo_g2_2``, ``afbo_g2_6``, ``afbo_g1_4`` (Table 7); ``repa_idle_25``,
  ``repa_idle_50``, ``repa_idle_100`` (RePa Table 4); ``mabvit_pr_glu`` (MABViT's parameter-reduced GLU:
  SwiGLU on V with the MLP cut from 4D to 3D).

MABViT's models also add a pre-logits layer and NiNformer's drop the position embedding; those
are backbone choices, not the block, so the benchmark keeps the one backbone for all.
"""
from functools import partial

from .mabvit import make_parallel, swap_value_attention
from .ninformer import swap_gating_unit
from .registry import VariantSpec, register_variant
from .residual_surgery import swap_residual_ffn
from .surgery import swap_ffn

__all__ = ['BENCH_BACKBONE', 'BLOCK_CONFIGS', 'MAIN_CONFIGS', 'CONTROL_CONFIGS', 'ABLATION_CONFIGS',
           'bench_model_name']

BENCH_BASE = 'vit_tiny_patch16_224'
BENCH_BACKBONE = dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0,
                      class_token=False, global_pool='avg', num_classes=10)


def bench_model_name(config: str) -> str:
    return f'bench_{config}_vit_tiny_patch4_32'


def _no_swap(model, cfg):
    if cfg:
        raise ValueError(f'the vanilla benchmark model takes no block config, got {sorted(cfg)}')


def _ffn(name, model, cfg):
    swap_ffn(model, name, **cfg)


def _mabvit(model, cfg):
    cfg = dict(cfg)
    value_act = cfg.pop('value_act', None)
    mlp_ratio = cfg.pop('mlp_ratio', None)
    if value_act:
        swap_value_attention(model, value_act)
    if mlp_ratio is not None:  # PR-GLU: the MLP cut to pay for the GLU's third matrix
        swap_ffn(model, 'mlp', mlp_ratio=mlp_ratio)
    if cfg.pop('parallel', False):
        make_parallel(model)
    if cfg:
        raise ValueError(f'unknown MABViT benchmark block config {sorted(cfg)}; keys: value_act, parallel, mlp_ratio')


# (config, paper, build, block config, what it changes)
BLOCK_CONFIGS = (
    ('vanilla', None, _no_swap, {}, 'vanilla ViT block (MLP 4D, GELU)'),
    ('iffn', 'iffn', partial(_ffn, 'iffn'), dict(kernel_size=3), 'IFFN in place of the MLP'),
    ('afbo', 'afbo', partial(_ffn, 'afbo'), dict(gccm_groups=2, occm_groups=4),
     'AFBO (G1=2, G2=4) in place of the MLP'),
    ('swiglu', 'afbo', partial(_ffn, 'swiglu'), {}, 'SwiGLU (width 8/3 D) in place of the MLP'),
    ('repa', 'repa', lambda m, c: swap_residual_ffn(m, 'repa', **c), dict(idle_ratio=0.75),
     'RePa channel-idle FFN (theta 0.75), foldable'),
    ('mabvit_glu', 'mabvit', _mabvit, dict(value_act='swiglu', parallel=False), 'MABViT SwiGLU on the Value tensor'),
    ('mabvit_parallel', 'mabvit', _mabvit, dict(value_act=None, parallel=True), 'MABViT parallel block'),
    ('mabvit_glu_parallel', 'mabvit', _mabvit, dict(value_act='swiglu', parallel=True),
     'MABViT parallel block + SwiGLU on V'),
    ('ninformer', 'ninformer', lambda m, c: swap_gating_unit(m, **c),
     dict(token_mlp_dim=512, channel_mlp_dim=384, shared_norm=False), 'NiNformer gating unit in place of attention'),
    # locality and size controls
    ('local_ffn', None, partial(_ffn, 'localvit'), dict(mlp_ratio=593 / 192, act_layer='gelu'),
     "vanilla FFN + 3x3 depthwise conv (LocalViT style, GELU) at IFFN's parameters"),
    ('local_ffn_afbo', None, partial(_ffn, 'localvit'), dict(mlp_ratio=785 / 192, act_layer='gelu'),
     "vanilla FFN + 3x3 depthwise conv (LocalViT style, GELU) at AFBO's parameters"),
    ('iffn_spatial_only', 'iffn', partial(_ffn, 'iffn'), dict(channel_part=False), 'IFFN spatial part only (Table 2)'),
    ('iffn_channel_only', 'iffn', partial(_ffn, 'iffn'), dict(spatial_part=False), 'IFFN channel part only (Table 2)'),
    ('afbo_c', 'afbo', partial(_ffn, 'afbo'), dict(gccm_groups=2, occm_groups=4, order='cm'),
     'AFBO-C: channel maps only, no spatial modelling (Table 5)'),
    ('vanilla_wide', None, partial(_ffn, 'mlp'), dict(mlp_ratio=1037 / 192),
     "vanilla MLP widened to NiNformer's parameters (hidden 1037)"),
    # the papers' ablations
    ('iffn_k5', 'iffn', partial(_ffn, 'iffn'), dict(kernel_size=5), 'IFFN with a 5x5 depthwise conv (Table 6)'),
    ('iffn_k7', 'iffn', partial(_ffn, 'iffn'), dict(kernel_size=7), 'IFFN with a 7x7 depthwise conv (Table 6)'),
    ('iffn_n4', 'iffn', partial(_ffn, 'iffn'), dict(num_functions=4), 'IFFN with N = 4 activations (Table 4)'),
    ('afbo_post', 'afbo', partial(_ffn, 'afbo'), dict(gccm_groups=2, occm_groups=4, act_position='post'),
     'AFBO with the activation after the product (Table 6)'),
    ('afbo_g2_2', 'afbo', partial(_ffn, 'afbo'), dict(gccm_groups=2, occm_groups=2), 'AFBO G1=2, G2=2 (Table 7)'),
    ('afbo_g2_6', 'afbo', partial(_ffn, 'afbo'), dict(gccm_groups=2, occm_groups=6), 'AFBO G1=2, G2=6 (Table 7)'),
    ('afbo_g1_4', 'afbo', partial(_ffn, 'afbo'), dict(gccm_groups=4, occm_groups=4), 'AFBO G1=4, G2=4 (Table 7)'),
    ('repa_idle_25', 'repa', lambda m, c: swap_residual_ffn(m, 'repa', **c), dict(idle_ratio=0.25),
     'RePa, channel idle ratio 0.25 (Table 4)'),
    ('repa_idle_50', 'repa', lambda m, c: swap_residual_ffn(m, 'repa', **c), dict(idle_ratio=0.5),
     'RePa, channel idle ratio 0.5 (Table 4)'),
    ('repa_idle_100', 'repa', lambda m, c: swap_residual_ffn(m, 'repa', **c), dict(idle_ratio=1.0),
     'RePa, channel idle ratio 1.0: a linear FFN (Table 4)'),
    ('mabvit_pr_glu', 'mabvit', _mabvit, dict(value_act='swiglu', parallel=False, mlp_ratio=3.0),
     'MABViT PR-GLU: SwiGLU on V, MLP 3D instead of 4D'),
)
MAIN_CONFIGS = tuple(c[0] for c in BLOCK_CONFIGS[:9])
CONTROL_CONFIGS = ('local_ffn', 'local_ffn_afbo', 'iffn_spatial_only', 'iffn_channel_only', 'afbo_c', 'vanilla_wide')
ABLATION_CONFIGS = tuple(c[0] for c in BLOCK_CONFIGS[9:] if c[0] not in CONTROL_CONFIGS)

for _config, _paper, _build, _cfg, _what in BLOCK_CONFIGS:
    _name = bench_model_name(_config)
    register_variant(VariantSpec(
        name=_name, method='bench', base=BENCH_BASE, build=_build, cfg=dict(_cfg), base_kwargs=dict(BENCH_BACKBONE),
        description=f'CIFAR-10 blocks benchmark: {_what}; DeiT-Ti-like ViT (timm {BENCH_BASE} entry with width 192, '
                    f'6 blocks, patch 4, 32x32 input, avg pool)',
        pretrained_cfg=dict(input_size=(3, 32, 32), fixed_input_size=True, crop_pct=1.0, num_classes=10)))
