"""Surgery for *residual* FFN units: FFNs that own their pre-norm, layer-scale, drop-path and
shortcut (RePa folds the shortcut into its merged matrix, Eq. 6, so it must own it).

A timm block computes ``x = x + drop_path(ls(mlp(norm(x))))``. Swapping in a residual unit
changes that second half to ``x = unit(x)``: for every supported timm block class there is a
static subclass below that overrides only ``forward`` (the token-mixer half is timm's, line for
line), and the surgery

1. builds the unit from the block's MLP dims, moving the block's layer-scale init value,
   residual scale and drop-path rate into it,
2. replaces the block's pre-FFN norm / layer-scale / drop-path with ``nn.Identity``,
3. sets ``block.__class__`` to the subclass (module-level classes, so models pickle and copy).

| timm block (family)             | unit slot        | moved into the unit (block keeps Identity)      |
| ------------------------------- | ---------------- | ----------------------------------------------- |
| ``Block`` (ViT, DeiT)           | ``mlp``          | norm2, ls2, drop_path2; tokens (B, N, C)        |
| ``SwinTransformerBlock``        | ``mlp``          | norm2, drop_path2; map (B, H, W, C)             |
| ``MetaFormerBlock`` (PoolFormer) | ``mlp``         | norm2, layer_scale2, res_scale2, drop_path2     |
| ``MixerBlock`` (MlpMixer)       | ``mlp_channels`` | norm2 (drop_path is shared: only its rate)      |
| ``LVViTBlock`` (LV-ViT)         | ``mlp``          | norm2, drop_path2, the constant 1/skip_lam (ls2) |

LV-ViT's branch scale is a constant, not a learned layer-scale: it moves into the unit as
``branch_scale`` (RePa folds it into fc2), and the block's ``ls2`` becomes ``nn.Identity``.
"""
import difflib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from timm.models.metaformer import MetaFormerBlock
from timm.models.mlp_mixer import MixerBlock
from timm.models.swin_transformer import SwinTransformerBlock
from timm.models.vision_transformer import Block
from torch import nn

from .lvvit import LVViTBlock
from .surgery import SWAPPED_ATTR, _mlp_dims, check_not_swapped, hidden_width

__all__ = ['swap_residual_ffn', 'register_residual_ffn', 'list_residual_ffns', 'RESIDUAL_FFN_REGISTRY',
           'ResidualFFNViTBlock', 'ResidualFFNSwinBlock', 'ResidualFFNMetaFormerBlock', 'ResidualFFNMixerBlock']


# --- the rewired blocks: forward = timm's token-mixer half, then the residual unit --------------

class ResidualFFNViTBlock(Block):
    """timm ``Block`` whose ``mlp`` is a residual unit (it owns norm2, ls2, drop_path2, shortcut)."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
        return self.mlp(x)


class ResidualFFNSwinBlock(SwinTransformerBlock):
    """timm ``SwinTransformerBlock`` whose ``mlp`` is a residual unit (owns norm2, drop_path2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self._attn(self.norm1(x)))  # (B, H, W, C)
        return self.mlp(x)  # point-wise unit: the (B, H, W, C) map needs no reshape to (B, H*W, C)


class ResidualFFNMetaFormerBlock(MetaFormerBlock):
    """timm ``MetaFormerBlock`` whose ``mlp`` is a residual unit (owns norm2, drop_path2,
    layer_scale2 and res_scale2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res_scale1(x) + self.layer_scale1(self.drop_path1(self.token_mixer(self.norm1(x))))
        return self.mlp(x)


class ResidualFFNMixerBlock(MixerBlock):
    """timm ``MixerBlock`` whose ``mlp_channels`` is a residual unit (owns norm2 and the shortcut;
    ``drop_path`` stays, the token-mixing half still uses it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2))  # (B, N, C)
        return self.mlp_channels(x)


@dataclass(frozen=True)
class _BlockRecipe:
    rewired: type  # the subclass above
    unit: str  # attribute holding the FFN
    norm: str  # pre-FFN norm, replaced by the unit's own
    drop_path: str
    layer_scale: Optional[str] = None
    res_scale: Optional[str] = None
    drop_path_shared: bool = False  # Mixer: one DropPath serves both halves
    constant_scale: Optional[str] = None  # a fixed branch scale (LV-ViT ls2), passed as branch_scale=


_RECIPES: Dict[type, _BlockRecipe] = {
    Block: _BlockRecipe(ResidualFFNViTBlock, 'mlp', 'norm2', 'drop_path2', layer_scale='ls2'),
    SwinTransformerBlock: _BlockRecipe(ResidualFFNSwinBlock, 'mlp', 'norm2', 'drop_path2'),
    MetaFormerBlock: _BlockRecipe(ResidualFFNMetaFormerBlock, 'mlp', 'norm2', 'drop_path2',
                                  layer_scale='layer_scale2', res_scale='res_scale2'),
    MixerBlock: _BlockRecipe(ResidualFFNMixerBlock, 'mlp_channels', 'norm2', 'drop_path', drop_path_shared=True),
    # LV-ViT's block is a timm Block with constant branch scales: once rewired it runs timm's
    # token-mixer half (its ls1 still divides by skip_lam) and the unit.
    LVViTBlock: _BlockRecipe(ResidualFFNViTBlock, 'mlp', 'norm2', 'drop_path2', constant_scale='ls2'),
}
SUPPORTED_BLOCKS = tuple(cls.__name__ for cls in _RECIPES)
_REWIRED = frozenset(r.rewired for r in _RECIPES.values())


# --- registry of residual units ---------------------------------------------------------------

@dataclass(frozen=True)
class _ResidualUnit:
    build: Callable[..., nn.Module]
    per_layer: Tuple[str, ...]  # arguments that accept one value per replaced block


RESIDUAL_FFN_REGISTRY: Dict[str, _ResidualUnit] = {}


def register_residual_ffn(name: str, build: Callable[..., nn.Module], per_layer: Sequence[str] = ()):
    """Register a residual FFN unit builder.

    ``build(in_features, hidden_features, out_features, *, channels_first, layer_scale_init_value,
    res_scale_init_value, drop_path, bias, device, dtype, **cfg)`` must return a module computing
    ``shortcut + drop_path(layer_scale * ffn(norm(x)))`` itself. Arguments named in ``per_layer``
    may be given to :func:`swap_residual_ffn` as a list/tuple with one value per replaced block.
    """
    if name in RESIDUAL_FFN_REGISTRY:
        raise ValueError(f'residual FFN {name!r} is already registered')
    RESIDUAL_FFN_REGISTRY[name] = _ResidualUnit(build, tuple(per_layer))
    return build


def list_residual_ffns() -> List[str]:
    return sorted(RESIDUAL_FFN_REGISTRY)


# --- the surgery ------------------------------------------------------------------------------

def _scale_value(module: nn.Module) -> Optional[float]:
    """Init value of a timm LayerScale / MetaFormer Scale (``None`` for Identity)."""
    if isinstance(module, nn.Identity):
        return None
    if hasattr(module, 'init_values'):  # timm LayerScale
        return float(module.init_values)
    param = getattr(module, 'gamma', None)
    param = param if param is not None else getattr(module, 'scale')  # metaformer Scale
    return float(param.detach().flatten()[0])


def _drop_rate(module: nn.Module) -> float:
    return float(getattr(module, 'drop_prob', 0.) or 0.)


def find_residual_slots(model: nn.Module) -> List[Tuple[str, nn.Module, _BlockRecipe]]:
    """``(qualified name, block, recipe)`` for every supported timm block of ``model``."""
    slots = []
    for qualname, module in model.named_modules():
        recipe = _RECIPES.get(type(module))  # exact class: a subclass may wire its forward differently
        if recipe is not None:
            slots.append((qualname, module, recipe))
        elif type(module) in _REWIRED:
            unit = type(getattr(module, 'mlp', getattr(module, 'mlp_channels', None))).__name__
            raise ValueError(f'{qualname or type(model).__name__} already holds a residual FFN ({unit}); '
                             'swap into a freshly built timm model')
    return slots


def swap_residual_ffn(model: nn.Module, name: str, *, mlp_ratio: Optional[float] = None,
                      include: Optional[Callable[[str], bool]] = None, **cfg) -> int:
    """Replace the FFN half of every supported timm block with the residual unit ``name``.

    Args:
        model: a timm model built from ``Block`` (ViT/DeiT), ``SwinTransformerBlock``,
            ``MetaFormerBlock`` (PoolFormer), ``MixerBlock`` (MLP-Mixer) or ``LVViTBlock``
            (LV-ViT); changed in place.
        name: registered residual unit (``list_residual_ffns()``), e.g. 'repa'.
        mlp_ratio: hidden width relative to the input width; default keeps the original width.
        include: optional predicate on the block's qualified name (e.g. ``'blocks.3'``).
        **cfg: unit arguments (``idle_ratio=0.5``, ``deploy=True``, ...). An argument the unit
            declares per-layer (RePa: ``idle_ratio``) may be a list with one value per replaced
            block, in model order.

    Returns:
        The number of blocks rewired. New units are freshly initialized on the device/dtype
        and in the train/eval mode of the MLP they replace.
    """
    if name not in RESIDUAL_FFN_REGISTRY:
        close = difflib.get_close_matches(name, RESIDUAL_FFN_REGISTRY, n=3)
        hint = f'; did you mean {", ".join(close)}?' if close else ''
        raise ValueError(f'unknown residual FFN {name!r}{hint} (available: {", ".join(list_residual_ffns())}); '
                         'plain FFNs are swapped with vitblocks.swap_ffn')
    unit = RESIDUAL_FFN_REGISTRY[name]
    slots = find_residual_slots(model)
    if not slots:
        raise ValueError(f'swap_residual_ffn found no supported block in {type(model).__name__}; supported timm '
                         f'blocks: {", ".join(SUPPORTED_BLOCKS)}')
    selected = [s for s in slots if include is None or include(s[0])]
    if not selected:
        raise ValueError(f'swap_residual_ffn: include= selected none of the {len(slots)} blocks of '
                         f'{type(model).__name__} (e.g. {slots[0][0]!r})')
    for qualname, block, recipe in selected:  # all checked before any is replaced
        check_not_swapped(getattr(block, recipe.unit), f'{qualname}.{recipe.unit}')
        hidden_width(_mlp_dims(getattr(block, recipe.unit))[0], mlp_ratio, 0, f'{qualname}.{recipe.unit}')
    schedules = {}
    for key in unit.per_layer:
        if isinstance(cfg.get(key), (list, tuple)):
            values = cfg.pop(key)
            if len(values) != len(selected):
                raise ValueError(f'{key} has {len(values)} values but {len(selected)} blocks are replaced '
                                 f'({selected[0][0]} ... {selected[-1][0]}); '
                                 'give one value per block or a single value')
            schedules[key] = values

    for i, (qualname, block, recipe) in enumerate(selected):
        old = getattr(block, recipe.unit)
        c_in, hidden, c_out, bias = _mlp_dims(old)
        hidden = hidden_width(c_in, mlp_ratio, hidden, f'{qualname}.{recipe.unit}')
        ref = old.fc1.weight
        layer_cfg = dict(cfg, **{key: values[i] for key, values in schedules.items()})
        if recipe.constant_scale:
            layer_cfg['branch_scale'] = getattr(block, recipe.constant_scale).value
        new = unit.build(
            c_in, hidden, c_out,
            channels_first=isinstance(old.fc1, nn.Conv2d),
            layer_scale_init_value=_scale_value(getattr(block, recipe.layer_scale)) if recipe.layer_scale else None,
            res_scale_init_value=_scale_value(getattr(block, recipe.res_scale)) if recipe.res_scale else None,
            drop_path=_drop_rate(getattr(block, recipe.drop_path)),
            bias=bias, device=ref.device, dtype=ref.dtype, **layer_cfg)
        new.train(old.training)
        setattr(new, SWAPPED_ATTR, name)
        setattr(block, recipe.unit, new)
        for attr in (recipe.norm, recipe.layer_scale, recipe.res_scale, recipe.constant_scale):
            if attr:
                setattr(block, attr, nn.Identity())
        if not recipe.drop_path_shared:
            setattr(block, recipe.drop_path, nn.Identity())
        block.__class__ = recipe.rewired
    return len(selected)
