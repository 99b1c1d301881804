"""IFFN's fused kernels: the channel part (Eq. 3-5) and the spatial part (Sec. 4.3) of the deployed layer.

fc1 and fc2 stay in cuBLAS; between them the reference ops pass over the C'-wide hidden tensor
about 17 times (N activations, concat, LayerNorm, a channels-last view for the conv, the conv, its
activation, the residual). Here it is written twice and read about twice: once by
:func:`agelu_concat_layernorm`, once by :func:`dwconv_act_residual` (its k x k neighbours come
from cache).
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import LaunchTuner, act_id, activate, depthwise_conv_tile, next_pow2, outputs_per_thread

__all__ = ['agelu_concat_layernorm', 'dwconv_act_residual', 'DWCONV_TUNER']

# (pixels of a row segment, channels, warps) per program: 4-8 outputs per thread (4 at k = 7, see
# _dwconv_fits), so the tap loop's loads and the accumulator fit in 128 registers; the first fitting one runs
# where nothing was timed
DWCONV_TUNER = LaunchTuner('dwconv_act_residual', [
    dict(W_BLOCK=8, C_BLOCK=64, num_warps=4), dict(W_BLOCK=16, C_BLOCK=64, num_warps=4),
    dict(W_BLOCK=8, C_BLOCK=128, num_warps=4), dict(W_BLOCK=16, C_BLOCK=64, num_warps=8),
    dict(W_BLOCK=8, C_BLOCK=128, num_warps=8)])


def _dwconv_fits(k: int):
    """k = 7 with 8 outputs per thread took 157-171 registers on sm_90 (ptxas unrolls the row loop)."""
    return lambda config: outputs_per_thread(config) <= (8 if k <= 5 else 4)


@triton.jit
def _agelu_concat_layernorm_kernel(h_ptr, alpha_ptr, gamma_ptr, beta_ptr, theta_ptr, w_ptr, b_ptr, out_ptr,
                                   stride_h, stride_out, CN, eps,
                                   NUM_F: tl.constexpr, NF_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr,
                                   ACT: tl.constexpr):
    # one token per program: its C'/N fc1 outputs -> N arbitrary activations (N, C'/N) -> LayerNorm over all C'
    row = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, NF_BLOCK)[:, None]  # (NF, 1): which function A_i
    c = tl.arange(0, C_BLOCK)[None, :]  # (1, C): channel of fc1's output
    cmask = c < CN
    mask = (f < NUM_F) & cmask
    h = tl.load(h_ptr + row * stride_h + c, mask=cmask, other=0.).to(tl.float32)  # (1, C)
    idx = f * CN + c  # (NF, C): position in the concatenation (all channels of A_1 first), Eq. 5
    alpha = tl.load(alpha_ptr + idx, mask=mask, other=0.).to(tl.float32)
    gamma = tl.load(gamma_ptr + idx, mask=mask, other=0.).to(tl.float32)
    beta = tl.load(beta_ptr + idx, mask=mask, other=0.).to(tl.float32)
    theta = tl.load(theta_ptr + idx, mask=mask, other=0.).to(tl.float32)
    u = theta + beta * activate(alpha * h + gamma, ACT)  # Eq. 3 on each copy, (NF, C)
    u = tl.where(mask, u, 0.)
    n = NUM_F * CN
    mean = tl.sum(tl.sum(u, axis=1), axis=0) / n
    centred = tl.where(mask, u - mean, 0.)
    var = tl.sum(tl.sum(centred * centred, axis=1), axis=0) / n
    rstd = 1.0 / tl.sqrt(var + eps)
    weight = tl.load(w_ptr + idx, mask=mask, other=0.).to(tl.float32)
    bias = tl.load(b_ptr + idx, mask=mask, other=0.).to(tl.float32)
    y = centred * rstd * weight + bias
    tl.store(out_ptr + row * stride_out + idx, y.to(out_ptr.dtype.element_ty), mask=mask)


def agelu_concat_layernorm(h: torch.Tensor, alpha: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                           theta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                           act: str = 'gelu') -> torch.Tensor:
    """``LayerNorm(concat_i(theta_i + beta_i * act(alpha_i * h + gamma_i)))`` (IFFN Eq. 3-5).

    Args:
        h: ``(T, C'/N)`` fc1 outputs, one token per row (last dim contiguous).
        alpha, gamma, beta, theta: ``(N, C'/N)`` parameters of the N arbitrary activations.
        weight, bias: ``(C',)`` LayerNorm affine; ``eps`` its epsilon.
        act: the base activation phi (registry name).

    Returns:
        ``(T, C')`` in ``h``'s dtype (arithmetic in fp32).
    """
    tokens, cn = h.shape
    nf = alpha.shape[0]
    if h.stride(-1) != 1:
        h = h.contiguous()
    out = h.new_empty(tokens, nf * cn)
    nf_block, c_block = next_pow2(nf), next_pow2(cn)
    warps = 8 if nf_block * c_block >= 4096 else 4
    _agelu_concat_layernorm_kernel[(tokens,)](
        h, alpha.contiguous(), gamma.contiguous(), beta.contiguous(), theta.contiguous(), weight, bias, out,
        h.stride(0), out.stride(0), cn, eps, NUM_F=nf, NF_BLOCK=nf_block, C_BLOCK=c_block, ACT=act_id(act),
        num_warps=warps)
    return out


@triton.jit(do_not_specialize=['H', 'W', 'C'])
def _dwconv_act_residual_kernel(y_ptr, w_ptr, b_ptr, out_ptr, H, W, C, stride_yb, stride_yt, stride_ob, stride_ot,
                                K: tl.constexpr, ACT: tl.constexpr, W_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    # program: one image row segment of W_BLOCK pixels x C_BLOCK channels; tokens are (B, H*W, C), channels contiguous
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    x = tl.program_id(1) * W_BLOCK + tl.arange(0, W_BLOCK)[:, None]  # (W, 1) pixel column
    c = tl.program_id(2) * C_BLOCK + tl.arange(0, C_BLOCK)[None, :]  # (1, C) channel
    cmask = c < C
    y_img = y_ptr + b.to(tl.int64) * stride_yb
    acc = depthwise_conv_tile(y_img, w_ptr, b_ptr, h, x, c, cmask, H, W, stride_yt, K, W_BLOCK, C_BLOCK)  # (W, C)
    m = (x < W) & cmask
    centre = tl.load(y_img + (h * W + x) * stride_yt + c, mask=m, other=0.).to(tl.float32)
    out = centre + activate(acc, ACT)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + (h * W + x) * stride_ot + c, out.to(out_ptr.dtype.element_ty),
             mask=m)


def dwconv_act_residual(y: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], grid: Tuple[int, int],
                        num_prefix_tokens: int = 0, act: str = 'gelu') -> torch.Tensor:
    """``y + act(DWConv_k(y) + b)`` on the patch tokens of ``y``; prefix tokens are copied as they are.

    Args:
        y: ``(B, P + H*W, C)`` tokens (channels contiguous), the IFFN hidden features after the LayerNorm.
        weight: ``(C, 1, k, k)`` depthwise weight (the BatchNorm folded in); ``bias``: ``(C,)`` or None.
        grid: ``(H, W)``; ``num_prefix_tokens``: P.

    Returns:
        A new ``(B, P + H*W, C)`` tensor (the conv reads neighbours, so it cannot write in place).
    """
    batch, tokens, channels = y.shape
    gh, gw = grid
    p = num_prefix_tokens
    if y.stride(-1) != 1:
        y = y.contiguous()
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    if p:
        out[:, :p] = y[:, :p]  # prefix tokens bypass the spatial part
    k = weight.shape[-1]
    if bias is None:
        bias = weight.new_zeros(channels)
    patches, patches_out = y[:, p:], out[:, p:]  # (B, H*W, C) views
    weight, act_code = weight.contiguous(), act_id(act)

    def run(config):
        w_block, c_block = min(config['W_BLOCK'], next_pow2(gw)), min(config['C_BLOCK'], next_pow2(channels))
        launch = (batch * gh, triton.cdiv(gw, w_block), triton.cdiv(channels, c_block))
        _dwconv_act_residual_kernel[launch](
            patches, weight, bias, patches_out, gh, gw, channels, patches.stride(0), patches.stride(1),
            patches_out.stride(0), patches_out.stride(1), K=k, ACT=act_code, W_BLOCK=w_block, C_BLOCK=c_block,
            num_warps=config['num_warps'])

    DWCONV_TUNER.launch((batch, gh, gw, channels, k, y.dtype), run, _dwconv_fits(k))
    return out
