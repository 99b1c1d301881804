"""Pyramid VisionLLaMA (Chu et al., "VisionLLaMA: A Unified LLaMA Backbone for Vision Tasks", ECCV 2024):
the AFBO Table 2 backbones Pyramid-VisionLLaMA-S/B/L.

Written from the paper (Sec. 3.3, the pyramid variant) and the authors' model definition
(``pllama_wols_{small,base,large}_patch16`` in ``deit/my_models.py``): Twins-SVT's layout with
LLaMA blocks.

* 4 stages, each a non-overlapping patch embedding (4x4, then 2x2; conv + LayerNorm) and blocks that
  alternate Twins' locally-grouped attention (LSA, even blocks: full attention inside 7x7 windows)
  and global sub-sampled attention (GSA, odd blocks: keys and values from an r x r strided conv +
  LayerNorm, r = 8, 4, 2, 1). The network runs on channels-last maps ``(B, H, W, C)``.
* A block (the paper's VisionLLaMA block, Eq. 1-2): pre-norm LayerNorm (the paper keeps ViT's
  LayerNorm, not RMSNorm), attention with 2-D rotary position embedding on queries and keys, SwiGLU
  FFN without biases, hidden width ``8d/3`` rounded up to a multiple of 256 (LLaMA's rule; timm's
  ``SwiGLU(align_to=256)``), layer scale (init 1e-4) on both branches. No conditional position
  encoding (Twins' PEG) and no absolute position embedding: the RoPE carries all position information.
* 2-D RoPE (the paper's AS2DRoPE at scale 1, the ImageNet setting): each head's channel pairs
  ``(2j, 2j+1)`` rotate by ``x * f_k`` for even ``j = 2k`` and ``y * f_k`` for odd ``j``, with
  ``f_k = 10000^(-4k / head_dim)`` and ``(x, y)`` the token's column and row. LSA uses the positions
  inside the window; GSA the query's grid position and, for each sub-sampled key, the center of
  the r x r cell it summarizes, ``r * i + (r - 1) / 2``.
* Head: the authors apply the final LayerNorm to every token, average, then apply *the same*
  LayerNorm again before the linear classifier; we keep that (it is how their checkpoints score).

| model | widths | depths | heads | SwiGLU hidden | params (M) | GMACs (attn incl.) |
| --- | --- | --- | --- | --- | ---: | ---: |
| ``pyramid_visionllama_s`` | 64, 128, 256, 512 | 2, 2, 10, 4 | 2, 4, 8, 16 | 256, 512, 768, 1536 | 25.90 | 3.31 |
| ``pyramid_visionllama_b`` | 96, 192, 384, 768 | 2, 2, 18, 2 | 3, 6, 12, 24 | 256, 512, 1024, 2048 | 56.03 | 8.56 |
| ``pyramid_visionllama_l`` | 128, 256, 512, 1024 | 2, 2, 18, 2 | 4, 8, 16, 32 | 512, 768, 1536, 2816 | 104.72 | 16.57 |

The published counts (AFBO Table 2: 22.0 / 56.0 / 99.0 M, 2.6 / 9.0 / 18.0 G) fit this definition for B
only; with the SwiGLU width not rounded (``swiglu_align=0``) S and L have Twins-SVT-S/L's sizes (24.03 M,
99.20 M), L then matching the published 99 M. ``papers/afbo.yaml`` has the evidence per row.

``swap_ffn`` replaces ``stages[s].blocks[i].mlp`` (channels-last ``(B, H, W, C)``, like LVT; timm's
``SwiGLU``, whose hidden width the new FFN keeps unless ``mlp_ratio`` is given).

Where we differ from the authors' code: their GSA lays the sub-sampled keys out with the full
grid's width ``W`` instead of the reduced grid's (stage 1 puts all 49 keys on one row) and offsets
them by ``1 - 1/r`` (the cell center only for r = 2); we use the reduced grid and the cell centers,
as the paper describes the keys as summaries of their sub-windows. Parameters and MACs do not change.
"""
from functools import partial
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, LayerScale, SwiGLU
from timm.layers.pos_embed_sincos import apply_rot_embed
from timm.models import generate_default_cfgs, register_model, register_notrace_function
from torch import nn

from ..slots import CHANNELS_LAST, register_slots, stage_block_slots
from .staged import ChannelsLastStage, StagedBackbone, authors_init, create_staged

__all__ = ['PyramidVisionLLaMA', 'LocallyGroupedRoPEAttention', 'GlobalSubsampledRoPEAttention', 'rope_2d']


@register_notrace_function  # shapes decide the table: an FX leaf
def rope_2d(head_dim: int, rows: int, cols: int, step: float = 1., offset: float = 0.,
            device: Optional[torch.device] = None,
            dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sin, cos), each ``(rows * cols, head_dim)``, of the 2-D RoPE on a row-major grid whose point
    ``(i, j)`` sits at ``x = offset + step * j``, ``y = offset + step * i``. Channel pair ``2m, 2m+1``
    rotates by ``x * f_{m//2}`` (m even) or ``y * f_{m//2}`` (m odd), ``f_k = 10000^(-4k / head_dim)``."""
    if head_dim % 4:
        raise ValueError(f'2-D RoPE needs a head width divisible by 4, got {head_dim}')
    freqs = 10000. ** (-torch.arange(0, head_dim, 4, device=device, dtype=torch.float32) / head_dim)  # (hd/4,)
    y = offset + step * torch.arange(rows, device=device, dtype=torch.float32)
    x = offset + step * torch.arange(cols, device=device, dtype=torch.float32)
    x_ang = (x[None, :, None] * freqs).expand(rows, cols, -1)  # (rows, cols, hd/4)
    y_ang = (y[:, None, None] * freqs).expand(rows, cols, -1)
    angles = torch.stack([x_ang, y_ang], dim=-1).reshape(rows * cols, head_dim // 2)  # pairs: x0, y0, x1, y1, ...
    angles = angles.repeat_interleave(2, dim=-1)  # one angle per channel of its pair: (N, hd)
    return angles.sin().to(dtype), angles.cos().to(dtype)


def _rotate(t: torch.Tensor, sin_cos: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return apply_rot_embed(t, sin_cos[0], sin_cos[1])  # timm's interleaved-pair rotation, (..., N, hd)


class LocallyGroupedRoPEAttention(nn.Module):
    """LSA (Twins) with 2-D RoPE on ``(B, H, W, C)``: full attention inside non-overlapping ``ws x ws``
    windows (the map is zero-padded to a multiple of ``ws`` and cropped back)."""

    def __init__(self, dim: int, num_heads: int, window_size: int = 7, qkv_bias: bool = True,
                 attn_drop: float = 0., proj_drop: float = 0.):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'LSA: {num_heads} heads do not divide {dim} channels')
        self.num_heads, self.ws, self.attn_drop = num_heads, window_size, attn_drop
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        ws, nh = self.ws, self.num_heads
        x = F.pad(x, (0, 0, 0, (ws - W % ws) % ws, 0, (ws - H % ws) % ws))
        Hp, Wp = x.shape[1:3]
        h, w = Hp // ws, Wp // ws
        x = x.reshape(B, h, ws, w, ws, C).transpose(2, 3).reshape(B * h * w, ws * ws, C)  # windows (B', ws*ws, C)
        # (B', n, 3, nh, d) -> 3 x (B', nh, n, d)
        q, k, v = self.qkv(x).reshape(B * h * w, ws * ws, 3, nh, C // nh).permute(2, 0, 3, 1, 4).unbind(0)
        rope = rope_2d(C // nh, ws, ws, device=x.device, dtype=q.dtype)
        out = F.scaled_dot_product_attention(_rotate(q, rope), _rotate(k, rope), v,
                                             dropout_p=self.attn_drop if self.training else 0.)
        out = out.transpose(1, 2).reshape(B, h, w, ws, ws, C)  # (B', nh, n, d) -> (B, h, w, ws, ws, C)
        out = out.transpose(2, 3).reshape(B, Hp, Wp, C)[:, :H, :W]  # back to the map, padding cropped
        return self.proj_drop(self.proj(out))


class GlobalSubsampledRoPEAttention(nn.Module):
    """GSA (Twins) with 2-D RoPE on ``(B, H, W, C)``: every token attends to keys/values computed from an
    ``sr_ratio x sr_ratio`` strided conv (+ LayerNorm) of the map, each key placed at its cell's center."""

    def __init__(self, dim: int, num_heads: int, sr_ratio: int = 1, qkv_bias: bool = True,
                 attn_drop: float = 0., proj_drop: float = 0.):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'GSA: {num_heads} heads do not divide {dim} channels')
        self.num_heads, self.sr_ratio, self.attn_drop = num_heads, sr_ratio, attn_drop
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.sr = nn.Conv2d(dim, dim, sr_ratio, sr_ratio) if sr_ratio > 1 else None
        self.norm = nn.LayerNorm(dim) if sr_ratio > 1 else None
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        nh, r = self.num_heads, self.sr_ratio
        q = self.q(x).reshape(B, H * W, nh, C // nh).transpose(1, 2)  # (B, nh, N, d)
        if self.sr is not None:
            x = self.norm(self.sr(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1))  # (B, C, H, W) -> (B, H/r, W/r, C)
        h, w = x.shape[1:3]
        # (B, M, 2, nh, d) -> 2 x (B, nh, M, d)
        k, v = self.kv(x).reshape(B, h * w, 2, nh, C // nh).permute(2, 0, 3, 1, 4).unbind(0)
        q = _rotate(q, rope_2d(C // nh, H, W, device=x.device, dtype=q.dtype))
        k = _rotate(k, rope_2d(C // nh, h, w, step=float(r), offset=(r - 1) / 2., device=x.device, dtype=k.dtype))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, H, W, C)))  # (B, nh, N, d) -> (B, H, W, C)


class VisionLLaMABlock(nn.Module):
    """``x + ls1 * attn(LN(x))``, then ``x + ls2 * SwiGLU(LN(x))`` on ``(B, H, W, C)`` maps."""

    def __init__(self, dim: int, attn: nn.Module, init_values: float = 1e-4, swiglu_align: int = 256,
                 proj_drop: float = 0., drop_path: float = 0.):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn
        self.ls1 = LayerScale(dim, init_values)
        self.norm2 = nn.LayerNorm(dim)
        # LLaMA's hidden width: 2/3 of 4d, rounded up to a multiple of swiglu_align (256; 0 = no rounding)
        self.mlp = SwiGLU(dim, int(2 * 4 * dim / 3), bias=False, drop=proj_drop, align_to=swiglu_align)
        self.ls2 = LayerScale(dim, init_values)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))


class PyramidVisionLLaMA(StagedBackbone):
    """Pyramid VisionLLaMA (see the module docstring); timm model interface.

    Args:
        embed_dims, depths, num_heads: per stage.
        window_size: LSA window (7 in every stage).
        sr_ratios: GSA key/value sub-sampling per stage.
        init_values: layer-scale init.
        swiglu_align: the SwiGLU hidden width ``int(8d/3)`` is rounded up to a multiple of this (256, the
            authors' code; 0: no rounding, which gives Twins-SVT's parameter counts, see ``papers/afbo.yaml``).
    """

    intermediates_fmts = ('NCHW', 'NHWC')  # NHWC: the maps as the stages run

    def __init__(self, num_classes: int = 1000, in_chans: int = 3, embed_dims: Sequence[int] = (64, 128, 256, 512),
                 depths: Sequence[int] = (2, 2, 10, 4), num_heads: Sequence[int] = (2, 4, 8, 16), window_size: int = 7,
                 sr_ratios: Sequence[int] = (8, 4, 2, 1), qkv_bias: bool = True, init_values: float = 1e-4,
                 swiglu_align: int = 256, global_pool: str = 'avg', drop_rate: float = 0., proj_drop_rate: float = 0.,
                 attn_drop_rate: float = 0., drop_path_rate: float = 0.):
        super().__init__()
        self.in_chans = in_chans  # timm's attribute: the input image's channels
        if not len(embed_dims) == len(depths) == len(num_heads) == len(sr_ratios):
            raise ValueError(f'embed_dims, depths, num_heads and sr_ratios need one entry per stage, got '
                             f'{len(embed_dims)}, {len(depths)}, {len(num_heads)}, {len(sr_ratios)}')
        if global_pool not in ('avg', ''):
            raise ValueError(f"Pyramid VisionLLaMA pools by averaging (global_pool='avg', or '' for none), "
                             f"got {global_pool!r}")
        self.num_classes, self.global_pool, self.drop_rate = num_classes, global_pool, drop_rate
        self.channels_last = True
        self.output_fmt = 'NHWC'  # timm's attribute: forward_features returns (B, H, W, C)
        self.num_features = self.head_hidden_size = embed_dims[-1]
        n_blocks = sum(depths)
        dpr = [drop_path_rate * i / max(n_blocks - 1, 1) for i in range(n_blocks)]  # linear, as the authors'
        stages, c_in, reduction, self.feature_info = [], in_chans, 1, []
        for s, (dim, depth, heads, sr) in enumerate(zip(embed_dims, depths, num_heads, sr_ratios)):
            patch = 4 if s == 0 else 2
            reduction *= patch
            blocks = []
            for i in range(depth):  # LSA and GSA alternate, LSA first (Twins-SVT)
                attn = (LocallyGroupedRoPEAttention(dim, heads, window_size, qkv_bias, attn_drop_rate, proj_drop_rate)
                        if i % 2 == 0 else
                        GlobalSubsampledRoPEAttention(dim, heads, sr, qkv_bias, attn_drop_rate, proj_drop_rate))
                blocks.append(VisionLLaMABlock(dim, attn, init_values, swiglu_align, proj_drop_rate,
                                               dpr[sum(depths[:s]) + i]))
            # non-overlapping patch embedding (kernel = stride) + LayerNorm, then the blocks
            stages.append(ChannelsLastStage(c_in, dim, blocks, patch, patch, channels_last_in=s > 0))
            self.feature_info.append(dict(num_chs=dim, reduction=reduction, module=f'stages.{s}'))
            c_in = dim
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(self.num_features)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)

    # the authors': trunc-normal linears, fan-out normal convs
    _init_weights = staticmethod(partial(authors_init, conv='fan_out'))

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool not in (None, 'avg', ''):
            raise ValueError(f"Pyramid VisionLLaMA pools by averaging ('avg', or '' for none); "
                             f"global_pool={global_pool!r} is not supported")
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = global_pool
        ref = self.stages[0].downsample.weight
        self.head = nn.Linear(self.num_features, num_classes, device=ref.device, dtype=ref.dtype).train(self.training) \
            if num_classes > 0 else nn.Identity()
        if isinstance(self.head, nn.Linear) and ref.device.type != 'meta':
            self._init_weights(self.head)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Average the normalized tokens, normalize again with the same LayerNorm (the authors' head), classify;
        ``global_pool=''``: the same per position, ``(B, H, W, C)`` in and out (timm's unpooled head)."""
        if self.global_pool == 'avg':
            x = x.mean(dim=(1, 2))  # (B, H, W, C) -> (B, C)
        x = self.head_drop(self.norm(x))
        return x if pre_logits else self.head(x)

    def _prune_head(self) -> None:
        self.reset_classifier(0)  # the head keeps its average pool and second LayerNorm (see forward_head)


# the slot protocol (models/slots.py): swap_ffn replaces stages[s].blocks[i].mlp, SwiGLU FFNs on (B, H, W, C) maps
register_slots(PyramidVisionLLaMA, ffn=stage_block_slots(CHANNELS_LAST))


default_cfgs = generate_default_cfgs({  # read by timm's register_model
    name: dict(url='', num_classes=1000, input_size=(3, 224, 224), pool_size=(7, 7), crop_pct=0.875,
               interpolation='bicubic', mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
               first_conv='stages.0.downsample', classifier='head')
    for name in ('pyramid_visionllama_s', 'pyramid_visionllama_b', 'pyramid_visionllama_l')
})


@register_model
def pyramid_visionllama_s(pretrained: bool = False, **kwargs) -> PyramidVisionLLaMA:
    """Pyramid-VisionLLaMA-S (25.90 M params, 3.31 GMACs; published 22 M, 2.6 G: see ``papers/afbo.yaml``)."""
    args = dict(embed_dims=(64, 128, 256, 512), depths=(2, 2, 10, 4), num_heads=(2, 4, 8, 16))
    return create_staged(PyramidVisionLLaMA, 'pyramid_visionllama_s', pretrained, **{**args, **kwargs})


@register_model
def pyramid_visionllama_b(pretrained: bool = False, **kwargs) -> PyramidVisionLLaMA:
    """Pyramid-VisionLLaMA-B (56.03 M params, 8.56 GMACs; published 56 M, 9.0 G)."""
    args = dict(embed_dims=(96, 192, 384, 768), depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24))
    return create_staged(PyramidVisionLLaMA, 'pyramid_visionllama_b', pretrained, **{**args, **kwargs})


@register_model
def pyramid_visionllama_l(pretrained: bool = False, **kwargs) -> PyramidVisionLLaMA:
    """Pyramid-VisionLLaMA-L (104.72 M params, 16.57 GMACs; published 99 M, 18.0 G: see ``papers/afbo.yaml``)."""
    args = dict(embed_dims=(128, 256, 512, 1024), depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32))
    return create_staged(PyramidVisionLLaMA, 'pyramid_visionllama_l', pretrained, **{**args, **kwargs})
