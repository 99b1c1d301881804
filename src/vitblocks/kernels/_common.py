"""Pieces every kernel shares: activations by registry name, launch dtypes, the depthwise tap loop, and the
choice of a launch configuration among a kernel's candidates (:class:`LaunchTuner`)."""
import os
from typing import Callable, Dict, Hashable, List, Optional, Sequence

import torch
import triton
import triton.language as tl

from . import interpreting

# activation registry name (vitblocks.layers.activations) -> id of the branch in activate()
ACT_IDS = {'gelu': 0, 'silu': 1, 'relu': 2, 'softplus': 3, 'elu': 4, 'sigmoid': 5, 'hardswish': 6, 'relu6': 7}
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def activate(x, ACT: tl.constexpr):
    """The activation registered as ``ACT`` (see ACT_IDS), in fp32, as torch's default of each."""
    if ACT == 0:  # exact GELU (erf), nn.GELU()
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 1:  # SiLU
        y = x * tl.sigmoid(x)
    elif ACT == 2:  # ReLU
        y = tl.maximum(x, 0.0)
    elif ACT == 3:  # Softplus(beta=1, threshold=20)
        y = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    elif ACT == 4:  # ELU(alpha=1)
        y = tl.where(x > 0.0, x, tl.exp(tl.minimum(x, 0.0)) - 1.0)
    elif ACT == 5:  # sigmoid
        y = tl.sigmoid(x)
    elif ACT == 6:  # Hardswish
        y = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0
    else:  # ReLU6
        y = tl.minimum(tl.maximum(x, 0.0), 6.0)
    return y


@triton.jit
def depthwise_conv_tile(img_ptr, w_ptr, b_ptr, h, x, c, cmask, H, W, stride_t, K: tl.constexpr,
                        W_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """``DWConv_k + b`` (zero padding) at pixels ``(h, x)`` (a row segment, ``x``: (W, 1)) and channels ``c`` ((1, C))
    of one image whose pixels are ``stride_t`` apart with contiguous channels; weight ``(C, 1, k, k)``. fp32.

    The rows of the window are a loop, not unrolled: only one row's k loads are live at a time, so the
    registers do not grow with k x k (k = 7 unrolled held 49 tiles and spilled); the k loads of a row
    are independent, which is the parallelism a memory-bound tap loop needs."""
    acc = tl.zeros((W_BLOCK, C_BLOCK), tl.float32)
    w_taps = w_ptr + c * (K * K)  # (1, C): this channel's k x k taps
    for dy in range(K):
        row = h + dy - K // 2
        row_ptr = img_ptr + row * W * stride_t
        row_ok = (row >= 0) & (row < H)
        for dx in tl.static_range(K):
            col = x + dx - K // 2
            m = row_ok & (col >= 0) & (col < W) & cmask  # zero padding
            v = tl.load(row_ptr + col * stride_t + c, mask=m, other=0.).to(tl.float32)
            acc += v * tl.load(w_taps + dy * K + dx, mask=cmask, other=0.).to(tl.float32)
    return acc + tl.load(b_ptr + c, mask=cmask, other=0.).to(tl.float32)


def act_id(name: str) -> int:
    if name not in ACT_IDS:
        raise ValueError(f'no fused kernel for activation {name!r}; kernels exist for {", ".join(ACT_IDS)}')
    return ACT_IDS[name]


def dot_dtype(dtype: torch.dtype):
    """Triton dtype of the matmul operands for tensors of ``dtype``."""
    if dtype not in _DOT_DTYPES:
        raise ValueError(f'no fused kernel for {dtype}; they run float32, bfloat16 and float16')
    return _DOT_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands: TF32 exactly when torch's own float32 matmuls use it (``allow_tf32``), so a fused
    model computes at the precision of the vanilla model it is compared with; others are exact products."""
    if dtype == torch.float32 and matmul_uses_tf32() and not interpreting():
        return 'tf32'
    return 'ieee'


def matmul_uses_tf32() -> bool:
    """Whether torch runs float32 CUDA matmuls in TF32 (``torch.backends.cuda.matmul.fp32_precision``, or the
    older ``allow_tf32`` / ``torch.set_float32_matmul_precision`` switches it defers to while it reads 'none')."""
    precision = getattr(torch.backends.cuda.matmul, 'fp32_precision', 'none')
    if precision != 'none':
        return precision == 'tf32'
    return bool(torch.backends.cuda.matmul.allow_tf32)


def upcast_operands() -> bool:
    """Triton's interpreter multiplies bf16/fp16 blocks wrongly: there the operands go to fp32 first (their
    products are exact in fp32, so the result is the same sum)."""
    return interpreting()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


class LaunchTuner:
    """A kernel's candidate launch configurations (dicts of constexpr tiles and ``num_warps``) and the choice
    among them per shape.

    On a GPU the first call for a new ``key`` (the shapes and dtypes the launch depends on) times every
    candidate with ``triton.testing.do_bench`` and keeps the fastest, as Triton's autotuner does; the
    kernels write outputs that do not alias their inputs, so timing them repeats the same work. Under
    the interpreter, and where ``VITBLOCKS_KERNEL_TUNING=0``, the first candidate runs. While
    :func:`~vitblocks.kernels.launches.record_launches` records, every candidate is launched (and
    recorded, not run), so the compile check covers them all.
    """
    recording_all = False  # set by launches.record_launches
    instances: Dict[str, 'LaunchTuner'] = {}

    def __init__(self, name: str, candidates: Sequence[dict]):
        self.name, self.candidates = name, list(candidates)
        self.chosen: Dict[Hashable, dict] = {}
        LaunchTuner.instances[name] = self

    def launch(self, key: Hashable, run: Callable[[dict], None], fits: Optional[Callable[[dict], bool]] = None) -> None:
        """``run(config)`` with the configuration chosen for ``key`` among the candidates that ``fits`` accepts
        (all by default; e.g. fewer outputs per thread for a larger depthwise kernel)."""
        candidates = [c for c in self.candidates if fits is None or fits(c)]
        if not candidates:
            raise ValueError(f'{self.name}: no candidate launch configuration fits {key!r}')
        if LaunchTuner.recording_all:
            for config in candidates:
                run(config)
            return
        if interpreting() or os.environ.get('VITBLOCKS_KERNEL_TUNING', '1') == '0' or len(candidates) == 1:
            run(candidates[0])
            return
        if key not in self.chosen:
            from triton.testing import do_bench
            times = [do_bench(lambda c=c: run(c), warmup=5, rep=20) for c in candidates]
            self.chosen[key] = candidates[times.index(min(times))]
        run(self.chosen[key])

    @classmethod
    def table(cls) -> List[dict]:
        """Every choice made so far in this process: kernel, key, the winning configuration and its index."""
        return [dict(kernel=t.name, key=repr(k), config=c, candidate=t.candidates.index(c))
                for t in cls.instances.values() for k, c in t.chosen.items()]


def outputs_per_thread(config: dict, rows: str = 'W_BLOCK', cols: str = 'C_BLOCK') -> int:
    """Elements of a ``(rows, cols)`` tile each of the ``num_warps x 32`` threads computes."""
    return config[rows] * config[cols] // (32 * config['num_warps'])
