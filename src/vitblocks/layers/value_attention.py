"""MABViT: attention with an activation on the Value tensor, and the parallel transformer block.

From "MABViT - Modified Attention Block Enhances Vision Transformers" (Ramesh & Ramkumar, 2023).
The queries and keys are those of standard attention; only the values change ("Modified
Attention Block" section)::

    Q = X W_Q + B_Q,   K = X W_K + B_K,   V = Activation(X W_V + B_V)
    out = softmax(Q K^T / sqrt(d_k)) V

* GLU family ("GLU Variant"): the V projection is widened to 2x and split in halves,
  ``V = gate(X W_1) * (X W_2)`` with ``gate`` = SiLU/Swish (``'swiglu'``, the paper's choice),
  GELU (``'geglu'``) or sigmoid (``'glu'``, Dauphin et al.). Adds ``D^2 + D`` parameters per
  layer (with a qkv bias).
* ``'gelu'``: GELU on V, no widening, no extra parameters (the paper's GELU variant).
* ``None`` / ``'identity'``: no activation -- exactly timm's ``Attention``, weights included.

The parallel block is the paper's "Parallel Pre-LN" formulation (Eq. in "Parallel Structure"),
``X = X + MHA(LN(X)) + MLP(LN(X))``, as a timm ``Block`` with a different ``forward``.
"""
from typing import Dict, Final, Optional, Type

import torch
import torch.nn.functional as F
from timm.layers import maybe_add_mask, resolve_self_attn_mask, trunc_normal_, use_fused_attn
from timm.models.vision_transformer import Block
from torch import nn

__all__ = ['ValueActivationAttention', 'ParallelBlock', 'VALUE_ACTIVATIONS', 'GATED_VALUE_ACTIVATIONS']

# Gates of the GLU family: V = gate(X W_1) * (X W_2) on a 2x-wide V projection. Modules, as timm's
# act_layer, so the attention scripts (TorchScript calls no functions stored as attributes).
GATED_VALUE_ACTIVATIONS: Dict[str, Type[nn.Module]] = {
    'swiglu': nn.SiLU,  # the paper's choice: Swish(X W_1) * X W_2
    'geglu': nn.GELU,
    'glu': nn.Sigmoid,  # the original GLU (Dauphin et al., 2017)
}
# Element-wise activations on V (no widening); identity means no activation (standard attention).
_PLAIN_VALUE_ACTIVATIONS: Dict[str, Type[nn.Module]] = {
    'identity': nn.Identity,
    'gelu': nn.GELU,
}
VALUE_ACTIVATIONS = tuple(GATED_VALUE_ACTIVATIONS) + tuple(_PLAIN_VALUE_ACTIVATIONS)


def _value_activation_name(value_act: Optional[str]) -> str:
    name = 'identity' if value_act is None else str(value_act).lower()
    if name not in VALUE_ACTIVATIONS:
        raise ValueError(f'unknown value activation {value_act!r}; use one of {", ".join(VALUE_ACTIVATIONS)} '
                         f'(or None for standard attention)')
    return name


class ValueActivationAttention(nn.Module):
    """Multi-head self-attention with an activation on V (MABViT); a drop-in for timm's ``Attention``.

    Same constructor vocabulary and ``forward(x, attn_mask=None, is_causal=False)`` as
    ``timm.layers.Attention``, and the same module names (``qkv``, ``q_norm``, ``k_norm``,
    ``norm``, ``gate``, ``proj``), so with ``value_act=None`` timm's weights load unchanged and
    the output is identical. Uses fused ``F.scaled_dot_product_attention`` when timm does
    (``timm.layers.use_fused_attn()``), else the explicit softmax path.

    Args:
        dim: input width D.
        num_heads: attention heads.
        attn_head_dim: width of each head (default ``dim // num_heads``).
        dim_out: output width (default D).
        qkv_bias: bias on the fused Q/K/V projection (B_Q, B_K, B_V).
        qk_norm: normalize queries and keys per head with ``norm_layer``.
        scale_norm: normalize the attention output before ``proj`` with ``norm_layer``.
        proj_bias: bias on the output projection.
        gated: timm's sigmoid output gate on the attention output (not MABViT; kept for parity).
        attn_drop: dropout on the attention weights.
        proj_drop: dropout after the output projection.
        norm_layer: norm class for ``qk_norm`` / ``scale_norm``.
        value_act: activation on V: 'swiglu' (default, the paper's), 'geglu', 'glu' (sigmoid),
            'gelu', or None / 'identity' (standard attention).

    The Q/K/V projection stays one fused ``qkv`` linear; with a GLU activation it produces
    ``(2 + 2) * attn_dim`` features, laid out as ``[Q | K | V_gate | V_linear]``.
    """
    fused_attn: Final[bool]
    gated_value: Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            attn_head_dim: Optional[int] = None,
            dim_out: Optional[int] = None,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_norm: bool = False,
            proj_bias: bool = True,
            gated: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Optional[Type[nn.Module]] = None,
            value_act: Optional[str] = 'swiglu',
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        dim_out = dim_out or dim
        if attn_head_dim is None:
            if dim % num_heads:
                raise ValueError(f'dim={dim} is not divisible by num_heads={num_heads}; pass attn_head_dim= '
                                 f'or choose num_heads among the divisors of {dim}')
            attn_head_dim = dim // num_heads
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError('qk_norm / scale_norm need a norm_layer (e.g. norm_layer=nn.LayerNorm)')
        self.value_act = _value_activation_name(value_act)
        self.num_heads = num_heads
        self.head_dim = attn_head_dim
        self.attn_dim = num_heads * attn_head_dim
        self.scale = attn_head_dim ** -0.5
        self.fused_attn = use_fused_attn()
        self.gated_value = self.value_act in GATED_VALUE_ACTIVATIONS
        self.value_width = (2 if self.gated_value else 1) * self.attn_dim  # "GLU Variant": V widened to 2x
        # the gate (GLU family) or the element-wise activation on V; no parameters, so no state-dict keys
        self.v_act = {**GATED_VALUE_ACTIVATIONS, **_PLAIN_VALUE_ACTIVATIONS}[self.value_act]()

        self.qkv = nn.Linear(dim, 2 * self.attn_dim + self.value_width, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(attn_head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(attn_head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.init_weights()

    def init_weights(self):
        """timm's ViT initialization for linears: truncated normal (std 0.02), zero bias."""
        for m in (self.qkv, self.gate, self.proj):
            if m is None:
                continue
            trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def activate_value(self, v: torch.Tensor) -> torch.Tensor:
        """``Activation(X W_V + B_V)``: ``(..., value_width) -> (..., attn_dim)``."""
        if self.gated_value:
            v_gate, v_linear = v.chunk(2, dim=-1)  # (..., 2A) -> 2 x (..., A): X W_1, X W_2
            return self.v_act(v_gate) * v_linear  # e.g. SwiGLU: Swish(X W_1) * X W_2
        return self.v_act(v)  # GELU, or nn.Identity for standard attention

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        B, N, _ = x.shape
        A, H, hd = self.attn_dim, self.num_heads, self.head_dim
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.qkv(x).split([A, A, self.value_width], dim=-1)  # (B, N, 2A + value_width) -> 3 parts
        v = self.activate_value(v)  # (B, N, value_width) -> (B, N, A): the MABViT change
        q = q.view(B, N, H, hd).transpose(1, 2)  # (B, N, A) -> (B, H, N, hd)
        k = k.view(B, N, H, hd).transpose(1, 2)
        v = v.view(B, N, H, hd).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)

        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                               dropout_p=self.attn_drop.p if self.training else 0.)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)  # (B, H, N, N)
            attn = maybe_add_mask(attn, resolve_self_attn_mask(N, attn, attn_mask, is_causal))
            attn = self.attn_drop(attn.softmax(dim=-1))
            x = attn @ v

        x = x.transpose(1, 2).reshape(B, N, A)  # (B, H, N, hd) -> (B, N, A)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))

    def extra_repr(self) -> str:
        return f'num_heads={self.num_heads}, head_dim={self.head_dim}, value_act={self.value_act!r}'


class ParallelBlock(Block):
    """Parallel pre-LN transformer block: ``x + attn(LN(x)) + mlp(LN(x))`` (MABViT "Parallel Structure").

    A timm ``Block`` (same constructor, same submodules, so it is a ``block_fn`` for timm's
    ``VisionTransformer`` and a standard block's weights load into it) whose ``forward`` runs
    attention and MLP on the same input instead of one after the other::

        x + drop_path1(ls1(attn(norm1(x)))) + drop_path2(ls2(mlp(norm2(x))))

    Args:
        shared_norm: one LayerNorm feeds both branches (PaLM / ViT-22B style; ``norm2`` becomes
            ``nn.Identity``). Default False: two LayerNorms, as a standard block, which keeps the
            parameter count identical to the standard block, as the paper states for its pairs.
        *args, **kwargs: timm ``Block`` arguments (dim, num_heads, mlp_ratio, qkv_bias, ...,
            attn_layer, mlp_layer).
    """

    shared_norm: bool = False  # class default, so a timm Block re-classed by surgery reads False

    def __init__(self, dim: int, num_heads: int, *args, shared_norm: bool = False, **kwargs):
        super().__init__(dim, num_heads, *args, **kwargs)
        self.shared_norm = shared_norm
        if shared_norm:
            self.norm2 = nn.Identity()

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        y_attn = self.norm1(x)
        y_mlp = y_attn if self.shared_norm else self.norm2(x)
        attn = self.drop_path1(self.ls1(self.attn(y_attn, attn_mask=attn_mask, is_causal=is_causal)))
        mlp = self.drop_path2(self.ls2(self.mlp(y_mlp)))
        return x + attn + mlp
