"""Arbitrary nonlinear functions (IFFN paper, Eq. 3-4) and the one activation registry of vitblocks.

Every layer that takes an activation by name (IFFN, AFBO, the counterpart FFNs, timm's ``Mlp``
baseline, RePa) resolves it here, so all accept the same names:

| name                   | module          | where the papers use it                                |
| ---------------------- | --------------- | ------------------------------------------------------ |
| ``gelu``               | ``nn.GELU``     | ViT/DeiT FFN; IFFN's AGeLU base (Eq. 4); AFBO Table 6  |
| ``silu`` (``swish``)   | ``nn.SiLU``     | AFBO's default sigma (Table 6); IFFN Table 3 (Swish)   |
| ``relu``               | ``nn.ReLU``     | AFBO Table 6; IFFN Fig. 2                              |
| ``softplus``           | ``nn.Softplus`` | IFFN Table 3                                           |
| ``elu``                | ``nn.ELU``      | IFFN Table 3                                           |
| ``sigmoid``            | ``nn.Sigmoid``  | GLU's gate (AFBO Table 1)                              |
| ``hardswish`` (``hard_swish``) | ``nn.Hardswish`` | LocalViT                                      |
| ``relu6``              | ``nn.ReLU6``    |                                                        |
| ``gelu_tanh``          | timm ``GELUTanh`` | GPT-1/2's FFN (tanh approximation; ``vitblocks.hf``)  |

A timm-style class is accepted wherever a name is (``act_layer=nn.SiLU``, or timm's own ``GELU``,
``Swish``, ``Sigmoid``, ``HardSwish``); any other class is an error naming the supported ones.
timm's ``get_act_layer`` maps names to its own classes (a timm ``GELU`` is not ``nn.GELU``), knows
no 'softplus', and has no in-place functional forms, which the inference paths of IFFN and AFBO
need; hence this small table.
"""
from functools import partial
from typing import Callable, NamedTuple, Optional, Type, Union

import torch
import torch.nn.functional as F
from timm.layers import activations as timm_act
from torch import nn

__all__ = ['ArbitraryActivation', 'AGeLU', 'ConcatArbitraryActivations', 'ActivationSpec', 'ACTIVATIONS',
           'ACTIVATION_ALIASES', 'activation_name', 'create_act', 'act_fn', 'act_fn_', 'get_base_activation',
           'BASE_ACTIVATIONS']


class ActivationSpec(NamedTuple):
    module: Type[nn.Module]  # timm-style act_layer class
    fn: Callable[[torch.Tensor], torch.Tensor]  # functional form
    fn_: Optional[Callable[[torch.Tensor], torch.Tensor]]  # in-place form (None: torch has no in-place kernel)


ACTIVATIONS: dict[str, ActivationSpec] = {
    'gelu': ActivationSpec(nn.GELU, F.gelu, torch.ops.aten.gelu_),
    'silu': ActivationSpec(nn.SiLU, F.silu, partial(F.silu, inplace=True)),
    'relu': ActivationSpec(nn.ReLU, F.relu, torch.relu_),
    'softplus': ActivationSpec(nn.Softplus, F.softplus, None),
    'elu': ActivationSpec(nn.ELU, F.elu, partial(F.elu, inplace=True)),
    'sigmoid': ActivationSpec(nn.Sigmoid, torch.sigmoid, torch.sigmoid_),
    'hardswish': ActivationSpec(nn.Hardswish, F.hardswish, partial(F.hardswish, inplace=True)),
    'relu6': ActivationSpec(nn.ReLU6, F.relu6, partial(F.relu6, inplace=True)),
    'gelu_tanh': ActivationSpec(timm_act.GELUTanh, partial(F.gelu, approximate='tanh'), None),
}
ACTIVATION_ALIASES = {'swish': 'silu', 'hard_swish': 'hardswish'}
# timm's own classes for the same functions (GC ViT's MLP uses timm's GELU, for instance)
_TIMM_CLASSES = {timm_act.GELU: 'gelu', timm_act.Swish: 'silu', timm_act.Sigmoid: 'sigmoid',
                 timm_act.HardSwish: 'hardswish'}


def activation_name(act: Union[str, Type[nn.Module], None], default: str = 'gelu') -> str:
    """The registry name of an activation given as a name, an alias or an ``nn.Module`` class."""
    if act is None:
        return default
    if isinstance(act, type):
        for key, spec in ACTIVATIONS.items():  # the exact class first, then subclasses
            if act is spec.module:
                return key
        if act in _TIMM_CLASSES:
            return _TIMM_CLASSES[act]
        for key, spec in ACTIVATIONS.items():
            if issubclass(act, spec.module):
                return key
        raise ValueError(f'unsupported activation class {act.__name__}; use one of {", ".join(ACTIVATIONS)} '
                         f'(or the matching torch.nn class)')
    key = str(act).lower()
    key = ACTIVATION_ALIASES.get(key, key)
    if key not in ACTIVATIONS:
        aliases = ', '.join(f'{a} = {k}' for a, k in ACTIVATION_ALIASES.items())
        raise ValueError(f'unknown activation {act!r}; use one of {", ".join(ACTIVATIONS)} ({aliases})')
    return key


def create_act(act: Union[str, Type[nn.Module], None], default: str = 'gelu') -> nn.Module:
    """An activation module from a name or class."""
    return ACTIVATIONS[activation_name(act, default)].module()


def act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The functional form of a registry name (see :func:`activation_name`)."""
    return ACTIVATIONS[activation_name(name)].fn


def act_fn_(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """An in-place form where torch has one, else the functional form (the result must be used)."""
    spec = ACTIVATIONS[activation_name(name)]
    return spec.fn_ or spec.fn


# Kept for the modules that import them (RePa): the functional and module tables by name.
get_base_activation = activation_name
BASE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {k: v.fn for k, v in ACTIVATIONS.items()}
_MODULE_ACTIVATIONS = {k: v.module for k, v in ACTIVATIONS.items()}


class ArbitraryActivation(nn.Module):
    """``beta * phi(alpha * x + gamma) + theta`` with per-channel learnable coefficients (Eq. 3).

    With ``phi = GELU`` this is AGeLU (Eq. 4). Initialized to ``alpha = beta = 1`` and
    ``gamma = theta = 0``, so at initialization it equals ``phi``.

    Args:
        num_channels: number of channels C; coefficients have shape ``(C,)``.
        base: basic nonlinear function phi, any name of :data:`ACTIVATIONS` (Table 3: 'gelu',
            'softplus', 'elu', 'silu'/'swish').
        channels_first: input is ``(B, C, H, W)`` (coefficients broadcast over H, W) instead of
            channels-last ``(..., C)``.
    """

    def __init__(self, num_channels: int, base: str = 'gelu', channels_first: bool = False,
                 device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.base = get_base_activation(base)
        self._phi = act_fn(self.base)
        self.channels_first = channels_first
        self.alpha = nn.Parameter(torch.empty(num_channels, **dd))  # scale before phi
        self.gamma = nn.Parameter(torch.empty(num_channels, **dd))  # shift before phi
        self.beta = nn.Parameter(torch.empty(num_channels, **dd))   # scale after phi
        self.theta = nn.Parameter(torch.empty(num_channels, **dd))  # shift after phi
        self.init_weights()

    def init_weights(self):
        nn.init.ones_(self.alpha)
        nn.init.zeros_(self.gamma)
        nn.init.ones_(self.beta)
        nn.init.zeros_(self.theta)

    def no_weight_decay(self) -> set:
        """The shifts ``gamma, theta`` stay out of weight decay, as in the IFFN authors' training: their
        coefficients are ``scale``/``bias`` tensors of shape ``(1, 1, C)``, and timm's optimizer factory
        decays the scales but not names ending in ``.bias``. (timm leaves all 1-D tensors undecayed, so
        here only the stacked ``(N, C)`` ones of :class:`ConcatArbitraryActivations` differ.) ``swap_ffn``
        puts these per-module names into the model's ``no_weight_decay()`` (``models.weight_decay``)."""
        return {'gamma', 'theta'}

    def _shaped(self, p: torch.Tensor) -> torch.Tensor:
        return p.view(-1, 1, 1) if self.channels_first else p  # (C,) -> (C, 1, 1) for (B, C, H, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, g, b, t = (self._shaped(p) for p in (self.alpha, self.gamma, self.beta, self.theta))
        return torch.addcmul(t, b, self._phi(torch.addcmul(g, a, x)))  # Eq. 3

    def extra_repr(self) -> str:
        return f'{self.alpha.numel()}, base={self.base!r}, channels_first={self.channels_first}'


class AGeLU(ArbitraryActivation):
    """Arbitrary GeLU (IFFN paper, Eq. 4): ``beta * GELU(alpha * x + gamma) + theta``."""

    def __init__(self, num_channels: int, channels_first: bool = False, device=None, dtype=None):
        super().__init__(num_channels, 'gelu', channels_first, device=device, dtype=dtype)


class ConcatArbitraryActivations(nn.Module):
    """N arbitrary activations of the same input, concatenated on channels (IFFN Eq. 5).

    ``concat(A_1(x), ..., A_N(x))`` where each ``A_i`` is an :class:`ArbitraryActivation` with its
    own per-channel ``alpha, gamma, beta, theta`` (stored stacked, shape ``(N, C)``). Computed
    by broadcasting, so the N copies of ``x`` are never materialized; the output has ``N * C``
    channels in concatenation order (all channels of ``A_1`` first).
    """

    def __init__(self, num_channels: int, num_functions: int = 2, base: str = 'gelu',
                 channels_first: bool = False, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if num_functions < 1:
            raise ValueError(f'num_functions must be >= 1, got {num_functions}')
        self.base = get_base_activation(base)
        self._phi = act_fn(self.base)
        self.num_functions = num_functions
        self.channels_first = channels_first
        shape = (num_functions, num_channels)
        self.alpha = nn.Parameter(torch.empty(shape, **dd))
        self.gamma = nn.Parameter(torch.empty(shape, **dd))
        self.beta = nn.Parameter(torch.empty(shape, **dd))
        self.theta = nn.Parameter(torch.empty(shape, **dd))
        self.init_weights()

    init_weights = ArbitraryActivation.init_weights
    no_weight_decay = ArbitraryActivation.no_weight_decay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_first:
            B, C, H, W = x.shape
            params = [p.view(1, self.num_functions, C, 1, 1) for p in (self.alpha, self.gamma, self.beta, self.theta)]
            x = x.unsqueeze(1)  # (B, C, H, W) -> (B, 1, C, H, W)
        else:
            params = [p for p in (self.alpha, self.gamma, self.beta, self.theta)]
            x = x.unsqueeze(-2)  # (..., C) -> (..., 1, C)
        a, g, b, t = params
        y = torch.addcmul(t, b, self._phi(torch.addcmul(g, a, x)))  # Eq. 3 on each copy
        if self.channels_first:
            return y.flatten(1, 2)  # (B, N, C, H, W) -> (B, N*C, H, W)
        return y.flatten(-2)  # (..., N, C) -> (..., N*C)

    def extra_repr(self) -> str:
        return f'{self.alpha.shape[1]}, num_functions={self.num_functions}, base={self.base!r}'
