"""IFFN: the improved feed-forward network of "Enhancing Vision Transformer: Amplifying
Non-Linearity in Feedforward Network Module" (Xu et al., ICML 2024).

Structure (paper Sec. 4, Fig. 4b; details follow the authors' released model)::

    x (C) -> fc1 -> (C'/N) -> [A_1 | ... | A_N] -> (C') -> LayerNorm(C')      # channel part, Eq. 5
          -> y + GELU(BN(DWConv_kxk(y)))                                      # spatial part, Sec. 4.3
          -> fc2 -> (C) -> LayerNorm(C)

with ``C' = hidden_features`` (4C in ViTs), ``N = num_functions`` (2 in the paper, Table 4
ablates 4) and ``A_i`` arbitrary activations (Eq. 3; AGeLU for GELU). Ablation switches
follow Table 2: without the channel part, fc1 maps C -> C' followed by the plain base
activation; without the spatial part, the depthwise block is dropped.

Deploy form: ``IFFN.fuse()`` returns an :class:`~vitblocks.layers.IFFNDeployed` (the BatchNorm
folded into the depthwise conv) whose forward chooses fast kernels by device
(:mod:`vitblocks.layers.iffn_deployed`); this module's forward is the reference.
"""
from typing import List, Optional, Tuple, Type, Union

import torch
import torch.nn.functional as F
from timm.layers import LayerNorm, LayerNorm2d, to_2tuple
from torch import nn

from .activations import ConcatArbitraryActivations, act_fn, activation_name
from .layout import TokenLayout
from .registry import deployed_form, register_ffn

__all__ = ['IFFN', 'DepthwiseBlock', 'SumOfNonlinearities']


def _fuse_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """Fold an eval-mode BatchNorm into the preceding conv (computed in float64)."""
    fused = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                      conv.dilation, conv.groups, bias=True, device=conv.weight.device, dtype=conv.weight.dtype)
    w = conv.weight.double()
    b = conv.bias.double() if conv.bias is not None else torch.zeros(conv.out_channels, dtype=torch.float64,
                                                                      device=w.device)
    scale = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
    fused.weight.data.copy_(w * scale.view(-1, 1, 1, 1))
    fused.bias.data.copy_((b - bn.running_mean.double()) * scale + bn.bias.double())
    return fused


def linear_weight(layer: nn.Module) -> torch.Tensor:
    """(out, in) weight of a Linear or 1x1 Conv2d (viewed, not copied)."""
    return layer.weight.flatten(1)  # (out, in, 1, 1) -> (out, in) for Conv2d


def norm_channels_last(norm: nn.Module, x: torch.Tensor, channels_first: bool) -> torch.Tensor:
    """Apply a norm built for the layer's layout to a channels-last ``(..., C)`` tensor.

    timm's LayerNorm2d is an ``nn.LayerNorm`` with the same parameters and math as LayerNorm, so
    every ``nn.LayerNorm`` runs as one ``F.layer_norm`` over the last dim; other norms are called
    in the layout they were built for.
    """
    if isinstance(norm, nn.LayerNorm):
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    if channels_first:
        return norm(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # (B, H, W, C) -> (B, C, H, W) -> back
    return norm(x)


class DepthwiseBlock(nn.Module):
    """Residual depthwise block ``x + GELU(BN(DWConv_k(x)))`` on a ``(B, C, H, W)`` map.

    The IFFN spatial enhancement part (Sec. 4.3, Eq. 10: a kxk depthwise conv after the
    nonlinearity mixes each channel's neighbours). ``fuse()`` folds the BatchNorm into the
    conv for inference (exact in eval mode).
    """

    def __init__(self, channels: int, kernel_size: int = 3, act: str = 'gelu', deploy: bool = False,
                 device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f'kernel_size must be a positive odd integer (same padding), got {kernel_size!r}')
        self.kernel_size = kernel_size
        self.conv = nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels,
                              bias=True, **dd)
        self.bn = nn.Identity() if deploy else nn.BatchNorm2d(channels, **dd)
        self.act_name = activation_name(act)
        self._act = act_fn(self.act_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._act(self.bn(self.conv(x)))

    @torch.no_grad()
    def fuse(self) -> 'DepthwiseBlock':
        """Return the deploy form (BatchNorm folded into the depthwise conv); idempotent."""
        if isinstance(self.bn, nn.Identity):
            return self
        w = self.conv.weight
        fused = DepthwiseBlock(self.conv.in_channels, self.kernel_size, self.act_name, deploy=True,
                               device=w.device, dtype=w.dtype)
        fused.conv = _fuse_conv_bn(self.conv, self.bn)
        return fused.train(self.training)


@register_ffn('iffn', inherits=('drop', 'act_layer'))
class IFFN(nn.Module):
    """Improved FFN (IFFN paper, Sec. 4, Fig. 4b); a drop-in for timm's ``Mlp``.

    Args:
        in_features: input channels C.
        hidden_features: C', the width entering fc2 (default 4C). With the channel part,
            fc1 produces ``C' / num_functions`` channels.
        out_features: output channels (default C).
        act_layer: basic nonlinear function phi of Eq. 3 (name or timm-style class of the activation
            registry, :mod:`vitblocks.layers.activations`): 'gelu' (AGeLU), 'softplus', 'elu', 'silu'
            (Table 3).
        spatial_act_layer: the activation of the depthwise block (``y + act(BN(DWConv(y)))``); default
            None follows ``act_layer``. Table 3 "replac[es] GeLU with different activation functions
            with and without using the proposed IFFN module": with IFFN the FFN's GeLUs are the base of
            AGeLU and the depthwise block's, so a Table 3 row swaps both (the default); pass
            ``spatial_act_layer='gelu'`` to swap the base only (the authors' code hard-codes this GELU).
        norm_layer: norm after the concatenation and at the output (default LayerNorm,
            LayerNorm2d for channels-first input).
        bias: bias of fc1/fc2 (bool or pair).
        drop: dropout after the hidden LayerNorm (the authors' placement; after the activation
            without the channel part) and after the output LayerNorm (float or pair).
        num_functions: N, number of concatenated arbitrary activations (Table 4).
        channel_part: use the channel-wise enhancement (Table 2).
        spatial_part: use the depthwise block (Table 2).
        kernel_size: n, depthwise kernel size (Table 6; 3 by default, 5 for the '*' rows).
        grid_size: ``(H, W)`` patch grid for token input; the surgery code sets and updates it.
        num_prefix_tokens: leading non-grid tokens (class/distillation/register) that bypass
            the spatial part.
        channels_first: input is ``(B, C, H, W)`` (timm's ``use_conv=True``, PoolFormer).
        layout: a shared :class:`TokenLayout` (overrides the three arguments above).

    This is the training form, with one forward: the reference computation. :meth:`fuse` returns
    its inference form, :class:`~vitblocks.layers.IFFNDeployed` (same arguments; build that directly,
    or a registered model with ``block_cfg={'deploy': True}``, to load a fused checkpoint).
    """

    deploy = False  # the inference form (IFFNDeployed) says True
    fold_batchnorm = False  # whether the depthwise block is built with its BatchNorm folded (IFFNDeployed)

    def __init__(
            self,
            in_features: int,
            hidden_features: Optional[int] = None,
            out_features: Optional[int] = None,
            act_layer: Union[str, Type[nn.Module]] = 'gelu',
            norm_layer: Optional[Type[nn.Module]] = None,
            bias: Union[bool, Tuple[bool, bool]] = True,
            drop: Union[float, Tuple[float, float]] = 0.,
            num_functions: int = 2,
            spatial_act_layer: Union[str, Type[nn.Module], None] = None,
            channel_part: bool = True,
            spatial_part: bool = True,
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
        self._init_args = dict(in_features=in_features, hidden_features=hidden_features, out_features=out_features,
                               act_layer=act_layer, norm_layer=norm_layer, bias=bias, drop=drop,
                               num_functions=num_functions, spatial_act_layer=spatial_act_layer,
                               channel_part=channel_part, spatial_part=spatial_part, kernel_size=kernel_size)
        out_features = out_features or in_features
        hidden_features = hidden_features or 4 * in_features
        self.layout = TokenLayout.resolve(layout, grid_size, num_prefix_tokens, channels_first)
        cf = self.layout.channels_first
        if norm_layer is None:
            norm_layer = LayerNorm2d if cf else LayerNorm
        base = activation_name(act_layer)
        spatial_act = activation_name(spatial_act_layer, default=base)
        bias, drop_probs = to_2tuple(bias), to_2tuple(drop)
        def linear(i, o, b):  # a token-wise linear layer in the input's layout
            return nn.Conv2d(i, o, 1, bias=b, **dd) if cf else nn.Linear(i, o, b, **dd)

        if isinstance(num_functions, bool) or not isinstance(num_functions, int) or num_functions < 1:
            raise ValueError(f'num_functions must be a positive integer (N of Table 4: 2 or 4), got {num_functions!r}')
        if channel_part and hidden_features % num_functions:
            raise ValueError(f'hidden_features={hidden_features} is not divisible by num_functions={num_functions}; '
                             f'choose hidden_features as a multiple of {num_functions}')
        self.hidden_features = hidden_features
        self.channel_part, self.spatial_part = channel_part, spatial_part
        fc1_out = hidden_features // num_functions if channel_part else hidden_features
        self.fc1 = linear(in_features, fc1_out, bias[0])
        if channel_part:  # Eq. 5: concat of N arbitrary activations, then LayerNorm on C'
            self.act = ConcatArbitraryActivations(fc1_out, num_functions, base, channels_first=cf, **dd)
            self.norm = norm_layer(hidden_features, **dd)
        else:
            self.act = _Activation(base)
            self.norm = nn.Identity()
        self.drop1 = nn.Dropout(drop_probs[0])
        self.spatial = DepthwiseBlock(hidden_features, kernel_size, spatial_act, deploy=self.fold_batchnorm, **dd) \
            if spatial_part else None
        self.fc2 = linear(hidden_features, out_features, bias[1])
        self.norm_out = norm_layer(out_features, **dd)
        self.drop2 = nn.Dropout(drop_probs[1])
        self.init_weights()

    @property
    def grid_size(self) -> Optional[Tuple[int, int]]:
        return self.layout.grid_size

    def init_weights(self):
        for m in (self.fc1, self.fc2):
            nn.init.trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        if hasattr(self.act, 'init_weights'):
            self.act.init_weights()

    def _spatial(self, x: torch.Tensor) -> torch.Tensor:
        if self.spatial is None:
            return x
        fmap, prefix = self.layout.to_map(x, 'IFFN')  # prefix tokens bypass the spatial part
        return self.layout.from_map(self.spatial(fmap), prefix, x.ndim)

    def forward(self, x: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        """``feat_size``: the grid ``(H, W)`` of this input, as timm's PVTv2 blocks pass it to their MLP."""
        self.layout.set_grid(feat_size)
        return self._forward_reference(x)

    def _forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        x = self.act(x)
        x = self.norm(x)
        x = self.drop1(x)  # after the hidden LayerNorm, as the authors' model
        x = self._spatial(x)
        x = self.fc2(x)
        x = self.norm_out(x)
        return self.drop2(x)

    @torch.no_grad()
    def fuse(self) -> 'IFFN':
        """Return the inference form, an :class:`~vitblocks.layers.IFFNDeployed` (same train/eval mode) whose
        depthwise conv carries the folded BatchNorm, sharing this layer's :class:`TokenLayout` object (so grid
        tracking keeps working). Same outputs as this layer in eval mode; ``self`` is left unchanged.
        Model level: ``vitblocks.deploy.reparameterize``.

        Only the BatchNorm is folded. AGeLU's inner scale and shift could go into fc1 only by
        widening it to C' outputs (both copies read the same fc1 output), doubling fc1's MACs
        for one saved element-wise pass; its outer scale and shift, and LayerNorm's affine (which
        feeds both the conv and its residual, with zero padding at the borders), cannot pass
        exactly into the following layer (docs/iffn_speed.md).
        """
        w = self.fc2.weight
        # IFFNDeployed subclasses this class, so it is found in the registry rather than imported here
        deployed = deployed_form('iffn')(**self._init_args, layout=self.layout, device=w.device, dtype=w.dtype)
        state = {k: v for k, v in self.state_dict().items() if not k.startswith('spatial.')}
        if self.spatial is not None:
            state.update({f'spatial.{k}': v for k, v in self.spatial.fuse().state_dict().items()})
        deployed.load_state_dict(state)  # strict: the deployed form has exactly these parameters
        return deployed.train(self.training)

    def extra_repr(self) -> str:
        return (f'hidden_features={self.hidden_features}, channel_part={self.channel_part}, '
                f'spatial_part={self.spatial_part}')


class _Activation(nn.Module):
    """A plain base activation by name (used when the channel part is off)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self._phi = act_fn(name)

    def forward(self, x):
        return self._phi(x)

    def extra_repr(self):
        return self.name


@register_ffn('sum_nonlinear')
class SumOfNonlinearities(nn.Module):
    """The FFN replaced by a sum of 4C nonlinear functions per channel: IFFN Eq. 11 (Table 5).

    ``y = phi_1(x) + ... + phi_4C(x)`` is written in scalars (plain ``x``, ``y``, as Eq. 3's
    scalar ``x``; vectors are bold in the paper), and it is motivated by Corollary 3.1: "each
    element y_c ... is the linear combination of C' different nonlinear functions to the input
    element x_c", with C' = 4C. So each channel c gets K = C' = ``hidden_features`` functions of
    its own x_c (``functions_per_channel`` overrides K; ``functions_per_channel=4``, C' functions
    in total rather than per channel, is the cheaper reading this module used before 0.2):

    * ``arbitrary=True`` (Table 5's "phi = AGeLU"): ``y_c = sum_k beta_ck GELU(alpha_ck x_c + gamma_ck)
      + theta_ck`` (Eq. 3 per function; 4KC parameters, K x C activations per token in memory).
    * ``arbitrary=False`` (Table 5's "phi = GeLU"): the K functions are the same fixed GeLU, so
      Eq. 11 is exactly ``y_c = K * GELU(x_c)``, computed in that closed form; the layer has no
      parameters. The paper prints no weights in Eq. 11, so none are added.

    ``act_layer`` is the basic function (any name of the activation registry). It mixes no
    channels, so ``out_features`` must equal ``in_features``; having no linear layers, it accepts
    ``bias`` (timm ``Mlp`` vocabulary, used by ``swap_ffn``) and ignores it.
    """

    def __init__(self, in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
                 act_layer: Union[str, Type[nn.Module]] = 'gelu', arbitrary: bool = True,
                 functions_per_channel: Optional[int] = None, bias: bool = True, channels_first: bool = False,
                 layout: Optional[TokenLayout] = None, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if out_features not in (None, in_features):
            raise ValueError(f'SumOfNonlinearities is channel-wise: out_features ({out_features}) '
                             f'must equal in_features ({in_features})')
        k = functions_per_channel or hidden_features or 4 * in_features  # Eq. 11: C' = 4C per channel
        if k < 1:
            raise ValueError(f'functions_per_channel must be >= 1, got {k}')
        self.functions_per_channel = k
        self.channels_first = layout.channels_first if layout is not None else channels_first
        self.arbitrary = arbitrary
        self.base = activation_name(act_layer)
        if arbitrary:
            self.act = ConcatArbitraryActivations(in_features, k, self.base, **dd)
        else:
            self._phi = act_fn(self.base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_first:
            x = x.permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C)
        k = self.functions_per_channel
        if self.arbitrary:
            y = self.act(x).unflatten(-1, (k, x.shape[-1])).sum(-2)  # (..., K*C) -> (..., K, C) -> (..., C)
        else:
            y = self._phi(x) * k  # Eq. 11 with one fixed phi: K identical terms
        if self.channels_first:
            y = y.permute(0, 3, 1, 2)  # (B, H, W, C) -> (B, C, H, W)
        return y

    def extra_repr(self) -> str:
        return f'functions_per_channel={self.functions_per_channel}, base={self.base!r}, arbitrary={self.arbitrary}'
