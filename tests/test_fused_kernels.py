"""The fused Triton kernels of the deployed IFFN and AFBO against their reference ops.

On a machine without a GPU they run through Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``); on a CUDA machine the same tests run compiled on the GPU (TF32 off, so the
fp32 tolerances stay those of exact fp32 arithmetic). Shapes are small and odd on purpose: widths
that are not powers of two, grids that are not square, with and without prefix tokens.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip('triton')

from vitblocks.kernels import interpreting, kernels_usable  # noqa: E402
from vitblocks.kernels.afbo import dwconv_pair_product, window_maps  # noqa: E402
from vitblocks.kernels.iffn import agelu_concat_layernorm, dwconv_act_residual  # noqa: E402
from vitblocks.layers import AFBO, IFFN  # noqa: E402
from vitblocks.layers.activations import act_fn  # noqa: E402
from vitblocks.layers.channel_maps import create_channel_map  # noqa: E402
from _helpers import perturb_  # noqa: E402

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
if DEVICE == 'cpu' and not interpreting():
    pytest.skip('no GPU and TRITON_INTERPRET is not set', allow_module_level=True)
FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=3e-2, atol=3e-2)  # one bf16 rounding of the stored result (the interpreter truncates)


@pytest.fixture(autouse=True)
def _strict_fp32():
    """The reference ops in exact fp32 on a GPU too (TF32 would be the reference's own error)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _agelu_reference(h, alpha, gamma, beta, theta, weight, bias, eps, act):
    u = theta + beta * act_fn(act)(alpha * h.float().unsqueeze(-2) + gamma)  # (T, 1, C) -> (T, N, C), Eq. 3
    return F.layer_norm(u.flatten(-2), weight.shape, weight, bias, eps)  # (T, N*C), Eq. 5


@pytest.mark.parametrize('num_functions', [2, 4])
@pytest.mark.parametrize('act', ['gelu', 'softplus', 'silu', 'elu'])
def test_agelu_concat_layernorm(num_functions, act):
    tokens, width = 7, 13
    h = _randn(tokens, width)
    alpha, gamma, beta, theta = (_randn(num_functions, width) for _ in range(4))
    weight, bias = _randn(num_functions * width), _randn(num_functions * width)
    out = agelu_concat_layernorm(h, alpha, gamma, beta, theta, weight, bias, 1e-6, act)
    ref = _agelu_reference(h, alpha, gamma, beta, theta, weight, bias, 1e-6, act)
    torch.testing.assert_close(out, ref, **FP32)
    out16 = agelu_concat_layernorm(h.bfloat16(), alpha, gamma, beta, theta, weight, bias, 1e-6, act)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), _agelu_reference(h.bfloat16(), alpha, gamma, beta, theta, weight,
                                                              bias, 1e-6, act), **BF16)


def _dw_reference(tokens, weight, bias, grid, prefix, act):
    """``y + act(DWConv(y))`` on the patch tokens through torch's conv2d; prefix tokens as they are."""
    b, _, c = tokens.shape
    fmap = tokens[:, prefix:].float().reshape(b, *grid, c).permute(0, 3, 1, 2)  # (B, H*W, C) -> (B, C, H, W)
    conv = F.conv2d(fmap, weight, bias, padding=weight.shape[-1] // 2, groups=c)
    patches = (fmap + act_fn(act)(conv)).flatten(2).transpose(1, 2)  # (B, C, H, W) -> (B, H*W, C)
    return torch.cat([tokens[:, :prefix].float(), patches], 1)


@pytest.mark.parametrize('kernel_size', [3, 5, 7])
@pytest.mark.parametrize('prefix', [0, 1, 2])
def test_dwconv_act_residual(kernel_size, prefix):
    grid, channels = (5, 3), 10
    y = _randn(2, prefix + 15, channels)
    weight, bias = _randn(channels, 1, kernel_size, kernel_size), _randn(channels)
    out = dwconv_act_residual(y, weight, bias, grid, prefix, 'gelu')
    torch.testing.assert_close(out, _dw_reference(y, weight, bias, grid, prefix, 'gelu'), **FP32)
    out16 = dwconv_act_residual(y.bfloat16(), weight, bias, grid, prefix, 'gelu')
    torch.testing.assert_close(out16.float(), _dw_reference(y.bfloat16(), weight, bias, grid, prefix, 'gelu'), **BF16)


def test_dwconv_act_residual_without_bias_and_another_activation():
    y, weight = _randn(1, 7 * 2, 6), _randn(6, 1, 3, 3)
    out = dwconv_act_residual(y, weight, None, (7, 2), 0, 'relu')
    torch.testing.assert_close(out, _dw_reference(y, weight, None, (7, 2), 0, 'relu'), **FP32)


def _maps(kinds_groups, d=12, md=48, bias=True):
    maps = [create_channel_map(kind, d, md, groups, bias=bias).to(DEVICE) for kind, groups in kinds_groups]
    for m in maps:
        if m.bias is not None:
            nn.init.normal_(m.bias)
    return maps


# (left, right) maps with the group numbers of the papers' tables: AFBO (OCCM G2, GCCM G1) with Table 7's
# G2 = 2, 3, 4, 6 and G1 = 2, 4 (Swin, LVT and the MLPs use G2 = 3), SCFBO-GC/OC (Table 1), FULL (Table 14),
# block-wise (Eq. 5)
MAP_PAIRS = [(('occm', 2), ('gccm', 2)), (('occm', 3), ('gccm', 2)), (('occm', 4), ('gccm', 2)),
             (('occm', 6), ('gccm', 2)), (('occm', 4), ('gccm', 4)), (('gccm', 2), ('gccm', 2)),
             (('occm', 4), ('occm', 4)), (('dense', 1), ('dense', 1)), (('grouped', 3), ('grouped', 3))]


@pytest.mark.parametrize('pair', MAP_PAIRS, ids=lambda p: f'{p[0][0]}{p[0][1]}-{p[1][0]}{p[1][1]}')
@pytest.mark.parametrize('layout', ['tokens', 'channels_first'])
def test_window_maps_equal_the_channel_maps(pair, layout):
    left_map, right_map = _maps(pair)
    if layout == 'tokens':
        x = _randn(2, 11, 12)
        rows, ref_in = x, x
    else:  # (B, C, H, W) read through its strides, no copy
        x = _randn(2, 12, 3, 5)
        rows, ref_in = x.flatten(2).transpose(1, 2), x.permute(0, 2, 3, 1).reshape(2, 15, 12)
    left, right = window_maps(rows, left_map, right_map)
    with torch.no_grad():
        torch.testing.assert_close(left, left_map(ref_in), **FP32)
        torch.testing.assert_close(right, right_map(ref_in), **FP32)
        left16, right16 = window_maps(rows, left_map, right_map, torch.bfloat16)
        assert left16.dtype == torch.bfloat16
        torch.testing.assert_close(left16.float(), left_map(ref_in), **BF16)
        torch.testing.assert_close(right16.float(), right_map(ref_in), **BF16)


def test_window_maps_without_bias():
    left_map, right_map = _maps((('occm', 3), ('gccm', 2)), bias=False)
    x = _randn(1, 9, 12)
    left, right = window_maps(x, left_map, right_map)
    with torch.no_grad():
        torch.testing.assert_close(left, left_map(x), **FP32)
        torch.testing.assert_close(right, right_map(x), **FP32)


def _combine_reference(left, right, act, position, branch):
    phi = act_fn(act)
    if position == 'post':
        return phi(left * right)
    return (phi(left) if branch in ('left', 'both') else left) * (phi(right) if branch in ('right', 'both') else right)


@pytest.mark.parametrize('position,branch', [('pre', 'left'), ('pre', 'right'), ('pre', 'both'), ('post', 'left')])
@pytest.mark.parametrize('kernel_size,prefix', [(3, 0), (3, 1), (5, 2), (7, 0), (None, 0)])
def test_dwconv_pair_product(position, branch, kernel_size, prefix):
    grid, channels = (3, 5), 20
    left, right = _randn(2, prefix + 15, channels), _randn(2, prefix + 15, channels)
    convs = None
    if kernel_size:
        convs = [nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels).to(DEVICE)
                 for _ in range(2)]
    out = dwconv_pair_product(left, right, convs, grid if convs else None, prefix, 'silu', position, branch)
    with torch.no_grad():
        def spatial(conv, t):
            if conv is None:
                return t
            return torch.cat([t[:, :prefix], _conv_only(conv, t, grid, prefix)], 1)  # prefix tokens: no conv
        ref = _combine_reference(spatial(convs and convs[0], left), spatial(convs and convs[1], right), 'silu',
                                 position, branch)
    torch.testing.assert_close(out, ref, **FP32)


def _conv_only(conv, tokens, grid, prefix):
    b, _, c = tokens.shape
    fmap = tokens[:, prefix:].reshape(b, *grid, c).permute(0, 3, 1, 2)  # (B, H*W, C) -> (B, C, H, W)
    return conv(fmap).flatten(2).transpose(1, 2)  # (B, C, H, W) -> (B, H*W, C)


# -- the deployed layers' fused path, end to end ----------------------------------------------------------------
def _iffn_input(layout):
    if layout == 'tokens+prefix':
        return dict(grid_size=(3, 5), num_prefix_tokens=1), _randn(2, 16, 12)
    if layout == 'channels_first':
        return dict(channels_first=True), _randn(2, 12, 3, 5)
    return dict(grid_size=(3, 5)), _randn(2, 3, 5, 12)  # channels-last map


@pytest.mark.parametrize('layout', ['tokens+prefix', 'channels_first', 'channels_last'])
@pytest.mark.parametrize('cfg', [dict(), dict(num_functions=4), dict(kernel_size=5), dict(kernel_size=7),
                                 dict(act_layer='softplus'), dict(channel_part=False), dict(spatial_part=False)],
                         ids=lambda c: ','.join(f'{k}={v}' for k, v in c.items()) or 'default')
def test_iffn_deployed_fused_path_equals_the_training_form(layout, cfg):
    layout_args, x = _iffn_input(layout)
    ffn = perturb_(IFFN(12, 48, **layout_args, **cfg), std=0.2, batchnorm=True).to(DEVICE).eval()
    deployed = ffn.fuse()
    with torch.inference_mode():
        ref = ffn(x)
        out = deployed._forward_fused(x)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, **FP32)


@pytest.mark.parametrize('layout', ['tokens+prefix', 'channels_first', 'channels_last'])
@pytest.mark.parametrize('cfg', [dict(), dict(occm_groups=3), dict(occm_groups=6, gccm_groups=2), dict(kernel_size=5),
                                 dict(order='cm'), dict(variant='afbo_full'), dict(variant='scfbo_gc'),
                                 dict(act_position='post', act_layer='gelu'), dict(act_branch='both'),
                                 dict(bias=False)],
                         ids=lambda c: ','.join(f'{k}={v}' for k, v in c.items()) or 'default')
def test_afbo_deployed_fused_path_equals_the_training_form(layout, cfg):
    layout_args, x = _iffn_input(layout)
    layer = perturb_(AFBO(12, 48, **layout_args, **cfg), std=0.2).to(DEVICE).eval()
    deployed = layer.fuse()
    with torch.inference_mode():
        ref = layer(x)
        out = deployed._forward_fused(x)
    assert out.shape == ref.shape
    if layout == 'channels_first':  # fc2 writes the input's own layout, as the reference returns it
        assert out.is_contiguous()
    torch.testing.assert_close(out, ref, **FP32)


def test_fused_paths_follow_autocast():
    """Under bf16 autocast the GEMMs around the kernels are cast as in the reference (fc2 returns bf16), and
    the result stays within bf16 error of the fp32 reference."""
    layout_args, x = _iffn_input('tokens+prefix')
    for layer in (perturb_(IFFN(12, 48, **layout_args), std=0.2, batchnorm=True), perturb_(AFBO(12, 48, **layout_args),
                                                                                            std=0.2)):
        layer = layer.to(DEVICE).eval()
        deployed = layer.fuse()
        with torch.inference_mode():
            ref = layer(x)
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                ref16 = layer(x)
                out16 = deployed._forward_fused(x)
        assert out16.dtype == ref16.dtype
        torch.testing.assert_close(out16.float(), ref.float(), rtol=5e-2, atol=5e-2)


def test_kernels_are_chosen_on_cuda_only():
    """The deployed layers call the fused kernels on CUDA tensors; never on the CPU (its own path), and not while
    torch.compile traces (inductor fuses the reference ops) or with autograd."""
    assert not kernels_usable(torch.ones(1))
    assert not kernels_usable(torch.ones(1, device='meta'))
    deployed = IFFN(12, 48, grid_size=(3, 5)).eval().fuse()
    calls = []
    deployed._forward_fused = lambda x: calls.append(x.device.type) or x
    with torch.inference_mode():
        deployed(torch.randn(2, 15, 12))
    assert calls == []
    if torch.cuda.is_available():
        on_gpu = copy.deepcopy(IFFN(12, 48, grid_size=(3, 5)).eval().fuse()).cuda()
        on_gpu._forward_fused = lambda x: calls.append(x.device.type) or x
        with torch.inference_mode():
            on_gpu(torch.randn(2, 15, 12, device='cuda'))
        assert calls == ['cuda']
