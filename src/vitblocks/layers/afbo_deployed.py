"""The deployed (inference) form of AFBO: :class:`AFBODeployed`, what :meth:`AFBO.fuse` returns.

AFBO has no BatchNorm, so the deployed form has exactly AFBO's parameters (a checkpoint of either
loads into the other). Its forward computes the numbers of :meth:`AFBO.forward` and chooses the
kernels by device, for the structures with a fast path (:meth:`AFBODeployed.has_fast_path`):

* **CPU** (eval, no autograd, no autocast): channels-last, in place, batch slices sized for the
  caches (:meth:`_forward_cpu`; docs/afbo.md has the measurements);
* **CUDA** (eval, no autograd; autocast applies): both channel maps as one grouped GEMM read
  in the input's own layout, then both depthwise convs, the activation and the product in one
  Triton kernel, and fc2 in cuBLAS writing the input's layout (:meth:`_forward_fused`,
  :mod:`vitblocks.kernels.afbo`);
* anything else (training mode, autograd, another device, ``torch.compile``, TorchScript,
  ``torch.export``, other structures): the reference ops of :meth:`AFBO.forward`.
"""
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import kernels_usable
from .activations import act_fn_
from .afbo import AFBO
from .layout import (autocasting, batch_slice_size, check_grid, conv_channels_last, exporting,
                     plain_eager_inference)
from .registry import register_deployed_form

__all__ = ['AFBODeployed']


class AFBODeployed(AFBO):
    """AFBO in its inference form; same arguments and parameters as :class:`AFBO`.

    Build it with :meth:`AFBO.fuse` (or ``vitblocks.deploy.reparameterize`` on a model), or directly.
    :meth:`fuse` returns the layer itself.
    """

    deploy = True

    # CPU path: run the batch in slices so that each Md-wide intermediate holds about this many
    # bytes per intra-op thread (2 MB ~ 3 images of DeiT-T), buffers reused across slices. The slices'
    # intermediates stay in cache and are recycled by the allocator instead of being fresh pages the OS
    # must zero on every call: afbo_deit_tiny / deit_tiny at batch 32 on 2 threads went from 1.435x
    # (whole batch) to 1.08-1.17x. 0: never slice. docs/afbo.md has the measurements.
    inference_chunk_bytes: int = 2 * 2 ** 20
    inference_chunk_max_threads: Optional[int] = None  # slice only with at most this many threads (None: any)

    def forward(self, x: torch.Tensor, feat_size: Optional[List[int]] = None) -> torch.Tensor:
        """``feat_size``: the grid ``(H, W)`` of this input, as timm's PVTv2 blocks pass it to their MLP."""
        self.layout.set_grid(feat_size)
        # the fast paths are eager-only: TorchScript runs the reference, and so does torch.export (the CPU
        # path's Python loop over batch slices would fix the batch size)
        if not torch.jit.is_scripting() and self.has_fast_path():
            if not (self.training or torch.is_grad_enabled()) and exporting():
                return self._forward_export(x)
            # the CPU path only in a plain eager call: not under autocast (its out= matmuls would stay fp32), nor
            # while a graph is recorded (compile, export, jit.trace: inductor fuses the reference ops itself, and
            # an exported program must hold no out= op or batch loop), nor under vmap
            if x.device.type == 'cpu' and plain_eager_inference(x, self.training):
                return self._forward_cpu(x)
            if not (self.training or torch.is_grad_enabled()) and kernels_usable(x):
                return self._forward_fused(x)
        return self._forward_reference(x)

    def fuse(self) -> 'AFBODeployed':
        """Already deployed: returns self (re-parameterizing twice is safe)."""
        return self

    # -- export: the graph another runtime gets ------------------------------------------------
    @torch.jit.unused
    def _forward_export(self, x: torch.Tensor) -> torch.Tensor:
        """The inference numbers as a plain graph for ``torch.export`` / ONNX (no in-place op, no batch loop).

        * Each channel map is one dense matmul with its zero blocks (:meth:`ChannelMap.export_weight`, a
          constant to the runtime): in ONNX Runtime that beat every grouped form (docs/cpu_deploy.md).
        * Tokens and channels-last maps stay channels-last, the depthwise convs' layout changes right
          around them (:func:`~vitblocks.layers.layout.conv_channels_last`, folded into ONNX Runtime's conv
          reorders); channels-first maps (PoolFormer) stay channels-first, the maps and fc2 as 1x1 convs.
        * Prefix tokens (no spatial op) go through the maps, product and fc2 on their own and join the patch
          tokens' output after fc2, where it is ``d`` wide rather than ``Md`` wide.
        """
        spatial = self.spatial_kind is not None
        w_left, w_right = self.left_map.export_weight(), self.right_map.export_weight()  # (Md, d) each
        b_left, b_right = self.left_map.bias, self.right_map.bias
        w2, b2 = self.fc2.weight, self.fc2.bias
        if self.layout.channels_first:
            if x.ndim != 4:
                raise ValueError(f'AFBO (channels_first) expects (B, C, H, W), got shape {list(x.shape)}')
            left = F.conv2d(x, w_left[:, :, None, None], b_left)  # (B, d, H, W) -> (B, Md, H, W)
            right = F.conv2d(x, w_right[:, :, None, None], b_right)
            if spatial:
                left, right = self.left_spatial(left), self.right_spatial(right)
            return F.conv2d(self._combine(left, right), w2[:, :, None, None], b2)  # (B, Md, H, W) -> (B, d, H, W)
        prefix = None
        tokens_as_map = x.ndim == 3 and spatial
        if tokens_as_map:  # tokens: the patch tokens as a channels-last map, prefix tokens set aside
            batch, n, d = x.shape
            gh, gw = check_grid(self.layout, n, type(self).__name__)
            p = self.layout.num_prefix_tokens
            if p:
                prefix, x = x[:, :p], x[:, p:]
            x = x.reshape(batch, gh, gw, d)  # (B, H*W, d) -> (B, H, W, d)
        elif x.ndim not in (3, 4):
            raise ValueError(f'AFBO expects tokens (B, N, C) or a map, got shape {list(x.shape)}')
        self.left_map.check_width(x)
        left, right = F.linear(x, w_left, b_left), F.linear(x, w_right, b_right)  # (..., d) -> (..., Md)
        if spatial:
            left = conv_channels_last(self.left_spatial, left)
            right = conv_channels_last(self.right_spatial, right)
        out = F.linear(self._combine(left, right), w2, b2)  # (..., Md) -> (..., d)
        if not tokens_as_map:
            return out
        out = out.flatten(1, 2)  # (B, H, W, d) -> (B, H*W, d)
        if prefix is None:
            return out
        z = self._combine(F.linear(prefix, w_left, b_left), F.linear(prefix, w_right, b_right))  # (B, P, Md)
        return torch.cat([F.linear(z, w2, b2), out], dim=1)  # (B, P + H*W, d)

    # -- CUDA: one grouped GEMM, one fused spatial/product kernel, fc2 in cuBLAS ----------------
    @torch.jit.unused
    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The channel maps read ``x`` in its own layout; fc2 writes the output in it (channels-first
        maps stay channels-first, so a residual add sees matching strides)."""
        from ..kernels.afbo import dwconv_pair_product, window_maps
        spatial = self.spatial_kind is not None
        cf = self.layout.channels_first
        if cf:
            if x.ndim != 4:
                raise ValueError(f'AFBO (channels_first) expects (B, C, H, W), got shape {list(x.shape)}')
            batch, _, gh, gw = x.shape
            rows, grid, prefix = x.flatten(2).transpose(1, 2), (gh, gw), 0  # (B, C, H, W) -> (B, H*W, C) view
        elif x.ndim == 4:  # channels-last map (B, H, W, C)
            batch, gh, gw, _ = x.shape
            rows, grid, prefix = x.flatten(1, 2), (gh, gw), 0  # (B, H, W, C) -> (B, H*W, C) view
        elif x.ndim == 3:  # tokens (B, N, C)
            batch = x.shape[0]
            grid = check_grid(self.layout, x.shape[1], type(self).__name__) if spatial else None
            rows, prefix = x, self.layout.num_prefix_tokens
        else:
            raise ValueError(f'AFBO expects tokens (B, N, C) or a map, got shape {list(x.shape)}')
        self.left_map.check_width(rows)
        dtype = torch.get_autocast_dtype(x.device.type) if autocasting(x) else x.dtype
        left, right = window_maps(rows, self.left_map, self.right_map, dtype)  # each (B, L, Md)
        convs = (self.left_spatial, self.right_spatial) if spatial else None
        z = dwconv_pair_product(left, right, convs, grid, prefix, self.act_name, self.act_position,
                                self.act_branch)  # (B, L, Md)
        w2, b2 = self.fc2.weight, self.fc2.bias
        if cf:  # out[b] = W2 z[b]^T: (d, Md) @ (Md, H*W) -> (d, H*W), channels-first as the input
            zt = z.transpose(1, 2)  # (B, L, Md) -> (B, Md, L) view
            w2b = w2.expand(batch, -1, -1)  # (d, Md) -> (B, d, Md) view
            out = torch.bmm(w2b, zt) if b2 is None else torch.baddbmm(b2.view(1, -1, 1), w2b, zt)
            return out.view(batch, -1, grid[0], grid[1])  # (B, d, H*W) -> (B, d, H, W)
        out = F.linear(z, w2, b2)  # (B, L, Md) -> (B, L, d)
        return out.view(x.shape[:-1] + (out.shape[-1],))  # maps: (B, H*W, d) -> (B, H, W, d)

    # -- CPU: channels-last, in place, batch slices -------------------------------------------
    def has_fast_path(self) -> bool:
        """Whether this structure has the CPU and CUDA paths: 'cm' or 'cm_sm' order, a depthwise conv or no
        spatial op, no norm (the paper's AFBO and its AFBO-C, activation and group ablations)."""
        return (self.order in ('cm', 'cm_sm') and isinstance(self.norm, nn.Identity)
                and (self.spatial_kind is None or self.spatial_kind == 'dwconv'))

    def _combine_into(self, left: torch.Tensor, right: torch.Tensor, dest: torch.Tensor) -> None:
        """:meth:`_combine` written into ``dest``; activates ``left``/``right`` in place (scratch buffers)."""
        act_ = act_fn_(self.act_name)  # in place where torch can (the inputs are scratch buffers)
        if self.act_position == 'post':
            y = act_(torch.mul(left, right, out=dest))
            if y is not dest:  # an activation without an in-place kernel (softplus)
                dest.copy_(y)
            return
        if self.act_branch in ('left', 'both'):
            left = act_(left)
        if self.act_branch in ('right', 'both'):
            right = act_(right)
        torch.mul(left, right, out=dest)

    @torch.jit.unused
    def _forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """Eval-mode CPU inference: the numbers of :meth:`AFBO.forward` with fewer passes and copies.

        * Channels-last throughout: each channel map writes its ``(tokens, Md)`` output in place
          with one batched matmul (no layout copy); the depthwise convs read the patch tokens
          through a channels-last ``(b, Md, H, W)`` view, and the product is written back into
          the left branch's buffer, which fc2 reads (prefix tokens skip the convs, no concat).
        * The batch runs in slices of about ``inference_chunk_bytes`` per thread per Md-wide
          intermediate, with the slice buffers reused, so the intermediates of a slice stay in
          cache and no call pays for fresh pages (1.08-1.17x DeiT-T instead of 1.44x on 2 threads);
          not while ``torch.compile`` or tracing builds a graph (:func:`~vitblocks.layers.layout.batch_slice_size`).
        * Grouped weights (GCCM's pairs) are packed once per call, not once per slice.
        """
        cf = self.layout.channels_first
        if cf:
            if x.ndim != 4:
                raise ValueError(f'AFBO (channels_first) expects (B, C, H, W), got shape {list(x.shape)}')
            x = x.permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C) view
        spatial = self.spatial_kind is not None
        if x.ndim == 3:  # tokens (B, N, C)
            B, N, C = x.shape
            prefix = self.layout.num_prefix_tokens if spatial else 0
            grid = check_grid(self.layout, N, type(self).__name__) if spatial else None
        elif x.ndim == 4:  # channels-last map (B, H, W, C)
            B, gh, gw, C = x.shape
            N, prefix, grid = gh * gw, 0, (gh, gw)
        else:
            raise ValueError(f'AFBO expects tokens (B, N, C) or a map, got shape {list(x.shape)}')
        self.left_map.check_width(x)  # both maps read the same rows; once, not per slice
        rows = x.reshape(B, N, C)  # a view unless the input is channels-first
        out = rows.new_empty(B, N, self.out_features)
        hid = self.hidden_features
        per_image = N * hid * rows.element_size()
        step = B  # the whole batch while torch.compile traces (a compiler plans memory itself)
        if not torch.compiler.is_compiling():  # dynamo cannot trace get_num_threads (a graph break)
            threads = torch.get_num_threads()
            limit = self.inference_chunk_max_threads
            budget = self.inference_chunk_bytes * threads if limit is None or threads <= limit else 0
            step = batch_slice_size(B, per_image, budget) or B
        w_left, w_right = self.left_map.bmm_weight(), self.right_map.bmm_weight()
        buf_left, buf_right = rows.new_empty(step * N, hid), rows.new_empty(step * N, hid)
        w2, b2 = self.fc2.weight, self.fc2.bias
        for i in range(0, B, step):
            b = min(step, B - i)
            xr = rows[i:i + b].reshape(b * N, C)  # (b, N, C) -> (b*N, C)
            left = self.left_map.forward_into(xr, buf_left[:b * N], w_left)  # (b*N, Md)
            right = self.right_map.forward_into(xr, buf_right[:b * N], w_right)
            if spatial:
                left3, right3 = left.view(b, N, hid), right.view(b, N, hid)
                patches = left3[:, prefix:].unflatten(1, grid)  # (b, H, W, Md) view into the left buffer
                conv_l = self._dwconv(self.left_spatial, patches)
                conv_r = self._dwconv(self.right_spatial, right3[:, prefix:].unflatten(1, grid))
                self._combine_into(conv_l, conv_r, patches)
                if prefix:  # prefix tokens: no spatial op
                    self._combine_into(left3[:, :prefix], right3[:, :prefix], left3[:, :prefix])
            else:
                self._combine_into(left, right, left)
            dest = out[i:i + b].view(b * N, self.out_features)
            if b2 is None:
                torch.mm(left, w2.t(), out=dest)
            else:
                torch.addmm(b2, left, w2.t(), out=dest)  # fc2, written in place
        if x.ndim == 4:
            out = out.view(B, grid[0], grid[1], self.out_features)
            return out.permute(0, 3, 1, 2) if cf else out  # (B, H, W, C) -> (B, C, H, W) view
        return out

    @staticmethod
    def _dwconv(conv: nn.Conv2d, fmap_cl: torch.Tensor) -> torch.Tensor:
        """Depthwise conv of a channels-last ``(b, H, W, C)`` view; returns ``(b, H, W, C)`` (a view)."""
        y = F.conv2d(fmap_cl.permute(0, 3, 1, 2), conv.weight, conv.bias, padding=conv.padding,
                     groups=conv.groups)  # (b, C, H, W) channels-last in, channels-last out
        return y.permute(0, 2, 3, 1)


register_deployed_form('afbo', AFBODeployed)
