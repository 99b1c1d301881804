"""Feature entropy per block (AFBO Table 18: Swin-T 2.7 vs Swin-T+AFBO 4.7 "feature entropy").

AFBO reports the number without defining it. We use the Shannon entropy of the distribution of
each channel's values, the usual reading of "denser features carry more information": for every
channel, its values over all tokens of all images are binned into ``bins`` equal-width bins
between that channel's min and max, and ``H_c = -sum_k p_k log2 p_k`` (bits); the block's
entropy is the mean of ``H_c`` over channels. A constant channel has entropy 0; values spread
uniformly reach the maximum ``log2(bins)``. Values are per channel, so a few large-valued
channels do not squeeze the others into one bin. Prefix tokens (class/distillation/register)
are left out, as they are not image features.
"""
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Sequence, Union

import torch
from torch import nn

from .components import eval_forward_with_hooks, find_blocks
from .figures import png_figure

__all__ = ['feature_entropy', 'BlockEntropy', 'EntropyReport', 'block_entropy', 'plot_entropy']


def feature_entropy(features: torch.Tensor, bins: int = 256) -> torch.Tensor:
    """Per-channel entropy in bits of channels-last ``features`` ``(..., C)``; returns ``(C,)``."""
    if bins < 2:
        raise ValueError(f'bins must be >= 2, got {bins}')
    x = features.detach().reshape(-1, features.shape[-1]).double().t()  # (..., C) -> (C, samples)
    if x.shape[1] == 0:
        raise ValueError('no feature values to compute an entropy of')
    low, high = x.min(1, keepdim=True).values, x.max(1, keepdim=True).values
    span = (high - low).clamp_min(torch.finfo(torch.float64).tiny)
    idx = ((x - low) / span * bins).long().clamp_(0, bins - 1)  # the max falls in the last bin
    counts = torch.zeros(x.shape[0], bins, dtype=torch.float64).scatter_add_(1, idx, torch.ones_like(x))
    p = counts / x.shape[1]
    h = -(p * torch.log2(p.where(p > 0, torch.ones_like(p)))).sum(1)  # 0 log 0 = 0
    return h.where(high.squeeze(1) > low.squeeze(1), torch.zeros_like(h)).float()  # constant channel: 0


@dataclass(frozen=True)
class BlockEntropy:
    index: int
    name: str
    mean: float  # mean over channels of the per-channel entropy (bits)
    min: float
    max: float


@dataclass
class EntropyReport:
    model: str
    bins: int
    num_images: int
    blocks: List[BlockEntropy] = field(default_factory=list)

    @property
    def average(self) -> float:
        return sum(b.mean for b in self.blocks) / len(self.blocks)

    @property
    def max_entropy(self) -> float:
        return math.log2(self.bins)


def _channels_last(out: torch.Tensor, model: nn.Module, name: str) -> torch.Tensor:
    if out.ndim == 4 and name.startswith('stages.'):  # PoolFormer blocks are channels-first
        return out.permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C)
    prefix = getattr(model, 'num_prefix_tokens', 0) if out.ndim == 3 and name.startswith('blocks.') else 0
    return out[:, prefix:]  # (B, P + N, C) -> (B, N, C); Swin's (B, H, W, C) stays


@torch.no_grad()
def block_entropy(model: nn.Module, images: torch.Tensor, name: str = '', bins: int = 256) -> EntropyReport:
    """Feature entropy of every block's output when ``model`` runs on ``images`` (eval mode)."""
    blocks = find_blocks(model)
    report = EntropyReport(name or type(model).__name__, bins, images.shape[0])

    def hook(i: int, bname: str):
        def fn(module, args, out):
            h = feature_entropy(_channels_last(out, model, bname), bins)
            report.blocks.append(BlockEntropy(i, bname, h.mean().item(), h.min().item(), h.max().item()))
        return fn

    eval_forward_with_hooks(model, images, [b.register_forward_hook(hook(i, n)) for i, (n, b) in enumerate(blocks)])
    return report


def plot_entropy(reports: Sequence[EntropyReport], path: Union[str, Path]) -> Path:
    """Per-block mean feature entropy of each model on one axis; returns the PNG path."""
    with png_figure(path, figsize=(6.5, 3.6)) as (_, ax):
        for k, r in enumerate(reports):
            ax.plot([b.index for b in r.blocks], [b.mean for b in r.blocks], f'C{k}-o',
                    label=f'{r.model} (mean {r.average:.2f})')
        ax.axhline(reports[0].max_entropy, color='k', ls=':', lw=1, label=f'max log2({reports[0].bins})')
        ax.set(xlabel='block', ylabel='feature entropy (bits)', title='per-channel feature entropy of block outputs')
        ax.grid(alpha=.3)
        ax.legend(fontsize=8)
    return Path(path)
