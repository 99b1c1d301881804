"""Name the activation of a replaced HF FFN in vitblocks' activation registry, by what it computes."""
import torch
from torch import nn

from ..layers.activations import ACTIVATIONS

__all__ = ['activation_of']

_CANDIDATES = ('gelu', 'gelu_tanh', 'silu', 'relu')


@torch.no_grad()
def activation_of(act: nn.Module) -> str:
    """The registry name whose function equals ``act`` on [-6, 6] (to 1e-6): HF's activations are many classes and
    config strings ('gelu_new', 'gelu_pytorch_tanh', 'swish', ...) for a few functions."""
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    y = act(x)
    for name in _CANDIDATES:
        if torch.allclose(y, ACTIVATIONS[name].fn(x), atol=1e-6, rtol=0):
            return name
    raise ValueError(f'the FFN activation {act!r} matches none of {", ".join(_CANDIDATES)}; pass act_layer= '
                     f'explicitly to a block that takes the activation over')
