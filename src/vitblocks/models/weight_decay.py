"""Weight-decay exclusions that timm's optimizer factory sees.

timm's ``create_optimizer_v2(model, ...)`` keeps 1-D tensors, names ending in ``.bias`` and the names
``model.no_weight_decay()`` returns out of weight decay; it asks the model only, never its submodules.
A block swapped into a timm backbone can name its own exclusions in a ``no_weight_decay()`` (IFFN's
stacked AGeLU shifts ``gamma, theta``, shape ``(2, C)``, which the authors kept as ``.bias`` tensors).
:func:`expose_no_weight_decay` makes the model answer with them too, so training with timm's
``train.py`` or ``create_optimizer_v2`` groups the parameters as vitblocks' own trainer does.
"""
import functools
from typing import Set

from torch import nn

__all__ = ['expose_no_weight_decay', 'no_weight_decay_names']


def _own_names(model: nn.Module) -> Set[str]:
    """What the model's class says (position embeddings, class tokens), ignoring an exposed list."""
    method = getattr(type(model), 'no_weight_decay', None)
    return set(method(model)) if callable(method) else set()


def _submodule_names(model: nn.Module) -> Set[str]:
    """Full parameter names that submodules keep out of weight decay (``path.name``)."""
    names: Set[str] = set()
    for path, module in model.named_modules():
        if path and hasattr(module, 'no_weight_decay'):
            names |= {f'{path}.{name}' for name in module.no_weight_decay()}
    return names


def no_weight_decay_names(model: nn.Module) -> Set[str]:
    """Parameter names kept out of weight decay: the model's ``no_weight_decay()`` plus what any
    submodule names in its own ``no_weight_decay()``, prefixed with the submodule's path."""
    names = set(model.no_weight_decay()) if hasattr(model, 'no_weight_decay') else set()
    return names | _submodule_names(model)


def expose_no_weight_decay(model: nn.Module) -> nn.Module:
    """Give ``model`` (in place) a ``no_weight_decay()`` that also returns its submodules' exclusions.

    Nothing changes when no submodule names any. The names are fixed when this is called (call it again
    after another swap). The answer is a ``functools.partial`` instance attribute, not a bound method:
    deepcopy, pickling, ``torch.export`` and ``torch.jit.script`` (which skips it as an attribute it
    cannot type) all keep working, and state dicts are unchanged.
    """
    extra = _submodule_names(model)
    if extra:
        model.no_weight_decay = functools.partial(set, frozenset(_own_names(model) | extra))
    return model
