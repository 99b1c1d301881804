"""``vitblocks.hf.swap_value_attention``: MABViT's activation on the value tensor inside HF attention layers.

MABViT changes only the values: ``V = gate(X W_1) * (X W_2)`` (GLU family: 'swiglu', 'geglu', 'glu'; the value
projection widened to two halves) or ``V = GELU(X W_V)`` ('gelu'); ``'identity'`` is standard attention. In an HF
layer that means replacing the value projection:

| family | value projection | how |
| --- | --- | --- |
| BERT, RoBERTa | ``attention.self.value`` | replaced |
| LLaMA, Qwen2, Mistral | ``self_attn.v_proj`` (grouped: ``kv_heads * head_dim`` wide) | replaced |
| ViT, DeiT | ``attention.v_proj`` (``attention.attention.value`` before 5.24) | replaced |
| GPT-2, OpenAI GPT | the last third of the fused ``attn.c_attn`` (Conv1D) | split: Q, K stay one projection |

The replaced projection's weights are kept where they fit: 'identity' and 'gelu' take W_V as it is, the GLU
family takes W_V as its linear half W_2 (the gate W_1 is new). The generation cache stores V after the
activation, so cached generation needs nothing more.
"""
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn.init import trunc_normal_

from ..layers.value_attention import GATED_VALUE_ACTIVATIONS, VALUE_ACTIVATIONS
from .families import find_layers
from .swap import CONFIG_KEY

__all__ = ['swap_value_attention', 'ActivatedValue', 'SplitQKV']


class ActivatedValue(nn.Module):
    """``V = act(x)`` of a value projection: gated ``gate(x W_1) * (x W_2)`` or element-wise ``act(x W)``."""

    def __init__(self, in_features: int, out_features: int, value_act: str, bias: bool, device=None, dtype=None):
        super().__init__()
        if value_act not in VALUE_ACTIVATIONS:
            raise ValueError(f'unknown value activation {value_act!r}; use one of {", ".join(VALUE_ACTIVATIONS)}')
        self.value_act = value_act
        self.gated = value_act in GATED_VALUE_ACTIVATIONS
        width = 2 * out_features if self.gated else out_features  # [gate | linear] halves for the GLU family
        self.proj = nn.Linear(in_features, width, bias=bias, device=device, dtype=dtype)
        self.act = GATED_VALUE_ACTIVATIONS[value_act]() if self.gated else \
            (nn.GELU() if value_act == 'gelu' else nn.Identity())

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        """Take the replaced projection's (out, in) weight as W (or as the GLU's linear half W_2)."""
        out = weight.shape[0]
        dest = self.proj.weight[out:] if self.gated else self.proj.weight
        dest.copy_(weight)
        if self.gated:
            trunc_normal_(self.proj.weight[:out], std=.02)
        if self.proj.bias is not None:
            self.proj.bias.zero_()
            if bias is not None:
                (self.proj.bias[out:] if self.gated else self.proj.bias).copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.proj(x)
        if self.gated:
            gate, linear = v.chunk(2, dim=-1)  # (..., 2A) -> 2 x (..., A)
            return self.act(gate) * linear
        return self.act(v)


class SplitQKV(nn.Module):
    """A fused Conv1D ``c_attn`` (GPT-1/2: ``x @ W + b`` with W (in, 3D)) split into one Q/K projection and an
    :class:`ActivatedValue`; returns ``[Q | K | V]`` as the attention expects."""

    def __init__(self, c_attn: nn.Module, value_act: str):
        super().__init__()
        w, b = c_attn.weight.t(), c_attn.bias  # (3D, in)
        d = w.shape[0] // 3
        self.qk = nn.Linear(w.shape[1], 2 * d, device=w.device, dtype=w.dtype)
        self.value = ActivatedValue(w.shape[1], d, value_act, bias=True, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            self.qk.weight.copy_(w[:2 * d])
            self.qk.bias.copy_(b[:2 * d])
            self.value.load_dense(w[2 * d:], b[2 * d:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.qk(x), self.value(x)], dim=-1)  # (..., 2D) + (..., D) -> (..., 3D)


def _resolve(layer: nn.Module, paths, qualname: str):
    """(parent, attribute) of the first candidate path present in the layer (transformers moves these)."""
    for path in paths:
        parent = layer
        try:
            for attr in path[:-1]:
                parent = getattr(parent, attr)
        except AttributeError:
            continue
        if hasattr(parent, path[-1]):
            return parent, path[-1]
    raise ValueError(f'{qualname}: found no value projection at {", ".join(".".join(p) for p in paths)}')


def swap_value_attention(model: nn.Module, value_act: str = 'swiglu', *,
                         include: Optional[Callable[[str], bool]] = None) -> int:
    """Put MABViT's value activation into the attention of every supported layer (``include``: a predicate on the
    layer's qualified name); returns how many layers changed. Recorded in ``config.vitblocks``."""
    if value_act not in VALUE_ACTIVATIONS:
        raise ValueError(f'unknown value activation {value_act!r}; use one of {", ".join(VALUE_ACTIVATIONS)}')
    layers = [(q, layer, fam) for q, layer, fam in find_layers(model) if include is None or include(q)]
    if not layers:
        raise ValueError(f'include= selected no layer of {type(model).__name__}')
    for qualname, layer, family in layers:
        parent, attr = _resolve(layer, family.value, qualname)
        old = getattr(parent, attr)
        if isinstance(old, (ActivatedValue, SplitQKV)):
            raise ValueError(f'{qualname} already has a vitblocks value activation')
        if family.fused_qkv:
            if old.weight.shape[1] != 3 * old.weight.shape[0]:
                raise ValueError(f'{qualname}.{attr} is not a fused [Q | K | V] projection (cross-attention?)')
            new = SplitQKV(old, value_act)
        else:
            new = ActivatedValue(old.in_features, old.out_features, value_act, old.bias is not None,
                                 device=old.weight.device, dtype=old.weight.dtype)
            new.load_dense(old.weight, old.bias)
        setattr(parent, attr, new.train(old.training))
    spec = dict(getattr(model.config, CONFIG_KEY, None) or {})
    spec['value_attention'] = {'value_act': value_act, 'layers': [q for q, _, _ in layers]}
    from .. import __version__
    spec['version'] = __version__
    setattr(model.config, CONFIG_KEY, spec)
    return len(layers)
