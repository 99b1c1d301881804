"""The deployed (inference) form of IFFN: :class:`IFFNDeployed`, what :meth:`IFFN.fuse` returns.

It has IFFN's parameters with the depthwise block's BatchNorm folded into its conv, so a fused
checkpoint loads into one built directly (``IFFNDeployed(...)``, or a registered model with
``block_cfg={'deploy': True}``). Its forward computes the numbers of :meth:`IFFN.forward` and
chooses the kernels by device:

* **CPU** (eval, no autograd, no autocast): channels-last, in-place, batch slices sized for the
  caches (:meth:`_forward_cpu`; docs/iffn_speed.md has the measurements behind each choice);
* **CUDA** (eval, no autograd; autocast applies to fc1/fc2): fc1 and fc2 in cuBLAS, the
  activations + concat + LayerNorm in one Triton kernel and the depthwise conv + activation +
  residual in another, on the token layout (:meth:`_forward_fused`, :mod:`vitblocks.kernels.iffn`);
* anything else (training mode, autograd, another device, ``torch.compile`` on a GPU, TorchScript):
  the reference ops of :meth:`IFFN.forward`.
"""
import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import kernels_usable
from .activations import act_fn, act_fn_
from .iffn import IFFN, linear_weight, norm_channels_last
from .layout import (autocasting, batch_slice_size, check_grid, conv_channels_last, exporting,
                     plain_eager_inference, split_tokens)
from .rational_gelu import gelu_rational
from .registry import register_deployed_form

__all__ = ['IFFNDeployed']


class IFFNDeployed(IFFN):
    """IFFN in its inference form (an :class:`IFFN` with the BatchNorm folded); same arguments as IFFN.

    Build it with :meth:`IFFN.fuse` (or ``vitblocks.deploy.reparameterize`` on a model), or directly
    to load a fused checkpoint. :meth:`fuse` returns the layer itself.
    """

    deploy = True
    fold_batchnorm = True  # IFFN.__init__ builds the depthwise block without its BatchNorm

    # CPU path: process the batch in slices of about this many bytes of C'-wide hidden
    # features; 0 = whole batch. See _forward_cpu; set per instance or on the class. Not a cache size: 8 MiB
    # was the fastest on both CPU families measured (AMD AVX2 and Intel AVX-512, where the size of two cores'
    # L2 caches, 4 MiB, was 10% slower and the whole batch 40%; docs/cpu_deploy.md).
    inference_chunk_bytes: int = 8 * 2 ** 20
    # CPU path while torch.compile traces it: exact GELUs through the rational erf of
    # layers/rational_gelu.py (same function within 3e-7 relative, ~1.7x faster per element in
    # inductor's CPU kernels); False = torch's GELU. Set per instance or on the class. Needs a torch whose
    # Dynamo answers is_exporting() truthfully: torch 2.11.0 answers True in every torch.compile (pytorch/pytorch
    # #176347), and there the eager path is traced instead (torch's GELU); the pinned 2.14.1 answers False.
    compile_rational_gelu: bool = True

    def forward(self, x: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        """``feat_size``: the grid ``(H, W)`` of this input, as timm's PVTv2 blocks pass it to their MLP."""
        self.layout.set_grid(feat_size)
        if not torch.jit.is_scripting() and not (self.training or torch.is_grad_enabled()):
            if exporting():
                return self._forward_export(x)
            if x.device.type == 'cpu' and (plain_eager_inference(x, self.training) or _compiling_for_cpu(x)):
                return self._forward_cpu(x)
            if kernels_usable(x):
                return self._forward_fused(x)
        # training, autograd, vmap, TorchScript: plain functional ops
        return self._forward_reference(x)

    def fuse(self) -> 'IFFNDeployed':
        """Already deployed: returns self (re-parameterizing twice is safe)."""
        return self

    # -- shared by the fast paths ----------------------------------------------------------
    def _channels_last(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as channels-last ``(..., C)`` (a view), after checking its shape fits the layout."""
        if self.layout.channels_first:
            if x.ndim != 4:
                raise ValueError(f'IFFN (channels_first) expects (B, C, H, W), got shape {tuple(x.shape)}')
            return x.permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C), a view
        if x.ndim == 3:
            if self.spatial is not None:  # without a spatial part (LVT's class attention) tokens need no grid
                check_grid(self.layout, x.shape[1], type(self).__name__)  # fail early, before any compute
        elif x.ndim != 4:
            raise ValueError(f'IFFN expects tokens (B, N, C) or a map, got shape {tuple(x.shape)}')
        return x

    def _back_to_input_layout(self, out: torch.Tensor) -> torch.Tensor:
        out = norm_channels_last(self.norm_out, out, self.layout.channels_first)
        return out.permute(0, 3, 1, 2) if self.layout.channels_first else out  # (B, H, W, C) -> (B, C, H, W) view

    # -- export: the graph another runtime gets ------------------------------------------------
    @torch.jit.unused
    def _forward_export(self, x: torch.Tensor) -> torch.Tensor:
        """The inference numbers as a plain graph for ``torch.export`` / ONNX (no in-place op, no batch loop).

        Channels-last throughout, like the CPU path: the depthwise conv's layout changes sit right around it
        (:func:`~vitblocks.layers.layout.conv_channels_last`), so ONNX Runtime folds them into its conv's own
        reorders, and the activation and residual run on the channels-last map. The reference ops put the
        residual on the channels-first map, which costs ONNX Runtime two transposes of the C'-wide features
        per block (IFFN-S FFN: 1.80x -> 1.58x timm's Mlp there; docs/cpu_deploy.md).
        """
        x = self._channels_last(x)
        h = F.linear(x, linear_weight(self.fc1), self.fc1.bias)  # (..., C) -> (..., C'/N)
        if self.channel_part:
            a = self.act
            u = torch.addcmul(a.gamma, a.alpha, h.unsqueeze(-2))  # (..., 1, C'/N) -> (..., N, C'/N), Eq. 3 inside
            u = torch.addcmul(a.theta, a.beta, act_fn(a.base)(u))  # Eq. 3 outside
            y = norm_channels_last(self.norm, u.flatten(-2), self.layout.channels_first)  # -> (..., C'), Eq. 5
        else:
            y = act_fn(self.act.name)(h)
        if self.spatial is not None:
            prefix = None
            if y.ndim == 3:  # tokens: the patch tokens as a channels-last map, prefix tokens set aside
                batch, n, c = y.shape
                gh, gw = check_grid(self.layout, n, type(self).__name__)
                p = self.layout.num_prefix_tokens
                if p:
                    prefix, y = y[:, :p], y[:, p:]
                fmap = y.reshape(batch, gh, gw, c)  # (B, H*W, C') -> (B, H, W, C')
            else:
                fmap = y
            z = act_fn(self.spatial.act_name)(conv_channels_last(self.spatial.conv, fmap))
            fmap = fmap + z  # the depthwise block's residual
            y = fmap if x.ndim == 4 else fmap.flatten(1, 2)  # (B, H, W, C') -> (B, H*W, C') for tokens
            if prefix is not None:
                y = torch.cat([prefix, y], dim=1)
        out = F.linear(y, linear_weight(self.fc2), self.fc2.bias)  # (..., C') -> (..., C)
        return self._back_to_input_layout(out)

    # -- CUDA: cuBLAS GEMMs around two fused Triton kernels ---------------------------------
    @torch.jit.unused
    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """fc1 (cuBLAS) -> [N activations, concat, LayerNorm] (one kernel) -> [DWConv, act, residual] (one
        kernel, prefix tokens passing by) -> fc2 (cuBLAS) -> LayerNorm. Autocast casts fc1 and fc2 as in
        the reference; the kernels compute in fp32 and store in their input's dtype."""
        from ..kernels.iffn import agelu_concat_layernorm, dwconv_act_residual
        x = self._channels_last(x)
        batch = x.shape[0]
        h = F.linear(x, linear_weight(self.fc1), self.fc1.bias)  # (B, ..., C) -> (B, ..., C'/N)
        rows = h.reshape(-1, h.shape[-1])  # (B, ..., C'/N) -> (T, C'/N)
        if self.channel_part and isinstance(self.norm, nn.LayerNorm):
            a, norm = self.act, self.norm
            y = agelu_concat_layernorm(rows, a.alpha, a.gamma, a.beta, a.theta, norm.weight, norm.bias, norm.eps,
                                       a.base)  # (T, C'), Eq. 3-5
        elif self.channel_part:  # another norm than LayerNorm: the reference ops for this stage
            y = norm_channels_last(self.norm, self.act(h), False).reshape(rows.shape[0], -1)
        else:
            y = act_fn(self.act.name)(rows)
        y = y.view(batch, -1, y.shape[-1])  # (T, C') -> (B, L, C')
        if self.spatial is not None:
            if x.ndim == 4:  # a map: every token is on the grid
                grid, prefix = (x.shape[1], x.shape[2]), 0
            else:
                grid, prefix = self.layout.grid_size, self.layout.num_prefix_tokens
            y = dwconv_act_residual(y, self.spatial.conv.weight, self.spatial.conv.bias, grid, prefix,
                                    self.spatial.act_name)
        out = F.linear(y, linear_weight(self.fc2), self.fc2.bias)  # (B, L, C') -> (B, L, C)
        return self._back_to_input_layout(out.view(x.shape[:-1] + (out.shape[-1],)))

    # -- CPU: channels-last, in place, batch slices -------------------------------------------
    @torch.jit.unused
    def _forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """Eval-mode CPU inference: the numbers of :meth:`IFFN.forward` with fewer passes and copies.

        * Everything runs channels-last ``(..., C)``: tokens as they come, channels-first input
          viewed as ``(B, H, W, C)``; the depthwise conv reads the hidden tokens through a
          channels-last ``(B, C', H, W)`` view and returns channels-last, so nothing is transposed.
        * The N activations are written by broadcasting into one ``(..., N, C'/N)`` buffer and
          finished in place (no concat copy); the spatial residual is added in place into the
          patch tokens (prefix tokens stay where they are, no concat).
        * The batch runs in slices of about 8 MiB of hidden features (``inference_chunk_bytes``),
          so the C'-wide intermediates stay in cache and the allocator recycles them: fresh tensors
          of tens of MB are mapped and zero-filled page by page on every allocation, which costs
          more than the element-wise arithmetic itself. Slicing multiplies the ops (each a
          fork/join of the intra-op threads): on a dedicated CPU that is cheap (IFFN-S, 2 threads,
          quiet machine: 0.97x DeiT-S sliced, 1.00x whole batch), on an oversubscribed one it
          can cost more than it saves (set 0 there; docs/iffn_speed.md).
        """
        x = self._channels_last(x)
        w2, b2 = linear_weight(self.fc2), self.fc2.bias
        step = self._slice_size(x)
        if step is None:  # the whole batch at once
            out = F.linear(self._hidden_cpu(x), w2, b2)
        else:
            out = x.new_empty(x.shape[:-1] + (w2.shape[0],))
            for i in range(0, x.shape[0], step):
                hidden = self._hidden_cpu(x[i:i + step]).flatten(0, -2)  # (b, ..., C') -> (b*L, C')
                out_slice = out[i:i + step].view(-1, w2.shape[0])  # contiguous rows of the output
                if b2 is None:
                    torch.mm(hidden, w2.t(), out=out_slice)
                else:
                    torch.addmm(b2, hidden, w2.t(), out=out_slice)  # fc2, written in place
        return self._back_to_input_layout(out)

    def _slice_size(self, x: torch.Tensor) -> Optional[int]:
        """Samples per batch slice of the CPU path, None for one slice (``inference_chunk_bytes``)."""
        per_sample = math.prod(x.shape[1:-1]) * self.hidden_features * x.element_size()  # hidden bytes
        return batch_slice_size(x.shape[0], per_sample, self.inference_chunk_bytes)

    def _hidden_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """fc1, activations, norm and spatial part of a channels-last slice ``(b, ..., C) -> (b, ..., C')``.

        While torch.compile traces it (not torch.export), the activations are functional (exact GELUs as
        :func:`gelu_rational` with ``compile_rational_gelu``) and the N copies of fc1's output are
        one flat ``(..., C')`` tensor: with the ``(..., N, C'/N)`` broadcast below, inductor stored
        the rational GELU's output channel-major and the LayerNorm read it across (docs/iffn_speed.md).
        """
        h = F.linear(x, linear_weight(self.fc1), self.fc1.bias)  # (..., C) -> (..., C'/N)
        cf = self.layout.channels_first
        compiling = torch.compiler.is_compiling()  # torch.compile (an export takes the reference ops)
        activate = self._activate_compiled if compiling else _activate_
        if self.channel_part and compiling:
            a = self.act
            h = h.repeat(*([1] * (h.ndim - 1)), a.num_functions)  # (..., C'/N) -> (..., C'): N copies, concat order
            u = torch.addcmul(a.gamma.flatten(), a.alpha.flatten(), h)  # (N, C'/N) -> (C'), Eq. 3 inside
            u = torch.addcmul(a.theta.flatten(), a.beta.flatten(), activate(a.base, u))  # Eq. 3 outside
            y = norm_channels_last(self.norm, u, cf)
        elif self.channel_part:
            a = self.act
            u = torch.addcmul(a.gamma, a.alpha, h.unsqueeze(-2))  # (..., 1, C'/N) -> (..., N, C'/N), Eq. 3 inside
            u = _activate_(a.base, u)
            torch.addcmul(a.theta, a.beta, u, out=u)  # Eq. 3 outside, in place
            y = norm_channels_last(self.norm, u.flatten(-2), cf)  # (..., N, C'/N) -> (..., C'): Eq. 5 concat
        else:
            y = activate(self.act.name, h)
        if self.spatial is None:
            return y
        if y.ndim == 3:  # tokens: patch tokens as a (b, C', H, W) channels-last view, prefix left out
            _, fmap = split_tokens(y, self.layout, type(self).__name__)
        else:
            fmap = y.permute(0, 3, 1, 2)  # (b, H, W, C') -> (b, C', H, W) view
        z = self.spatial.conv(fmap)  # BN folded into the conv; channels-last (b, C', H, W)
        # the activation on the standard-contiguous (b, H, W, C') view of the same memory: torch's
        # element-wise kernels run ~1.4x slower on the channels-last 4D strides (docs/iffn_speed.md)
        z = activate(self.spatial.act_name, z.permute(0, 2, 3, 1))  # (b, C', H, W) -> (b, H, W, C') view
        fmap.add_(z.permute(0, 3, 1, 2))  # residual, in place in y; (b, H, W, C') -> (b, C', H, W) view
        return y

    def _activate_compiled(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``phi(x)`` for a compiled graph: functional, the exact GELU as :func:`gelu_rational` if chosen."""
        if name == 'gelu' and self.compile_rational_gelu:
            return gelu_rational(x)
        return act_fn(name)(x)


register_deployed_form('iffn', IFFNDeployed)


def _compiling_for_cpu(x: torch.Tensor) -> bool:
    """``torch.compile`` (not ``torch.export``, nor under autocast) tracing a CPU inference call: it traces the
    CPU path's functional form (:meth:`IFFNDeployed._hidden_cpu`), whose exact GELU inductor runs faster."""
    return torch.compiler.is_compiling() and not torch.compiler.is_exporting() and not autocasting(x)


def _activate_(name: str, x: torch.Tensor) -> torch.Tensor:
    """``phi(x)``, computed in place in ``x`` where torch has an in-place kernel (use the result)."""
    return act_fn_(name)(x)
