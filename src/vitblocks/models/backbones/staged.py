"""The timm interface shared by vitblocks' staged (pyramid) backbones: LVT, EdgeViT, Pyramid VisionLLaMA,
CycleMLP and Hire-MLP.

Each is ``_embed`` (a stem, or nothing where the first stage embeds the image) -> ``stages`` (an
``nn.Sequential``, one feature map per stage) -> ``_after_stages`` (the final norm) -> ``forward_head``.
:class:`StagedBackbone` implements ``forward_features``, ``forward`` and timm's feature API
(``forward_intermediates``, ``prune_intermediate_layers``, which timm's ``features_only=True`` getter
wrapper calls) and ``group_matcher`` (timm's layer-wise LR decay) once on top of that; a model overrides
only the hooks where it differs.

timm has no such base class (each timm model writes these methods itself), so it is written here once.
"""
import math
from contextlib import nullcontext
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from timm.layers import trunc_normal_
from timm.models import build_model_with_cfg, checkpoint, checkpoint_seq
from timm.models._features import feature_take_indices
from torch import nn

__all__ = ['StagedBackbone', 'ChannelsLastStage', 'create_staged', 'authors_init']

CONV_INITS = (None, 'fan_out', 'trunc_normal')


def authors_init(m: nn.Module, conv: Optional[str] = None) -> None:
    """The initialization the staged backbones' authors give a layer (``model.apply``): truncated-normal linears
    (std 0.02) with zero biases; 2-D convs keep torch's init (``conv=None``: EdgeViT, CycleMLP), or get a normal
    of std sqrt(2 / fan_out) (``'fan_out'``: LVT, Pyramid VisionLLaMA) or the linears' init (``'trunc_normal'``:
    Hire-MLP), with zero biases. Norms keep theirs."""
    if conv not in CONV_INITS:
        raise ValueError(f'conv={conv!r}: expected one of {CONV_INITS}')
    if isinstance(m, nn.Linear) or (conv == 'trunc_normal' and isinstance(m, nn.Conv2d)):
        trunc_normal_(m.weight, std=.02)
    elif conv == 'fan_out' and isinstance(m, nn.Conv2d):
        fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
        nn.init.normal_(m.weight, 0, math.sqrt(2. / fan_out))
    else:
        return
    if m.bias is not None:
        nn.init.zeros_(m.bias)


class StagedBackbone(nn.Module):
    """Base of a staged backbone (see the module docstring).

    A subclass builds ``stages``, ``norm``, ``feature_info`` (one entry per stage), its head and
    ``forward_head``, and sets ``self.channels_last``: whether its stage outputs are ``(B, H, W, C)``
    maps (else ``(B, C, H, W)``). Hooks it may override: ``_embed``, ``_after_stages``,
    ``_norm_intermediate``, ``_prune_norm``, ``_prune_head``; ``intermediates_fmts`` lists the
    ``output_fmt`` values ``forward_intermediates`` accepts ('NHWC' only for a channels-last model).
    """

    channels_last: bool
    intermediates_fmts: Tuple[str, ...] = ('NCHW',)

    def __init__(self):
        super().__init__()
        self.grad_checkpointing = False

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's API (``train.py --grad-checkpointing``): recompute each stage in the backward pass."""
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """timm's API (``create_optimizer_v2(..., layer_decay=)``, ``param_groups_layer_decay``): parameter
        groups from the input to the head. The stem (or the first stage's patch embedding), then per stage
        its downsample (+ norm) and each block; ``coarse``: one group per stage. The final norm joins the
        last block; the head matches nothing, so timm puts it in the last group. Without this, timm falls
        back to cutting ``named_parameters()`` into runs of 12 tensors, which splits blocks (a norm's
        weight and bias got different learning rates)."""
        return dict(
            stem=r'^stem',
            blocks=[(r'^stages\.(\d+)', None), (r'^norm\.', (99999,))] if coarse else [
                (r'^stages\.(\d+)\.(?:downsample|norm)\.', (-1,)),  # before the stage's block 0
                (r'^stages\.(\d+)\.blocks\.(\d+)\.', None),
                (r'^norm\.', (99999,)),  # timm's MATCH_PREV_GROUP: with the last block
            ],
        )

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        """The image ``(B, 3, H, W)`` -> the first stage's input (default: the image itself)."""
        return x

    def _after_stages(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's map -> ``forward_features``' output (default: the final norm)."""
        return self.norm(x)

    def _norm_intermediate(self, x: torch.Tensor) -> torch.Tensor:
        """What ``forward_intermediates(norm=True)`` applies to the last stage's map (default: the final norm)."""
        return self.norm(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._embed(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.stages, x)
        else:
            x = self.stages(x)
        return self._after_stages(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = 'NCHW',
                              intermediates_only: bool = False):
        """timm's feature API: the outputs of the stages ``indices`` selects, as ``(B, C, H, W)`` maps
        (``output_fmt='NHWC'``: as a channels-last model's stages run), and ``forward_features``' output
        unless ``intermediates_only``. ``norm`` applies ``_norm_intermediate`` to the last stage's map
        when it is taken; ``stop_early`` runs only the stages up to the last one taken."""
        if output_fmt not in self.intermediates_fmts:
            raise ValueError(f'{type(self).__name__} intermediates are {" or ".join(self.intermediates_fmts)} maps, '
                             f'got output_fmt={output_fmt!r}')
        take, max_index = feature_take_indices(len(self.stages), indices)
        last = len(self.stages) - 1
        intermediates = []
        x = self._embed(x)
        stages = self.stages[:max_index + 1] if stop_early else self.stages
        for s, stage in enumerate(stages):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(stage, x)
            else:
                x = stage(x)
            if s in take:
                y = self._norm_intermediate(x) if norm and s == last else x
                if self.channels_last and output_fmt == 'NCHW':
                    y = y.permute(0, 3, 1, 2)  # (B, H, W, C) -> (B, C, H, W)
                intermediates.append(y)
        if intermediates_only:
            return intermediates
        return self._after_stages(x), intermediates

    def _prune_norm(self) -> None:
        self.norm = nn.Identity()

    def _prune_head(self) -> None:
        """Drop the classifier and its pooling (``forward`` then returns the final map)."""
        self.reset_classifier(0, '')

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """Keep the stages up to the last one ``indices`` selects (timm's API); returns the selected indices."""
        take, max_index = feature_take_indices(len(self.stages), indices)
        self.stages = self.stages[:max_index + 1]
        if prune_norm:
            self._prune_norm()
        if prune_head:
            self._prune_head()
        return take


class ChannelsLastStage(nn.Module):
    """A conv patch embedding + LayerNorm, then the stage's blocks on ``(B, H, W, C)`` maps (LVT, Pyramid
    VisionLLaMA). The first stage takes the image ``(B, 3, H, W)``, the others the previous stage's map
    (``channels_last_in``)."""

    def __init__(self, in_chs: int, dim: int, blocks: List[nn.Module], kernel_size: int, stride: int,
                 padding: int = 0, channels_last_in: bool = True):
        super().__init__()
        self.channels_last_in = channels_last_in
        self.downsample = nn.Conv2d(in_chs, dim, kernel_size, stride, padding)
        self.norm = nn.LayerNorm(dim)
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # -> (B, H/stride, W/stride, C)
        if self.channels_last_in:
            x = x.permute(0, 3, 1, 2)  # (B, H, W, C) -> (B, C, H, W)
        x = self.norm(self.downsample(x).permute(0, 2, 3, 1))  # (B, C, H, W) -> (B, H, W, C)
        return self.blocks(x)


def create_staged(model_cls, name: str, pretrained: bool, device=None, dtype=None, **kwargs) -> nn.Module:
    """timm builder for a registered staged backbone (``features_only``: the four stages, timm's getter
    wrapper over ``forward_intermediates``). ``device`` / ``dtype`` (``timm.create_model(..., device=, dtype=)``):
    the model is built on that device (``'meta'``: no memory) and in that dtype."""
    if pretrained:
        raise RuntimeError(f'{name}: vitblocks ships no weights (nothing is downloaded); pass checkpoint_path= '
                           f'to timm.create_model to load a checkpoint')
    # the layers take no device argument (timm's own models pass one to each): they are built inside the
    # device context instead, which places every parameter and buffer there without a copy
    with torch.device(device) if device is not None else nullcontext():
        model = build_model_with_cfg(model_cls, name, pretrained,
                                     feature_cfg=dict(out_indices=(0, 1, 2, 3), feature_cls='getter'), **kwargs)
    return model if dtype is None else model.to(dtype=dtype)
