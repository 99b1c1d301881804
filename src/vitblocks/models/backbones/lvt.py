"""LVT, the Lite Vision Transformer (Yang et al., "Lite Vision Transformer with Enhanced
Self-Attention", CVPR 2022): the IFFN paper's "portable ViT" and an AFBO Table 2 backbone.

Written from the paper and the authors' model definition (``lvt`` with its ImageNet config):

* 4 stages of 2 blocks, widths 64/64/160/256, heads 2/2/5/8, MLP ratios 4/8/4/4. Each stage
  starts with an overlapping patch embedding (7x7 stride 4, then 3x3 stride 2) + LayerNorm.
  The whole network runs on channels-last maps ``(B, H, W, C)``.
* Stage 1 mixes tokens with Convolutional Self-Attention (CSA, :class:`ConvSelfAttention`):
  each 3x3 neighbourhood (stride 2) attends within itself, with weights predicted from the
  average-pooled center and one C x C value projection per kernel position.
* Stages 2-4 use Recursive Atrous Self-Attention (RASA, :class:`RecursiveAtrousSelfAttention`):
  queries pass a depthwise 3x3 conv shared over dilations 1, 3, 5 (SiLU each, summed), keys and
  values are spatially reduced (stride 4/2/1 conv + LayerNorm), and the attention is applied
  ``recursions`` times with shared weights: ``x <- SiLU(attn(x + x_prev))`` (2 in the authors'
  ImageNet config; the IFFN paper's LVT-R1..R4 are 1..4 recursions, same parameters).
* MLPs: stage 1 a plain MLP, stages 2-4 ``fc1 -> 3x3 depthwise conv -> GELU -> fc2``.
* Head of the authors' ImageNet model (``lvt_cls``, the 5.5 M model the papers report): a class
  token and two VOLO class-attention blocks (timm's ``volo.ClassBlock``) on the final 7x7
  tokens, LayerNorm, ``head(cls) + 0.5 * max over tokens of aux_head(tokens)`` (the token-
  labeling head, as LV-ViT; token-labeling training itself is not implemented).
  ``class_blocks=0`` builds the plain backbone (``lvt``: LayerNorm, average pool, linear; 3.69 M).
* timm's interface: ``forward_features`` returns the final ``(B, H, W, C)`` map, as every
  hierarchical timm model (PVTv2, Swin) does; the class-attention blocks and the final LayerNorm,
  which follows them, belong to the head (as timm's ConvNeXt keeps its final norm in its head).
  ``global_pool=''`` returns the normalized map (the class-attention blocks update only the class
  token, so the patch tokens reach the norm as the stages left them), classified per position.

``swap_ffn`` replaces ``stages[s].blocks[i].mlp`` (input ``(B, H, W, C)``, like GC ViT); the
depthwise conv of LVT's own MLP goes with it.

| model | params | GMACs (attn matmuls, norms 2/element) |
| --- | ---: | ---: |
| ``lvt`` (recursions=2) | 5.52 M | 0.92; 0.84 counted as the papers (see ``papers/iffn.yaml``) |
"""
from functools import partial
from typing import Any, Dict, Optional, Sequence, Set

import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from timm.models.volo import ClassBlock
from torch import nn

from ...layers import TokenLayout, create_ffn
from ..slots import CHANNELS_LAST, register_slots, stage_block_slots
from ..weight_decay import expose_no_weight_decay
from .staged import ChannelsLastStage, StagedBackbone, authors_init, create_staged

__all__ = ['LVT', 'ConvSelfAttention', 'RecursiveAtrousSelfAttention', 'LVTMlp', 'swap_class_block_ffns']


class ConvSelfAttention(nn.Module):
    """CSA (LVT Sec. 3.1): attention inside every 3x3 window (stride 2), folded back to the map.

    For each window the attention over its 9 x 9 position pairs is predicted from the average-
    pooled window center by one linear layer; values get one C x C projection per kernel
    position (a grouped 1x1 conv in the authors' code). Input and output ``(B, H, W, C)``.
    """

    def __init__(self, dim: int, num_heads: int, kernel_size: int = 3, stride: int = 2, attn_drop: float = 0.,
                 proj_drop: float = 0.):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'CSA: {num_heads} heads do not divide {dim} channels')
        self.num_heads, self.kernel_size, self.stride = num_heads, kernel_size, stride
        self.scale = (dim // num_heads) ** -0.5
        k2 = kernel_size * kernel_size
        self.attn = nn.Linear(dim, k2 * k2 * num_heads)  # pooled center -> (heads, k2, k2) weights
        # one C x C value projection per kernel position: a 1x1 conv with k2 groups over (position, channel)
        self.value = nn.Conv2d(k2 * dim, k2 * dim, 1, groups=k2, bias=False)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        k, s, nh = self.kernel_size, self.stride, self.num_heads
        k2, pad = k * k, k // 2
        x_nchw = x.permute(0, 3, 1, 2)  # (B, H, W, C) -> (B, C, H, W)
        centers = F.avg_pool2d(x_nchw, s, s, ceil_mode=True).permute(0, 2, 3, 1)  # (B, h, w, C)
        h, w = centers.shape[1], centers.shape[2]
        attn = self.attn(centers).reshape(B, h * w, nh, k2, k2).transpose(1, 2)  # (B, nh, N, k2, k2)
        attn = self.attn_drop((attn * self.scale).softmax(dim=-1))

        v = F.unfold(x_nchw, k, padding=pad, stride=s)  # (B, C * k2, N), channel-major
        v = v.reshape(B, C, k2, h * w).transpose(1, 2).reshape(B, k2 * C, h * w, 1)  # position-major groups
        v = self.value(v).reshape(B, k2, nh, C // nh, h * w).permute(0, 2, 4, 1, 3)  # (B, nh, N, k2, C/nh)

        out = (attn @ v).permute(0, 1, 4, 3, 2).reshape(B, C * k2, h * w)  # (B, nh, C/nh, k2, N) -> (B, C*k2, N)
        out = F.fold(out, (H, W), k, padding=pad, stride=s)  # overlapping windows summed: (B, C, H, W)
        return self.proj_drop(self.proj(out.permute(0, 2, 3, 1)))  # (B, C, H, W) -> (B, H, W, C)


class AtrousDepthwiseConv(nn.Module):
    """One depthwise 3x3 kernel applied at several dilations, SiLU after each, summed (RASA queries)."""

    def __init__(self, dim: int, dilations: Sequence[int] = (1, 3, 5), bias: bool = False):
        super().__init__()
        self.dilations = tuple(dilations)
        self.weight = nn.Parameter(torch.empty(dim, 1, 3, 3))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        nn.init.kaiming_uniform_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        out = torch.zeros_like(x)  # a loop rather than sum(generator), which TorchScript cannot compile
        for d in self.dilations:
            out = out + F.silu(F.conv2d(x, self.weight, self.bias, padding=d, dilation=d, groups=x.shape[1]))
        return out


class RecursiveAtrousSelfAttention(nn.Module):
    """RASA (LVT Sec. 3.2) on ``(B, H, W, C)`` maps: atrous queries, spatially reduced keys and values,
    applied ``recursions`` times with shared weights (SiLU between, input re-added)."""

    def __init__(self, dim: int, num_heads: int, sr_ratio: int = 1, recursions: int = 2,
                 dilations: Sequence[int] = (1, 3, 5), attn_drop: float = 0., proj_drop: float = 0.):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'RASA: {num_heads} heads do not divide {dim} channels')
        if recursions < 1:
            raise ValueError(f'recursions must be >= 1, got {recursions}')
        self.num_heads, self.recursions, self.attn_drop = num_heads, recursions, attn_drop
        self.q = nn.Linear(dim, dim, bias=False)
        self.q_atrous = AtrousDepthwiseConv(dim, dilations) if dilations else None
        self.kv = nn.Linear(dim, 2 * dim, bias=False)
        self.sr = nn.Conv2d(dim, dim, sr_ratio, sr_ratio) if sr_ratio > 1 else None
        self.sr_norm = nn.LayerNorm(dim) if sr_ratio > 1 else None
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        nh = self.num_heads
        q = self.q(x)
        if self.q_atrous is not None:
            q = self.q_atrous(q.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # conv on (B, C, H, W), back to (B, H, W, C)
        q = q.reshape(B, H * W, nh, C // nh).transpose(1, 2)  # (B, nh, N, C/nh)
        if self.sr is not None:
            x = self.sr_norm(self.sr(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1))  # (B, H/r, W/r, C)
        k, v = self.kv(x).reshape(B, -1, 2, nh, C // nh).permute(2, 0, 3, 1, 4).unbind(0)  # 2 x (B, nh, M, C/nh)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, H, W, C)))  # (B, nh, N, d) -> (B, H, W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._attend(x)
        if self.recursions == 1:
            return out
        out = F.silu(out)
        for _ in range(self.recursions - 1):  # recursion: attend to (previous output + its input)
            x = out + x
            out = F.silu(self._attend(x))
        return out


class LVTMlp(nn.Module):
    """LVT's MLP on ``(B, H, W, C)`` maps: fc1, optional 3x3 depthwise conv, GELU, fc2 (a Linear on
    channels-last maps is the authors' 1x1 conv; ``fc1``/``fc2`` are what ``swap_ffn`` reads)."""

    def __init__(self, in_features: int, hidden_features: int, depthwise: bool = True, drop: float = 0.):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.dwconv = nn.Conv2d(hidden_features, hidden_features, 3, padding=1, groups=hidden_features) \
            if depthwise else None
        self.act = nn.GELU()
        self.drop = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        if self.dwconv is not None:
            x = self.dwconv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # (B, H, W, C') via (B, C', H, W)
        return self.drop(self.fc2(self.drop(self.act(x))))


class LVTBlock(nn.Module):
    """Pre-norm block on ``(B, H, W, C)`` maps: CSA or RASA, then the MLP, each residual."""

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: float, depthwise_mlp: bool, drop_path: float = 0.,
                 drop: float = 0.):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = LVTMlp(dim, int(dim * mlp_ratio), depthwise_mlp, drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, W, C)
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class LVT(StagedBackbone):
    """Lite Vision Transformer (see the module docstring); timm model interface.

    Args:
        recursions: RASA recursions (2 in the authors' model; LVT-R1..R4 of the IFFN paper).
        class_blocks: class-attention blocks before the head (2: the authors' ImageNet model;
            0: the plain backbone with average pooling).
        aux_head: with class blocks, the token-labeling head on the patch tokens.
    """

    def __init__(self, num_classes: int = 1000, in_chans: int = 3, embed_dims=(64, 64, 160, 256),
                 depths=(2, 2, 2, 2), num_heads=(2, 2, 5, 8), mlp_ratios=(4, 8, 4, 4),
                 depthwise_mlp=(False, True, True, True), sr_ratios=(8, 4, 2, 1), recursions: int = 2,
                 dilations: Sequence[int] = (1, 3, 5), class_blocks: int = 2, aux_head: bool = True,
                 global_pool: Optional[str] = None, drop_rate: float = 0., proj_drop_rate: float = 0.,
                 attn_drop_rate: float = 0., drop_path_rate: float = 0.):
        super().__init__()
        self.in_chans = in_chans  # timm's attribute: the input image's channels
        self.output_fmt = 'NHWC'  # timm's attribute: forward_features returns (B, H, W, C)
        pool = 'token' if class_blocks else 'avg'  # the pooling the head is built for (_built_pool)
        if global_pool not in (None, pool, ''):
            raise ValueError(f"LVT with class_blocks={class_blocks} pools by {pool!r} (or '' for none), got "
                             f"global_pool={global_pool!r} (class_blocks=0 for average pooling)")
        self.num_classes, self.drop_rate, self.channels_last = num_classes, drop_rate, True
        self.global_pool = pool if global_pool is None else global_pool
        self.num_features = self.head_hidden_size = embed_dims[-1]
        n_blocks = sum(depths)
        dpr = [drop_path_rate * i / max(n_blocks - 1, 1) for i in range(n_blocks)]  # linear, as the authors'
        stages, c_in, reduction, self.feature_info = [], in_chans, 1, []
        for s, (dim, depth) in enumerate(zip(embed_dims, depths)):
            patch, stride = (7, 4) if s == 0 else (3, 2)
            reduction *= stride
            blocks = []
            for i in range(depth):
                if s == 0:  # CSA in the first stage, RASA after
                    attn = ConvSelfAttention(dim, num_heads[s], attn_drop=attn_drop_rate, proj_drop=proj_drop_rate)
                else:
                    attn = RecursiveAtrousSelfAttention(dim, num_heads[s], sr_ratios[s], recursions, dilations,
                                                        attn_drop=attn_drop_rate, proj_drop=proj_drop_rate)
                blocks.append(LVTBlock(dim, attn, mlp_ratios[s], depthwise_mlp[s], dpr[sum(depths[:s]) + i],
                                       proj_drop_rate))
            # overlapping patch embedding (padding patch // 2) + LayerNorm, then the blocks
            stages.append(ChannelsLastStage(c_in, dim, blocks, patch, stride, patch // 2, channels_last_in=s > 0))
            self.feature_info.append(dict(num_chs=dim, reduction=reduction, module=f'stages.{s}'))
            c_in = dim
        self.stages = nn.Sequential(*stages)
        dim = embed_dims[-1]
        self.num_prefix_tokens = 1 if class_blocks else 0
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if class_blocks else None
        self.post_blocks = nn.Sequential(*[ClassBlock(dim, num_heads[-1], mlp_ratio=mlp_ratios[-1])
                                           for _ in range(class_blocks)])
        self.norm = nn.LayerNorm(dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.use_aux_head = aux_head and class_blocks > 0
        self.head = self.aux_head = None
        self.reset_classifier(num_classes, self.global_pool)
        self.apply(self._init_weights)
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=.02)

    # the authors': trunc-normal linears, fan-out normal convs
    _init_weights = staticmethod(partial(authors_init, conv='fan_out'))

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Parameters timm's optimizer factory keeps out of weight decay: the class token, as the authors'
        ``no_weight_decay`` (biases and norms are left out by timm anyway)."""
        return {'cls_token'} if self.cls_token is not None else set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """The stages' groups (see ``StagedBackbone.group_matcher``), then the class token with the first
        class-attention block, one group per class block and the final norm with the last (as timm's VOLO)."""
        matcher = super().group_matcher(coarse)
        if not coarse:
            matcher['blocks'] = matcher['blocks'][:-1]  # the final norm follows the class blocks here
        matcher['post_blocks'] = [(r'^cls_token$', (0,)), (r'^post_blocks\.(\d+)\.', None), (r'^norm\.', (99999,))]
        return matcher

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def _built_pool(self) -> str:
        """The pooling the head is built for: the class token with class blocks, else the average."""
        return 'token' if self.cls_token is not None else 'avg'

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """timm's API: a new classifier for ``num_classes`` (0: none). ``global_pool``: the pooling the model was
        built with (class token with class blocks, else average), or ``''`` for none (see ``forward_head``)."""
        pool = self._built_pool()
        if global_pool not in (None, pool, ''):
            raise ValueError(f"this LVT pools by {pool!r} (or '' for none); global_pool={global_pool!r} needs "
                             f"another class_blocks setting at build time")
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = global_pool
        ref = self.stages[0].downsample.weight
        dd = dict(device=ref.device, dtype=ref.dtype)
        linear = lambda: nn.Linear(self.num_features, num_classes, **dd)  # noqa: E731
        # new heads join the model's train / eval mode
        self.head = linear().train(self.training) if num_classes > 0 else nn.Identity()
        self.aux_head = linear().train(self.training) if num_classes > 0 and self.use_aux_head else None
        for head in (self.head, self.aux_head):
            if isinstance(head, nn.Linear) and head.weight.device.type != 'meta':
                self._init_weights(head)

    def _after_stages(self, x: torch.Tensor) -> torch.Tensor:
        """Final (B, H, W, C) map -> forward_features' output: the map itself with class blocks (the final norm
        follows them, in the head), else the normalized map."""
        return x if self.cls_token is not None else self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """forward_features' (B, H, W, C) map -> logits: the class token after the class-attention blocks and
        the norm (+ 0.5 x the per-class max of the aux head over the patch tokens), or the average of the
        normalized map without class blocks. ``global_pool=''``: the normalized map, ``(B, H, W, C)``, and the
        classifier per position (timm's unpooled head)."""
        if self.global_pool == '':
            x = self.norm(x) if self.cls_token is not None else x  # class blocks would change the class token only
            return x if pre_logits else self.head(self.head_drop(x))
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x.flatten(1, 2)], dim=1)  # (B, 1 + H*W, C)
            x = self.norm(self.post_blocks(x))
            pooled, patches = x[:, 0], x[:, 1:]  # (B, C), (B, H*W, C)
        else:
            pooled, patches = x.mean(dim=(1, 2)), x.flatten(1, 2)  # (B, H, W, C) -> (B, C), (B, H*W, C)
        pooled = self.head_drop(pooled)
        if pre_logits:
            return pooled
        logits = self.head(pooled)
        if self.aux_head is not None:
            logits = logits + 0.5 * self.aux_head(patches).amax(dim=1)  # (B, N, classes) -> (B, classes)
        return logits

    def _norm_intermediate(self, x: torch.Tensor) -> torch.Tensor:
        # forward_intermediates(norm=True): with class blocks the final norm is the head's, and maps are taken
        # as they are
        return x if self.cls_token is not None else self.norm(x)

    def _prune_norm(self) -> None:
        if self.cls_token is None:
            self.norm = nn.Identity()  # with class blocks the norm goes with the head, in _prune_head

    def _prune_head(self) -> None:
        """Drop the head: the class-attention blocks, class token and final norm with it; forward then returns
        the last stage's map."""
        if self.cls_token is not None:
            self.post_blocks, self.norm, self.cls_token = nn.Sequential(), nn.Identity(), None
            self.use_aux_head = False
        self.reset_classifier(0, '')


default_cfgs = generate_default_cfgs({  # read by timm's register_model
    'lvt': dict(url='', num_classes=1000, input_size=(3, 224, 224), pool_size=(7, 7), crop_pct=0.96,
                interpolation='bicubic', mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
                first_conv='stages.0.downsample', classifier=('head', 'aux_head')),
})


@register_model
def lvt(pretrained: bool = False, **kwargs) -> LVT:
    """LVT (5.52 M params): the authors' ImageNet model (``lvt_cls``: 2 RASA recursions, 2 class-attention
    blocks, token-labeling head). ``recursions=1..4``: the IFFN paper's LVT-R1..R4."""
    return create_staged(LVT, 'lvt', pretrained, **kwargs)


# --- the papers' LVT variants (iffn_lvt in models/iffn.py, afbo_lvt in models/afbo.py) --------------
# IFFN Table 1 (LVT-R1..R4 + IFFN*, 5x5 kernel) and AFBO Table 2 (LVT + AFBO, G1 = 2, G2 = 2).
# Their parameter counts (4.98 M, 5.2 M) are reached only if the MLPs of the two class-attention
# blocks are replaced too; those see one class token and no grid, so they get the FFN's
# channel part only (IFFN ``spatial_part=False``, AFBO ``order='cm'``).

def swap_class_block_ffns(model: LVT, name: str, **cfg) -> int:
    """Replace the MLPs of ``model.post_blocks`` (class token only, no grid) with FFN ``name``."""
    for blk in model.post_blocks:
        old = blk.mlp
        ref = old.fc1.weight
        blk.mlp = create_ffn(name, old.fc1.in_features, old.fc1.out_features, old.fc2.out_features,
                             layout=TokenLayout(None, 0), device=ref.device, dtype=ref.dtype, **cfg).train(old.training)
    expose_no_weight_decay(model)
    return len(model.post_blocks)


# the slot protocol (models/slots.py): swap_ffn replaces stages[s].blocks[i].mlp, on (B, H, W, C) maps
register_slots(LVT, ffn=stage_block_slots(CHANNELS_LAST))
