"""CycleMLP (Chen et al., "CycleMLP: A MLP-like Architecture for Dense Prediction", ICLR 2022; TPAMI
2023): an AFBO Table 2 backbone.

Written from the paper and the authors' model definition (``CycleMLP_B1..B5``):

* Stem: 7x7 stride-4 conv (padding 2, no norm). Four stages; stages 2-4 start with a 3x3 stride-2
  conv. The network runs on channels-last maps ``(B, H, W, C)``.
* Block (pre-norm, LayerNorm): ``x + CycleMLP(LN(x))``, then ``x + MLP(LN(x))`` (timm ``Mlp``, GELU).
* Token mixer (:class:`CycleMixer`, with the split-attention reweighting of ViP): three branches,
  a Cycle FC along the width (``(1, 3)``), one along the height (``(3, 1)``) and a channel FC
  without bias; their mean over positions goes through an MLP (C -> C/4 -> 3C),
  softmax over the 3 branches gives per-channel weights, the weighted sum goes through ``proj``.
* Cycle FC (:class:`CycleFC`): a channel FC whose input channel ``i`` is read at a spatial
  offset ``(i + 1) mod 3 - 1`` (pseudo-kernel 3) along one axis, zero outside the map.
* Head: LayerNorm on every position, average pool, linear.

| model | depths | widths | MLP ratios | params | GMACs (norms 2/element) | published (README) |
| --- | --- | --- | --- | ---: | ---: | --- |
| ``cyclemlp_b1`` | 2, 2, 4, 2 | 64, 128, 320, 512 | 4, 4, 4, 4 | 15.155 M | 2.125 | 15 M, 2.1 G |
| ``cyclemlp_b2`` | 2, 3, 10, 3 | 64, 128, 320, 512 | 4, 4, 4, 4 | 26.803 M | 3.881 | 27 M, 3.9 G |
| ``cyclemlp_b3`` | 3, 4, 18, 3 | 64, 128, 320, 512 | 8, 8, 4, 4 | 38.386 M | 6.840 | 38 M, 6.9 G |
| ``cyclemlp_b4`` | 3, 8, 27, 3 | 64, 128, 320, 512 | 8, 8, 4, 4 | 51.797 M | 10.040 | 52 M, 10.1 G |
| ``cyclemlp_b5`` | 3, 4, 24, 3 | 96, 192, 384, 768 | 4, 4, 4, 4 | 75.747 M | 12.246 | 76 M, 12.3 G |

The Cycle FCs are counted as the channel FCs they are (C^2 MACs per position each); without them
B1 would be 1.81 G, so the published 2.1 G counts them too.

``swap_ffn`` replaces ``stages[s].blocks[i].mlp`` (input ``(B, H, W, C)``, like GC ViT and LVT).
"""
from functools import partial
from typing import List, Optional

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import ClassifierHead, get_device_dtype, DropPath, Mlp, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from torch import nn

from ..slots import CHANNELS_LAST, register_slots, stage_block_slots
from .staged import StagedBackbone, authors_init, create_staged

__all__ = ['CycleMLPNet', 'CycleFC', 'CycleMixer', 'split_attention', 'StagedMlpNet']


def cycle_offsets(channels: int, kernel: int) -> List[int]:
    """Spatial offset of each input channel of a Cycle FC with pseudo-kernel ``kernel`` (the authors' offsets):
    channel ``i`` is read at ``(i + kernel // 2) mod kernel - kernel // 2``, i.e. 0, 1, -1, 0, 1, ... for 3."""
    half = kernel // 2
    return [(i + half) % kernel - half for i in range(channels)]


class CycleFC(nn.Module):
    """Cycle FC (CycleMLP's layer) on channels-last maps ``(B, H, W, C)``: shift input channel ``i`` by
    ``cycle_offsets(C, kernel)[i]`` positions along ``axis`` (zero fill at the border), then a channel FC.

    The authors run it as a deformable 1x1 conv (``torchvision.ops.deform_conv2d``) with constant
    integer offsets, where bilinear sampling at integer positions is a plain read (zero outside the map).
    The shift + ``F.linear`` here is the same function (``tests/test_cyclemlp.py`` checks it against
    ``deform_conv2d``); written by hand because it needs no per-pixel sampling, and MAC counters,
    torch.fx and TorchScript see an ordinary matmul.

    Args:
        axis: 'width' (the authors' ``sfc_h``, pseudo-kernel ``(1, 3)``) or 'height' (``sfc_w``, ``(3, 1)``).
    """

    def __init__(self, in_features: int, out_features: int, axis: str, kernel: int = 3, bias: bool = True):
        super().__init__()
        if axis not in ('height', 'width'):
            raise ValueError(f"CycleFC axis must be 'height' or 'width', got {axis!r}")
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f'CycleFC pseudo-kernel must be a positive odd number, got {kernel}')
        self.axis, self.kernel = axis, kernel
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.register_buffer('offsets', torch.tensor(cycle_offsets(in_features, kernel)), persistent=False)
        trunc_normal_(self.weight, std=.02)  # the authors' init for Cycle FC

    def shift(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, W, C) -> (B, H, W, C), channel i read at its cycle offset along the axis."""
        dim = 1 if self.axis == 'height' else 2
        half, length = self.kernel // 2, x.shape[dim]
        pad = [0, 0, half, half] if dim == 2 else [0, 0, 0, 0, half, half]  # F.pad pads the last dims first
        padded = F.pad(x, pad)  # (B, H, W + 2h, C) or (B, H + 2h, W, C), zeros outside the map
        out = padded.narrow(dim, half, length)  # offset 0
        for offset in range(-half, half + 1):  # each channel takes the window at its own offset
            if offset != 0:
                out = torch.where(self.offsets == offset, padded.narrow(dim, half + offset, length), out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.shift(x), self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f'{self.weight.shape[1]}, {self.weight.shape[0]}, axis={self.axis}, kernel={self.kernel}, '
                f'bias={self.bias is not None}')


def split_attention(branches: List[torch.Tensor], logits: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """Weighted sum of ``branches`` with per-channel weights, a softmax over the branches of ``logits``
    ``(B, len(branches) * C)`` (ViP's split attention, used by CycleMLP and Hire-MLP; the mixer predicts the
    logits from the branches' summed mean over positions)."""
    n, B = len(branches), logits.shape[0]
    weights = logits.reshape(B, -1, n).permute(2, 0, 1).softmax(dim=0)  # (B, C*n) -> (n, B, C), channel-major
    weights = weights[:, :, None, None, :] if channels_last else weights[:, :, :, None, None]  # over positions
    out = weights[0] * branches[0]
    for i in range(1, n):
        out = out + weights[i] * branches[i]
    return out


class CycleMixer(nn.Module):
    """CycleMLP token mixer (the authors' ``CycleMLP`` module) on ``(B, H, W, C)`` maps."""

    def __init__(self, dim: int, qkv_bias: bool = False, proj_drop: float = 0.):
        super().__init__()
        self.mlp_c = nn.Linear(dim, dim, bias=qkv_bias)  # the channel FC (no bias in all B models)
        self.sfc_h = CycleFC(dim, dim, 'width')  # named as the authors': their sfc_h has kernel (1, 3)
        self.sfc_w = CycleFC(dim, dim, 'height')
        self.reweight = Mlp(dim, dim // 4, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, c = self.sfc_h(x), self.sfc_w(x), self.mlp_c(x)
        logits = self.reweight((h + w + c).mean((1, 2)))  # (B, H, W, C) -> (B, C) -> (B, 3C)
        return self.proj_drop(self.proj(split_attention([h, w, c], logits, channels_last=True)))


class CycleBlock(nn.Module):
    """Pre-norm block on ``(B, H, W, C)`` maps: Cycle mixer, then the channel MLP, each residual."""

    def __init__(self, dim: int, mlp_ratio: float, qkv_bias: bool = False, drop_path: float = 0.,
                 proj_drop: float = 0.):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CycleMixer(dim, qkv_bias, proj_drop)  # `attn` as the authors' (a token mixer)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class CycleStage(nn.Module):
    """Optional 3x3 stride-2 downsampling conv, then the blocks; ``(B, H, W, C)`` in and out."""

    def __init__(self, in_chs: int, dim: int, blocks: List[nn.Module]):
        super().__init__()
        self.downsample = nn.Conv2d(in_chs, dim, 3, 2, 1) if in_chs else None
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.downsample is not None:
            x = self.downsample(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # conv on (B, C, H, W), back to NHWC
        return self.blocks(x)


class StagedMlpNet(StagedBackbone):
    """The timm interface CycleMLP and Hire-MLP share on top of :class:`StagedBackbone`: ``stem`` (giving
    (B, C, H, W)) -> ``stages`` -> ``norm`` -> ``head`` (a timm ``ClassifierHead``). A subclass builds those,
    ``feature_info`` and ``_init_weights``, and sets ``channels_last``: the layout its stages run in."""

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        # on the model's device and dtype, also after reset_classifier(0) left the head without parameters
        self.head.reset(num_classes, global_pool, **get_device_dtype(self))
        if global_pool is not None:
            self.global_pool = global_pool
        self.head_hidden_size = self.head.num_features
        if isinstance(self.head.fc, nn.Linear) and self.head.fc.weight.device.type != 'meta':
            self._init_weights(self.head.fc)

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return x.permute(0, 2, 3, 1) if self.channels_last else x  # (B, C, H, W) -> (B, H, W, C)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.head(x, pre_logits=pre_logits)


class CycleMLPNet(StagedMlpNet):
    """CycleMLP (see the module docstring); timm model interface, channels-last throughout.

    Args:
        depths, embed_dims, mlp_ratios: per stage (the B1..B5 tables above).
        qkv_bias: bias of the mixer's channel FC (False in all published models).
        global_pool: timm pool type of the head: 'avg' (the authors'), '' for none (logits per position).
    """

    def __init__(self, depths=(2, 2, 4, 2), embed_dims=(64, 128, 320, 512), mlp_ratios=(4, 4, 4, 4),
                 num_classes: int = 1000, in_chans: int = 3, global_pool: str = 'avg', qkv_bias: bool = False,
                 drop_rate: float = 0., proj_drop_rate: float = 0., drop_path_rate: float = 0.):
        super().__init__()
        self.in_chans = in_chans  # timm's attribute: the input image's channels
        if not len(depths) == len(embed_dims) == len(mlp_ratios):
            raise ValueError(f'depths, embed_dims and mlp_ratios need one entry per stage, got '
                             f'{len(depths)}, {len(embed_dims)}, {len(mlp_ratios)}')
        self.num_classes, self.global_pool, self.channels_last = num_classes, global_pool, True
        self.output_fmt = 'NHWC'  # timm's attribute: forward_features returns (B, H, W, C)
        self.num_features = embed_dims[-1]
        self.stem = nn.Conv2d(in_chans, embed_dims[0], 7, 4, 2)  # overlapping patch embedding, no norm
        n_blocks = sum(depths)
        rates = [drop_path_rate * i / max(n_blocks - 1, 1) for i in range(n_blocks)]  # linear, as the authors'
        stages, c_in, self.feature_info = [], 0, []
        for s, (dim, depth) in enumerate(zip(embed_dims, depths)):
            blocks = [CycleBlock(dim, mlp_ratios[s], qkv_bias, rates[sum(depths[:s]) + i], proj_drop_rate)
                      for i in range(depth)]
            stages.append(CycleStage(c_in, dim, blocks))
            self.feature_info.append(dict(num_chs=dim, reduction=4 * 2 ** s, module=f'stages.{s}'))
            c_in = dim
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(embed_dims[-1])
        self.head = ClassifierHead(self.num_features, num_classes, global_pool, drop_rate, input_fmt='NHWC')
        self.head_hidden_size = self.head.num_features  # the pooled width ('avgmax' doubles it)
        self.apply(self._init_weights)

    # the authors': trunc-normal linears, torch's convs
    _init_weights = staticmethod(partial(authors_init, conv=None))


# the slot protocol (models/slots.py): swap_ffn replaces stages[s].blocks[i].mlp, on (B, H, W, C) maps
register_slots(CycleMLPNet, ffn=stage_block_slots(CHANNELS_LAST))


def _cfg(crop_pct: float) -> dict:
    # the authors' configs (crop 0.9 for B1-B3, 0.875 for B4-B5); pool_size is forward_features' 7x7 grid
    return dict(url='', num_classes=1000, input_size=(3, 224, 224), pool_size=(7, 7), crop_pct=crop_pct,
                interpolation='bicubic', mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
                first_conv='stem', classifier='head.fc')


default_cfgs = generate_default_cfgs({  # read by timm's register_model
    'cyclemlp_b1': _cfg(0.9), 'cyclemlp_b2': _cfg(0.9), 'cyclemlp_b3': _cfg(0.9),
    'cyclemlp_b4': _cfg(0.875), 'cyclemlp_b5': _cfg(0.875),
})


def _b(depths, mlp_ratios, embed_dims=(64, 128, 320, 512)) -> dict:
    return dict(depths=depths, mlp_ratios=mlp_ratios, embed_dims=embed_dims)


@register_model
def cyclemlp_b1(pretrained: bool = False, **kwargs) -> CycleMLPNet:
    """CycleMLP-B1 (15.155 M params, 2.125 GMACs)."""
    return create_staged(CycleMLPNet, 'cyclemlp_b1', pretrained, **{**_b((2, 2, 4, 2), (4, 4, 4, 4)), **kwargs})


@register_model
def cyclemlp_b2(pretrained: bool = False, **kwargs) -> CycleMLPNet:
    """CycleMLP-B2 (26.803 M params, 3.881 GMACs)."""
    return create_staged(CycleMLPNet, 'cyclemlp_b2', pretrained, **{**_b((2, 3, 10, 3), (4, 4, 4, 4)), **kwargs})


@register_model
def cyclemlp_b3(pretrained: bool = False, **kwargs) -> CycleMLPNet:
    """CycleMLP-B3 (38.386 M params, 6.840 GMACs)."""
    return create_staged(CycleMLPNet, 'cyclemlp_b3', pretrained, **{**_b((3, 4, 18, 3), (8, 8, 4, 4)), **kwargs})


@register_model
def cyclemlp_b4(pretrained: bool = False, **kwargs) -> CycleMLPNet:
    """CycleMLP-B4 (51.797 M params, 10.040 GMACs)."""
    return create_staged(CycleMLPNet, 'cyclemlp_b4', pretrained, **{**_b((3, 8, 27, 3), (8, 8, 4, 4)), **kwargs})


@register_model
def cyclemlp_b5(pretrained: bool = False, **kwargs) -> CycleMLPNet:
    """CycleMLP-B5 (75.747 M params, 12.246 GMACs)."""
    b5 = _b((3, 4, 24, 3), (4, 4, 4, 4), embed_dims=(96, 192, 384, 768))
    return create_staged(CycleMLPNet, 'cyclemlp_b5', pretrained, **{**b5, **kwargs})
