"""Hire-MLP (Guo et al., "Hire-MLP: Vision MLP via Hierarchical Rearrangement", CVPR 2022): an AFBO
Table 2 backbone.

Written from the paper and the authors' model definition (``hire_mlp_tiny`` ... ``hire_mlp_large``):

* Channels-first maps ``(B, C, H, W)`` with BatchNorm throughout. Stem: 7x7 stride-4 conv (padding 2)
  + BN + ReLU; stages 2-4 start with a 3x3 stride-2 conv + BN + ReLU.
* Block: ``x + HireMixer(BN(x))``, then ``x + MLP(BN(x))`` (1x1 convs, GELU; timm ``Mlp(use_conv=True)``).
* Token mixer (:class:`HireMixer`): a height branch and a width branch of *hierarchical rearrangement*
  (:class:`RegionRearrangedMLP`), a channel FC (1x1 conv), combined by the split-attention
  reweighting CycleMLP uses (:func:`~vitblocks.models.cyclemlp.split_attention`), then ``proj``.
* Inner-region rearrangement: the axis is cut into regions of ``region`` (the authors'
  ``pixel``) consecutive positions, padded circularly to a multiple of it; the positions of a region
  are stacked into the channels, ``(B, C, H, W) -> (B, C * region, H / region, W)`` (channel
  ``c * region + k`` holds position ``k`` of the region), mixed by ``1x1 conv (C*region -> C/2, no
  bias) -> BN -> ReLU -> 1x1 conv (C/2 -> C*region)`` and put back.
* Cross-region rearrangement: in every block whose ``shift`` (the authors' ``step``) is
  non-zero, the map is rolled by ``shift`` positions along the axis before and rolled back after, so the
  regions straddle the previous block's region borders. Block ``i`` of a stage shifts by
  ``(i mod shift_period) * shift_dilation`` (the authors' ``step_stride``, ``step_dilation``).
  Only the authors' circular modes (``'c'`` for both paddings, used by every published model) are built.
* Head: BatchNorm, average pool, linear.

All four: MLP ratio 4, regions 4, 3, 3, 2, shift periods 2, 2, 3, 2, shift dilations 2, 2, 1, 1.

| model | depths | widths | params | GMACs (norms 2/element) | published (paper) |
| --- | --- | --- | ---: | ---: | --- |
| ``hiremlp_tiny`` | 2, 2, 4, 2 | 64, 128, 320, 512 | 18.042 M | 2.149 | 18 M, 2.1 G |
| ``hiremlp_small`` | 3, 4, 10, 3 | 64, 128, 320, 512 | 33.114 M | 4.240 | 33 M, 4.2 G |
| ``hiremlp_base`` | 4, 6, 24, 3 | 64, 128, 320, 512 | 58.227 M | 8.125 | 58 M, 8.1 G |
| ``hiremlp_large`` | 4, 6, 24, 3 | 96, 192, 384, 768 | 95.724 M | 13.442 | 96 M, 13.4 G |

The rearranged branches run on the circularly padded map (28 rows -> 30 for regions of 3), and are
counted there.

``swap_ffn`` replaces ``stages[s].blocks[i].mlp`` (input channels-first ``(B, C, H, W)``, like PoolFormer).
"""
from functools import partial
from typing import List

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import ClassifierHead, ConvNormAct, DropPath, Mlp
from timm.models import generate_default_cfgs, register_model, register_notrace_module
from torch import nn

from ..slots import CHANNELS_FIRST, register_slots, stage_block_slots
from .cyclemlp import StagedMlpNet, split_attention
from .staged import authors_init, create_staged

__all__ = ['HireMLPNet', 'HireMixer', 'RegionRearrangedMLP']


@register_notrace_module  # a torch.fx leaf: its padding depends on the map size
class RegionRearrangedMLP(nn.Module):
    """One branch of the Hire-MLP mixer: inner-region rearrangement along ``axis`` (regions of ``region``
    positions), with the cross-region ``shift`` (see the module docstring). ``(B, C, H, W)`` in and out."""

    def __init__(self, dim: int, region: int, shift: int, axis: str):
        super().__init__()
        if axis not in ('height', 'width'):
            raise ValueError(f"RegionRearrangedMLP axis must be 'height' or 'width', got {axis!r}")
        if region < 1 or shift < 0:
            raise ValueError(f'region must be >= 1 and shift >= 0, got region={region}, shift={shift}')
        self.region, self.shift, self.axis = region, shift, axis
        self.fc1 = nn.Conv2d(dim * region, dim // 2, 1, bias=False)
        self.norm = nn.BatchNorm2d(dim // 2)
        self.act = nn.ReLU()
        self.fc2 = nn.Conv2d(dim // 2, dim * region, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.axis == 'width':  # rearranging W is rearranging H of the transposed map (1x1 convs, BN see
            return self.forward_height(x.transpose(2, 3)).transpose(2, 3)  # the same set of positions)
        return self.forward_height(x)

    def forward_height(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        r = self.region
        if self.shift:
            x = torch.roll(x, self.shift, 2)  # cross-region: move region borders by `shift` rows
        pad = (r - H % r) % r
        if pad:
            if pad > H:
                raise ValueError(f'Hire-MLP: a map of {H} rows cannot be padded circularly to regions of {r} rows; '
                                 f'use a larger input')
            x = F.pad(x, (0, 0, 0, pad), mode='circular')  # (B, C, H + pad, W), wrapped-around rows
        n = (H + pad) // r
        x = x.reshape(B, C, n, r, W).transpose(2, 3).reshape(B, C * r, n, W)  # (B, C, n*r, W) -> (B, C*r, n, W)
        x = self.fc2(self.act(self.norm(self.fc1(x))))
        x = x.reshape(B, C, r, n, W).transpose(2, 3).reshape(B, C, n * r, W)[:, :, :H]  # back, padding cropped
        if self.shift:
            x = torch.roll(x, -self.shift, 2)
        return x


class HireMixer(nn.Module):
    """Hire-MLP token mixer (the authors' ``HireMLP`` module) on ``(B, C, H, W)`` maps."""

    def __init__(self, dim: int, region: int = 2, shift: int = 0, proj_drop: float = 0.):
        super().__init__()
        self.mlp_h = RegionRearrangedMLP(dim, region, shift, 'height')
        self.mlp_w = RegionRearrangedMLP(dim, region, shift, 'width')
        self.mlp_c = nn.Conv2d(dim, dim, 1)
        self.reweight = Mlp(dim, dim // 4, dim * 3)  # on the pooled (B, C) vector (the authors' 1x1 convs)
        self.proj = nn.Conv2d(dim, dim, 1)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, c = self.mlp_h(x), self.mlp_w(x), self.mlp_c(x)
        logits = self.reweight((h + w + c).mean((2, 3)))  # (B, C, H, W) -> (B, C) -> (B, 3C)
        return self.proj_drop(self.proj(split_attention([h, w, c], logits, channels_last=False)))


class HireBlock(nn.Module):
    """Pre-norm (BatchNorm) block on ``(B, C, H, W)``: Hire mixer, then the 1x1-conv MLP, each residual."""

    def __init__(self, dim: int, mlp_ratio: float, region: int, shift: int, drop_path: float = 0.,
                 proj_drop: float = 0.):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(dim)
        self.attn = HireMixer(dim, region, shift, proj_drop)  # `attn` as the authors' (a token mixer)
        self.norm2 = nn.BatchNorm2d(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop, use_conv=True)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class HireStage(nn.Module):
    """Optional 3x3 stride-2 conv + BN + ReLU, then the blocks; ``(B, C, H, W)`` in and out."""

    def __init__(self, in_chs: int, dim: int, blocks: List[nn.Module]):
        super().__init__()
        self.downsample = ConvNormAct(in_chs, dim, 3, 2, 1, bias=True) if in_chs else None
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.downsample is not None:
            x = self.downsample(x)
        return self.blocks(x)


class HireMLPNet(StagedMlpNet):
    """Hire-MLP (see the module docstring); timm model interface, channels-first throughout.

    Args:
        depths, embed_dims, mlp_ratios: per stage.
        regions: region size per stage (the authors' ``pixel``; 4, 3, 3, 2 in every published model).
        shift_periods, shift_dilations: block ``i`` of stage ``s`` shifts by
            ``(i % shift_periods[s]) * shift_dilations[s]`` (the authors' ``step_stride``, ``step_dilation``).
        global_pool: timm pool type of the head: 'avg' (the authors'), '' for none (without a classifier).
    """

    def __init__(self, depths=(2, 2, 4, 2), embed_dims=(64, 128, 320, 512), mlp_ratios=(4, 4, 4, 4),
                 regions=(4, 3, 3, 2), shift_periods=(2, 2, 3, 2), shift_dilations=(2, 2, 1, 1),
                 num_classes: int = 1000, in_chans: int = 3, global_pool: str = 'avg', drop_rate: float = 0.,
                 proj_drop_rate: float = 0., drop_path_rate: float = 0.):
        super().__init__()
        self.in_chans = in_chans  # timm's attribute: the input image's channels
        per_stage = dict(depths=depths, embed_dims=embed_dims, mlp_ratios=mlp_ratios, regions=regions,
                         shift_periods=shift_periods, shift_dilations=shift_dilations)
        if len({len(v) for v in per_stage.values()}) != 1:
            raise ValueError('Hire-MLP needs one entry per stage in each of '
                             + ', '.join(f'{k} ({len(v)})' for k, v in per_stage.items()))
        self.num_classes, self.global_pool, self.channels_last = num_classes, global_pool, False
        self.num_features = embed_dims[-1]
        self.stem = ConvNormAct(in_chans, embed_dims[0], 7, 4, 2, bias=True)  # conv + BN + ReLU
        n_blocks = sum(depths)
        rates = [drop_path_rate * i / max(n_blocks - 1, 1) for i in range(n_blocks)]  # linear, as the authors'
        stages, c_in, self.feature_info = [], 0, []
        for s, (dim, depth) in enumerate(zip(embed_dims, depths)):
            blocks = [HireBlock(dim, mlp_ratios[s], regions[s], (i % shift_periods[s]) * shift_dilations[s],
                                rates[sum(depths[:s]) + i], proj_drop_rate) for i in range(depth)]
            stages.append(HireStage(c_in, dim, blocks))
            self.feature_info.append(dict(num_chs=dim, reduction=4 * 2 ** s, module=f'stages.{s}'))
            c_in = dim
        self.stages = nn.Sequential(*stages)
        self.norm = nn.BatchNorm2d(embed_dims[-1])
        self.head = ClassifierHead(self.num_features, num_classes, global_pool, drop_rate)
        self.head_hidden_size = self.head.num_features
        self.apply(self._init_weights)

    # the authors': trunc-normal linears and convs
    _init_weights = staticmethod(partial(authors_init, conv='trunc_normal'))


# the slot protocol (models/slots.py): swap_ffn replaces stages[s].blocks[i].mlp, 1x1-conv MLPs on (B, C, H, W) maps
register_slots(HireMLPNet, ffn=stage_block_slots(CHANNELS_FIRST))


default_cfgs = generate_default_cfgs({  # read by timm's register_model; the authors' config (crop 0.9)
    name: dict(url='', num_classes=1000, input_size=(3, 224, 224), pool_size=(7, 7), crop_pct=0.9,
               interpolation='bicubic', mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
               first_conv='stem.conv', classifier='head.fc')
    for name in ('hiremlp_tiny', 'hiremlp_small', 'hiremlp_base', 'hiremlp_large')
})


@register_model
def hiremlp_tiny(pretrained: bool = False, **kwargs) -> HireMLPNet:
    """Hire-MLP-Tiny (18.042 M params, 2.149 GMACs)."""
    return create_staged(HireMLPNet, 'hiremlp_tiny', pretrained, **{'depths': (2, 2, 4, 2), **kwargs})


@register_model
def hiremlp_small(pretrained: bool = False, **kwargs) -> HireMLPNet:
    """Hire-MLP-Small (33.114 M params, 4.240 GMACs)."""
    return create_staged(HireMLPNet, 'hiremlp_small', pretrained, **{'depths': (3, 4, 10, 3), **kwargs})


@register_model
def hiremlp_base(pretrained: bool = False, **kwargs) -> HireMLPNet:
    """Hire-MLP-Base (58.227 M params, 8.125 GMACs)."""
    return create_staged(HireMLPNet, 'hiremlp_base', pretrained, **{'depths': (4, 6, 24, 3), **kwargs})


@register_model
def hiremlp_large(pretrained: bool = False, **kwargs) -> HireMLPNet:
    """Hire-MLP-Large (95.724 M params, 13.442 GMACs)."""
    large = {'depths': (4, 6, 24, 3), 'embed_dims': (96, 192, 384, 768)}
    return create_staged(HireMLPNet, 'hiremlp_large', pretrained, **{**large, **kwargs})
