"""Registry of FFN (channel-mixer) layers that ``vitblocks.swap_ffn`` can put into backbones.

Every registered class follows timm's ``Mlp`` constructor vocabulary
(``in_features, hidden_features, out_features, act_layer, norm_layer, bias, drop``) and
accepts ``layout=TokenLayout(...)``, which tells it the token layout of its backbone.
Adding a block: write the layer, decorate it with ``@register_ffn('name')``; surgery,
registry tests and profiling then pick it up.
"""
import difflib
from typing import Callable, Dict, Optional

from torch import nn


__all__ = ['register_ffn', 'create_ffn', 'list_ffns', 'FFN_REGISTRY']

FFN_REGISTRY: Dict[str, Callable[..., nn.Module]] = {}


def register_ffn(name: str):
    """Class/function decorator adding an FFN builder to :data:`FFN_REGISTRY` under ``name``."""
    def wrap(fn):
        if name in FFN_REGISTRY:
            raise ValueError(f'FFN {name!r} is already registered')
        FFN_REGISTRY[name] = fn
        return fn
    return wrap


def list_ffns():
    return sorted(FFN_REGISTRY)


def create_ffn(name: str, in_features: int, hidden_features: Optional[int] = None,
               out_features: Optional[int] = None, layout=None, **kwargs) -> nn.Module:
    """Build the FFN registered as ``name``."""
    if name not in FFN_REGISTRY:
        close = difflib.get_close_matches(name, FFN_REGISTRY, n=3)
        hint = f'; did you mean {", ".join(close)}?' if close else ''
        raise ValueError(f'unknown FFN {name!r}{hint} (available: {", ".join(list_ffns())})')
    return FFN_REGISTRY[name](in_features, hidden_features, out_features, layout=layout, **kwargs)
