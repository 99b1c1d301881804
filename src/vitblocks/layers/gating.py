"""NiNformer: a gating unit whose gate is an MLP-Mixer sub-network, and the LocalViT baseline FFN.

From "NiNformer: A Network in Network Transformer with Token Mixing as a Gating Function
Generator" (Abdullah & Aydin, 2024), Sec. 3.2::

    Gating(I) = MLPMixer(I) * Linear(I)                       # Eq. 8, the token mixer
    Y = Gating(LayerNorm(X)) + X                              # Eq. 9
    Z = MLP(LayerNorm(Y)) + Y                                 # Eq. 10

The inner network ``MLPMixer`` is one full MLP-Mixer block (token-mixing MLP then
channel-mixing MLP, each pre-normed and residual; timm's ``MixerBlock``), so the gate depends
on the whole input (dynamic), unlike a Mixer's static token weights. Per the authors' code:
the gate has no activation, and a NiNformer block applies *one* LayerNorm instance before
both Eq. 9 and Eq. 10 (the model code ties the block's two norms; see
``vitblocks.models.ninformer``).

:class:`LocalityFFN` is the FFN of the paper's Local-ViT baseline (Sec. 3.1, Eq. 7): the
per-token MLP with a depthwise convolution between its two 1x1 layers (Li et al., LocalViT).
"""
from typing import List, Optional, Tuple, Type, Union

import torch
from timm.layers import LayerNorm, to_2tuple, trunc_normal_
from timm.models.mlp_mixer import MixerBlock
from torch import nn

from .activations import ACTIVATIONS, activation_name
from .layout import TokenLayout
from .registry import register_ffn

__all__ = ['MixerGatingUnit', 'LocalityFFN', 'check_mlp_widths']



def check_mlp_widths(**widths) -> None:
    """Raise ValueError unless every hidden width is a positive integer (0 or True would build silently)."""
    for key, width in widths.items():
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f'{key} must be a positive integer (a hidden width), got {width!r}')

class MixerGatingUnit(nn.Module):
    """NiNformer gating unit ``MixerBlock(x) * Linear(x)`` (Eq. 8), a token mixer for a fixed token count.

    Stands in for timm's ``Attention`` as a ViT ``Block``'s ``attn`` (``forward(x, attn_mask=None,
    is_causal=False)``; masks are rejected, there is no attention matrix) and for a MetaFormer
    block's ``token_mixer`` (4-D maps, see ``channels_first``). The token-mixing MLP has one input
    per token, so the unit is built for ``num_tokens`` tokens (prefix tokens included) and refuses
    other counts; that is why it is assigned to built blocks (one token count per stage) rather
    than passed as a class to timm's constructors.

    Args:
        dim: token width C.
        num_tokens: N, the number of tokens it mixes (H*W, plus prefix tokens if any).
        token_mlp_dim: hidden width of the token-mixing MLP of the Mixer sub-unit (paper: 512;
            default C/2 as timm's MLP-Mixer).
        channel_mlp_dim: hidden width of its channel-mixing MLP (paper: 512; default 4C).
        proj_bias: bias of the outer ``Linear(I)``.
        act_layer: activation inside the Mixer MLPs (name or class of the activation registry,
            :mod:`vitblocks.layers.activations`; GELU). The gate itself has none.
        norm_layer: the Mixer sub-unit's two norms (default timm LayerNorm).
        drop: dropout inside the Mixer MLPs (the authors' script uses 0.5 in every MLP).
        proj_drop: dropout on the output (MetaFormer passes it; 0 in the paper).
        channels_first: 4-D input is ``(B, C, H, W)`` (PoolFormer); otherwise 4-D input is
            channels-last ``(B, H, W, C)``. Token input ``(B, N, C)`` is always accepted.
    """

    def __init__(
            self,
            dim: int,
            num_tokens: int,
            token_mlp_dim: Optional[int] = None,
            channel_mlp_dim: Optional[int] = None,
            proj_bias: bool = True,
            act_layer: Union[str, Type[nn.Module]] = nn.GELU,
            norm_layer: Optional[Type[nn.Module]] = None,
            drop: float = 0.,
            proj_drop: float = 0.,
            channels_first: bool = False,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        token_mlp_dim = dim // 2 if token_mlp_dim is None else token_mlp_dim
        channel_mlp_dim = 4 * dim if channel_mlp_dim is None else channel_mlp_dim
        check_mlp_widths(token_mlp_dim=token_mlp_dim, channel_mlp_dim=channel_mlp_dim)
        self.num_tokens = num_tokens
        self.channels_first = channels_first
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **dd)  # Linear(I) of Eq. 8: the gated signal
        # timm's MixerBlock sizes its MLPs as int(ratio * dim); +0.5 keeps that exact under float rounding
        ratios = ((token_mlp_dim + .5) / dim, (channel_mlp_dim + .5) / dim)
        self.mixer = MixerBlock(dim, num_tokens, mlp_ratio=ratios, norm_layer=norm_layer or LayerNorm,
                                act_layer=ACTIVATIONS[activation_name(act_layer)].module, drop=drop,
                                **dd)  # the inner network
        self.proj_drop = nn.Dropout(proj_drop)
        self.init_weights()

    def init_weights(self):
        """timm's ViT initialization for every linear (std 0.02, zero bias); norms to identity."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError('MixerGatingUnit mixes tokens with a fixed MLP and has no attention matrix to mask; '
                             'call it without attn_mask / is_causal')
        if x.ndim == 4:
            if self.channels_first:
                B, C, H, W = x.shape
                tokens = x.flatten(2).transpose(1, 2)  # (B, C, H, W) -> (B, H*W, C)
                return self._mix(tokens).transpose(1, 2).reshape(B, C, H, W)  # -> (B, C, H, W)
            B, H, W, C = x.shape
            return self._mix(x.reshape(B, H * W, C)).reshape(B, H, W, C)  # (B, H, W, C) -> (B, H*W, C) -> back
        if x.ndim != 3:
            raise ValueError(f'MixerGatingUnit expects tokens (B, N, C) or a 4-D map, got shape {list(x.shape)}')
        return self._mix(x)

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if n != self.num_tokens:
            raise ValueError(f'MixerGatingUnit was built for {self.num_tokens} tokens (its token-mixing MLP has one '
                             f'input per token) but got {n}; build it with num_tokens={n} for this input size')
        gate = self.mixer(x)  # (B, N, C): MLP-Mixer sub-unit, token- then channel-mixing
        return self.proj_drop(self.proj(x) * gate)  # Eq. 8, no activation on the gate

    def extra_repr(self) -> str:
        return f'num_tokens={self.num_tokens}'


@register_ffn('locality', inherits=('drop',))
class LocalityFFN(nn.Module):
    """LocalViT's locality FFN (Li et al., 2021), the Local-ViT baseline of the NiNformer paper (Eq. 7).

    ``fc1 (1x1) -> act -> kxk depthwise conv on the patch grid -> act -> fc2 (1x1)``; timm ``Mlp``
    constructor vocabulary, so ``swap_ffn(model, 'locality')`` puts it into any supported backbone.
    Prefix tokens (class/distillation/register) get the point-wise layers but bypass the conv.

    Interpretation: the NiNformer paper gives only "convolutions" after a LayerNorm (Eq. 7) and
    the hidden width (512). We keep LocalViT's layer order and h-swish activation and leave out
    its BatchNorms and squeeze-excitation, since the block is already pre-normalized.

    Args:
        in_features, hidden_features, out_features, bias, drop: as timm's ``Mlp``
            (hidden default 4C).
        act_layer: activation after fc1 and after the depthwise conv (name or class of the activation
            registry, :mod:`vitblocks.layers.activations`; h-swish).
        norm_layer: optional norm before fc2 (timm ``Mlp`` position); none by default.
        kernel_size: depthwise kernel size (3 in LocalViT).
        grid_size, num_prefix_tokens, channels_first, layout: the token layout
            (:class:`~vitblocks.layers.TokenLayout`); ``swap_ffn`` fills it in.
    """

    def __init__(
            self,
            in_features: int,
            hidden_features: Optional[int] = None,
            out_features: Optional[int] = None,
            act_layer: Union[str, Type[nn.Module]] = nn.Hardswish,
            norm_layer: Optional[Type[nn.Module]] = None,
            bias: Union[bool, Tuple[bool, bool]] = True,
            drop: Union[float, Tuple[float, float]] = 0.,
            kernel_size: int = 3,
            grid_size: Optional[Tuple[int, int]] = None,
            num_prefix_tokens: int = 0,
            channels_first: bool = False,
            layout: Optional[TokenLayout] = None,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f'kernel_size must be a positive odd number (same padding), got {kernel_size}')
        out_features = out_features or in_features
        hidden_features = hidden_features or 4 * in_features
        self.layout = TokenLayout.resolve(layout, grid_size, num_prefix_tokens, channels_first)
        bias, drop_probs = to_2tuple(bias), to_2tuple(drop)
        act_layer = ACTIVATIONS[activation_name(act_layer)].module
        if self.layout.channels_first:
            def linear(i, o, b):
                return nn.Conv2d(i, o, 1, bias=b, **dd)
        else:
            def linear(i, o, b):
                return nn.Linear(i, o, bias=b, **dd)
        self.fc1 = linear(in_features, hidden_features, bias[0])
        self.act1 = act_layer()
        self.conv = nn.Conv2d(hidden_features, hidden_features, kernel_size, padding=kernel_size // 2,
                              groups=hidden_features, bias=True, **dd)
        self.act2 = act_layer()
        self.drop1 = nn.Dropout(drop_probs[0])
        self.norm = norm_layer(hidden_features, **dd) if norm_layer is not None else nn.Identity()
        self.fc2 = linear(hidden_features, out_features, bias[1])
        self.drop2 = nn.Dropout(drop_probs[1])
        self.init_weights()

    def init_weights(self):
        for m in (self.fc1, self.fc2):
            trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        self.conv.reset_parameters()

    def forward(self, x: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        """``feat_size``: the grid ``(H, W)`` of this input, as timm's PVTv2 blocks pass it to their MLP."""
        self.layout.set_grid(feat_size)
        x = self.act1(self.fc1(x))
        fmap, prefix = self.layout.to_map(x, 'LocalityFFN')  # prefix tokens bypass the conv
        fmap = self.act2(self.conv(fmap))  # (B, C', H, W): each channel mixes its kxk neighbourhood
        x = self.layout.from_map(fmap, prefix, x.ndim)
        x = self.norm(self.drop1(x))
        return self.drop2(self.fc2(x))

    def extra_repr(self) -> str:
        return f'kernel_size={self.conv.kernel_size[0]}'
