"""RePa: the channel-idle FFN of "RePaFormer: Ferocious and Scalable Acceleration of MetaFormers
via Structural Reparameterization", as a *residual unit*, and its deployed (folded) form.

Training form (paper Eq. 3, with the details of the authors' code)::

    h = fc1(BN_in(x))                                  # BN_in replaces the block's pre-FFN LayerNorm
    a = concat(GELU(h[:K]), h[K:])                     # only the first K hidden channels are activated
    z = x * r + drop_path(gamma * fc2(BN_hidden(a)))   # the shortcut lives inside the unit

with ``H = hidden_features = rho * C``, idle ratio ``theta = 1 - mu / rho`` and
``K = ceil(H * (1 - theta))`` active channels (``mu * C`` in the paper). ``gamma`` is an
optional layer-scale (PoolFormer), ``r`` an optional residual scale (MetaFormer ``res_scale``;
1 everywhere in the paper). The unit owns the pre-norm and the shortcut because Eq. 6 folds
the identity into the merged matrix; ``vitblocks.models.swap_residual_ffn`` rewires the block.

Deployed form (Eq. 5-7; :class:`RePaDeployedFFN`), exact in eval mode::

    z = x @ W~ + act(x @ W~in[:, :K]) @ W~out[:K, :]   # W~ = W~in[:, K:] W~out[K:, :] + diag(r)  (Eq. 6)

Both BatchNorms, the layer-scale (weight *and* bias) and every bias are folded; the folded
biases of the linear path and of fc2 end up in one bias of the merged C x C layer. Per FFN
the weights shrink from ``2 H C`` to ``(2 K + C) C``, i.e. to ``1 - theta + 1 / (2 rho)``
(Sec. 4.3). Edge cases: ``theta = 1`` (K = 0) leaves a single C x C linear layer;
``theta = 0`` has no linear path, only the identity plus a bias.
"""
import math
from numbers import Real
from typing import Optional, Type, Union

import torch
import torch.nn.functional as F
from timm.layers import DropPath, to_2tuple
from torch import nn

from .activations import _MODULE_ACTIVATIONS, act_fn_, activation_name, get_base_activation
from .batchnorm import TokenBatchNorm
from .layout import TokenLayout, plain_eager_inference

__all__ = ['RePaFFN', 'RePaDeployedFFN', 'TokenBatchNorm', 'active_channels', 'check_idle_ratio', 'repa_ffn']


def check_idle_ratio(idle_ratio) -> float:
    """Validate theta: a real number in [0, 1]."""
    if isinstance(idle_ratio, bool) or not isinstance(idle_ratio, Real) or not 0. <= float(idle_ratio) <= 1.:
        raise ValueError(
            f'idle_ratio (theta, the fraction of hidden channels that skip the activation) must be a number '
            f'in [0, 1], got {idle_ratio!r}; the paper uses 0.75 (Table 4 sweeps 0, 0.25, 0.5, 0.75, 1)')
    return float(idle_ratio)


def active_channels(hidden_features: int, idle_ratio: float) -> int:
    """K = ceil(H * (1 - theta)): the number of leading hidden channels that go through the activation."""
    theta = check_idle_ratio(idle_ratio)
    # round first, so that e.g. 100 * (1 - 0.7) = 30.000000000000004 gives 30, not 31
    return min(hidden_features, math.ceil(round(hidden_features * (1. - theta), 9)))


def _activation_module(act_layer) -> nn.Module:
    if isinstance(act_layer, type):
        get_base_activation(act_layer)  # validates
        return act_layer()
    return _MODULE_ACTIVATIONS[get_base_activation(act_layer)]()


def _bn_scale_shift(bn: nn.Module, channels: int, dtype, device):
    """``(s, t)`` with ``BN(x) = s * x + t`` per channel, from the running statistics (Eq. 4)."""
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError(f'cannot fold {type(bn).__name__} without running statistics (track_running_stats=False)')
    inv_std = torch.rsqrt(bn.running_var.to(device, dtype) + bn.eps)
    weight = bn.weight.to(device, dtype) if bn.weight is not None else torch.ones(channels, dtype=dtype, device=device)
    bias = bn.bias.to(device, dtype) if bn.bias is not None else torch.zeros(channels, dtype=dtype, device=device)
    scale = weight * inv_std
    return scale, bias - bn.running_mean.to(device, dtype) * scale


class RePaFFN(nn.Module):
    """Channel-idle FFN residual unit (RePa Eq. 3), training form; ``fuse()`` gives Eq. 7.

    Args:
        in_features: channels C.
        hidden_features: H = rho * C (default 4C).
        out_features: must equal ``in_features`` (the shortcut is inside the unit).
        act_layer: activation of the K active channels (name or ``nn.Module`` class; GELU).
        bias: bias of fc1/fc2 (bool or pair).
        drop: dropout after the activation and after fc2 (float or pair), as timm's ``Mlp``.
        idle_ratio: theta, the fraction of hidden channels that stay linear (default 0.75, i.e.
            mu = 1 for rho = 4); the first ``K = ceil(H * (1 - theta))`` channels are active.
        layer_scale_init_value: per-channel scale gamma on the FFN branch (``None``: none).
        res_scale_init_value: per-channel scale r on the shortcut (MetaFormer ``res_scale``).
        branch_scale: a constant (not learned) factor on the FFN branch: LV-ViT's ``1 / skip_lam``.
            Folded into fc2's weight and bias like gamma.
        drop_path: stochastic-depth rate of the FFN branch.
        channels_first: input is ``(B, C, H, W)`` (1x1 convs, BatchNorm2d; PoolFormer) instead
            of channels-last ``(..., C)`` (tokens ``(B, N, C)`` or maps ``(B, H, W, C)``).
        layout: a :class:`TokenLayout`; only its ``channels_first`` is used (the unit is
            point-wise, so prefix tokens and the grid do not matter).

    ``fuse()`` folds from the BatchNorm running statistics, i.e. it reproduces eval mode.
    """

    def __init__(
            self,
            in_features: int,
            hidden_features: Optional[int] = None,
            out_features: Optional[int] = None,
            act_layer: Union[str, Type[nn.Module]] = 'gelu',
            bias: Union[bool, tuple] = True,
            drop: Union[float, tuple] = 0.,
            idle_ratio: float = 0.75,
            layer_scale_init_value: Optional[float] = None,
            res_scale_init_value: Optional[float] = None,
            branch_scale: float = 1.0,
            drop_path: float = 0.,
            channels_first: bool = False,
            layout: Optional[TokenLayout] = None,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        hidden_features = hidden_features or 4 * in_features
        if out_features not in (None, in_features):
            raise ValueError(f'RePaFFN is a residual unit: out_features ({out_features}) must equal '
                             f'in_features ({in_features})')
        self.in_features, self.hidden_features = in_features, hidden_features
        self.idle_ratio = check_idle_ratio(idle_ratio)
        self.active_features = active_channels(hidden_features, idle_ratio)
        self.channels_first = layout.channels_first if layout is not None else channels_first
        bias, drop_probs = to_2tuple(bias), to_2tuple(drop)
        self.layer_scale_init_value, self.res_scale_init_value = layer_scale_init_value, res_scale_init_value
        self.branch_scale = float(branch_scale)

        cf = self.channels_first
        norm = nn.BatchNorm2d if cf else TokenBatchNorm
        # skip_init: init_weights() initializes the projections; no need to pay for torch's default init too
        skip = {'device': device if device is not None else torch.get_default_device(), 'dtype': dtype}
        linear = ((lambda i, o, b: nn.utils.skip_init(nn.Conv2d, i, o, 1, bias=b, **skip)) if cf
                  else (lambda i, o, b: nn.utils.skip_init(nn.Linear, i, o, b, **skip)))
        self.norm_in = norm(in_features, **dd)  # replaces the block's pre-FFN LayerNorm (Eq. 3, BN(Y))
        self.fc1 = linear(in_features, hidden_features, bias[0])
        self.act = _activation_module(act_layer)
        self.drop1 = nn.Dropout(drop_probs[0])
        self.norm_hidden = norm(hidden_features, **dd)  # Eq. 3, BN(Y^Act)
        self.fc2 = linear(hidden_features, in_features, bias[1])
        self.drop2 = nn.Dropout(drop_probs[1])
        self.layer_scale = nn.Parameter(torch.empty(in_features, **dd)) if layer_scale_init_value is not None else None
        self.res_scale = nn.Parameter(torch.empty(in_features, **dd)) if res_scale_init_value is not None else None
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.init_weights()

    def init_weights(self):
        for m in (self.fc1, self.fc2):
            nn.init.trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        for bn in (self.norm_in, self.norm_hidden):
            bn.reset_parameters()
        if self.layer_scale is not None:
            nn.init.constant_(self.layer_scale, self.layer_scale_init_value)
        if self.res_scale is not None:
            nn.init.constant_(self.res_scale, self.res_scale_init_value)

    def _channel_scale(self, scale: torch.Tensor) -> torch.Tensor:
        return scale.view(-1, 1, 1) if self.channels_first else scale  # (C,) -> (C, 1, 1) for (B, C, H, W)

    def _partial_activation(self, h: torch.Tensor) -> torch.Tensor:
        """Eq. 3, ``concat(Act(h[:K]), h[K:])`` without the concat: the activation is written into
        the first K channels of h in place, and never computed on the idle ones."""
        k, dim = self.active_features, 1 if self.channels_first else -1
        if k == 0:
            return h
        if k == self.hidden_features:
            return self.act(h)
        active = h.narrow(dim, 0, k)  # a view of the first K channels
        if torch.is_grad_enabled() and h.requires_grad:
            # the activation's backward needs its input, which the in-place write would destroy:
            # keep a K-wide copy of it (cheaper than concatenating H channels)
            active.copy_(self.act(active.clone()))
        else:
            active.copy_(self.act(active))
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm_in(x))  # (..., C) -> (..., H)  [or (B, C, h, w) -> (B, H, h, w)]
        h = self.drop1(self._partial_activation(h))
        y = self.drop2(self.fc2(self.norm_hidden(h)))  # (..., H) -> (..., C)
        if self.layer_scale is not None:
            y = y * self._channel_scale(self.layer_scale)
        if self.branch_scale != 1.:
            y = y * self.branch_scale
        shortcut = x * self._channel_scale(self.res_scale) if self.res_scale is not None else x
        return shortcut + self.drop_path(y)

    @torch.no_grad()
    def fuse(self) -> 'RePaDeployedFFN':
        """Return the deployed module (Eq. 5-7), folded in float64 from the BatchNorm running
        statistics (so it reproduces eval mode) and cast back to this module's dtype."""
        ref = self.fc1.weight
        fold = torch.float32 if ref.device.type == 'mps' else torch.float64  # mps has no float64
        c, hid, k = self.in_features, self.hidden_features, self.active_features
        dev = ref.device

        def weight_bias(m, rows, cols):
            w = m.weight.to(dev, fold).reshape(rows, cols)  # 1x1 conv (o, i, 1, 1) -> (o, i)
            b = m.bias.to(dev, fold) if m.bias is not None else torch.zeros(rows, dtype=fold, device=dev)
            return w, b

        # Eq. 4: BN_in into fc1 (its shift goes through fc1 into both paths), BN_hidden into fc2
        s_in, t_in = _bn_scale_shift(self.norm_in, c, fold, dev)
        w1, b1 = weight_bias(self.fc1, hid, c)
        w1, b1 = w1 * s_in, b1 + w1 @ t_in
        s_h, t_h = _bn_scale_shift(self.norm_hidden, hid, fold, dev)
        w2, b2 = weight_bias(self.fc2, c, hid)
        w2, b2 = w2 * s_h, b2 + w2 @ t_h
        if self.layer_scale is not None:  # gamma scales fc2's weight *and* bias
            g = self.layer_scale.to(dev, fold)
            w2, b2 = w2 * g[:, None], b2 * g
        w2, b2 = w2 * self.branch_scale, b2 * self.branch_scale
        r = self.res_scale.to(dev, fold) if self.res_scale is not None else None

        # Eq. 6: idle rows of fc1 x idle columns of fc2 (+ shortcut) -> one C x C matrix
        linear_path = k < hid or r is not None
        deployed = RePaDeployedFFN(c, k, linear_path=linear_path, act_layer=type(self.act),
                                   channels_first=self.channels_first, device=dev, dtype=ref.dtype)
        bias = b2 + w2[:, k:] @ b1[k:]
        # in_proj = [W~ | W~in]: the merged C x C rows (Eq. 6), then fc1's first K rows (Eq. 7)
        weights, biases = [w1[:k]], [b1[:k]]
        if linear_path:
            merged = w2[:, k:] @ w1[k:]
            merged += torch.diag(r) if r is not None else torch.eye(c, dtype=fold, device=dev)
            weights, biases = [merged] + weights, [bias] + biases
        else:
            deployed.bias.copy_(bias)
        # (o, i) -> conv (o, i, 1, 1)
        deployed.in_proj.weight.copy_(torch.cat(weights).view_as(deployed.in_proj.weight))
        deployed.in_proj.bias.copy_(torch.cat(biases))
        if k:  # Eq. 7: the active path keeps fc2's first K columns
            deployed.fc2.weight.copy_(w2[:, :k].reshape(deployed.fc2.weight.shape))
        return deployed.train(self.training)

    def extra_repr(self) -> str:
        return (f'in_features={self.in_features}, hidden_features={self.hidden_features}, '
                f'idle_ratio={self.idle_ratio}, active_features={self.active_features}, '
                f'channels_first={self.channels_first}' + (f', branch_scale={self.branch_scale:g}'
                                                           if self.branch_scale != 1. else ''))


class RePaDeployedFFN(nn.Module):
    """The deployed RePa unit (Eq. 7): ``z = x W~ + act(x W~in) W~out``; buildable from dims,
    so fused checkpoints load into a freshly built deployed model.

    Both input projections read the same x, so they are stored as one layer ``in_proj`` of
    ``C + K`` outputs, the rows of W~ (Eq. 6) then those of W~in: one GEMM reads x once and
    writes ``[x W~ + b | x W~in + b_in]``; the activation runs on the last K columns and
    ``act(.) W~out`` is accumulated in place into the first C (autograd off). The split layout
    of the checkpoints saved before (``linear.*``, ``fc1.*``) still loads: a load hook
    concatenates it. Storing the concatenation, not caching it next to the two layers, keeps
    one copy of the weights (no second ~C(C+K) per unit) and nothing to keep in sync.

    Args:
        in_features: channels C.
        active_features: K, the active hidden channels (0 when theta = 1: one linear layer).
        linear_path: whether the merged C x C matrix (idle path + identity, Eq. 6) exists; it
            does not when theta = 0, where the unit is ``x + bias + fc2(act(fc1(x)))``.
        act_layer: activation of the active path.
        channels_first: ``(B, C, H, W)`` input with 1x1 convs, else channels-last ``(..., C)``.

    Use :meth:`from_config` to build it from the training-form arguments.
    """

    def __init__(self, in_features: int, active_features: int, linear_path: bool = True,
                 act_layer: Union[str, Type[nn.Module]] = 'gelu', channels_first: bool = False,
                 layout: Optional[TokenLayout] = None, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if active_features < 0 or (active_features == 0 and not linear_path):
            raise ValueError(f'a deployed RePa unit needs active channels or a linear path, got '
                             f'active_features={active_features}, linear_path={linear_path}')
        self.in_features, self.active_features = in_features, active_features
        self.linear_features = in_features if linear_path else 0  # rows of W~ in in_proj (0: theta = 0)
        self.channels_first = layout.channels_first if layout is not None else channels_first
        cf = self.channels_first
        linear = ((lambda i, o, b: nn.Conv2d(i, o, 1, bias=b, **dd)) if cf
                  else (lambda i, o, b: nn.Linear(i, o, b, **dd)))
        # [W~ | W~in] of Eq. 6-7 as one layer; its bias holds every folded bias of the unit, then b_in
        self.in_proj = linear(in_features, self.linear_features + active_features, True)
        self.bias = None if linear_path else nn.Parameter(torch.zeros(in_features, **dd))
        self.act_name = activation_name(act_layer)
        self.act = _activation_module(act_layer) if active_features else None
        self.fc2 = linear(active_features, in_features, False) if active_features else None
        self.register_load_state_dict_pre_hook(_concat_split_checkpoint)

    @classmethod
    def from_config(cls, in_features: int, hidden_features: Optional[int] = None, idle_ratio: float = 0.75,
                    act_layer: Union[str, Type[nn.Module]] = 'gelu', res_scale_init_value: Optional[float] = None,
                    channels_first: bool = False, layout: Optional[TokenLayout] = None, device=None, dtype=None, *,
                    bias=True, drop=0., layer_scale_init_value=None, branch_scale=1.,
                    drop_path=0.) -> 'RePaDeployedFFN':
        """The deployed module that ``RePaFFN(same arguments).fuse()`` returns. The training-only
        arguments (``bias``, ``drop``, ``layer_scale_init_value``, ``branch_scale``, ``drop_path``) are accepted so
        that one config builds either form; they do not change the deployed structure."""
        hidden_features = hidden_features or 4 * in_features
        k = active_channels(hidden_features, idle_ratio)
        return cls(in_features, k, linear_path=k < hidden_features or res_scale_init_value is not None,
                   act_layer=act_layer, channels_first=channels_first, layout=layout, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_first:  # (B, C, H, W), 1x1 convs
            return self._add_active_path(self.in_proj(x), x, 1)  # (B, C, H, W) -> (B, C + K, H, W) -> (B, C, H, W)
        x2 = x.reshape(-1, self.in_features)  # (..., C) -> (M, C)
        h = F.linear(x2, self.in_proj.weight, self.in_proj.bias)  # (M, C) -> (M, C + K): [x W~ + b | x W~in + b_in]
        return self._add_active_path(h, x2, 1).view(x.shape)  # (M, C) -> (..., C)

    def _add_active_path(self, h: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``h[:C] + act(h[C:]) W~out`` along ``dim`` (Eq. 7), from ``h = [x W~ + b | x W~in + b_in]``."""
        if self.fc2 is None:  # theta = 1: the unit is the merged C x C layer
            return h
        bias = self.bias
        if bias is None:
            out = h.narrow(dim, 0, self.linear_features)  # x W~ + b, a view
        else:  # theta = 0: no linear path, the identity shortcut plus the folded bias
            out = x + (bias.view(-1, 1, 1) if self.channels_first else bias)  # (C,) -> (C, 1, 1) for NCHW
        # x W~in + b_in, the K active channels (a view)
        active = h.narrow(dim, self.linear_features, self.active_features)
        if not torch.jit.is_scripting():
            # no autograd: activate and accumulate in place, no new buffers; autocast does not cover the
            # in-place addmm_ (bf16 activations against the fp32 weight), and a recorded graph (export,
            # jit.trace, vmap) takes plain ops, so both take the out-of-place path
            if x.device.type != 'meta' and plain_eager_inference(x, False):  # meta: no autocast query
                active = act_fn_(self.act_name)(active)
                if self.channels_first:
                    return out.add_(self.fc2(active))  # (B, K, H, W) -> (B, C, H, W)
                # the out-of-place addmm would copy `out` first (5-10% of the unit at batch 16-4 on CPU);
                # vitblocks.profile counts addmm_
                return out.addmm_(active, self.fc2.weight.t())  # (M, K) @ (K, C) added into (M, C)
        return out + self.fc2(self.act(active))  # autograd needs the activation's input: out of place

    def fuse(self) -> 'RePaDeployedFFN':
        """Already deployed: returns self (so re-parameterizing twice is safe)."""
        return self

    def extra_repr(self) -> str:
        return (f'in_features={self.in_features}, active_features={self.active_features}, '
                f'linear_path={self.linear_features > 0}, channels_first={self.channels_first}')


def _concat_split_checkpoint(module: RePaDeployedFFN, state_dict, prefix, *args) -> None:
    """Load hook: a deployed checkpoint in the split layout written before ``in_proj`` existed
    (``linear.*`` = W~, ``fc1.*`` = W~in) is concatenated into ``in_proj.*``, in place."""
    for name in ('weight', 'bias'):
        old = [prefix + f'{layer}.{name}' for layer in ('linear', 'fc1') if prefix + f'{layer}.{name}' in state_dict]
        if old and prefix + f'in_proj.{name}' not in state_dict:  # both layouts at once: leave it to strict loading
            state_dict[prefix + f'in_proj.{name}'] = torch.cat([state_dict.pop(k) for k in old])  # -> (C + K, C)


def repa_ffn(in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None, *,
             deploy: bool = False, **kwargs) -> nn.Module:
    """Build a RePa residual unit: :class:`RePaFFN`, or with ``deploy=True`` the
    :class:`RePaDeployedFFN` that its ``fuse()`` would return (for loading fused checkpoints)."""
    if deploy:
        if out_features not in (None, in_features):
            raise ValueError(f'RePa is a residual unit: out_features ({out_features}) must equal '
                             f'in_features ({in_features})')
        return RePaDeployedFFN.from_config(in_features, hidden_features, **kwargs)
    return RePaFFN(in_features, hidden_features, out_features, **kwargs)
