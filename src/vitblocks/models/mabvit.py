"""MABViT models: the paper's seven variants on big_vision-style ViTs, plus the surgery behind them.

Every model is "build the timm ViT, swap": timm's ``VisionTransformer`` without class token,
average-pooled, with a learned position embedding (``class_token=False, global_pool='avg',
fc_norm=False``: final LayerNorm, then mean over tokens, as big_vision's ``pool_type='gap'``),
then

* ``swap_value_attention(model, value_act)``: every ``blocks[i].attn`` becomes a
  :class:`~vitblocks.layers.ValueActivationAttention` (GLU = SwiGLU on a 2x-wide V; GELU);
* ``make_parallel(model)``: every block computes ``x + attn(LN x) + mlp(LN x)``
  (:class:`~vitblocks.layers.ParallelBlock`);
* ``add_pre_logits(model)``: big_vision's ``rep_size=True`` pre-logits layer, Dense(D) + tanh
  between the pooled features and the head (timm's ``VisionTransformer`` no longer has one).

"PR" (parameter-reduced) variants use MLP ratio 3 instead of 4 (timm kwarg ``mlp_ratio``).

Why this backbone: the paper's "Number of Parameters" table fits it exactly. Per block, the
GLU V projection adds ``D^2 + D``, and PR-GLU then removes ``2 D^2 + D`` (a 3D-wide MLP). With
average pooling, learned position embeddings and the pre-logits layer we count Ti/16
5.75 / 6.20 / 5.31 M (paper 5.8 / 6.2 / 5.3), S/16 22.20 / 23.97 / 20.43 (22.2 / 24 / 20.4), B/16
87.16 / 94.24 / 80.08 (86 / 94 / 80) and M/16 39.10 / 42.25 / 35.95 (39.1 / 42.25 / 35.9) for
base / GLU / PR-GLU. B/16's "86 M" is the one cell off (+1.3%): the 86 M usually quoted for
ViT-B/16 (with class token, without pre-logits); the same arithmetic matches its GLU and PR-GLU
cells within 0.3%.

Architectures (``<method>_<variant>_<arch>``, variants: ``standard``, ``parallel``, ``glu``,
``glu_parallel``, ``prglu``, ``prglu_parallel``, ``gelu``):

* ``vit_tiny_patch16_224``, ``vit_small_patch16_224``, ``vit_base_patch16_224``: the paper's
  Ti/16, S/16, B/16 (timm names).
* ``vit_medium_patch16_224``: M/16. The paper's text says width 576 and MLP 2304, but its own
  M/16 table (39.1 / 42.25 / 35.9 M) fits width 512 with MLP 2048 and 8 heads exactly (GLU adds
  12 (D^2 + D) = 3.15 M only for D = 512; D = 576 gives 49.3 / 53.3 / 45.4 M). That is timm's ViT-Medium
  (``vit_medium_patch16_gap_*``, which timm has at 240/256/384 px only), so this is it at 224 px.
* ``vit_small_patch16_18x1_224``: S/16 with 18 layers (timm's depth naming, as in its
  ``vit_small_patch16_36x1_224``), built from ``vit_small_patch16_224`` with ``depth=18``.

Block config (``timm.create_model(name, block_cfg=...)``): ``value_act`` ('swiglu', 'geglu',
'glu', 'gelu' or None), ``parallel`` (bool), ``shared_norm`` (parallel blocks with one
LayerNorm for both branches), ``pre_logits`` (bool).
"""
from collections import OrderedDict
from typing import Callable, Optional

import torch
from timm.layers import Attention, trunc_normal_
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ..layers.value_attention import ParallelBlock, ValueActivationAttention
from .recipe import recorded_surgery
from .registry import VariantSpec, register_variant
from .slots import find_slots, slot_spec, supported_families

__all__ = ['swap_value_attention', 'make_parallel', 'add_pre_logits', 'PreLogitsVisionTransformer',
           'MABVIT_ARCHS', 'MABVIT_VARIANTS']


# --- surgery ----------------------------------------------------------------------------------

def _require_vit(model: nn.Module, what: str) -> None:
    if not isinstance(model, VisionTransformer):
        raise ValueError(f'{what} supports timm VisionTransformer models (ViT, DeiT), got {type(model).__name__}')


def _norm_like(norm: nn.Module) -> Callable[..., nn.Module]:
    """A constructor for a norm of the same class and eps as ``norm`` (for qk_norm / scale_norm)."""
    return lambda n, **dd: type(norm)(n, eps=norm.eps, **dd)


@recorded_surgery(candidates=lambda model: list(range(len(find_slots(model, 'attention')))))
def swap_value_attention(model: nn.Module, value_act: Optional[str] = 'swiglu',
                         include: Optional[Callable[[int], bool]] = None) -> int:
    """Replace ``blocks[i].attn`` of a timm ViT with :class:`ValueActivationAttention` (fresh weights).

    The new attention keeps the old one's widths, heads, biases, norms and dropouts; only the
    activation on V (and, for GLU activations, a 2x-wide V projection) is new.

    Args:
        model: a timm ``VisionTransformer``; changed in place.
        value_act: 'swiglu' (the paper's GLU), 'geglu', 'glu', 'gelu', or None.
        include: optional predicate on the block index selecting which blocks to change.

    Returns:
        The number of attention modules replaced (ValueError if none).
    """
    if slot_spec(type(model), 'attention') is None:
        raise ValueError(f'swap_value_attention supports timm VisionTransformer models (ViT, DeiT), got '
                         f'{type(model).__name__} (attention slots are declared for '
                         f'{", ".join(supported_families("attention"))})')
    count = 0
    slots = find_slots(model, 'attention')
    for i, (blk, attr, _, _) in enumerate(slots):
        old = getattr(blk, attr, None)
        if not isinstance(old, (Attention, ValueActivationAttention)) or (include is not None and not include(i)):
            continue
        out_norm, out_gate = getattr(old, 'norm', nn.Identity()), getattr(old, 'gate', None)  # newer timm options
        qk_norm, scale_norm = not isinstance(old.q_norm, nn.Identity), not isinstance(out_norm, nn.Identity)
        norm_source = old.q_norm if qk_norm else out_norm
        ref = old.qkv.weight
        new = ValueActivationAttention(
            old.qkv.in_features, num_heads=old.num_heads, attn_head_dim=old.head_dim, dim_out=old.proj.out_features,
            qkv_bias=old.qkv.bias is not None, qk_norm=qk_norm, scale_norm=scale_norm,
            proj_bias=old.proj.bias is not None, gated=out_gate is not None, attn_drop=old.attn_drop.p,
            proj_drop=old.proj_drop.p, norm_layer=_norm_like(norm_source) if qk_norm or scale_norm else None,
            value_act=value_act, device=ref.device, dtype=ref.dtype)
        setattr(blk, attr, new.train(old.training))
        count += 1
    if count == 0:
        raise ValueError(f'swap_value_attention found no timm Attention in {type(model).__name__}.blocks'
                         + (' selected by include=' if include is not None else ''))
    return count


@recorded_surgery()
def make_parallel(model: nn.Module) -> int:
    """Turn every timm ``Block`` of a ViT into a :class:`ParallelBlock` in place (same weights);
    returns the number of blocks. Only ``forward`` changes: ``x + attn(LN x) + mlp(LN x)``."""
    _require_vit(model, 'make_parallel')
    for i, blk in enumerate(model.blocks):
        if type(blk) not in (Block, ParallelBlock):
            raise ValueError(f'make_parallel: blocks.{i} is a {type(blk).__name__}; only timm Block '
                             f'(pre-norm attention + MLP) has a parallel form here')
        if type(blk) is Block:
            blk.__class__ = ParallelBlock  # a module-level subclass: models still pickle and copy
            blk.shared_norm = False  # an instance attribute, as ParallelBlock.__init__ sets (TorchScript reads those)
    return len(model.blocks)


class PreLogitsVisionTransformer(VisionTransformer):
    """timm ``VisionTransformer`` with big_vision's pre-logits layer (``rep_size``) before the head.

    ``forward_head``: pool -> fc_norm -> ``pre_logits`` (Dense(D) + tanh) -> head_drop -> head.
    ``forward_head(x, pre_logits=True)`` returns the tanh features, as big_vision's
    ``out['pre_logits']``. Models get this class from :func:`add_pre_logits`. (``pre_logits`` is set
    there; no class-level annotation, which TorchScript would read as an unknown type.)
    """

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.pool(x)
        x = self.fc_norm(x)
        x = self.pre_logits(x)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def prune_intermediate_layers(self, indices=1, prune_norm: bool = False, prune_head: bool = True):
        take_indices = super().prune_intermediate_layers(indices, prune_norm, prune_head)
        if prune_head:
            self.pre_logits = nn.Identity()
        return take_indices


@recorded_surgery()
def add_pre_logits(model: nn.Module) -> nn.Module:
    """Give a timm ViT big_vision's pre-logits layer (``rep_size=True``: Dense(D) + tanh), in place.

    Returns the model, whose class becomes :class:`PreLogitsVisionTransformer`; calling it twice
    is an error, not a second layer.
    """
    _require_vit(model, 'add_pre_logits')
    if isinstance(model, PreLogitsVisionTransformer):
        raise ValueError('the model already has a pre-logits layer')
    ref = model.patch_embed.proj.weight
    fc = nn.Linear(model.embed_dim, model.embed_dim, device=ref.device, dtype=ref.dtype)
    trunc_normal_(fc.weight, std=.02)  # timm's ViT init for linears
    nn.init.zeros_(fc.bias)
    model.__class__ = PreLogitsVisionTransformer
    model.pre_logits = nn.Sequential(OrderedDict(fc=fc, act=nn.Tanh())).train(model.training)
    return model


# --- registered models --------------------------------------------------------------------------

_BIG_VISION = dict(class_token=False, global_pool='avg', fc_norm=False)

# (paper name, registered architecture name, timm base, base kwargs beyond _BIG_VISION)
MABVIT_ARCHS = (
    ('Ti/16', 'vit_tiny_patch16_224', 'vit_tiny_patch16_224', {}),
    ('S/16', 'vit_small_patch16_224', 'vit_small_patch16_224', {}),
    ('B/16', 'vit_base_patch16_224', 'vit_base_patch16_224', {}),
    # timm's ViT-M/16 (512 wide, 8 heads, MLP 2048) at 224 px with qkv bias and without its layer-scale
    # (init_values=0 turns it off; timm.create_model drops None-valued kwargs)
    ('M/16', 'vit_medium_patch16_224', 'vit_medium_patch16_gap_256',
     dict(img_size=224, qkv_bias=True, init_values=0.)),
    ('S/16 18 layers', 'vit_small_patch16_18x1_224', 'vit_small_patch16_224', dict(depth=18)),
)

_ARCH_NOTES = {
    'vit_medium_patch16_224': '; timm\'s ViT-M/16 (vit_medium_patch16_gap_256) at 224 px: width 512, MLP 2048 as '
                              'the paper\'s M/16 table (its text says 576 / 2304)',
    'vit_small_patch16_18x1_224': '; vit_small_patch16_224 with 18 blocks',
}

# (variant, paper name, value activation, parallel, MLP ratio)
MABVIT_VARIANTS = (
    ('standard', 'standard ViT', None, False, 4.0),
    ('parallel', 'parallel ViT', None, True, 4.0),
    ('glu', 'GLU (SwiGLU on V)', 'swiglu', False, 4.0),
    ('glu_parallel', 'GLU parallel', 'swiglu', True, 4.0),
    ('prglu', 'PR-GLU (SwiGLU on V, MLP 3x)', 'swiglu', False, 3.0),
    ('prglu_parallel', 'PR-GLU parallel (MLP 3x)', 'swiglu', True, 3.0),
    ('gelu', 'GELU on V', 'gelu', False, 4.0),
)

_CFG_KEYS = ('value_act', 'parallel', 'shared_norm', 'pre_logits')


def _build_mabvit(model: nn.Module, cfg) -> None:
    unknown = set(cfg) - set(_CFG_KEYS)
    if unknown:
        raise ValueError(f'unknown MABViT block config {sorted(unknown)}; known keys: {", ".join(_CFG_KEYS)} '
                         f'(widths, depth and mlp_ratio are timm kwargs: timm.create_model(name, mlp_ratio=3))')
    if cfg.get('value_act') is not None:
        swap_value_attention(model, cfg['value_act'])
    if cfg.get('parallel'):
        make_parallel(model)
        for blk in model.blocks:
            if cfg.get('shared_norm'):
                blk.shared_norm, blk.norm2 = True, nn.Identity()
    elif cfg.get('shared_norm'):
        raise ValueError('shared_norm applies to parallel blocks only; pass parallel=True with it')
    if cfg.get('pre_logits', True):
        add_pre_logits(model)


for _paper_arch, _arch, _base, _kwargs in MABVIT_ARCHS:
    for _variant, _paper_variant, _act, _parallel, _mlp_ratio in MABVIT_VARIANTS:
        _name = f'mabvit_{_variant}_{_arch}'
        register_variant(VariantSpec(
            name=_name, method='mabvit', base=_base, build=_build_mabvit,
            cfg=dict(value_act=_act, parallel=_parallel, pre_logits=True),
            base_kwargs=dict(_BIG_VISION, mlp_ratio=_mlp_ratio, **_kwargs),
            description=f'MABViT {_paper_arch} {_paper_variant}; big_vision-style ViT (avg pool, pre-logits)'
                        + _ARCH_NOTES.get(_arch, ''),
            # a data config for the built model, not the base (M/16's base is a 256 px model)
            pretrained_cfg=dict(input_size=(3, 224, 224), crop_pct=0.9)))
