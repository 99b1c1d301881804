"""Module surgery: put a registered FFN into the channel-mixer slots of any backbone that declares them.

The surgery knows no backbone: every backbone declares its slots through the slot protocol
(``models/slots.py``: ``register_slots(model_class, ffn=finder, ...)``) and :func:`find_ffn_slots` asks
that one registry. Where the declarations are:

| backbone (model class)                       | declared in                   | ``'ffn'`` slots, layout          |
| -------------------------------------------- | ----------------------------- | -------------------------------- |
| timm VisionTransformer, SwinTransformer,     | ``models/timm_slots.py``      | ``blocks[i].mlp`` and the like;  |
| MetaFormer, MlpMixer, PVTv2, GlobalContextVit | (all timm families, one file) | the table in that file           |
| LVViT (LV-ViT, a timm VisionTransformer)     | inherits VisionTransformer's  | ``blocks[i].mlp``, tokens        |
| LVT                                          | ``backbones/lvt.py``          | ``stages[s].blocks[i].mlp``, NHWC |
| CycleMLPNet                                  | ``backbones/cyclemlp.py``     | ``stages[s].blocks[i].mlp``, NHWC |
| HireMLPNet                                   | ``backbones/hiremlp.py``      | ``stages[s].blocks[i].mlp``, NCHW |
| EdgeViT                                      | ``backbones/edgevit.py``      | ``...local_agg.mlp`` NCHW,        |
|                                              |                               | ``...global_attn.mlp`` NHWC       |
| PyramidVisionLLaMA                           | ``backbones/vision_llama.py`` | ``stages[s].blocks[i].mlp``, NHWC |

(NHWC: channels-last maps ``(B, H, W, C)`` that carry their grid; NCHW: channels-first ``(B, C, H, W)``.)
``SUPPORTED_FAMILIES`` lists the model classes that declare ``'ffn'`` slots (read from the registry).

The new FFN is called as the one it replaces: PVTv2 blocks call their MLP as ``mlp(x, feat_size)``. The
grid-aware FFNs (those with a ``TokenLayout``) take that argument as timm's ``MlpWithDepthwiseConv`` does
and set their layout from it on every call (eager, torch.fx and TorchScript alike, so a model traced before
its first forward has its grid); an FFN without a ``feat_size`` argument that replaces one with it gets a
forward pre-hook that drops it (eager only).
"""
import inspect
from typing import Callable, List, Optional, Tuple

from torch import nn

from ..layers import FFN_INHERITS, activation_name, create_ffn
from . import timm_slots  # noqa: F401  (declares the timm families' slots)
from .recipe import recorded_surgery
from .slots import Slot, find_slots, supported_families
from .weight_decay import expose_no_weight_decay

__all__ = ['swap_ffn', 'find_ffn_slots', 'SUPPORTED_FAMILIES']  # noqa: F822  (SUPPORTED_FAMILIES: __getattr__)


def __getattr__(name: str):
    """``SUPPORTED_FAMILIES``: the classes that declare ``'ffn'`` slots now (backbones register on import)."""
    if name == 'SUPPORTED_FAMILIES':
        return supported_families('ffn')
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def _drop_feat_size(mlp: nn.Module, args):
    """Forward pre-hook on an FFN without a ``feat_size`` argument in a block that passes one (PVTv2):
    call it with the tokens only."""
    return args[:1]


def _takes_feat_size(mlp: nn.Module) -> bool:
    return 'feat_size' in inspect.signature(mlp.forward).parameters


def find_ffn_slots(model: nn.Module) -> List[Slot]:
    """List the channel-MLP slots ``(parent, attr, qualname, layout)`` of a model whose class declares them
    (``models/slots.py``); an empty list if it declares none."""
    return find_slots(model, 'ffn')


def _mlp_dims(mlp: nn.Module) -> Tuple[int, int, int, bool]:
    """(in, hidden, out, bias) of a timm Mlp-like module (Linear or 1x1-conv fc1/fc2; timm's SwiGLU has
    the gate and value halves of fc1 as fc1_g, fc1_x)."""
    fc1, fc2 = mlp.fc1 if hasattr(mlp, 'fc1') else mlp.fc1_g, mlp.fc2

    def in_out(m):
        return (m.in_features, m.out_features) if isinstance(m, nn.Linear) else (m.in_channels, m.out_channels)

    (c_in, hidden), (_, c_out) = in_out(fc1), in_out(fc2)
    return c_in, hidden, c_out, fc1.bias is not None


SWAPPED_ATTR = '_vitblocks_ffn'  # set on every module swap_ffn / swap_residual_ffn puts into a model: its registry name


def check_not_swapped(old: nn.Module, qualname: str) -> None:
    """Refuse a slot that already holds a block vitblocks swapped in: its module no longer has the backbone
    MLP's widths (IFFN's fc1 is half the hidden width, GLU's double, AFBO has no fc1), and a residual unit
    owns the block's pre-norm and shortcut, so a second swap would build the wrong width, drop the residual
    or fail deep inside."""
    swapped = getattr(old, SWAPPED_ATTR, None)
    if swapped is None and type(old).__module__.startswith('vitblocks.layers'):  # e.g. a fused (deployed) unit
        swapped = type(old).__name__
    if swapped is not None:
        raise ValueError(f'{qualname} already holds {swapped!r}, swapped in by vitblocks: its widths are not the '
                         f"backbone MLP's; swap into a freshly built timm model (the timm base, not a vitblocks "
                         f'model)')


def hidden_width(c_in: int, mlp_ratio: Optional[float], default: int, qualname: str) -> int:
    """The hidden width for ``mlp_ratio`` (``default``, the replaced MLP's, when it is None). A ratio that gives
    no channel is an error: the FFNs read a hidden width of 0 as "not given" and fall back to their default."""
    if mlp_ratio is None:
        return default
    hidden = int(round(c_in * mlp_ratio)) if isinstance(mlp_ratio, (int, float)) and mlp_ratio > 0 else 0
    if hidden < 1:
        raise ValueError(f'mlp_ratio={mlp_ratio!r} gives {qualname} (width {c_in}) no hidden channel; '
                         f'give a ratio > 0 with width x ratio >= 0.5 (e.g. 4), or None to keep the MLP\'s width')
    return hidden


def _inherited(name: str, old: nn.Module, cfg: dict) -> dict:
    """The knobs the new FFN takes over from the MLP it replaces (``register_ffn(inherits=...)``),
    unless the caller set them: the two dropout rates, and the activation by its registry name."""
    knobs = {}
    wanted = [k for k in FFN_INHERITS.get(name, ()) if k not in cfg]
    if 'drop' in wanted and isinstance(getattr(old, 'drop1', None), nn.Dropout):
        drop2 = old.drop2.p if isinstance(getattr(old, 'drop2', None), nn.Dropout) else 0.
        knobs['drop'] = (old.drop1.p, drop2)
    if 'act_layer' in wanted and isinstance(getattr(old, 'act', None), nn.Module):
        try:
            knobs['act_layer'] = activation_name(type(old.act))
        except ValueError as e:
            raise ValueError(f'swap_ffn: {name!r} takes over the activation of the MLP it replaces, and {e}; '
                             f'pass act_layer= explicitly') from None
    return knobs


@recorded_surgery(candidates=lambda model: [slot[2] for slot in find_ffn_slots(model)])
def swap_ffn(model: nn.Module, name: str, *, mlp_ratio: Optional[float] = None,
             include: Optional[Callable[[str], bool]] = None, **cfg) -> int:
    """Replace the channel MLPs of a timm model with the FFN registered as ``name``.

    Args:
        model: a model whose class declares ``'ffn'`` slots (see ``SUPPORTED_FAMILIES``); changed in place.
        name: registered FFN name (``vitblocks.layers.list_ffns()``), e.g. 'iffn'.
        mlp_ratio: hidden width relative to the input width; default keeps the original width.
        include: optional predicate on the slot's qualified name (e.g. ``'blocks.3.mlp'``)
            selecting which slots to replace.
        **cfg: constructor arguments of the FFN (``kernel_size=5``, ``act_layer='silu'``, ...).
            Knobs the FFN shares with the replaced MLP (its ``register_ffn(inherits=...)``, listed in
            ``vitblocks.layers.FFN_INHERITS``: the dropout rates for every FFN but ``sum_nonlinear``, which
            has no dropout; the activation for IFFN, SCHEME and ``mlp``) default to the MLP's values.

    Returns:
        The number of modules replaced. New modules are freshly initialized, on the device and
        dtype of the module they replace, in the model's current train/eval mode. The model's
        ``no_weight_decay()`` then also names what the new modules keep out of weight decay
        (``models.weight_decay``), so timm's optimizer factory groups them as vitblocks' trainer does.

    Raises:
        ValueError: if the model has no supported slot (or ``include`` selected none), or a selected
            slot already holds a block vitblocks swapped in (build the timm base afresh instead).
    """
    slots = find_ffn_slots(model)
    if not slots:
        raise ValueError(f'swap_ffn found no channel MLP in {type(model).__name__}; supported timm families: '
                         f'{", ".join(supported_families("ffn"))}')
    selected = [slot for slot in slots if include is None or include(slot[2])]
    for parent, attr, qualname, _ in selected:  # all checked before any is replaced
        check_not_swapped(getattr(parent, attr), qualname)
        hidden_width(_mlp_dims(getattr(parent, attr))[0], mlp_ratio, 0, qualname)
    count = 0
    for parent, attr, qualname, layout in selected:
        old = getattr(parent, attr)
        c_in, hidden, c_out, bias = _mlp_dims(old)
        hidden = hidden_width(c_in, mlp_ratio, hidden, qualname)
        ref = old.fc2.weight
        kwargs = dict(bias=bias, **_inherited(name, old, cfg), **cfg)
        new = create_ffn(name, c_in, hidden, c_out, layout=layout, device=ref.device, dtype=ref.dtype, **kwargs)
        new.train(old.training)
        setattr(new, SWAPPED_ATTR, name)
        if _takes_feat_size(old) and not _takes_feat_size(new):
            new.register_forward_pre_hook(_drop_feat_size)  # the block calls mlp(x, feat_size) (PVTv2)
        setattr(parent, attr, new)
        count += 1
    if count == 0:
        raise ValueError(f'swap_ffn: include= selected none of the {len(slots)} slots of {type(model).__name__} '
                         f'(e.g. {slots[0][2]!r})')
    expose_no_weight_decay(model)  # timm's optimizer factory asks the model only
    return count
