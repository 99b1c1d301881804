"""The slot protocol: how a backbone tells the surgery where its swappable modules are.

A *slot* is an attribute of a module that the surgery may replace: ``(parent, attr, qualname, layout)``,
``getattr(parent, attr)`` being the module that is there now. Each backbone class declares its slots once,
per swap kind, with :func:`register_slots`; the surgery (``surgery.py``, ``residual_surgery.py``, the value
attention and gating swaps) asks :func:`find_slots` and imports no backbone.

| kind               | declared as                              | looked up by                  | swapped by           |
| ------------------ | ---------------------------------------- | ----------------------------- | -------------------- |
| ``'ffn'``          | ``finder(model) -> [Slot]``, each with   | the model's class, or its     | swap_ffn             |
|                    | the layout the new FFN sees              | nearest registered base class |                      |
| ``'attention'``    | ``finder(model) -> [Slot]``, one a block | as ``'ffn'``                  | swap_value_attention |
| ``'gating'``       | as attention; layout = the token grid    | as ``'ffn'``                  | swap_gating_unit     |
| ``'residual_ffn'`` | a :class:`ResidualRecipe`, block class   | every submodule's exact class | swap_residual_ffn    |

(A residual recipe matches the exact class: a subclass may wire its forward differently.)

The layout (:class:`~vitblocks.layers.TokenLayout`) says what the new module sees: tokens ``(B, P + H*W, C)``
with P prefix tokens (``TokenLayout(grid, P)``), channels-first maps (``TokenLayout(None, 0, True)``) or
channels-last maps that carry their grid (``TokenLayout(None, 0, False)``). Where tokens lose the grid, the
finder also keeps the grid current: :func:`tracked_layout` attaches one layout to the module whose forward
reveals the grid (a patch embedding, a block, a downsampling) with a hook that updates it every forward.

Where the declarations live: the timm families in ``models/timm_slots.py``, each in-house backbone in its own
file under ``models/backbones/``. Adding a backbone is its file plus one ``register_slots`` call.
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from ..layers import TokenLayout

__all__ = ['Slot', 'ResidualRecipe', 'SlotSpec', 'SLOT_KINDS', 'register_slots', 'find_slots', 'slot_spec',
           'residual_recipe', 'supported_families', 'stage_block_slots', 'tracked_layout', 'tracing_symbolically',
           'TOKENS', 'CHANNELS_FIRST', 'CHANNELS_LAST']

SLOT_KINDS = ('ffn', 'attention', 'gating', 'residual_ffn')
MODEL_KINDS = ('ffn', 'attention', 'gating')  # declared per model class; 'residual_ffn' per block class

# the layouts a slot's module can see (``stage_block_slots(layout=...)``)
TOKENS, CHANNELS_FIRST, CHANNELS_LAST = 'tokens', 'channels_first', 'channels_last'


class Slot(NamedTuple):
    """A replaceable module: ``getattr(parent, attr)``, named ``qualname`` in the model."""
    parent: nn.Module
    attr: str
    qualname: str
    layout: Optional[TokenLayout] = None  # what the module sees; None where the swap needs none


@dataclass(frozen=True)
class ResidualRecipe:
    """How ``swap_residual_ffn`` rewires a block class: its FFN half ``x + drop_path(ls(unit(norm(x))))`` becomes
    ``x = unit(x)``; the named modules move into the unit and the block keeps ``nn.Identity`` in their place."""
    rewired: type  # the block subclass whose forward calls the unit as the whole FFN half (models/residual_blocks.py)
    unit: str  # attribute holding the FFN
    norm: str  # pre-FFN norm, replaced by the unit's own
    drop_path: str
    layer_scale: Optional[str] = None
    res_scale: Optional[str] = None
    drop_path_shared: bool = False  # Mixer: one DropPath serves both halves
    constant_scale: Optional[str] = None  # a fixed branch scale (LV-ViT ls2), passed as branch_scale=


Finder = Callable[[nn.Module], List[Slot]]


@dataclass(frozen=True)
class SlotSpec:
    """What one class declares: a finder per model-level kind, a recipe where it is a residual block."""
    ffn: Optional[Finder] = None
    attention: Optional[Finder] = None
    gating: Optional[Finder] = None
    residual_ffn: Optional[ResidualRecipe] = None


_SPECS: Dict[type, SlotSpec] = {}


def register_slots(cls: type, *, ffn: Optional[Finder] = None, attention: Optional[Finder] = None,
                   gating: Optional[Finder] = None, residual_ffn: Optional[ResidualRecipe] = None) -> type:
    """Declare the slots of ``cls`` (a model class for ``ffn`` / ``attention`` / ``gating``, a block class for
    ``residual_ffn``); a later call for the same class adds kinds, and declaring a kind twice is an error."""
    given = dict(ffn=ffn, attention=attention, gating=gating, residual_ffn=residual_ffn)
    old = _SPECS.get(cls, SlotSpec())
    for kind, value in given.items():
        if value is not None and getattr(old, kind) is not None:
            raise ValueError(f'{cls.__name__} already declares its {kind!r} slots')
    _SPECS[cls] = SlotSpec(**{k: given[k] if given[k] is not None else getattr(old, k) for k in given})
    return cls


def slot_spec(cls: type, kind: str) -> Optional[Finder]:
    """The ``kind`` finder of ``cls`` or its nearest registered base class (None if there is none)."""
    for base in cls.__mro__:
        finder = getattr(_SPECS.get(base), kind, None) if base in _SPECS else None
        if finder is not None:
            return finder
    return None


def residual_recipe(cls: type) -> Optional[ResidualRecipe]:
    """The residual recipe of exactly ``cls`` (not of a base: a subclass may wire its forward differently)."""
    spec = _SPECS.get(cls)
    return spec.residual_ffn if spec is not None else None


def supported_families(kind: str) -> Tuple[str, ...]:
    """Names of the classes that declare ``kind`` slots, in registration order."""
    _check_kind(kind)
    return tuple(cls.__name__ for cls, spec in _SPECS.items() if getattr(spec, kind) is not None)


def _check_kind(kind: str) -> None:
    if kind not in SLOT_KINDS:
        raise ValueError(f'unknown slot kind {kind!r}; kinds: {", ".join(SLOT_KINDS)}')


def _join(prefix: str, name: str) -> str:
    return f'{prefix}.{name}' if prefix else name


def find_slots(model: nn.Module, kind: str) -> List[Slot]:
    """The ``kind`` slots of ``model`` in model order (empty if its class declares none).

    ``'residual_ffn'``: one slot per block whose exact class has a recipe (``parent`` the block, ``attr``
    the recipe's unit); a block already rewired by ``swap_residual_ffn`` is an error."""
    _check_kind(kind)
    if kind != 'residual_ffn':
        finder = slot_spec(type(model), kind)
        return finder(model) if finder is not None else []
    rewired = {spec.residual_ffn.rewired for spec in _SPECS.values() if spec.residual_ffn is not None}
    slots = []
    for qualname, module in model.named_modules():
        recipe = residual_recipe(type(module))
        if recipe is not None:
            slots.append(Slot(module, recipe.unit, _join(qualname, recipe.unit)))
        elif type(module) in rewired:
            unit = type(getattr(module, 'mlp', getattr(module, 'mlp_channels', None))).__name__
            raise ValueError(f'{qualname or type(model).__name__} already holds a residual FFN ({unit}); '
                             'swap into a freshly built timm model')
    return slots


# --- helpers for declarations -------------------------------------------------------------------

def _layout(kind: str) -> TokenLayout:
    if kind == TOKENS:
        return TokenLayout(None, 0)
    if kind in (CHANNELS_FIRST, CHANNELS_LAST):
        return TokenLayout(None, 0, kind == CHANNELS_FIRST)
    raise ValueError(f'unknown layout {kind!r}; use {TOKENS!r}, {CHANNELS_FIRST!r} or {CHANNELS_LAST!r}')


def stage_block_slots(layout: str, attr: str = 'mlp') -> Finder:
    """A finder for ``stages[s].blocks[i].<attr>`` slots that all see ``layout`` (one layout per slot):
    the declaration of most staged backbones."""
    _layout(layout)  # a bad name fails at registration

    def find(model: nn.Module) -> List[Slot]:
        return [Slot(blk, attr, f'stages.{s}.blocks.{i}.{attr}', _layout(layout))
                for s, stage in enumerate(model.stages) for i, blk in enumerate(stage.blocks)]
    return find


def tracing_symbolically() -> bool:
    """torch.fx tracing: shapes are proxies, and a hook's update of the layout is not recorded in the
    graph. The hooks then leave the layout as the last eager forward (or the build) set it, so a traced
    model runs at that input size; the spatial layers are FX leaves (``vitblocks.layers``) whose
    ``check_grid`` names any mismatch."""
    return is_fx_symbolic_tracing()  # not is_fx_tracing(): that one logs a deprecation warning per process


def tracked_layout(module: nn.Module, make: Callable[[], TokenLayout], hook: Callable,
                   pre: bool = False) -> TokenLayout:
    """The layout kept on ``module`` (made and attached on first use, with ``hook`` registered as its forward
    hook, or pre-hook with ``pre``, to keep its grid current); the same one for every slot that asks again.

    The layout is a plain attribute ``_vitblocks_layout`` of the module it hooks, outside that module's tree
    (not a submodule): timm's module and its state dict stay as timm builds them, and the layout is listed
    once, under the FFNs that use it. Hooks return early when scripting (``torch.jit.is_scripting()``) or
    tracing (:func:`tracing_symbolically`)."""
    layout = getattr(module, '_vitblocks_layout', None)
    if layout is None:
        layout = make()
        object.__setattr__(module, '_vitblocks_layout', layout)
        (module.register_forward_pre_hook if pre else module.register_forward_hook)(hook)
    return layout

