"""BatchNorm over the channel (last) dim of channels-last features, convertible to SyncBatchNorm."""
from typing import Optional

import torch
from torch import nn

__all__ = ['TokenBatchNorm']

_BN_KEYS = ('weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked')


class TokenBatchNorm(nn.Module):
    """BatchNorm over the last (channel) dim of a ``(..., C)`` tensor: tokens ``(B, N, C)`` or
    channels-last maps ``(B, H, W, C)``; every token is a sample of the batch statistics.

    It holds an ``nn.BatchNorm1d`` (``.bn``) applied to the ``(M, C)`` flattening, rather than
    being a ``_BatchNorm`` itself: ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` and timm's
    ``convert_sync_batchnorm`` replace every ``_BatchNorm`` by a SyncBatchNorm that normalizes
    dim 1, which for tokens is N, not C. Here they replace the inner module, which only ever sees
    ``(M, C)``, so the converted model normalizes the right dim across all processes.
    Checkpoints of the earlier subclass form (``<name>.weight`` instead of ``<name>.bn.weight``)
    still load. ``weight``, ``running_mean``, ... read through to the inner module (BN folding).
    """
    __jit_unused_properties__ = ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked', 'eps',
                                 'num_features']

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None):
        super().__init__()
        self.bn = nn.BatchNorm1d(num_features, eps, momentum, affine, track_running_stats, device=device,
                                 dtype=dtype)
        self._register_load_state_dict_pre_hook(_nest_old_keys)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.reshape(-1, x.shape[-1])).view(x.shape)  # (..., C) -> (M, C) -> (..., C)

    def reset_parameters(self) -> None:
        self.bn.reset_parameters()

    @property
    def weight(self):
        return self.bn.weight

    @property
    def bias(self):
        return self.bn.bias

    @property
    def running_mean(self):
        return self.bn.running_mean

    @property
    def running_var(self):
        return self.bn.running_var

    @property
    def num_batches_tracked(self):
        return self.bn.num_batches_tracked

    @property
    def eps(self) -> float:
        return self.bn.eps

    @property
    def num_features(self) -> int:
        return self.bn.num_features


def _nest_old_keys(state_dict, prefix, *args) -> None:
    for key in _BN_KEYS:
        if prefix + key in state_dict:
            state_dict[prefix + 'bn.' + key] = state_dict.pop(prefix + key)
