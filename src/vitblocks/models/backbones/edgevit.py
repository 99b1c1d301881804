"""EdgeViT (Pan et al., "EdgeViTs: Competing Light-weight CNNs on Mobile Devices with Vision
Transformers", ECCV 2022): the backbone of AFBO Table 16 (EdgeViT-XXS + AFBO).

Written from the paper and the authors' model definition (``saic-fi/edgevit``, ``edgevit.py``):

* 4 stages; each starts with a non-overlapping patch embedding (4x4, then 2x2 convs, stride =
  kernel) followed by a LayerNorm over channels. The network runs on channels-first maps.
* Every block is a Local-Global-Local (LGL) bottleneck (paper Sec. 3.2, Fig. 2):

  1. *local aggregation* (:class:`LocalAggregation`): a 3x3 depthwise conditional position
     encoding, then ``1x1 conv -> 5x5 depthwise conv -> 1x1 conv`` after a BatchNorm, then a
     1x1-conv FFN after a second BatchNorm (each residual). Only in stages with a sparsity
     ratio r > 1 (the authors' code has none in the last stage, r = 1);
  2. *sparse global attention* among delegate tokens (:class:`SparseGlobalAttention`): every
     r-th position in each direction (the authors' ``AvgPool2d(1, r)``, i.e. plain subsampling),
     full multi-head self-attention among them;
  3. *local propagation*: a depthwise transposed conv (kernel r, stride r) spreads each delegate's
     output back over its r x r neighbourhood, then LayerNorm and the output projection.

  The attention part (:class:`SparseGlobalBlock`) has its own 3x3 depthwise position encoding,
  pre-norm LayerNorms (eps 1e-6) and a token FFN, so an LGL block holds two FFNs.
* Head: BatchNorm on the final map, global average pool, linear.

``edgevit_xxs`` (AFBO Table 16's backbone): depths 1, 1, 3, 2, widths 36, 72, 144, 288, head width 36
(1, 2, 4, 8 heads), r = 4, 2, 2, 1, MLP ratio 4: 4.068 M parameters (the EdgeViT paper's 4.1 M) and
0.551 GMACs with the attention matmuls (0.554 with norms at 2 MACs per element; the paper prints
0.6 GFLOPs, i.e. MACs, and Table 16 of the AFBO paper 1.3 G, see ``papers/afbo.yaml``). XS and S
are the same class with other widths (``embed_dims=(48, 96, 240, 384), head_dim=48`` and depths
1, 1, 3, 1 or 1, 2, 5, 3); they are not registered: the authors' S definition counts 13.11 M, not the
paper's 11.1 M, and XS 6.77 M against 6.7 M.

``swap_ffn`` replaces both FFNs of each block: ``stages[s].blocks[i].local_agg.mlp`` (channels-first
``(B, C, H, W)``, 1x1 convs) and ``stages[s].blocks[i].global_attn.mlp`` (channels-last ``(B, H, W, C)``).

Differences to the authors' code, none of which changes a parameter or a MAC: the FFNs are timm's
``Mlp`` (``use_conv=True`` for the 1x1-conv one), the patch-embedding LayerNorm is timm's
``LayerNorm2d`` (the same normalization over channels without the flatten/reshape), the attention
uses ``F.scaled_dot_product_attention``; ``drop_rate`` is the head dropout (timm's meaning) and the
authors' dropout after the stem is not kept; inputs whose stage grid is not a multiple of r are
accepted (the propagated map is cropped to the grid; the authors' reshape would fail).
"""
from functools import partial
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import ClassifierHead, get_device_dtype, DropPath, LayerNorm2d, Mlp
from timm.models import generate_default_cfgs, register_model
from torch import nn

from ...layers import TokenLayout
from ..slots import Slot, register_slots
from .staged import StagedBackbone, authors_init, create_staged

__all__ = ['EdgeViT', 'LocalAggregation', 'SparseGlobalAttention', 'SparseGlobalBlock', 'LGLBlock']


class LocalAggregation(nn.Module):
    """Local aggregation (EdgeViT Sec. 3.2, step 1) on ``(B, C, H, W)``: 3x3 depthwise position
    encoding, ``BN -> 1x1 -> 5x5 depthwise -> 1x1`` token mixing, ``BN -> 1x1-conv FFN``, each residual."""

    def __init__(self, dim: int, mlp_ratio: float = 4., proj_drop: float = 0., drop_path: float = 0.):
        super().__init__()
        self.pos_embed = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm1 = nn.BatchNorm2d(dim)
        self.conv1 = nn.Conv2d(dim, dim, 1)
        self.dwconv = nn.Conv2d(dim, dim, 5, padding=2, groups=dim)
        self.conv2 = nn.Conv2d(dim, dim, 1)
        self.norm2 = nn.BatchNorm2d(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop, use_conv=True)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos_embed(x)
        x = x + self.drop_path(self.conv2(self.dwconv(self.conv1(self.norm1(x)))))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class SparseGlobalAttention(nn.Module):
    """Sparse global attention + local propagation (EdgeViT Sec. 3.2, steps 2 and 3) on ``(B, H, W, C)``.

    Delegates are the tokens at every ``sr_ratio``-th row and column; they attend to each other,
    and a depthwise transposed conv (kernel = stride = ``sr_ratio``) spreads each delegate's output
    over its ``sr_ratio x sr_ratio`` cell before the LayerNorm and the output projection.
    """

    def __init__(self, dim: int, num_heads: int, sr_ratio: int = 1, qkv_bias: bool = True, attn_drop: float = 0.,
                 proj_drop: float = 0.):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'SparseGlobalAttention: {num_heads} heads do not divide {dim} channels')
        if sr_ratio < 1:
            raise ValueError(f'sr_ratio must be >= 1, got {sr_ratio}')
        self.num_heads, self.sr_ratio, self.attn_drop = num_heads, sr_ratio, attn_drop
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        if sr_ratio > 1:
            self.propagate = nn.ConvTranspose2d(dim, dim, sr_ratio, stride=sr_ratio, groups=dim)
            self.norm = nn.LayerNorm(dim)
        else:
            self.propagate = self.norm = None
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        r, nh = self.sr_ratio, self.num_heads
        delegates = x[:, ::r, ::r] if r > 1 else x  # (B, ceil(H/r), ceil(W/r), C)
        h, w = delegates.shape[1:3]
        qkv = self.qkv(delegates).reshape(B, h * w, 3, nh, C // nh).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, n, C/nh)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2],
                                             dropout_p=self.attn_drop if self.training else 0.)
        out = out.transpose(1, 2).reshape(B, h, w, C)  # (B, nh, n, C/nh) -> (B, h, w, C)
        if self.propagate is not None:
            out = self.propagate(out.permute(0, 3, 1, 2))  # (B, C, h, w) -> (B, C, h*r, w*r)
            out = self.norm(out[:, :, :H, :W].permute(0, 2, 3, 1))  # crop to the grid, (B, C, H, W) -> (B, H, W, C)
        return self.proj_drop(self.proj(out))


class SparseGlobalBlock(nn.Module):
    """The attention half of an LGL block on ``(B, C, H, W)``: 3x3 depthwise position encoding, then
    pre-norm sparse global attention and a token FFN on the channels-last map."""

    def __init__(self, dim: int, num_heads: int, sr_ratio: int, mlp_ratio: float = 4., qkv_bias: bool = True,
                 proj_drop: float = 0., attn_drop: float = 0., drop_path: float = 0.):
        super().__init__()
        norm = partial(nn.LayerNorm, eps=1e-6)
        self.pos_embed = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm1 = norm(dim)
        self.attn = SparseGlobalAttention(dim, num_heads, sr_ratio, qkv_bias, attn_drop, proj_drop)
        self.norm2 = norm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x + self.pos_embed(x)).permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C)
        x = x + self.drop_path(self.attn(self.norm1(x)))
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x.permute(0, 3, 1, 2)  # (B, H, W, C) -> (B, C, H, W)


class LGLBlock(nn.Module):
    """Local-Global-Local block: local aggregation (only where ``sr_ratio > 1``, as the authors'),
    then sparse global attention with local propagation."""

    def __init__(self, dim: int, num_heads: int, sr_ratio: int, mlp_ratio: float = 4., qkv_bias: bool = True,
                 proj_drop: float = 0., attn_drop: float = 0., drop_path: float = 0.):
        super().__init__()
        self.local_agg = LocalAggregation(dim, mlp_ratio, proj_drop, drop_path) if sr_ratio > 1 else nn.Identity()
        self.global_attn = SparseGlobalBlock(dim, num_heads, sr_ratio, mlp_ratio, qkv_bias, proj_drop, attn_drop,
                                             drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        return self.global_attn(self.local_agg(x))


class EdgeViTStage(nn.Module):
    """Patch embedding (conv, kernel = stride, + LayerNorm over channels) and the stage's LGL blocks."""

    def __init__(self, in_chs: int, dim: int, patch: int, blocks: List[nn.Module]):
        super().__init__()
        self.downsample = nn.Conv2d(in_chs, dim, patch, patch)
        self.norm = LayerNorm2d(dim, eps=1e-5)  # the authors' nn.LayerNorm(dim) on the flattened tokens
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C_in, H, W) -> (B, C, H/p, W/p)
        return self.blocks(self.norm(self.downsample(x)))


class EdgeViT(StagedBackbone):
    """EdgeViT (see the module docstring); timm model interface.

    Args:
        embed_dims, depths: width and number of LGL blocks per stage.
        head_dim: channels per attention head (heads = width // head_dim).
        sr_ratios: sparsity ratio r of the global attention per stage (delegates every r-th token).
        mlp_ratio: FFN hidden width / width (both FFNs of a block).
    """

    def __init__(self, num_classes: int = 1000, in_chans: int = 3, embed_dims: Sequence[int] = (36, 72, 144, 288),
                 depths: Sequence[int] = (1, 1, 3, 2), head_dim: int = 36, sr_ratios: Sequence[int] = (4, 2, 2, 1),
                 mlp_ratio: float = 4., qkv_bias: bool = True, global_pool: str = 'avg', drop_rate: float = 0.,
                 proj_drop_rate: float = 0., attn_drop_rate: float = 0., drop_path_rate: float = 0.):
        super().__init__()
        self.in_chans = in_chans  # timm's attribute: the input image's channels
        if not len(embed_dims) == len(depths) == len(sr_ratios):
            raise ValueError(f'embed_dims, depths and sr_ratios need one entry per stage, got '
                             f'{len(embed_dims)}, {len(depths)}, {len(sr_ratios)}')
        bad = [d for d in embed_dims if d % head_dim]
        if bad:
            raise ValueError(f'head_dim={head_dim} must divide every width; it does not divide {bad}')
        self.num_classes, self.global_pool, self.channels_last = num_classes, global_pool, False
        self.num_features = embed_dims[-1]
        n_blocks = sum(depths)
        dpr = [drop_path_rate * i / max(n_blocks - 1, 1) for i in range(n_blocks)]  # linear, as the authors'
        stages, c_in, reduction, self.feature_info = [], in_chans, 1, []
        for s, (dim, depth, sr) in enumerate(zip(embed_dims, depths, sr_ratios)):
            patch = 4 if s == 0 else 2
            reduction *= patch
            first = sum(depths[:s])
            blocks = [LGLBlock(dim, dim // head_dim, sr, mlp_ratio, qkv_bias, proj_drop_rate, attn_drop_rate,
                               dpr[first + i]) for i in range(depth)]
            stages.append(EdgeViTStage(c_in, dim, patch, blocks))
            self.feature_info.append(dict(num_chs=dim, reduction=reduction, module=f'stages.{s}'))
            c_in = dim
        self.stages = nn.Sequential(*stages)
        self.norm = nn.BatchNorm2d(self.num_features)
        self.head = ClassifierHead(self.num_features, num_classes, pool_type=global_pool, drop_rate=drop_rate)
        self.head_hidden_size = self.head.num_features  # the pooled width ('catavgmax' doubles it)
        self.apply(self._init_weights)

    # the authors': trunc-normal linears, torch's convs
    _init_weights = staticmethod(partial(authors_init, conv=None))

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        # on the model's device and dtype, also after reset_classifier(0) left the head without parameters
        self.head.reset(num_classes, pool_type=global_pool, **get_device_dtype(self))
        if global_pool is not None:
            self.global_pool = global_pool
        self.head_hidden_size = self.head.num_features
        if isinstance(self.head.fc, nn.Linear):
            self._init_weights(self.head.fc)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The final BatchNorm'd map (B, C, H/32, W/32) -> pooled features or logits."""
        return self.head(x, pre_logits=pre_logits)


def _ffn_slots(model: EdgeViT) -> List[Slot]:
    """Both FFNs of every LGL block (no local part where r = 1): the local aggregation's 1x1-conv FFN on
    channels-first maps, the global block's token FFN on channels-last maps."""
    slots = []
    for s, stage in enumerate(model.stages):
        for i, blk in enumerate(stage.blocks):
            if isinstance(blk.local_agg, LocalAggregation):
                slots.append(Slot(blk.local_agg, 'mlp', f'stages.{s}.blocks.{i}.local_agg.mlp',
                                  TokenLayout(None, 0, True)))
            slots.append(Slot(blk.global_attn, 'mlp', f'stages.{s}.blocks.{i}.global_attn.mlp',
                              TokenLayout(None, 0, False)))
    return slots


register_slots(EdgeViT, ffn=_ffn_slots)  # the slot protocol (models/slots.py)


default_cfgs = generate_default_cfgs({  # read by timm's register_model
    'edgevit_xxs': dict(url='', num_classes=1000, input_size=(3, 224, 224), pool_size=(7, 7), crop_pct=0.875,
                        interpolation='bicubic', mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
                        first_conv='stages.0.downsample', classifier='head.fc'),
})


@register_model
def edgevit_xxs(pretrained: bool = False, **kwargs) -> EdgeViT:
    """EdgeViT-XXS (4.07 M params, 0.55 GMACs; the EdgeViT paper's 4.1 M / 0.6 G): AFBO Table 16's backbone."""
    return create_staged(EdgeViT, 'edgevit_xxs', pretrained, **kwargs)
