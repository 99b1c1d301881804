"""Surgery for *residual* FFN units: FFNs that own their pre-norm, layer-scale, drop-path and
shortcut (RePa folds the shortcut into its merged matrix, Eq. 6, so it must own it).

A timm block computes ``x = x + drop_path(ls(mlp(norm(x))))``. Swapping in a residual unit
changes that second half to ``x = unit(x)``: every supported block class declares a
``ResidualRecipe`` (the slot protocol of ``models/slots.py``, kind ``'residual_ffn'``) naming a static
subclass that overrides only ``forward`` (``models/residual_blocks.py``: the token-mixer half is timm's,
line for line), and the surgery

1. builds the unit from the block's MLP dims, moving the block's layer-scale init value,
   residual scale and drop-path rate into it,
2. replaces the block's pre-FFN norm / layer-scale / drop-path with ``nn.Identity``,
3. sets ``block.__class__`` to the subclass (module-level classes, so models pickle and copy).

| block (family)                   | unit slot        | moved into the unit (block keeps Identity)       |
| -------------------------------- | ---------------- | ------------------------------------------------ |
| ``Block`` (ViT, DeiT)            | ``mlp``          | norm2, ls2, drop_path2; tokens (B, N, C)         |
| ``SwinTransformerBlock``         | ``mlp``          | norm2, drop_path2; map (B, H, W, C)              |
| ``MetaFormerBlock`` (PoolFormer) | ``mlp``          | norm2, layer_scale2, res_scale2, drop_path2      |
| ``MixerBlock`` (MlpMixer)        | ``mlp_channels`` | norm2 (drop_path is shared: only its rate)       |
| ``LVViTBlock`` (LV-ViT)          | ``mlp``          | norm2, drop_path2, the constant 1/skip_lam (ls2) |

The timm blocks declare their recipes in ``models/timm_slots.py``, LV-ViT's in ``models/backbones/lvvit.py``.
Recipes match a block's exact class (a subclass may wire its forward differently), wherever the block
sits in the model. LV-ViT's branch scale is a constant, not a learned layer-scale: it moves into the unit
as ``branch_scale`` (RePa folds it into fc2), and the block's ``ls2`` becomes ``nn.Identity``.
"""
import difflib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn

from .recipe import recorded_surgery
from .residual_blocks import (ResidualFFNMetaFormerBlock, ResidualFFNMixerBlock, ResidualFFNSwinBlock,
                              ResidualFFNViTBlock)
from .slots import ResidualRecipe, find_slots, residual_recipe, supported_families
from .surgery import SWAPPED_ATTR, _mlp_dims, check_not_swapped, hidden_width

__all__ = ['swap_residual_ffn', 'register_residual_ffn', 'list_residual_ffns', 'RESIDUAL_FFN_REGISTRY',
           'ResidualFFNViTBlock', 'ResidualFFNSwinBlock', 'ResidualFFNMetaFormerBlock', 'ResidualFFNMixerBlock']


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
    if param.is_meta:  # built without storage (timm.create_model(..., device='meta')): there is no value to read,
        return 1.0  # and the unit's scale, of the same shape, has none either; the number only says "a scale"
    return float(param.detach().flatten()[0])


def _drop_rate(module: nn.Module) -> float:
    return float(getattr(module, 'drop_prob', 0.) or 0.)


def find_residual_slots(model: nn.Module) -> List[Tuple[str, nn.Module, ResidualRecipe]]:
    """``(qualified name, block, recipe)`` for every block of ``model`` that declares a residual recipe."""
    slots = []
    for slot in find_slots(model, 'residual_ffn'):
        block = slot.parent
        slots.append((slot.qualname.rpartition('.')[0], block, residual_recipe(type(block))))
    return slots


@recorded_surgery(candidates=lambda model: [slot[0] for slot in find_residual_slots(model)])
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
                         f'blocks: {", ".join(supported_families("residual_ffn"))}')
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
