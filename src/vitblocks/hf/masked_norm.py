"""BatchNorm over the real tokens of a padded batch, and the causal choice of running statistics.

IFFN's depthwise block and LocalViT normalize a ``(B, C, 1, L)`` sequence map with ``BatchNorm2d``; RePa and
LocalViT normalize tokens ``(B, L, C)`` with :class:`~vitblocks.layers.TokenBatchNorm`. In a padded batch their
training statistics would count the pad tokens, so the outputs at real tokens would depend on how much padding the
batch has. The masked forms here compute mean and variance over the real tokens only (the mask of the shared
:class:`~vitblocks.hf.sequence.SequenceContext`), and update the running statistics from them.

In a causal model batch statistics would let every token see the later tokens of its batch (their mean and
variance), so the context's ``batch_norm='running'`` (the default, and the only choice, for decoders) normalizes
with the running statistics in training too and leaves them as they are: the statistics of the checkpoint the model
was loaded from, mean 0 and variance 1 for a fresh block, so the BatchNorm trains as a per-channel affine map.
Updating them from each batch after use would be causal too, but gradient checkpointing recomputes the forward in
the backward pass and would then normalize with statistics the first forward did not use. In eval mode both choices
are the plain running-statistics BatchNorm, so the folding of :mod:`vitblocks.deploy` applies unchanged.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.batchnorm import TokenBatchNorm

__all__ = ['MaskedBatchNorm2d', 'MaskedTokenBatchNorm', 'masked_batch_norm']


def masked_batch_norm(x: torch.Tensor, keep: Optional[torch.Tensor], bn: nn.modules.batchnorm._BatchNorm,
                      mode: str) -> torch.Tensor:
    """BatchNorm of ``x`` (M, C) whose rows ``keep`` (M,) are the real tokens (None: all are).

    ``mode='batch'``: in training, normalize with the mean and biased variance of the real rows and update the
    running statistics with their unbiased variance (``nn.BatchNorm1d``'s rule; not again in gradient
    checkpointing's recomputation). ``mode='running'``: always normalize with the running statistics, never
    update them.
    """
    real = x if keep is None else x[keep]  # (M', C)
    update = mode == 'batch' and bn.training and bn.track_running_stats and real.shape[0] > 1 and not _in_backward()
    if update:
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            momentum = bn.momentum if bn.momentum is not None else 1. / float(bn.num_batches_tracked)
            mean, var = real.mean(0), real.var(0, unbiased=False)
            n = real.shape[0]
            new_mean = torch.lerp(bn.running_mean, mean.to(bn.running_mean.dtype), momentum)
            new_var = torch.lerp(bn.running_var, (var * n / (n - 1)).to(bn.running_var.dtype), momentum)
    if bn.training and mode == 'batch' and real.shape[0] > 0:
        mean, var = real.mean(0), real.var(0, unbiased=False)
        y = (x - mean) * torch.rsqrt(var + bn.eps)
        if bn.affine:
            y = y * bn.weight + bn.bias
    else:
        y = F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0., bn.eps)
    if update:
        with torch.no_grad():
            bn.running_mean.copy_(new_mean)
            bn.running_var.copy_(new_var)
    return y


def _in_backward() -> bool:
    """Whether this forward is gradient checkpointing's recomputation inside the backward pass: the statistics
    were updated by the first forward already (and 'running' must normalize as it did then)."""
    task = getattr(torch._C, '_current_graph_task_id', None)
    return task is not None and task() != -1


def _masked_copy(cls, bn: nn.modules.batchnorm._BatchNorm, source: nn.Module, context):
    """A ``cls`` built with ``bn``'s arguments on its device and dtype, holding ``source``'s state and train/eval
    mode, reading the pad mask from ``context``."""
    ref = bn.running_mean if bn.running_mean is not None else bn.weight
    new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, device=ref.device,
              dtype=ref.dtype)
    new.load_state_dict(source.state_dict())
    new.context = context
    return new.train(source.training)


class MaskedBatchNorm2d(nn.BatchNorm2d):
    """``BatchNorm2d`` on a ``(B, C, 1, L)`` sequence map whose statistics leave out pad tokens
    (:func:`masked_batch_norm`); same parameters, buffers and state-dict keys as ``nn.BatchNorm2d``."""

    @classmethod
    def from_batchnorm(cls, bn: nn.BatchNorm2d, context) -> 'MaskedBatchNorm2d':
        return _masked_copy(cls, bn, bn, context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, _, L = x.shape
        keep = self.context.token_mask(B, L)
        rows = x.permute(0, 2, 3, 1).reshape(-1, C)  # (B, C, 1, L) -> (B, 1, L, C) -> (B*L, C)
        y = masked_batch_norm(rows, None if keep is None else keep.reshape(-1), self, self.context.batch_norm)
        return y.view(B, 1, L, C).permute(0, 3, 1, 2)  # (B*L, C) -> (B, 1, L, C) -> (B, C, 1, L)


class MaskedTokenBatchNorm(TokenBatchNorm):
    """:class:`~vitblocks.layers.TokenBatchNorm` on tokens ``(B, L, C)`` whose statistics leave out pad tokens;
    same state-dict keys, and RePa's folding reads it as it reads the plain one."""

    @classmethod
    def from_batchnorm(cls, norm: TokenBatchNorm, context) -> 'MaskedTokenBatchNorm':
        return _masked_copy(cls, norm.bn, norm, context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 3:
            raise ValueError(f'{type(self).__name__} expects tokens (B, L, C), got {list(x.shape)}')
        B, L, C = x.shape
        keep = self.context.token_mask(B, L)
        y = masked_batch_norm(x.reshape(-1, C), None if keep is None else keep.reshape(-1), self.bn,
                              self.context.batch_norm)  # (B, L, C) -> (B*L, C)
        return y.view(B, L, C)
