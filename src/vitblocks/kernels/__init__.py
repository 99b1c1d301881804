"""Fused kernels for the deployed forms of IFFN and AFBO on CUDA GPUs, written in Triton.

The deployed modules (:class:`~vitblocks.layers.IFFNDeployed`, :class:`~vitblocks.layers.AFBODeployed`)
call these for inference on a CUDA device; the GEMMs that cuBLAS already runs at full speed (IFFN's
fc1 and fc2, AFBO's fc2) stay in cuBLAS, and the kernels here fuse the memory-bound element-wise
work around them, so the wide hidden tensor is read and written as few times as possible:

| kernel                                | replaces (reference ops)                                          |
| ------------------------------------- | ----------------------------------------------------------------- |
| :func:`agelu_concat_layernorm`        | IFFN: N arbitrary activations, concat, LayerNorm(C') (Eq. 3-5)    |
| :func:`dwconv_act_residual`           | IFFN: ``y + act(DWConv_k(y) + b)`` on the token layout            |
| :func:`window_maps`                   | AFBO: both block-sparse channel maps (Eq. 5-7) in one grouped GEMM |
| :func:`dwconv_pair_product`           | AFBO: both branches' DW convs, the activation and the product     |

Triton ships with torch's CUDA wheels. Without it (or on another device) the deployed modules run
their reference ops. On a machine without a GPU every kernel runs through Triton's interpreter when
``TRITON_INTERPRET=1`` is set before this package is first imported (the tests do this): slowly, in
fp32 arithmetic, but the same program.

Each kernel has a few candidate launch configurations; on a GPU the fastest for a shape is chosen on
its first call (:class:`~vitblocks.kernels._common.LaunchTuner`). Without a GPU, the compiler's view of
every configuration the deployed layers launch (registers, spills, occupancy, for sm_80 and sm_90) is
``python -m vitblocks.kernels.report`` (:mod:`.launches`, :mod:`.compile_check`), and
:mod:`.traffic` models an FFN's bytes, FLOPs and roofline time against timm's ``Mlp``.
"""
import functools
import importlib.util
import os

import torch

__all__ = ['triton_available', 'interpreting', 'kernels_usable']


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton can be imported (it ships with torch's CUDA wheels); looked up once, not on every forward."""
    return importlib.util.find_spec('triton') is not None


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get('TRITON_INTERPRET', '0').lower() in ('1', 'true', 'on', 'yes')


def kernels_usable(x: torch.Tensor) -> bool:
    """Whether a deployed module runs these kernels on ``x``: a CUDA tensor with Triton installed, outside
    ``torch.compile`` (inductor fuses the reference ops itself), tracing, scripting and ``torch.func`` transforms
    (``vmap`` has no batching rule for a Triton launch)."""
    if torch.jit.is_scripting() or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return x.device.type == 'cuda' and triton_available()
