"""How a model was built, kept on the model so that a saved file can rebuild it by itself.

A model built by a registered vitblocks name records the block config and the timm kwargs it was built
with (``model.vitblocks_recipe['build']``); a surgery call a user makes on a model (``swap_ffn``,
``swap_residual_ffn``, ``swap_value_attention``, ``swap_gating_unit``, ``make_parallel``,
``add_pre_logits``) appends itself, with its arguments, to ``model.vitblocks_recipe['surgery']``.
A predicate ``include=`` is recorded as the slots it selected. Surgery inside a registered build is
part of the name and is not recorded. ``vitblocks.deploy.io.save_deployed`` writes the recipe into the
file and ``load_deployed`` replays it.

An argument that is not JSON (a class, a function) cannot be written to a file: the recipe then says
why (``unrecordable``) and loading by the file alone is refused with that reason, never guessed.
"""
import functools
import inspect
import json
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Dict, List, Optional

from torch import nn

__all__ = ['RECIPE_ATTR', 'recorded_surgery', 'registered_build', 'record_build', 'recipe_of', 'replay_surgery',
           'json_ready']

RECIPE_ATTR = 'vitblocks_recipe'
_DEPTH: ContextVar[int] = ContextVar('vitblocks_surgery_depth', default=0)  # > 0 inside a build or a surgery
_SURGERY: Dict[str, Callable] = {}  # name -> the undecorated function, for replay


def json_ready(value: Any) -> bool:
    """Whether ``value`` can be written as JSON (names, numbers, lists, dicts; tuples read back as lists)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def recipe_of(model: nn.Module) -> Dict[str, Any]:
    """The model's recipe (``{}`` when it records none: a plain timm model, or one built before recipes)."""
    return getattr(model, RECIPE_ATTR, None) or {}


def _recipe(model: nn.Module) -> Dict[str, Any]:
    recipe = model.__dict__.get(RECIPE_ATTR)
    if recipe is None:
        recipe = {}
        model.__dict__[RECIPE_ATTR] = recipe  # a plain attribute: not in the state dict, kept by deepcopy
    return recipe


@contextmanager
def registered_build():
    """Surgery inside this block is part of a registered model's build, not recorded."""
    token = _DEPTH.set(_DEPTH.get() + 1)
    try:
        yield
    finally:
        _DEPTH.reset(token)


def record_build(model: nn.Module, name: str, block_cfg: Optional[Dict[str, Any]], kwargs: Dict[str, Any]) -> None:
    """Record that ``model`` is the registered ``name`` built with ``block_cfg`` and timm ``kwargs``."""
    build = {'name': name, 'block_cfg': dict(block_cfg or {}), 'kwargs': dict(kwargs)}
    bad = sorted(k for k, v in {**build['block_cfg'], **build['kwargs']}.items() if not json_ready(v))
    recipe = _recipe(model)
    recipe['build'] = build
    if bad:
        recipe.setdefault('unrecordable', []).append(
            f'{name} was built with {", ".join(bad)} given as Python objects, not names or numbers')


def recorded_surgery(candidates: Optional[Callable[[nn.Module], List[Any]]] = None):
    """Decorator of a surgery function ``fn(model, ...)``: a call made outside any build appends
    ``{'surgery': fn.__name__, 'kwargs': {...}}`` to the model's recipe. ``candidates(model)``: what the
    function's ``include=`` predicate is asked about (slot names or block indices), so a predicate is
    recorded as the list of candidates it selected."""
    def decorate(fn):
        _SURGERY[fn.__name__] = fn
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(model, *args, **kwargs):
            outermost = _DEPTH.get() == 0
            bound = sig.bind(model, *args, **kwargs)
            arguments = dict(list(bound.arguments.items())[1:])  # without the model
            extra = arguments.pop(next((p.name for p in sig.parameters.values()
                                        if p.kind is p.VAR_KEYWORD), ''), {})
            arguments.update(extra)
            include = arguments.get('include')
            if outermost and callable(include) and candidates is not None:
                arguments['include'] = [c for c in candidates(model) if include(c)]
            token = _DEPTH.set(_DEPTH.get() + 1)
            try:
                out = fn(model, *args, **kwargs)
            finally:
                _DEPTH.reset(token)
            if outermost:
                target = out if isinstance(out, nn.Module) else model  # add_pre_logits returns the model
                _record_surgery(target, fn.__name__, arguments)
            return out
        return wrapper
    return decorate


def _record_surgery(model: nn.Module, name: str, arguments: Dict[str, Any]) -> None:
    recipe = _recipe(model)
    bad = sorted(k for k, v in arguments.items() if not json_ready(v))
    if bad:
        recipe.setdefault('unrecordable', []).append(
            f'{name} was called with {", ".join(f"{k}={arguments[k]!r}" for k in bad)} (not a name or a number)')
        return
    recipe.setdefault('surgery', []).append({'surgery': name, 'kwargs': json.loads(json.dumps(arguments))})


def replay_surgery(model: nn.Module, steps: List[Dict[str, Any]]) -> nn.Module:
    """Apply recorded surgery ``steps`` to a freshly built model, recording them again; returns the model."""
    for step in steps:
        name = step.get('surgery')
        if name not in _SURGERY:
            raise ValueError(f'unknown recorded surgery {name!r} (known: {", ".join(sorted(_SURGERY))})')
        kwargs = dict(step.get('kwargs') or {})
        if isinstance(kwargs.get('include'), list):
            chosen = kwargs['include']
            kwargs['include'] = lambda c, chosen=chosen: c in chosen
        with registered_build():  # recorded once below, as it was recorded the first time
            out = _SURGERY[name](model, **kwargs)
        model = out if isinstance(out, nn.Module) else model
        _record_surgery(model, name, dict(step.get('kwargs') or {}))
    return model
