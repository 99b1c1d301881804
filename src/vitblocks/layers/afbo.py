"""AFBO: the Asymmetric Factorized Bilinear Operation of "Asymmetric Factorized Bilinear
Operation for Vision Transformer" (Wu et al., ICLR 2025), a drop-in for the FFN.

Structure (Sec. 3.2, Eq. 4 with the activation moved before the product, Fig. 1b)::

    x (d) -> left channel map  (OCCM, Eq. 7) -> (Md) -> spatial op (3x3 DW conv) -> act (SiLU) -.
          -> right channel map (GCCM, Eq. 6) -> (Md) -> spatial op (3x3 DW conv) ------------- * -> fc2 -> (d)

The "spatial-channel factorized bilinear operation" (SCFBO) replaces the FFN's fc1 by the
element-wise product of two branches, each a channel mapping (CM) followed by spatial
modelling (SM). The variants of Sec. 3.3 / Tables 1 and 14 differ in the channel maps of the
two branches (``variant``):

| variant          | left map     | right map    | paper                                   |
| ---------------- | ------------ | ------------ | --------------------------------------- |
| ``afbo``         | OCCM (G2)    | GCCM (G1)    | AFBO, the default everywhere            |
| ``scfbo_gc``     | GCCM (G1)    | GCCM (G1)    | SCFBO-GC (Table 1)                      |
| ``scfbo_oc``     | OCCM (G2)    | OCCM (G2)    | SCFBO-OC (Table 1)                      |
| ``afbo_full``    | dense        | dense        | FULL channel mapping, Eq. 4 (Table 14)  |
| ``afbo_grouped`` | grouped (G)  | grouped (G)  | block-wise maps, Eq. 5                  |

Each variant is also a registered FFN of the same name (``swap_ffn(model, 'afbo_full')`` is
``variant='afbo_full'``); ``'full'`` and ``'grouped'``, the names before 0.2, are aliases.
Table 1's "Group FFN" and Table 13's "Group Convolution" are ``afbo_grouped`` *without* spatial
modelling (``order='cm'``, App. A.4): the registered counterpart ``group_ffn``.

Ablations (Sec. 4.4, appendix): ``order`` ('cm' = AFBO-C, 'sm' = AFBO-S, 'cm_sm' = AFBO-CS,
the default, 'sm_cm' = AFBO-SC; Table 5), ``spatial`` ('dwconv', 'maxpool', 'avgpool',
'attention' (CBAM); Table 8; 'conv', Table 10, see below), ``kernel_size`` (Table 9),
``act_position`` ('pre'/'post'), ``act_layer`` (any name of
:data:`vitblocks.layers.activations.ACTIVATIONS`; Table 6 compares 'silu', 'gelu', 'relu') and
``act_branch`` ('left', 'right', 'both'; Table 6). Group numbers: ``gccm_groups`` = G1 (default
2), ``occm_groups`` = G2 (default 4 as for DeiT and PoolFormer; the paper uses 3 for Swin, LVT and
the MLP models, App. A.1). A group number that no branch of the chosen maps uses, and a
``variant``/map with ``order='sm'`` (which has no channel maps), are errors, not ignored.

Table 10's "original convolution" (DeiT-T 13.3 M, Swin-T 64.8 M parameters) is a dense 3x3 conv
on the *d input* channels, i.e. ``spatial='conv', order='sm_cm'`` (ours 13.69 M and 66.41 M).
A dense conv on the Md-wide hidden features (the default order) has M^2 = 16 times the weights,
133.1 M for DeiT-T, ten times the table, so ``spatial='conv'`` with ``order='cm_sm'`` or ``'sm'``
is an error rather than a silent reading the paper does not support. (Table 10's GMACs, +0.4 G
and +0.2 G, fit no dense conv with those parameters: ours are +1.53 G and +6.14 G.)

Choices where the paper is silent (docs/afbo.md has the reasoning):

* Eq. 6 and Eq. 7 are read as documented in :mod:`vitblocks.layers.channel_maps`.
* The spatial op is per branch (Eq. 4 has one for each) with a bias; prefix tokens (class,
  distillation, register) skip it, as they have no place on the grid.
* AFBO-S (``order='sm'``, "only spatial modeling") keeps the FFN's dense fc1 (d -> Md) as the
  one channel mapping shared by both branches, so the branches differ only in their spatial
  op; AFBO-SC (``order='sm_cm'``) applies the spatial op on the d input channels.
* No normalization inside (timm's ``norm_layer`` slot after the product is kept, default none).
"""
from typing import List, Optional, Tuple, Type, Union

import torch
from timm.layers import to_2tuple
from torch import nn

from .activations import activation_name, create_act
from .channel_maps import create_channel_map
from .layout import TokenLayout, merge_tokens
from .registry import deployed_form, register_ffn

__all__ = ['AFBO', 'SpatialAttention', 'create_spatial_op', 'AFBO_VARIANTS', 'AFBO_VARIANT_ALIASES', 'SPATIAL_OPS',
           'scfbo_gc', 'scfbo_oc', 'afbo_full', 'afbo_grouped']

# variant (= registered FFN name) -> (left channel map, right channel map); the left branch is activated by default
AFBO_VARIANTS = {
    'afbo': ('occm', 'gccm'),
    'scfbo_gc': ('gccm', 'gccm'),
    'scfbo_oc': ('occm', 'occm'),
    'afbo_full': ('dense', 'dense'),
    'afbo_grouped': ('grouped', 'grouped'),
}
AFBO_VARIANT_ALIASES = {'full': 'afbo_full', 'grouped': 'afbo_grouped'}  # the variant names before 0.2
SPATIAL_OPS = ('dwconv', 'maxpool', 'avgpool', 'attention', 'conv')
ORDERS = ('cm', 'sm', 'cm_sm', 'sm_cm')
# channel map kind -> (constructor argument of its group number, paper symbol, default)
_GROUP_ARGS = {'occm': ('occm_groups', 'G2', 4), 'gccm': ('gccm_groups', 'G1', 2), 'grouped': ('block_groups', 'G', 2)}


class SpatialAttention(nn.Module):
    """CBAM spatial attention (Woo et al., 2018) as a spatial op: ``x * sigmoid(conv_k([max_c x, mean_c x]))``.

    A k x k conv maps the channel-wise max and mean (2 maps) to one attention map shared by all
    channels: ``2k^2 + 1`` parameters (Table 8's "Spatial Attention" row).
    """

    def __init__(self, kernel_size: int = 7, device=None, dtype=None):
        super().__init__()
        self.conv = nn.Conv2d(2, 1, kernel_size, padding=kernel_size // 2, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        pooled = torch.cat([x.amax(dim=1, keepdim=True), x.mean(dim=1, keepdim=True)], dim=1)  # (B, 2, H, W)
        return x * torch.sigmoid(self.conv(pooled))


def create_spatial_op(kind: str, channels: int, kernel_size: int = 3, device=None, dtype=None) -> nn.Module:
    """A ``(B, C, H, W) -> (B, C, H, W)`` spatial op (Eq. 4's K x K spatial modelling, Tables 8-10)."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f'kernel_size must be a positive odd number (same padding), got {kernel_size}')
    dd = {'device': device, 'dtype': dtype}
    pad = kernel_size // 2
    if kind == 'dwconv':  # default: K x K depthwise conv with bias (W^s, b^s of Eq. 4, per channel)
        return nn.Conv2d(channels, channels, kernel_size, padding=pad, groups=channels, **dd)
    if kind == 'maxpool':
        return nn.MaxPool2d(kernel_size, stride=1, padding=pad)
    if kind == 'avgpool':
        return nn.AvgPool2d(kernel_size, stride=1, padding=pad, count_include_pad=False)
    if kind == 'attention':
        return SpatialAttention(kernel_size, **dd)
    if kind == 'conv':  # Table 10's "original convolution": dense K x K
        return nn.Conv2d(channels, channels, kernel_size, padding=pad, **dd)
    raise ValueError(f'unknown spatial op {kind!r}; choose one of {", ".join(SPATIAL_OPS)} (or order="cm" for none)')


@register_ffn('afbo', inherits=('drop',))
class AFBO(nn.Module):
    """Asymmetric Factorized Bilinear Operation (Sec. 3.2-3.3); a drop-in for timm's ``Mlp``.

    Args:
        in_features: input channels d.
        hidden_features: Md, the width of both branches and of fc2's input (default 4d, M = 4).
        out_features: output channels (default d).
        act_layer: sigma: 'silu' (default, Sec. 4.4), 'gelu', 'relu' (Table 6), or any other name or
            class of the activation registry (:mod:`vitblocks.layers.activations`).
        norm_layer: optional norm on the Md-wide product before fc2 (timm ``Mlp`` slot; default none).
        bias: bias of the channel maps and of fc2 (bool or pair).
        drop: dropout after the product and after fc2 (float or pair).
        variant: which channel maps the two branches use (module docstring table; default 'afbo').
        gccm_groups: G1, the GCCM group number (Eq. 6; default 2). Only with a GCCM branch.
        occm_groups: G2, the OCCM group number (Eq. 7; default 4). Only with an OCCM branch.
        block_groups: G of the block-wise map (Eq. 5; default 2). Only with a 'grouped' branch.
        left_map, right_map: override the variant's map of one branch ('dense', 'grouped', 'gccm', 'occm').
        order: 'cm_sm' (CM then SM, default), 'sm_cm', 'cm' (channel mapping only), 'sm' (spatial only).
        spatial: spatial op: 'dwconv' (default), 'maxpool', 'avgpool', 'attention', 'conv' (dense,
            only with ``order='sm_cm'``: Table 10, module docstring).
        kernel_size: K of the spatial op (3 by default, Table 9).
        act_position: 'pre' (activation on a branch before the product, default) or 'post'.
        act_branch: with 'pre', the activated branch: 'left' (the OCCM branch of AFBO, default),
            'right' (GCCM) or 'both' (Table 6).
        grid_size, num_prefix_tokens, channels_first, layout: where the 2-D grid is
            (:class:`~vitblocks.layers.TokenLayout`); surgery sets and updates it.

    This is the training form, with one forward: the reference computation. :meth:`fuse` returns its
    inference form, :class:`~vitblocks.layers.AFBODeployed` (same arguments and parameters), which chooses
    fast kernels by device.
    """

    def __init__(
            self,
            in_features: int,
            hidden_features: Optional[int] = None,
            out_features: Optional[int] = None,
            act_layer: Union[str, Type[nn.Module]] = 'silu',
            norm_layer: Optional[Type[nn.Module]] = None,
            bias: Union[bool, Tuple[bool, bool]] = True,
            drop: Union[float, Tuple[float, float]] = 0.,
            variant: Optional[str] = None,
            gccm_groups: Optional[int] = None,
            occm_groups: Optional[int] = None,
            block_groups: Optional[int] = None,
            left_map: Optional[str] = None,
            right_map: Optional[str] = None,
            order: str = 'cm_sm',
            spatial: Optional[str] = 'dwconv',
            kernel_size: int = 3,
            act_position: str = 'pre',
            act_branch: str = 'left',
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
                               act_layer=act_layer, norm_layer=norm_layer, bias=bias, drop=drop, variant=variant,
                               gccm_groups=gccm_groups, occm_groups=occm_groups, block_groups=block_groups,
                               left_map=left_map, right_map=right_map, order=order, spatial=spatial,
                               kernel_size=kernel_size, act_position=act_position, act_branch=act_branch)
        if order not in ORDERS:
            raise ValueError(f'unknown order {order!r}; choose one of {", ".join(ORDERS)} '
                             "('cm' = channel mapping only, 'sm' = spatial modelling only)")
        if order != 'cm' and spatial is None:
            raise ValueError(f"order={order!r} needs a spatial op; use order='cm' for channel mapping only")
        if spatial == 'conv' and order in ('cm_sm', 'sm'):
            raise ValueError(f"spatial='conv' with order={order!r} is a dense conv on the Md-wide hidden features "
                             f"(M^2 times Table 10's row: 133 M parameters for DeiT-T, not 13.3 M); Table 10's "
                             f"'original convolution' is reproduced with order='sm_cm' (conv on the d input channels)")
        if act_position not in ('pre', 'post'):
            raise ValueError(f"act_position must be 'pre' or 'post', got {act_position!r}")
        if act_branch not in ('left', 'right', 'both'):
            raise ValueError(f"act_branch must be 'left', 'right' or 'both', got {act_branch!r}")
        out_features = out_features or in_features
        hidden_features = hidden_features or 4 * in_features
        self.in_features, self.hidden_features, self.out_features = in_features, hidden_features, out_features
        self.layout = TokenLayout.resolve(layout, grid_size, num_prefix_tokens, channels_first)
        groups = {'occm_groups': occm_groups, 'gccm_groups': gccm_groups, 'block_groups': block_groups}
        variant, kinds = self._resolve_maps(variant, left_map, right_map, order, groups)
        self.variant, self.order, self.kernel_size = variant, order, kernel_size
        self.spatial_kind = None if order == 'cm' else spatial
        self.act_position, self.act_branch = act_position, act_branch
        self.act_name = activation_name(act_layer, default='silu')
        self.act = create_act(self.act_name)
        bias, drop_probs = to_2tuple(bias), to_2tuple(drop)

        self.map_kinds = kinds
        group_of = {kind: default if groups[arg] is None else groups[arg]  # 0 is checked, not taken for None
                    for kind, (arg, _, default) in _GROUP_ARGS.items()}
        group_of['dense'] = 1
        if order == 'sm':  # AFBO-S: the FFN's dense fc1 is the one channel mapping, shared by both branches
            self.fc1 = nn.Linear(in_features, hidden_features, bias=bias[0], **dd)
            self.left_map = self.right_map = None
        else:
            self.fc1 = None
            def make_map(kind):
                return create_channel_map(kind, in_features, hidden_features, group_of[kind], bias[0], **dd)
            self.left_map, self.right_map = make_map(kinds[0]), make_map(kinds[1])
        if self.spatial_kind is None:
            self.left_spatial = self.right_spatial = None
        else:
            sm_width = in_features if order == 'sm_cm' else hidden_features
            self.left_spatial = create_spatial_op(self.spatial_kind, sm_width, kernel_size, **dd)
            self.right_spatial = create_spatial_op(self.spatial_kind, sm_width, kernel_size, **dd)
        self.norm = norm_layer(hidden_features, **dd) if norm_layer is not None else nn.Identity()
        self.drop1 = nn.Dropout(drop_probs[0])
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias[1], **dd)
        self.drop2 = nn.Dropout(drop_probs[1])
        self.init_weights()

    @staticmethod
    def _map_kinds(variant: Optional[str], left_map: Optional[str], right_map: Optional[str]):
        """(canonical variant name, (left map kind, right map kind)); aliases resolved, unknown names rejected."""
        variant = AFBO_VARIANT_ALIASES.get(variant, variant) or 'afbo'
        if variant not in AFBO_VARIANTS:
            aliases = ', '.join(f'{a} = {v}' for a, v in AFBO_VARIANT_ALIASES.items())
            raise ValueError(f'unknown AFBO variant {variant!r}; choose one of {", ".join(AFBO_VARIANTS)} ({aliases})')
        return variant, (left_map or AFBO_VARIANTS[variant][0], right_map or AFBO_VARIANTS[variant][1])

    @staticmethod
    def group_args_used(variant: Optional[str] = None, left_map: Optional[str] = None, right_map: Optional[str] = None,
                        order: str = 'cm_sm') -> set:
        """The group-number arguments (``occm_groups``, ...) that a configuration's channel maps read."""
        if order == 'sm':  # AFBO-S has no channel maps
            return set()
        _, kinds = AFBO._map_kinds(variant, left_map, right_map)
        return {arg for kind, (arg, _, _) in _GROUP_ARGS.items() if kind in kinds}

    @staticmethod
    def _resolve_maps(variant, left_map, right_map, order, groups):
        """(variant name, (left kind, right kind)); errors for options the chosen structure would ignore."""
        name, kinds = AFBO._map_kinds(variant, left_map, right_map)
        given = [k for k, v in groups.items() if v is not None]
        if order == 'sm':  # AFBO-S has no channel maps: a map choice or group number would be ignored
            extra = [f'{k}={v!r}' for k, v in (('variant', variant), ('left_map', left_map), ('right_map', right_map))
                     if v is not None] + [f'{k}={groups[k]}' for k in given]
            if extra:
                raise ValueError(f"order='sm' (AFBO-S, Table 5) has no channel maps, only the dense fc1 shared by both "
                                 f"branches, so {', '.join(extra)} would be ignored; drop them or use another order")
            return name, (None, None)
        for kind, (arg, symbol, _) in _GROUP_ARGS.items():
            if arg in given and kind not in kinds:
                raise ValueError(f'{arg}={groups[arg]} ({symbol}) is set but neither branch uses a {kind} map '
                                 f'(maps: {kinds[0]}, {kinds[1]}); drop it or choose a variant with a {kind} map')
        return name, kinds

    @property
    def grid_size(self) -> Optional[Tuple[int, int]]:
        return self.layout.grid_size

    def init_weights(self):
        for m in (self.fc1, self.fc2):
            if m is not None:
                nn.init.trunc_normal_(m.weight, std=.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for m in (self.left_map, self.right_map):
            if m is not None:
                m.init_weights()
        for m in (self.left_spatial, self.right_spatial):
            if m is not None:
                for sub in m.modules():
                    if isinstance(sub, nn.Conv2d):
                        sub.reset_parameters()

    def forward(self, x: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        """``feat_size``: the grid ``(H, W)`` of this input, as timm's PVTv2 blocks pass it to their MLP."""
        self.layout.set_grid(feat_size)
        return self._forward_reference(x)

    def _forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        cf = self.layout.channels_first
        if cf:
            if x.ndim != 4:
                raise ValueError(f'AFBO (channels_first) expects (B, C, H, W), got shape {list(x.shape)}')
            x = x.permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C): channel maps act on the last dim
        left, right = self._branches(x)
        z = self._combine(left, right)
        z = self.drop1(self.norm(z))
        y = self.drop2(self.fc2(z))
        return y.permute(0, 3, 1, 2) if cf else y  # (B, H, W, C) -> (B, C, H, W)

    def _branches(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        # written with `is not None` tests on the optional submodules, which TorchScript resolves when compiling
        if self.fc1 is not None:  # AFBO-S: the dense fc1 is the channel mapping shared by both branches
            x = self.fc1(x)
        left, right = x, x
        if self.order == 'sm_cm':  # AFBO-SC: spatial op on the d input channels, then the channel maps
            left, right = self._spatial(left, right)
        if self.left_map is not None and self.right_map is not None:
            left, right = self.left_map(left), self.right_map(right)
        if self.order != 'sm_cm':  # AFBO-CS (Eq. 4) and AFBO-S; AFBO-C (order='cm') has no spatial op
            left, right = self._spatial(left, right)
        return left, right

    def _spatial(self, left: torch.Tensor, right: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each branch's map-to-map op on channels-last features; prefix tokens bypass it."""
        if self.left_spatial is None or self.right_spatial is None:
            return left, right
        map_l, prefix_l = self._to_map(left)
        map_r, prefix_r = self._to_map(right)
        ndim = left.ndim
        return (self._from_map(self.left_spatial(map_l), prefix_l, ndim),
                self._from_map(self.right_spatial(map_r), prefix_r, ndim))

    def _to_map(self, h: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Channels-last features (the input was made channels-last in :meth:`forward`) as a map."""
        if h.ndim == 4:
            return h.permute(0, 3, 1, 2), None  # (B, H, W, C) -> (B, C, H, W)
        prefix, fmap = self.layout.split_tokens(h, 'AFBO')  # (B, P + H*W, C) -> (B, P, C), (B, C, H, W)
        return fmap, prefix

    @staticmethod
    def _from_map(fmap: torch.Tensor, prefix: Optional[torch.Tensor], ndim: int) -> torch.Tensor:
        if ndim == 4:
            return fmap.permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C)
        return merge_tokens(prefix, fmap)  # (B, C, H, W) (+ prefix) -> (B, P + H*W, C)

    def _combine(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        if self.act_position == 'post':
            return self.act(left * right)  # Eq. 4 as printed: sigma after the product
        if self.act_branch in ('left', 'both'):
            left = self.act(left)
        if self.act_branch in ('right', 'both'):
            right = self.act(right)
        return left * right  # pre-act (Fig. 1b, Table 6): sigma before the product

    @torch.no_grad()
    def fuse(self) -> 'AFBO':
        """Return the inference form, an :class:`~vitblocks.layers.AFBODeployed` with the same parameters (AFBO
        has no BatchNorm to fold) and the same :class:`TokenLayout` object, in the same train/eval mode; it
        chooses fast kernels by device. ``self`` is left unchanged. Model level: ``vitblocks.deploy.reparameterize``.
        """
        w = self.fc2.weight
        # AFBODeployed subclasses this class, so it is found in the registry rather than imported here
        deployed = deployed_form('afbo')(**self._init_args, layout=self.layout, device=w.device, dtype=w.dtype)
        deployed.load_state_dict(self.state_dict())  # strict: the same parameters
        return deployed.train(self.training)

    def extra_repr(self) -> str:
        maps = f'maps={self.map_kinds}' if self.order != 'sm' else 'maps=(shared dense fc1)'
        return (f'{self.in_features} -> {self.hidden_features} -> {self.out_features}, variant={self.variant}, '
                f'{maps}, order={self.order}, spatial={self.spatial_kind}, kernel_size={self.kernel_size}, '
                f'act={self.act_name} ({self.act_position}, {self.act_branch})')


@register_ffn('scfbo_gc', inherits=('drop',))
def scfbo_gc(in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
             **kwargs) -> AFBO:
    """SCFBO-GC (Sec. 3.3, Table 1): GCCM (G1 = ``gccm_groups``) in both branches."""
    return AFBO(in_features, hidden_features, out_features, variant='scfbo_gc', **kwargs)


@register_ffn('scfbo_oc', inherits=('drop',))
def scfbo_oc(in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
             **kwargs) -> AFBO:
    """SCFBO-OC (Sec. 3.3, Table 1): OCCM (G2 = ``occm_groups``) in both branches."""
    return AFBO(in_features, hidden_features, out_features, variant='scfbo_oc', **kwargs)


@register_ffn('afbo_full', inherits=('drop',))
def afbo_full(in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
              **kwargs) -> AFBO:
    """FULL channel mapping (App. A.5, Table 14): Eq. 4 with dense channel maps in both branches."""
    return AFBO(in_features, hidden_features, out_features, variant='afbo_full', **kwargs)


@register_ffn('afbo_grouped', inherits=('drop',))
def afbo_grouped(in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
                 **kwargs) -> AFBO:
    """Block-wise channel maps (Eq. 5, G = ``block_groups``) in both branches, with AFBO's spatial modelling.

    Without spatial modelling (``order='cm'``) this is Table 1's Group FFN: the registered ``group_ffn``.
    """
    return AFBO(in_features, hidden_features, out_features, variant='afbo_grouped', **kwargs)

