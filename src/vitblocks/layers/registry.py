"""Registry of FFN (channel-mixer) layers that ``vitblocks.swap_ffn`` can put into backbones.

Every registered class follows timm's ``Mlp`` constructor vocabulary
(``in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop``) and
accepts ``layout=TokenLayout(...)``, which tells it the token layout of its backbone.
Adding a block: write the layer, decorate it with ``@register_ffn('name')``; surgery,
registry tests and profiling then pick it up.

A block with a separate inference form (``fuse()`` returns it) registers that class with
:func:`register_deployed_form`; ``create_ffn(name, ..., deploy=True)`` (and so a registered model's
``block_cfg={'deploy': True}``) then builds the inference form directly, so fused checkpoints load. The
training form's ``fuse()`` finds its inference form here too (:func:`deployed_form`), so the training module
never imports the deployed one (which subclasses it): the deployed module registers itself, and
``vitblocks.layers`` imports every deployed module with the layers.

``inherits`` names the constructor knobs that mean the same thing in the block and in the MLP
it replaces, so that ``swap_ffn`` carries the replaced MLP's value over unless the caller sets
it: ``'drop'`` (the MLP's two dropout rates) and ``'act_layer'`` where the block's activation
*is* the backbone's (IFFN's base activation replaces the FFN's GeLU, Eq. 3-4), not where the
block has its own (AFBO's sigma is SiLU on any backbone, Table 6; GLU's gate is a sigmoid).
"""
import difflib
import inspect
from typing import Callable, Dict, Optional, Tuple

from torch import nn


__all__ = ['register_ffn', 'register_deployed_form', 'deployed_form', 'create_ffn', 'list_ffns', 'FFN_REGISTRY',
           'FFN_INHERITS', 'FFN_DEPLOYED']

FFN_REGISTRY: Dict[str, Callable[..., nn.Module]] = {}
FFN_INHERITS: Dict[str, Tuple[str, ...]] = {}  # name -> knobs swap_ffn carries over from the replaced MLP
FFN_DEPLOYED: Dict[str, Callable[..., nn.Module]] = {}  # name -> its inference form, built by deploy=True
_INHERITABLE = ('drop', 'act_layer')


def register_ffn(name: str, inherits: Tuple[str, ...] = ()):
    """Class/function decorator adding an FFN builder to :data:`FFN_REGISTRY` under ``name``;
    ``inherits``: which of ``'drop'``, ``'act_layer'`` it takes over from the MLP it replaces."""
    unknown = set(inherits) - set(_INHERITABLE)
    if unknown:
        raise ValueError(f'inherits= may name {", ".join(_INHERITABLE)}, got {sorted(unknown)}')

    def wrap(fn):
        if name in FFN_REGISTRY:
            raise ValueError(f'FFN {name!r} is already registered')
        FFN_REGISTRY[name] = fn
        FFN_INHERITS[name] = tuple(inherits)
        return fn
    return wrap


def register_deployed_form(name: str, cls: Callable[..., nn.Module]) -> None:
    """Record ``cls`` as the inference form of the registered FFN ``name`` (same constructor arguments)."""
    if name not in FFN_REGISTRY:
        raise ValueError(f'FFN {name!r} is not registered; register it before its deployed form')
    FFN_DEPLOYED[name] = cls


def deployed_form(name: str) -> Callable[..., nn.Module]:
    """The inference form registered for the FFN ``name`` (what its ``fuse()`` builds)."""
    if name not in FFN_DEPLOYED:
        known = ', '.join(sorted(FFN_DEPLOYED)) or 'none'
        raise LookupError(f'FFN {name!r} has no registered deployed form (registered: {known}); its deployed module '
                          f'registers it with register_deployed_form({name!r}, cls) when imported, and '
                          f'vitblocks.layers imports them all: import vitblocks.layers first')
    return FFN_DEPLOYED[name]


def list_ffns():
    """Names of the registered FFNs (``swap_ffn(model, name)`` / ``create_ffn(name, ...)``), sorted."""
    return sorted(FFN_REGISTRY)


def create_ffn(name: str, in_features: int, hidden_features: Optional[int] = None,
               out_features: Optional[int] = None, layout=None, **kwargs) -> nn.Module:
    """Build the FFN registered as ``name``."""
    if name not in FFN_REGISTRY:
        close = difflib.get_close_matches(name, FFN_REGISTRY, n=3)
        hint = f'; did you mean {", ".join(close)}?' if close else ''
        raise ValueError(f'unknown FFN {name!r}{hint} (available: {", ".join(list_ffns())})')
    builder = FFN_REGISTRY[name]
    if name in FFN_DEPLOYED and 'deploy' in kwargs:  # the builder itself has no deploy argument
        builder = FFN_DEPLOYED[name] if kwargs.pop('deploy') else builder
    _check_arguments(name, kwargs)
    return builder(in_features, hidden_features, out_features, layout=layout, **kwargs)


def _check_arguments(name: str, kwargs: Dict) -> None:
    """A misspelt knob (``kernel=5``) named with the ones the FFN has, before Python's bare TypeError."""
    params = inspect.signature(FFN_REGISTRY[name]).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return  # a wrapper passing its keywords on: the class it builds checks them
    known = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f'did you mean {", ".join(close)}? ' if close else ''
            if name in FFN_DEPLOYED:
                known.append('deploy')
            raise TypeError(f'FFN {name!r} has no argument {key!r}; {hint}(its arguments: {", ".join(known[3:])})')
