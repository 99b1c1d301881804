"""FFNs that AFBO is compared with (AFBO paper Tables 1, 3, 11 and 13), under the swap API.

| registered name | what                                                          | paper rows                |
| --------------- | ------------------------------------------------------------- | ------------------------- |
| ``glu``         | GLU (Shazeer 2020), timm ``GluMlp``, sigmoid gate, width M*d  | Table 1 (M=8/3), 11 (M=4) |
| ``swiglu``      | SwiGLU (EVA-02), timm ``SwiGLU``, SiLU gate, width M*d        | Table 3                   |
| ``group_ffn``   | ``afbo_grouped`` without spatial op (``order='cm'``)          | Table 1 Group FFN, 13     |
| ``conv_glu``    | ConvGLU (TransNeXt): ``act(DWConv(x W_x)) * (x W_v)``         | Table 3                   |
| ``convnext_block`` | ConvNeXt block: 7x7 DWConv, LayerNorm, MLP, layer scale    | Table 3                   |
| ``localvit``    | LocalViT FFN: 1x1 conv-BN-act, kxk depthwise-BN-act, 1x1-BN   | (Sec. 2, related work)    |

All follow timm's ``Mlp`` constructor vocabulary and accept ``layout=``; the ones with a
depthwise conv keep prefix tokens out of it, as AFBO does.
"""
from typing import List, Optional, Tuple, Type, Union

import torch
from timm.layers import GluMlp, LayerNorm, SwiGLU, to_2tuple
from torch import nn

from .activations import ACTIVATIONS, activation_name
from .afbo import AFBO
from .batchnorm import TokenBatchNorm
from .layout import TokenLayout, merge_tokens
from .registry import register_ffn

__all__ = ['glu', 'swiglu', 'group_ffn', 'ConvGLU', 'ConvNeXtFFN', 'LocalViTFFN']

def _act_class(act_layer: Union[str, Type[nn.Module]]) -> Type[nn.Module]:
    """The ``act_layer`` class of a name or class, through the one activation registry."""
    return ACTIVATIONS[activation_name(act_layer)].module


def _gated_width(in_features: int, hidden_features: Optional[int], expansion: Optional[float]) -> int:
    """M*d for an expansion M (GLU's gated width), else the slot's hidden width."""
    if expansion is None:
        return hidden_features or 4 * in_features
    return int(round(expansion * in_features))


@register_ffn('glu', inherits=('drop',))
def glu(in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
        act_layer: Union[str, Type[nn.Module]] = 'sigmoid', expansion: Optional[float] = 8 / 3,
        layout: Optional[TokenLayout] = None, **kwargs) -> nn.Module:
    """GLU FFN (timm ``GluMlp``): ``fc2((x W) * act(x V))`` with gated width ``M*d``.

    ``expansion`` is M: 8/3 keeps the FFN's parameters and MACs (Table 1), 4 is Table 11's
    wide GLU; ``None`` uses ``hidden_features``. Three ``d x Md`` matrices: ``3Md^2``.
    """
    width = _gated_width(in_features, hidden_features, expansion)
    cf = bool(layout and layout.channels_first)
    mlp = GluMlp(in_features, 2 * width, out_features, act_layer=_act_class(act_layer), use_conv=cf, **kwargs)
    mlp.init_weights()  # timm's GLU init: gate ~ constant at start
    return mlp


@register_ffn('swiglu', inherits=('drop',))
def swiglu(in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
           act_layer: Union[str, Type[nn.Module]] = 'silu', expansion: Optional[float] = 8 / 3,
           layout: Optional[TokenLayout] = None, **kwargs) -> nn.Module:
    """SwiGLU FFN (timm ``SwiGLU``, as in EVA-02): ``fc2(act(x W_g) * (x W_x))``, gated width ``M*d``.

    Channels-first backbones (PoolFormer) get timm's packed form (``GluMlp`` with 1x1 convs,
    gate first), which is the same function.
    """
    width = _gated_width(in_features, hidden_features, expansion)
    if layout is not None and layout.channels_first:
        mlp = GluMlp(in_features, 2 * width, out_features, act_layer=_act_class(act_layer), use_conv=True,
                     gate_last=False, **kwargs)
    else:
        mlp = SwiGLU(in_features, width, out_features, act_layer=_act_class(act_layer), **kwargs)
    mlp.init_weights()
    return mlp


@register_ffn('group_ffn', inherits=('drop',))
def group_ffn(in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
              groups: int = 2, **kwargs) -> AFBO:
    """Group FFN (Table 1) / Group Convolution (Table 13): the bilinear FFN with block-wise maps.

    ``AFBO(variant='afbo_grouped', order='cm', block_groups=groups)``: both branches are the
    block-diagonal map of Eq. 5 with G = ``groups``, multiplied after the activation of the left
    branch, then fc2; no spatial op ("AFBO with only CM" with block-wise maps, App. A.4). Cost:
    ``2Md^2/G + Md^2``, Table 1's formula. The registered ``afbo_grouped`` keeps the spatial op.
    """
    if 'block_groups' in kwargs:
        raise ValueError(f"group_ffn takes its group number as groups= (got block_groups={kwargs['block_groups']})")
    return AFBO(in_features, hidden_features, out_features, variant='afbo_grouped', block_groups=groups, order='cm',
                **kwargs)


def _check_kernel_size(kernel_size: int) -> None:
    """Same padding needs a positive odd kernel: an even one would grow the grid by one row and column."""
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f'kernel_size must be a positive odd integer (same padding), got {kernel_size!r}')


def _to_channels_last(x: torch.Tensor, layout: TokenLayout, owner: str) -> torch.Tensor:
    if layout.channels_first:
        if x.ndim != 4:
            raise ValueError(f'{owner} (channels_first) expects (B, C, H, W), got shape {list(x.shape)}')
        return x.permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C)
    return x


def _map_of(h: torch.Tensor, layout: TokenLayout, owner: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Channels-last tokens ``(B, N, C)`` or maps ``(B, H, W, C)`` as a ``(B, C, H, W)`` map view, plus the prefix
    tokens that bypass a spatial op; :func:`_back_from_map` undoes it. Free functions around the layer's own call of
    its op, so the layer scripts (TorchScript passes no module to a function)."""
    if h.ndim == 4:
        return h.permute(0, 3, 1, 2), None  # (B, H, W, C) -> (B, C, H, W)
    prefix, fmap = layout.split_tokens(h, owner)  # (B, P + H*W, C) -> (B, P, C), (B, C, H, W)
    return fmap, prefix


def _back_from_map(fmap: torch.Tensor, prefix: Optional[torch.Tensor], ndim: int) -> torch.Tensor:
    if ndim == 4:
        return fmap.permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C)
    return merge_tokens(prefix, fmap)  # (B, C, H, W) (+ prefix) -> (B, P + H*W, C)


@register_ffn('conv_glu', inherits=('drop',))
class ConvGLU(nn.Module):
    """Convolutional GLU of TransNeXt (Shi, CVPR 2024): ``fc2(act(DWConv(x W_x)) * (x W_v))``.

    fc1 maps d to two halves of ``h = int(2/3 * hidden_features)`` channels (TransNeXt's choice,
    which keeps the FFN's cost); the first half goes through a k x k depthwise conv and the
    activation (GELU) and gates the second. Prefix tokens skip the depthwise conv.
    """

    def __init__(self, in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
                 act_layer: Union[str, Type[nn.Module]] = 'gelu', norm_layer: Optional[Type[nn.Module]] = None,
                 bias: Union[bool, Tuple[bool, bool]] = True, drop: Union[float, Tuple[float, float]] = 0.,
                 kernel_size: int = 3, grid_size: Optional[Tuple[int, int]] = None, num_prefix_tokens: int = 0,
                 channels_first: bool = False, layout: Optional[TokenLayout] = None, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        out_features = out_features or in_features
        hidden = int(2 * (hidden_features or 4 * in_features) / 3)
        bias, drop_probs = to_2tuple(bias), to_2tuple(drop)
        _check_kernel_size(kernel_size)
        self.layout = TokenLayout.resolve(layout, grid_size, num_prefix_tokens, channels_first)
        self.hidden_features = hidden
        self.fc1 = nn.Linear(in_features, 2 * hidden, bias=bias[0], **dd)
        self.dwconv = nn.Conv2d(hidden, hidden, kernel_size, padding=kernel_size // 2, groups=hidden, **dd)
        self.act = _act_class(act_layer)()
        self.drop1 = nn.Dropout(drop_probs[0])
        self.norm = norm_layer(hidden, **dd) if norm_layer is not None else nn.Identity()
        self.fc2 = nn.Linear(hidden, out_features, bias=bias[1], **dd)
        self.drop2 = nn.Dropout(drop_probs[1])
        self.init_weights()

    def init_weights(self):
        for m in (self.fc1, self.fc2):
            nn.init.trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        self.layout.set_grid(feat_size)  # timm's PVTv2 passes the grid (feat_size)
        h = self.fc1(_to_channels_last(x, self.layout, 'ConvGLU'))
        h, v = h.chunk(2, dim=-1)  # (..., 2h) -> 2 x (..., h)
        fmap, prefix = _map_of(h, self.layout, 'ConvGLU')
        h = self.act(_back_from_map(self.dwconv(fmap), prefix, h.ndim)) * v
        y = self.drop2(self.fc2(self.norm(self.drop1(h))))
        return y.permute(0, 3, 1, 2) if self.layout.channels_first else y  # (B, H, W, C) -> (B, C, H, W)


@register_ffn('convnext_block', inherits=('drop',))
class ConvNeXtFFN(nn.Module):
    """The ConvNeXt block (Liu et al., CVPR 2022) as a channel mixer, the "ConvNeXt Block" rows of
    AFBO's Table 3: ``gamma * fc2(GELU(fc1(LN(DWConv_k(x)))))``.

    k x k depthwise conv with bias (k = 7), LayerNorm, fc1 (d -> hidden, 4d), GELU, fc2 (hidden -> d),
    a per-channel layer scale initialized to ``ls_init_value`` (1e-6, as ConvNeXt). The host block's
    pre-norm and shortcut stay; the ConvNeXt block's own shortcut is not added a second time.
    Prefix tokens skip the depthwise conv. Parameters over timm's ``Mlp``: ``d(k^2 + 1) + 3d``.
    """

    def __init__(self, in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
                 act_layer: Union[str, Type[nn.Module]] = 'gelu', norm_layer: Optional[Type[nn.Module]] = None,
                 bias: Union[bool, Tuple[bool, bool]] = True, drop: Union[float, Tuple[float, float]] = 0.,
                 kernel_size: int = 7, ls_init_value: Optional[float] = 1e-6,
                 grid_size: Optional[Tuple[int, int]] = None, num_prefix_tokens: int = 0, channels_first: bool = False,
                 layout: Optional[TokenLayout] = None, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        out_features = out_features or in_features
        hidden = hidden_features or 4 * in_features
        bias, drop_probs = to_2tuple(bias), to_2tuple(drop)
        _check_kernel_size(kernel_size)
        self.layout = TokenLayout.resolve(layout, grid_size, num_prefix_tokens, channels_first)
        self.dwconv = nn.Conv2d(in_features, in_features, kernel_size, padding=kernel_size // 2, groups=in_features,
                                **dd)
        self.norm = (norm_layer or LayerNorm)(in_features, **dd)
        self.fc1 = nn.Linear(in_features, hidden, bias=bias[0], **dd)
        self.act = _act_class(act_layer)()
        self.drop1 = nn.Dropout(drop_probs[0])
        self.fc2 = nn.Linear(hidden, out_features, bias=bias[1], **dd)
        self.gamma = nn.Parameter(torch.full((out_features,), ls_init_value, **dd)) if ls_init_value else None
        self.drop2 = nn.Dropout(drop_probs[1])
        for m in (self.fc1, self.fc2):
            nn.init.trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        self.layout.set_grid(feat_size)  # timm's PVTv2 passes the grid (feat_size)
        h = _to_channels_last(x, self.layout, 'ConvNeXtFFN')
        fmap, prefix = _map_of(h, self.layout, 'ConvNeXtFFN')
        h = _back_from_map(self.dwconv(fmap), prefix, h.ndim)
        y = self.fc2(self.drop1(self.act(self.fc1(self.norm(h)))))
        y = self.drop2(y * self.gamma if self.gamma is not None else y)
        return y.permute(0, 3, 1, 2) if self.layout.channels_first else y  # (B, H, W, C) -> (B, C, H, W)


class _ConvBNAct(nn.Module):
    """k x k depthwise conv (no bias) + BatchNorm2d + activation on a ``(B, C, H, W)`` map."""

    def __init__(self, channels: int, kernel_size: int, act: Type[nn.Module], device=None, dtype=None):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels, bias=False,
                              device=device, dtype=dtype)
        self.bn = nn.BatchNorm2d(channels, device=device, dtype=dtype)
        self.act = act()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


@register_ffn('localvit', inherits=('drop',))
class LocalViTFFN(nn.Module):
    """The locality FFN of LocalViT (Li et al., 2021): a MobileNetV2-style inverted residual body.

    ``1x1 conv (d -> hidden) - BN - act``, ``kxk depthwise - BN - act``, ``1x1 conv (hidden -> d) - BN``,
    act = hard swish (LocalViT's default). No biases: a BatchNorm follows every conv, so ``bias``
    is accepted for the ``Mlp`` vocabulary and ignored. As a swap-in FFN the block's own shortcut
    and pre-norm are kept (LocalViT drops the norm and puts the shortcut inside); prefix tokens
    (class token) go through the 1x1 layers but skip the depthwise conv. The SE/ECA options of
    LocalViT are not reproduced. ``norm_layer`` (none by default) is timm ``Mlp``'s optional norm on
    the hidden features before the last 1x1 layer.
    """

    def __init__(self, in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
                 act_layer: Union[str, Type[nn.Module]] = 'hardswish', bias: Union[bool, Tuple[bool, bool]] = False,
                 drop: Union[float, Tuple[float, float]] = 0., kernel_size: int = 3,
                 grid_size: Optional[Tuple[int, int]] = None, num_prefix_tokens: int = 0, channels_first: bool = False,
                 layout: Optional[TokenLayout] = None, norm_layer=None, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        out_features = out_features or in_features
        hidden = hidden_features or 4 * in_features
        act = _act_class(act_layer)
        drop_probs = to_2tuple(drop)
        _check_kernel_size(kernel_size)
        self.layout = TokenLayout.resolve(layout, grid_size, num_prefix_tokens, channels_first)
        self.fc1 = nn.Linear(in_features, hidden, bias=False, **dd)
        self.bn1 = TokenBatchNorm(hidden, **dd)
        self.act1 = act()
        self.spatial = _ConvBNAct(hidden, kernel_size, act, **dd)
        self.drop1 = nn.Dropout(drop_probs[0])
        self.norm = norm_layer(hidden, **dd) if norm_layer is not None else nn.Identity()  # timm Mlp's slot
        self.fc2 = nn.Linear(hidden, out_features, bias=False, **dd)
        self.bn2 = TokenBatchNorm(out_features, **dd)
        self.drop2 = nn.Dropout(drop_probs[1])

    def forward(self, x: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        self.layout.set_grid(feat_size)  # timm's PVTv2 passes the grid (feat_size)
        h = self.act1(self.bn1(self.fc1(_to_channels_last(x, self.layout, 'LocalViTFFN'))))
        fmap, prefix = _map_of(h, self.layout, 'LocalViTFFN')
        h = self.drop1(_back_from_map(self.spatial(fmap), prefix, h.ndim))
        y = self.drop2(self.bn2(self.fc2(self.norm(h))))
        return y.permute(0, 3, 1, 2) if self.layout.channels_first else y
