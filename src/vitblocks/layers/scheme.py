"""SCHEME, the Scalable CHannEl MixEr of Sridhar, Li and Vasconcelos ("SCHEME: Scalable Channel Mixer
for Vision Transformers", arXiv 2312.00412), a counterpart FFN of AFBO's Table 3.

Structure (a block-diagonal MLP with a parallel channel covariance attention branch)::

    x (d) -> fc1, G1 groups (d -> Ed) -> act -> fc2, G2 groups (Ed -> d) ---- * alpha -----.
      '----> CCA: softmax(scale * X^T X) over channel pairs, applied to X ---- * (1 - alpha) -+-> y

* **BD-MLP**: the FFN's two fully-connected layers with block-diagonal weights (grouped 1x1 convs):
  fc1 splits the d inputs into G1 groups, fc2 the Ed hidden channels into G2 groups. The saved
  cost pays for a larger expansion E (8 in SCHEMEformer and in AFBO's Table 3 rows). Parameters
  ``Ed^2 (1/G1 + 1/G2)`` plus biases; the same MACs per token.
* **CCA** (channel covariance attention, parameter-free): for each image, the d x d attention
  ``A = softmax(scale * X^T X)`` (rows over the N tokens ``X`` of shape (N, d), softmax over the last
  axis) mixes the input channels, ``CCA(X) = X A^T``: every output channel is a convex combination of
  input channels, so features of different BD-MLP groups talk to each other during training.
* **Mixing**: ``y = alpha * BD-MLP(x) + (1 - alpha) * CCA(x)``, ``(alpha, 1 - alpha)`` the softmax of
  two learned logits. SCHEME reports that ``1 - alpha`` decays to zero as training converges, so CCA is
  dropped at inference: :meth:`SCHEME.fuse` returns the BD-MLP alone with ``alpha`` folded into fc2.
  That equals the training-form layer exactly when ``1 - alpha == 0``; otherwise it differs by
  ``(1 - alpha) * CCA(x)`` and ``fuse()`` warns with the dropped weight (tests/test_scheme.py checks
  both). The training-form layer keeps CCA in eval mode too, so evaluating it evaluates the trained
  function; the deployed one is what the published parameter and MAC counts describe.

Names: ``SCHEME-12`` / ``SCHEME-44`` in AFBO's Table 3 are the group numbers (G1, G2) = (1, 2) and
(4, 4) at E = 8. The counts fit these numbers only (docs/afbo.md); which layer carries the 1 and which
the 2 the counts cannot tell (both cost the same): we follow the authors' public code, whose
"partial" variant keeps fc1 dense and groups fc2 by 2.

Choices where the description is open (the authors' public code, DeepakSridhar/scheme_vit, read to
learn only):

* ``scale = (E d)^-1/2``, the authors' choice. Their code forms the "transpose" of X with a reshape
  (which scrambles tokens and channels for N > 1); we use the channel covariance ``X^T X`` that the
  method's name and the paper's abstract (attention from channel covariances) describe.
* The mixing logits start at zero (``alpha = 0.5``); the authors draw them from N(0, 1).
* All tokens, prefix (class) tokens included, enter the covariance: CCA is a channel operation
  and needs no grid. Channels-first input (PoolFormer) is handled by a permute.
"""
import copy
import warnings
from typing import Optional, Tuple, Type, Union

import torch
from timm.layers import to_2tuple
from torch import nn

from .activations import ACTIVATIONS, activation_name
from .channel_maps import check_group_number, create_channel_map
from .layout import TokenLayout
from .registry import register_ffn

__all__ = ['SCHEME', 'channel_covariance_attention']

# fuse() warns when it drops a CCA branch whose weight (1 - alpha) is larger than this
CCA_DROP_TOLERANCE = 1e-3


def channel_covariance_attention(x: torch.Tensor, scale: float) -> torch.Tensor:
    """SCHEME's CCA on channels-last tokens ``(B, N, C)``: ``X softmax(scale X^T X)^T`` per image."""
    attn = torch.softmax((x.transpose(1, 2) @ x) * scale, dim=-1)  # (B, C, N) @ (B, N, C) -> (B, C, C)
    return x @ attn.transpose(1, 2)  # (B, N, C) @ (B, C, C) -> (B, N, C): y[n, i] = sum_j A[i, j] x[n, j]


@register_ffn('scheme', inherits=('drop', 'act_layer'))
class SCHEME(nn.Module):
    """SCHEME channel mixer: block-diagonal MLP + training-time channel covariance attention.

    Args:
        in_features: input channels d.
        hidden_features: hidden width Ed (default 4d; SCHEMEformer and AFBO Table 3 use E = 8:
            ``swap_ffn(model, 'scheme', mlp_ratio=8)``).
        out_features: output channels (default d; must be d while the CCA branch is built).
        act_layer: activation between the layers (name or class; default GELU, the backbone's).
        norm_layer: optional norm on the hidden features (timm ``Mlp``'s slot; default none).
        bias: bias of fc1/fc2 (bool or pair).
        drop: dropout after the activation and after fc2 (float or pair).
        groups: (G1, G2), the group numbers of fc1 and fc2; an int sets both. ``(1, 2)`` is SCHEME-12.
        cca: build the CCA branch and the mixing weight (training form); ``False`` is the deploy form
            that :meth:`fuse` returns, so fused checkpoints load into a model built with it.
        layout / channels_first: ``(B, C, H, W)`` input (PoolFormer) when ``channels_first``;
            otherwise any channels-last input ``(B, ..., C)``. CCA needs no grid.
    """

    def __init__(self, in_features: int, hidden_features: Optional[int] = None, out_features: Optional[int] = None,
                 act_layer: Union[str, Type[nn.Module]] = 'gelu', norm_layer: Optional[Type[nn.Module]] = None,
                 bias: Union[bool, Tuple[bool, bool]] = True, drop: Union[float, Tuple[float, float]] = 0.,
                 groups: Union[int, Tuple[int, int]] = (1, 2), cca: bool = True, channels_first: bool = False,
                 layout: Optional[TokenLayout] = None, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        out_features = out_features or in_features
        hidden = hidden_features or 4 * in_features
        g1, g2 = to_2tuple(groups)
        check_group_number(g1, in_features, hidden, 'G1 (fc1 groups)')
        check_group_number(g2, hidden, out_features, 'G2 (fc2 groups)')
        if cca and out_features != in_features:
            raise ValueError(f'SCHEME adds CCA(x) ({in_features} channels) to the MLP output ({out_features}); '
                             'out_features must equal in_features, or build the deploy form with cca=False')
        bias, drop_probs = to_2tuple(bias), to_2tuple(drop)
        self.layout = TokenLayout.resolve(layout, None, 0, channels_first)
        self.in_features, self.hidden_features, self.out_features = in_features, hidden, out_features
        self.groups = (g1, g2)
        self.fc1 = create_channel_map('dense' if g1 == 1 else 'grouped', in_features, hidden, g1, bias[0], **dd)
        self.act = ACTIVATIONS[activation_name(act_layer)].module()
        self.drop1 = nn.Dropout(drop_probs[0])
        self.norm = norm_layer(hidden, **dd) if norm_layer is not None else nn.Identity()
        self.fc2 = create_channel_map('dense' if g2 == 1 else 'grouped', hidden, out_features, g2, bias[1], **dd)
        self.drop2 = nn.Dropout(drop_probs[1])
        self.cca_scale = hidden ** -0.5  # the authors' scale, 1/sqrt(Ed)
        # softmax of these two logits is (alpha, 1 - alpha): the weights of the BD-MLP and of CCA
        self.mix_logits = nn.Parameter(torch.zeros(2, **dd)) if cca else None
        self.init_weights()

    @property
    def cca(self) -> bool:
        return self.mix_logits is not None

    def init_weights(self):
        self.fc1.init_weights()
        self.fc2.init_weights()
        if self.mix_logits is not None:
            nn.init.zeros_(self.mix_logits)

    def cca_weight(self) -> float:
        """``1 - alpha``, the weight of the CCA branch (0 for the deploy form)."""
        return 0. if self.mix_logits is None else float(torch.softmax(self.mix_logits.detach(), 0)[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout.channels_first:
            if x.ndim != 4:
                raise ValueError(f'SCHEME (channels_first) expects (B, C, H, W), got shape {list(x.shape)}')
            x = x.permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C)
        y = self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))
        if self.mix_logits is not None:
            w = torch.softmax(self.mix_logits, 0)
            tokens = x.reshape(x.shape[0], -1, x.shape[-1])  # (B, ..., C) -> (B, N, C)
            cca = channel_covariance_attention(tokens, self.cca_scale).view(y.shape)  # (B, N, C) -> (B, ..., C)
            y = w[0] * y + w[1] * cca
        return y.permute(0, 3, 1, 2) if self.layout.channels_first else y  # (B, H, W, C) -> (B, C, H, W)

    def fuse(self) -> 'SCHEME':
        """Deploy form: the BD-MLP alone, ``alpha`` folded into fc2's weight and bias, CCA dropped.

        Equal to this layer when CCA's weight ``1 - alpha`` is zero (SCHEME's converged state); a
        larger weight is dropped with a warning that gives it. Same train/eval mode, shares the
        layout object; ``self`` is unchanged; a deploy-form layer returns itself.
        """
        if self.mix_logits is None:
            return self
        dropped = 0. if self.mix_logits.is_meta else self.cca_weight()  # meta: shapes only, nothing to compare
        if dropped > CCA_DROP_TOLERANCE:
            warnings.warn(f'SCHEME.fuse drops the CCA branch with weight 1 - alpha = {dropped:.4g} '
                          f'(> {CCA_DROP_TOLERANCE:g}): the deployed layer differs from the trained one by that '
                          'fraction of CCA(x). SCHEME drops CCA once training has driven its weight to ~0.',
                          stacklevel=2)
        fused = copy.deepcopy(self, {id(self.layout): self.layout})  # shares the layout object
        fused.mix_logits = None
        with torch.no_grad():
            alpha = torch.softmax(self.mix_logits, 0)[0]
            fused.fc2.weight.mul_(alpha)
            if fused.fc2.bias is not None:
                fused.fc2.bias.mul_(alpha)
        return fused

    def extra_repr(self) -> str:
        return f'groups={self.groups}, cca={self.cca}, channels_first={self.layout.channels_first}'
