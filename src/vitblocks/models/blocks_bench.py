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

MABViT's models also add a pre-logits layer and NiNformer's drop the position embedding; those
are backbone choices, not the block, so the benchmark keeps the one backbone for all.
"""
from functools import partial

from .mabvit import make_parallel, swap_value_attention
from .ninformer import swap_gating_unit
from .registry import VariantSpec, register_variant
from .residual_surgery import swap_residual_ffn
from .surgery import swap_ffn

__all__ = ['BENCH_BACKBONE', 'BLOCK_CONFIGS', 'bench_model_name']

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
    if value_act:
        swap_value_attention(model, value_act)
    if cfg.pop('parallel', False):
        make_parallel(model)
    if cfg:
        raise ValueError(f'unknown MABViT benchmark block config {sorted(cfg)}; keys: value_act, parallel')


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
)

for _config, _paper, _build, _cfg, _what in BLOCK_CONFIGS:
    _name = bench_model_name(_config)
    register_variant(VariantSpec(
        name=_name, method='bench', base=BENCH_BASE, build=_build, cfg=dict(_cfg), base_kwargs=dict(BENCH_BACKBONE),
        description=f'CIFAR-10 blocks benchmark: {_what}; DeiT-Ti-like ViT (timm {BENCH_BASE} entry with width 192, '
                    f'6 blocks, patch 4, 32x32 input, avg pool)',
        pretrained_cfg=dict(input_size=(3, 32, 32), fixed_input_size=True, crop_pct=1.0, num_classes=10)))
