"""AFBO's fused kernels: both channel maps as one grouped GEMM, then both branches' spatial ops,
the activation and the bilinear product in one pass (Eq. 4 with Fig. 1b's activation placement).

Every channel map of :mod:`vitblocks.layers.channel_maps` is a *window map*: output group g
(``n`` channels) reads ``K`` consecutive input channels starting at ``g * step``, cyclically
(mod d), with its own ``(K, n)`` weight block:

| map     | groups | K           | step   | n           |
| ------- | ------ | ----------- | ------ | ----------- |
| dense   | 1      | d           | -      | Md          |
| grouped | G      | d/G         | d/G    | Md/G        |
| GCCM    | G1     | d/G1        | d/G1   | Md/G1 (the pair [W(j) | W(j+1)]) |
| OCCM    | G2     | (G2-1)d/G2  | d/G2   | Md/G2       |

So one kernel runs any two maps: the launch's column tiles are the left map's followed by the right
map's, and each program computes one ``(tokens, n)`` tile of one group of one map, reading the
input through its strides (tokens, channels-last or channels-first maps: no layout copy).
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import (LaunchTuner, act_id, activate, depthwise_conv_tile, dot_dtype, dot_precision, next_pow2,
                      outputs_per_thread, upcast_operands)

__all__ = ['window_spec', 'window_maps', 'dwconv_pair_product', 'GEMM_TUNER', 'PAIR_TUNER']

# (pixels of a row segment, channels, warps) per program; two branches' accumulators live at once, so 2-4
# outputs per thread (W_BLOCK=4 x 128 channels spilled 8 bytes at k = 7 on sm_90); the first runs where
# nothing was timed
PAIR_TUNER = LaunchTuner('dwconv_pair_product', [
    dict(W_BLOCK=8, C_BLOCK=32, num_warps=4), dict(W_BLOCK=8, C_BLOCK=64, num_warps=4),
    dict(W_BLOCK=16, C_BLOCK=64, num_warps=8), dict(W_BLOCK=16, C_BLOCK=32, num_warps=4)])

# (tokens, output channels, reduction step) per program, warps and software-pipeline stages; strict fp32 has
# no tensor cores (FMA, the accumulator and operands in registers) and takes the small tiles only (_gemm_fits);
# the first fitting one runs where nothing was timed
GEMM_TUNER = LaunchTuner('window_maps', [
    dict(T_BLOCK=64, N_BLOCK=64, K_BLOCK=32, num_warps=4, num_stages=3),
    dict(T_BLOCK=128, N_BLOCK=64, K_BLOCK=32, num_warps=4, num_stages=3),
    dict(T_BLOCK=64, N_BLOCK=128, K_BLOCK=32, num_warps=8, num_stages=3),
    dict(T_BLOCK=32, N_BLOCK=64, K_BLOCK=32, num_warps=4, num_stages=3),
    dict(T_BLOCK=32, N_BLOCK=32, K_BLOCK=32, num_warps=4, num_stages=3)])


def _gemm_fits(fma: bool):
    """Strict fp32: at most 16 accumulators per thread (64 x 64 on 4 warps spilled on sm_80)."""
    return lambda config: not fma or outputs_per_thread(config, 'T_BLOCK', 'N_BLOCK') <= 16

# combine(): where the activation goes, as AFBO's act_position / act_branch
COMBINE_IDS = {('pre', 'left'): 0, ('pre', 'right'): 1, ('pre', 'both'): 2, ('post', 'left'): 3,
               ('post', 'right'): 3, ('post', 'both'): 3}


def window_spec(channel_map) -> Tuple[torch.Tensor, int]:
    """``(weight as (G, K, n) possibly strided, step)`` of a channel map (module docstring table)."""
    weight = channel_map.bmm_weight()
    if weight.ndim == 2:  # dense (Md, d): one group reading every channel; a transposed view, not a copy
        return weight.t().unsqueeze(0), 0
    return weight, channel_map.in_features // channel_map.groups


@triton.jit
def _window_tile(x_ptr, sx_b, sx_t, sx_c, w_ptr, sw_g, sw_k, sw_n, bias_ptr, out_ptr, so_b, so_t,
                 tile, b, t0, TOKENS, D, STEP, K, N_OUT, TILES_PER_GROUP,
                 HAS_BIAS: tl.constexpr, T_BLOCK: tl.constexpr, N_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
                 DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    g = tile // TILES_PER_GROUP  # output group of this map
    j = (tile % TILES_PER_GROUP) * N_BLOCK + tl.arange(0, N_BLOCK)  # (N,) output channel within the group
    t = t0 + tl.arange(0, T_BLOCK)  # (T,) token within the image
    tmask, jmask = t < TOKENS, j < N_OUT
    x_img = x_ptr + b.to(tl.int64) * sx_b
    acc = tl.zeros((T_BLOCK, N_BLOCK), tl.float32)
    for k0 in range(0, K, K_BLOCK):
        k = k0 + tl.arange(0, K_BLOCK)
        kmask = k < K
        col = (g * STEP + k) % D  # the window, wrapping around the d input channels (OCCM, Eq. 7)
        a = tl.load(x_img + t[:, None] * sx_t + col[None, :] * sx_c, mask=tmask[:, None] & kmask[None, :],
                    other=0.).to(DOT)  # (T, K)
        w = tl.load(w_ptr + g * sw_g + k[:, None] * sw_k + j[None, :] * sw_n, mask=kmask[:, None] & jmask[None, :],
                    other=0.).to(DOT)  # (K, N)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + g * N_OUT + j, mask=jmask, other=0.).to(tl.float32)[None, :]
    dest = out_ptr + b.to(tl.int64) * so_b + t[:, None] * so_t + (g * N_OUT + j)[None, :]
    tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & jmask[None, :])


@triton.jit(do_not_specialize=['TOKENS', 'TILES_L', 'TILES_R', 'T_TILES', 'LEFT_TILES'])
def _window_maps_kernel(x_ptr, sx_b, sx_t, sx_c, TOKENS, D,
                        wl_ptr, swl_g, swl_k, swl_n, bl_ptr, ol_ptr, STEP_L, K_L, N_L, TILES_L,
                        wr_ptr, swr_g, swr_k, swr_n, br_ptr, or_ptr, STEP_R, K_R, N_R, TILES_R,
                        so_b, so_t, T_TILES, LEFT_TILES,
                        HAS_BIAS: tl.constexpr, T_BLOCK: tl.constexpr, N_BLOCK: tl.constexpr,
                        K_BLOCK: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # axis 0: (image, token tile); axis 1: the left map's column tiles, then the right map's
    pid = tl.program_id(0)
    b, t0 = pid // T_TILES, (pid % T_TILES) * T_BLOCK
    tile = tl.program_id(1)
    if tile < LEFT_TILES:
        _window_tile(x_ptr, sx_b, sx_t, sx_c, wl_ptr, swl_g, swl_k, swl_n, bl_ptr, ol_ptr, so_b, so_t,
                     tile, b, t0, TOKENS, D, STEP_L, K_L, N_L, TILES_L,
                     HAS_BIAS, T_BLOCK, N_BLOCK, K_BLOCK, DOT, UPCAST, PRECISION)
    else:
        _window_tile(x_ptr, sx_b, sx_t, sx_c, wr_ptr, swr_g, swr_k, swr_n, br_ptr, or_ptr, so_b, so_t,
                     tile - LEFT_TILES, b, t0, TOKENS, D, STEP_R, K_R, N_R, TILES_R,
                     HAS_BIAS, T_BLOCK, N_BLOCK, K_BLOCK, DOT, UPCAST, PRECISION)


def window_maps(x: torch.Tensor, left_map, right_map, dtype: Optional[torch.dtype] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both channel maps of AFBO on ``x`` in one launch.

    Args:
        x: ``(B, T, d)`` with any strides: tokens, a channels-last map flattened, or a channels-first
            ``(B, d, H, W)`` map seen as ``x.flatten(2).transpose(1, 2)`` (no copy is made).
        left_map, right_map: :class:`~vitblocks.layers.channel_maps.ChannelMap` modules on d channels.
        dtype: the operands' dtype (bf16 under autocast); default ``x.dtype``.

    Returns:
        ``(left, right)``, each ``(B, T, Md)`` contiguous, in ``dtype``; fp32 accumulation.
    """
    dtype = dtype or x.dtype
    batch, tokens, d = x.shape
    (wl, step_l), (wr, step_r) = window_spec(left_map), window_spec(right_map)
    md = left_map.out_features
    out = x.new_empty((2, batch, tokens, md), dtype=dtype)  # left and right in one allocation
    has_bias = left_map.bias is not None
    if has_bias != (right_map.bias is not None):
        raise ValueError('window_maps needs both maps with a bias or both without')
    dummy = out  # any pointer: the bias is not read without HAS_BIAS
    dot, upcast, precision = dot_dtype(dtype), upcast_operands(), dot_precision(dtype)

    def run(config):
        t_block, n_block = config['T_BLOCK'], config['N_BLOCK']
        t_tiles = triton.cdiv(tokens, t_block)
        tiles_l, tiles_r = triton.cdiv(wl.shape[2], n_block), triton.cdiv(wr.shape[2], n_block)
        left_tiles = wl.shape[0] * tiles_l
        launch = (batch * t_tiles, left_tiles + wr.shape[0] * tiles_r)
        _window_maps_kernel[launch](
            x, x.stride(0), x.stride(1), x.stride(2), tokens, d,
            wl, wl.stride(0), wl.stride(1), wl.stride(2), left_map.bias if has_bias else dummy, out[0],
            step_l, wl.shape[1], wl.shape[2], tiles_l,
            wr, wr.stride(0), wr.stride(1), wr.stride(2), right_map.bias if has_bias else dummy, out[1],
            step_r, wr.shape[1], wr.shape[2], tiles_r,
            out.stride(1), out.stride(2), t_tiles, left_tiles,
            HAS_BIAS=has_bias, T_BLOCK=t_block, N_BLOCK=n_block, K_BLOCK=config['K_BLOCK'], DOT=dot, UPCAST=upcast,
            PRECISION=precision, num_warps=config['num_warps'], num_stages=config['num_stages'])

    fma = dtype == torch.float32 and precision == 'ieee'  # no tensor cores
    GEMM_TUNER.launch((batch, tokens, d, md, tuple(wl.shape), tuple(wr.shape), x.stride(), dtype, precision), run,
                      _gemm_fits(fma))
    return out[0], out[1]


@triton.jit
def _combine(left, right, ACT: tl.constexpr, COMBINE: tl.constexpr):
    """AFBO's product with its activation: pre on left (0), right (1), both (2), or post (3)."""
    if COMBINE == 0:
        z = activate(left, ACT) * right
    elif COMBINE == 1:
        z = left * activate(right, ACT)
    elif COMBINE == 2:
        z = activate(left, ACT) * activate(right, ACT)
    else:
        z = activate(left * right, ACT)
    return z


@triton.jit(do_not_specialize=['H', 'W', 'C'])
def _dwconv_pair_product_kernel(l_ptr, r_ptr, wl_ptr, bl_ptr, wr_ptr, br_ptr, out_ptr, H, W, C,
                                stride_b, stride_t, stride_ob, stride_ot,
                                K: tl.constexpr, ACT: tl.constexpr, COMBINE: tl.constexpr, HAS_CONV: tl.constexpr,
                                W_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    # program: W_BLOCK pixels of one image row x C_BLOCK channels; both branches (B, H*W, C), channels contiguous
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    x = tl.program_id(1) * W_BLOCK + tl.arange(0, W_BLOCK)[:, None]  # (W, 1)
    c = tl.program_id(2) * C_BLOCK + tl.arange(0, C_BLOCK)[None, :]  # (1, C)
    cmask = c < C
    l_img, r_img = l_ptr + b.to(tl.int64) * stride_b, r_ptr + b.to(tl.int64) * stride_b
    m = (x < W) & cmask
    if HAS_CONV:
        left = depthwise_conv_tile(l_img, wl_ptr, bl_ptr, h, x, c, cmask, H, W, stride_t, K, W_BLOCK, C_BLOCK)  # (W, C)
        right = depthwise_conv_tile(r_img, wr_ptr, br_ptr, h, x, c, cmask, H, W, stride_t, K, W_BLOCK, C_BLOCK)
    else:  # AFBO-C (no spatial op), and prefix tokens
        offs = (h * W + x) * stride_t + c
        left = tl.load(l_img + offs, mask=m, other=0.).to(tl.float32)
        right = tl.load(r_img + offs, mask=m, other=0.).to(tl.float32)
    z = _combine(left, right, ACT, COMBINE)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + (h * W + x) * stride_ot + c, z.to(out_ptr.dtype.element_ty),
             mask=m)


def dwconv_pair_product(left: torch.Tensor, right: torch.Tensor, convs, grid: Optional[Tuple[int, int]],
                        num_prefix_tokens: int = 0, act: str = 'silu', act_position: str = 'pre',
                        act_branch: str = 'left') -> torch.Tensor:
    """AFBO after its channel maps: ``combine(DWConv_l(left), DWConv_r(right))`` (Eq. 4, Fig. 1b).

    Args:
        left, right: ``(B, P + H*W, Md)`` channel-map outputs (channels contiguous, same strides).
        convs: ``(left_conv, right_conv)`` depthwise ``nn.Conv2d`` modules, or None for AFBO-C (no spatial op).
        grid: ``(H, W)`` of the patch tokens (None without convs: every token is its own row).
        num_prefix_tokens: P leading tokens that skip the spatial op (product and activation only).
        act, act_position, act_branch: as :class:`~vitblocks.layers.AFBO`.

    Returns:
        ``(B, P + H*W, Md)`` contiguous, in ``left``'s dtype.
    """
    batch, tokens, channels = left.shape
    out = torch.empty_like(left, memory_format=torch.contiguous_format)
    combine, act_code = COMBINE_IDS[(act_position, act_branch)], act_id(act)
    p = num_prefix_tokens if convs is not None else 0

    def launch(l_part, r_part, o_part, gh, gw, has_conv):
        wl, bl, wr, br = _conv_params(convs, l_part) if has_conv else (l_part,) * 4  # unread without HAS_CONV
        k = convs[0].kernel_size[0] if has_conv else 1

        def run(config):
            w_block, c_block = min(config['W_BLOCK'], next_pow2(gw)), min(config['C_BLOCK'], next_pow2(channels))
            _dwconv_pair_product_kernel[(batch * gh, triton.cdiv(gw, w_block), triton.cdiv(channels, c_block))](
                l_part, r_part, wl, bl, wr, br, o_part, gh, gw, channels, l_part.stride(0), l_part.stride(1),
                o_part.stride(0), o_part.stride(1), K=k, ACT=act_code, COMBINE=combine, HAS_CONV=has_conv,
                W_BLOCK=w_block, C_BLOCK=c_block, num_warps=config['num_warps'])

        PAIR_TUNER.launch((batch, gh, gw, channels, k, has_conv, left.dtype), run)

    if convs is None:  # no spatial op: every token of the image as one row
        launch(left, right, out, 1, tokens, False)
        return out
    if p:  # prefix tokens: product only, as one row of P tokens
        launch(left[:, :p], right[:, :p], out[:, :p], 1, p, False)
    launch(left[:, p:], right[:, p:], out[:, p:], grid[0], grid[1], True)
    return out


def _conv_params(convs, like: torch.Tensor):
    """Depthwise weights ``(C, 1, k, k)`` contiguous and biases (zeros when a conv has none)."""
    params = []
    for conv in convs:
        params.append(conv.weight.contiguous())
        params.append(conv.bias if conv.bias is not None else like.new_zeros(conv.weight.shape[0]))
    return params
