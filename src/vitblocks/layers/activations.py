"""Arbitrary nonlinear functions (IFFN paper, Eq. 3-4) and activation lookup by name."""
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ['ArbitraryActivation', 'AGeLU', 'get_base_activation', 'BASE_ACTIVATIONS']

# Basic nonlinear functions phi of Eq. 3 (IFFN Table 3 ablates GeLU, Softplus, ELU, Swish).
BASE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    'gelu': F.gelu,
    'softplus': F.softplus,
    'elu': F.elu,
    'silu': F.silu,
    'swish': F.silu,
    'relu': F.relu,
}
_MODULE_ACTIVATIONS = {'gelu': nn.GELU, 'softplus': nn.Softplus, 'elu': nn.ELU, 'silu': nn.SiLU,
                       'swish': nn.SiLU, 'relu': nn.ReLU}


def get_base_activation(name: Union[str, type, None]) -> str:
    """Normalize an activation given as a name or timm-style ``nn.Module`` class to a name."""
    if name is None:
        return 'gelu'
    if isinstance(name, type):
        for key, cls in _MODULE_ACTIVATIONS.items():
            if issubclass(name, cls):
                return key
        raise ValueError(f'unsupported activation class {name.__name__}; use one of {sorted(BASE_ACTIVATIONS)}')
    key = str(name).lower()
    if key not in BASE_ACTIVATIONS:
        raise ValueError(f'unknown base activation {name!r}; use one of {sorted(BASE_ACTIVATIONS)}')
    return key


class ArbitraryActivation(nn.Module):
    """``beta * phi(alpha * x + gamma) + theta`` with per-channel learnable coefficients (Eq. 3).

    With ``phi = GELU`` this is AGeLU (Eq. 4). Initialized to ``alpha = beta = 1`` and
    ``gamma = theta = 0``, so at initialization it equals ``phi``.

    Args:
        num_channels: number of channels C; coefficients have shape ``(C,)``.
        base: basic nonlinear function phi: 'gelu', 'softplus', 'elu', 'silu'/'swish', 'relu'.
        channels_first: input is ``(B, C, H, W)`` (coefficients broadcast over H, W) instead of
            channels-last ``(..., C)``.
    """

    def __init__(self, num_channels: int, base: str = 'gelu', channels_first: bool = False,
                 device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.base = get_base_activation(base)
        self._phi = BASE_ACTIVATIONS[self.base]
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
        self._phi = BASE_ACTIVATIONS[self.base]
        self.num_functions = num_functions
        self.channels_first = channels_first
        shape = (num_functions, num_channels)
        self.alpha = nn.Parameter(torch.empty(shape, **dd))
        self.gamma = nn.Parameter(torch.empty(shape, **dd))
        self.beta = nn.Parameter(torch.empty(shape, **dd))
        self.theta = nn.Parameter(torch.empty(shape, **dd))
        self.init_weights()

    init_weights = ArbitraryActivation.init_weights

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
