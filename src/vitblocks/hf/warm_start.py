"""Warm start: a swapped block takes the weights of the dense FFN it replaces, where the shapes allow.

| block      | takes                                   | from                                         |
| ---------- | --------------------------------------- | -------------------------------------------- |
| ``mlp``    | fc1, fc2 (weights and biases)           | BERT / RoBERTa, GPT-1/2 (Conv1D, transposed), ViT / DeiT |
| ``repa``   | fc1, fc2 (its BatchNorms start as identity) | the same families                        |
| ``swiglu`` | fc1_g <- gate, fc1_x <- up, fc2 <- down | LLaMA, Qwen2, Mistral                        |

Every other block has no dense matrix of the FFN's shape (IFFN's fc1 is half as wide, AFBO's channel maps are
structured-sparse, GLU's gate is a sigmoid): asking to warm-start it is an error. With ``mlp_ratio`` changing the
width nothing fits either.
"""
from typing import Dict, Optional, Tuple

import torch
from torch import nn

__all__ = ['warm_start', 'WARM_START']

# block name -> (its linear layer, the dense FFN's matrix) pairs
WARM_START = {
    'mlp': (('fc1', 'fc1'), ('fc2', 'fc2')),
    'repa': (('fc1', 'fc1'), ('fc2', 'fc2')),
    'swiglu': (('fc1_g', 'gate'), ('fc1_x', 'up'), ('fc2', 'down')),
}

Dense = Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]


def check_warm_start(name: str, dense: Dense, family: str) -> None:
    """Refuse early a warm start the block or the family cannot take."""
    if name not in WARM_START:
        raise ValueError(f'warm_start: {name!r} has no matrix of the dense FFN\'s shape; blocks that take the dense '
                         f'weights: {", ".join(f"{k} ({v[0][0]}...)" for k, v in WARM_START.items())}')
    missing = [src for _, src in WARM_START[name] if src not in dense]
    if missing:
        have = ', '.join(dense)
        raise ValueError(f'warm_start: {name!r} takes {", ".join(src for _, src in WARM_START[name])}, but a '
                         f'{family} FFN has {have}; use ' + ('swiglu' if 'gate' in dense else 'mlp or repa'))


@torch.no_grad()
def warm_start(block: nn.Module, name: str, dense: Dense, qualname: str) -> None:
    """Copy the dense FFN's matrices (already (out, in)) and biases into ``block``'s linear layers."""
    for dst, src in WARM_START[name]:
        layer = getattr(block, dst)
        weight, bias = dense[src]
        if layer.weight.shape != weight.shape:
            raise ValueError(f'warm_start: {qualname}.{dst} is {tuple(layer.weight.shape)} but the dense {src} is '
                             f'{tuple(weight.shape)}; warm start keeps the FFN\'s width (no mlp_ratio)')
        layer.weight.copy_(weight)
        if layer.bias is not None:
            layer.bias.copy_(bias if bias is not None else torch.zeros_like(layer.bias))
