"""Latency / throughput benchmarks with warm-up, medians and same-run baselines.

Models are measured interleaved (one timed batch of each model per round), so slow drift of
the machine (thermal, other load) affects every model alike and ratios stay fair.
Times are milliseconds per batch; throughput is images per second.

How each batch is timed depends on the device (:func:`step_timer`): on CUDA a pair of CUDA
events around the step on the current stream, read after synchronizing (what the GPU spent,
launch gaps included); on the CPU the wall clock. ``torch.utils.benchmark.Timer`` is not used
underneath: its ``timeit`` runs at least two untimed calls before every measurement, which would
triple the cost of the one-batch rounds that keep the interleaving fair.

Options a deployment uses are measured as such: ``amp`` (``torch.autocast`` in bfloat16 or
float16), ``channels_last`` (model and input in NHWC memory format) and ``compile``
(``torch.compile``; the first call, which compiles, is timed separately as ``compile_s``).
:func:`check_bench_options` rejects combinations that would silently measure something else;
:func:`amp_kernel_note` says when ``amp`` on the CPU measures torch's fallback kernels.
"""
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from .allocator import minor_page_faults

__all__ = ['LatencyResult', 'benchmark_models', 'fixed_threads', 'check_bench_options', 'BenchOptionError',
           'amp_kernel_note', 'step_timer', 'interleaved_times', 'AMP_DTYPES',
           'COMPILE_MODES', 'WallTimer', 'CudaEventTimer', 'timm_record']

AMP_DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16}
# torch.compile's modes (timm's benchmark.py passes its --torchcompile-mode through the same way)
COMPILE_MODES = ('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs')


@dataclass
class LatencyResult:
    name: str
    batch_size: int
    times_ms: List[float]
    compile_s: Optional[float] = None  # the first (compiling) call, with compile=True
    page_faults: List[int] = field(default_factory=list)  # CPU: minor page faults of each timed batch

    @property
    def median_page_faults(self) -> Optional[int]:
        """Fresh pages the kernel zero-filled in a timed batch (median; CPU runs only, else None)."""
        return int(statistics.median(self.page_faults)) if self.page_faults else None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def mean_ms(self) -> float:
        """timm's ``step_time`` (its ``samples_per_sec`` is ``batch_size / mean``)."""
        return statistics.fmean(self.times_ms)

    @property
    def p10_ms(self) -> float:
        return _quantile(self.times_ms, 0.1)

    @property
    def p90_ms(self) -> float:
        return _quantile(self.times_ms, 0.9)

    @property
    def images_per_s(self) -> float:
        return self.batch_size / (self.median_ms / 1e3)


def _quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


@contextmanager
def fixed_threads(num_threads: Optional[int]):
    """Pin torch's intra-op thread count for the duration of a benchmark."""
    old = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)


def interleaved_times(fns: Dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                      block: int = 1) -> Dict[str, List[float]]:
    """Wall-clock ms of every call of each function, the functions taking turns (``block`` calls of one, then
    the next), so a change of load on the machine hits all of them alike; ``warmup`` untimed rounds first.
    For CPU work, and for GPU work that synchronizes itself; a model on a GPU: ``benchmark_models``."""
    times = {name: [] for name in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return times


class BenchOptionError(ValueError):
    """An option of a benchmark that cannot run as asked. ``option`` names it ('device', 'amp',
    'compile_mode'), ``value`` is what was given, ``reason`` says what to change; the command
    line prints it with its flag (``--amp fp16: ...``)."""

    def __init__(self, option: str, value, reason: str):
        super().__init__(f'{option}={value!r}: {reason}')
        self.option, self.value, self.reason = option, value, reason


class WallTimer:
    """Wall-clock milliseconds of a CPU step (the CPU runs it synchronously)."""

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        return (time.perf_counter() - self._t0) * 1e3


class CudaEventTimer:
    """Milliseconds between two CUDA events recorded around a step on ``device``'s current stream (not the
    current device's: ``cuda:1`` is timed on GPU 1).

    ``start`` first synchronizes the device, so no earlier work is counted; ``stop`` waits for
    the end event, so all of the step's kernels are."""

    def __init__(self, device: torch.device):
        self.device = device
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        self._begin.record(torch.cuda.current_stream(self.device))

    def stop(self) -> float:
        self._end.record(torch.cuda.current_stream(self.device))
        self._end.synchronize()
        return self._begin.elapsed_time(self._end)


def step_timer(device: Union[str, torch.device]) -> Union[WallTimer, CudaEventTimer]:
    """The timer for one step on ``device``: CUDA events on a CUDA device, the wall clock otherwise."""
    device = torch.device(device)
    return CudaEventTimer(device) if device.type == 'cuda' else WallTimer()


def check_bench_options(device: Union[str, torch.device], amp: Optional[str] = None, compile: bool = False,
                        compile_mode: Optional[str] = None) -> torch.device:
    """Raise :class:`BenchOptionError` (a ``ValueError`` saying what to change) for options that
    cannot run as asked on ``device``, instead of measuring something else; return the device.

    * ``device``: 'cpu', 'cuda' or 'cuda:N', and CUDA must be available for the latter.
    * ``amp``: 'bf16' or 'fp16'; autocast must support that dtype on the device (CPU autocast
      would otherwise disable itself with a warning and run fp32; a pre-Ampere GPU has no bf16).
    * ``compile_mode`` needs ``compile``; 'reduce-overhead' is CUDA graphs, which the CPU lacks.
    """
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ('cpu', 'cuda'):
        raise BenchOptionError('device', device, 'expected cpu, cuda or cuda:N')
    if dev.type == 'cuda' and not torch.cuda.is_available():
        raise BenchOptionError('device', device, 'CUDA is not available here; use cpu')
    if dev.type == 'cuda' and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise BenchOptionError('device', device, f'this machine has {torch.cuda.device_count()} GPU(s), cuda:0 to '
                                                 f'cuda:{torch.cuda.device_count() - 1}')
    if compile_mode is not None and not compile:
        raise BenchOptionError('compile_mode', compile_mode, 'given without compiling; add compile or drop the mode')
    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise BenchOptionError('compile_mode', compile_mode, f'expected one of {", ".join(COMPILE_MODES)}')
    if compile and compile_mode == 'reduce-overhead' and dev.type != 'cuda':
        raise BenchOptionError('compile_mode', compile_mode, "CUDA graphs; on the CPU it would run as 'default'. "
                                                             "Use 'default' or 'max-autotune-no-cudagraphs'")
    if amp is not None:
        _check_amp(dev, amp)
    return dev


def _check_amp(dev: torch.device, amp: str) -> None:
    if amp not in AMP_DTYPES:
        raise BenchOptionError('amp', amp, f'expected one of {", ".join(AMP_DTYPES)}')
    dtype = AMP_DTYPES[amp]
    if not torch.amp.is_autocast_available(dev.type):
        raise BenchOptionError('amp', amp, f'torch has no autocast for {dev.type}; drop amp')
    if dev.type == 'cuda' and dtype == torch.bfloat16:
        # is_bf16_supported asks the current device: make it cuda:N's (plain 'cuda' is the current one)
        with torch.cuda.device(dev.index) if dev.index is not None else nullcontext():
            supported = torch.cuda.is_bf16_supported()
        if not supported:
            raise BenchOptionError('amp', amp, f'{torch.cuda.get_device_name(dev)} has no bfloat16 support; use fp16')
    # autocast disables itself (a warning, then fp32) for a dtype the device does not support: probe it
    w = torch.ones(2, 2, device=dev)
    try:
        with torch.autocast(dev.type, dtype=dtype):
            out = torch.nn.functional.linear(w, w)
    except RuntimeError as e:
        out, err = None, e
    if out is None or out.dtype != dtype:
        why = f' ({err})' if out is None else ''
        raise BenchOptionError('amp', amp, f'autocast to {dtype} is not supported on {dev.type} by this '
                                           f'torch{why}; use {"bf16" if amp == "fp16" else "fp16"} or drop amp')


# whether this CPU's oneDNN has kernels for an autocast dtype (what torch's convolution dispatch asks itself)
ONEDNN_DTYPE_PROBES = {'bf16': lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                       'fp16': lambda: torch.ops.mkldnn._is_mkldnn_fp16_supported()}


def amp_kernel_note(device: Union[str, torch.device], amp: Optional[str]) -> Optional[str]:
    """A note when ``amp`` on a CPU runs without oneDNN kernels for its dtype, else None.

    On a CPU without native bf16/fp16 (AVX2, AVX-512 without BF16/FP16 or AMX) autocast still runs
    in that dtype, but its matmuls take slower fallback kernels (DeiT-T, batch 8, 32 px, 2 threads,
    AVX2: 66 ms in bf16 against 25 ms in fp32), and a grouped or depthwise convolution runs as one
    convolution per channel group (``_slow_conv2d_forward``, once per group). That hits models with
    depthwise convs, IFFN's and AFBO's included, far harder than the plain ViT (same setting: IFFN-T
    deployed 3.75x DeiT-T in bf16 against 1.18x in fp32, AFBO-T 6.4x against 1.68x), so the ratios
    measure torch's fallback, not the blocks. Not an error: the dtype is what was asked for.
    """
    if amp is None or torch.device(device).type != 'cpu':
        return None
    try:
        native = ONEDNN_DTYPE_PROBES[amp]()
    except (AttributeError, RuntimeError):  # a torch without the probe: nothing known to say
        return None
    if native:
        return None
    return (f'note: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no oneDNN {amp} kernels: autocast '
            f'runs {amp} matmuls in slower fallback kernels and grouped/depthwise convolutions one channel group '
            f'at a time, so models with depthwise convs (IFFN, AFBO) lose far more than the baseline; compare '
            f'{amp} ratios on a GPU or a CPU with native {amp} (AVX512-{amp.upper()} or AMX)')


@contextmanager
def _restored_state(models: Dict[str, nn.Module], train: bool):
    """Give each model back its train/eval mode, and with ``train`` its parameters' ``.grad`` and its buffers
    (train-mode forwards update BatchNorm running statistics from the random batch), on exit."""
    modes = {name: m.training for name, m in models.items()}
    grads = {p: p.grad for m in models.values() for p in m.parameters()} if train else {}
    # by name: moving a model to `device` replaces its buffer tensors
    buffers = {(name, b): t.detach().clone() for name, m in models.items() for b, t in m.named_buffers()} \
        if train else {}
    for p in grads:
        p.grad = None  # kept aside: backward would accumulate into them
    try:
        yield
    finally:
        for name, m in models.items():
            m.train(modes[name])
        for p, g in grads.items():
            p.grad = g if g is None or g.device == p.device else g.to(p.device)  # the model moved to `device`
        with torch.no_grad():
            for name, m in models.items():
                for b, t in m.named_buffers():
                    if (name, b) in buffers:
                        t.copy_(buffers[name, b])


def benchmark_models(models: Dict[str, nn.Module], batch_size: int = 32, input_size=(3, 224, 224),
                     warmup: int = 3, repeats: int = 10, num_threads: Optional[int] = None,
                     device: str = 'cpu', train: bool = False, amp: Optional[str] = None,
                     channels_last: bool = False, compile: bool = False,
                     compile_mode: Optional[str] = None) -> Dict[str, LatencyResult]:
    """Median latency of several models on the same random batch, measured interleaved.

    Args:
        models: name -> model. Inference mode (``eval`` + ``torch.inference_mode``) unless
            ``train=True``, which times forward + backward of the summed output.
        batch_size, input_size: the batch is ``(batch_size, *input_size)``.
        warmup: untimed batches per model before timing (allocator, kernels, caches).
        repeats: timed batches per model; the median is reported.
        num_threads: torch intra-op threads during the run (default: leave as is).
        device: 'cpu', 'cuda' or 'cuda:N' (timed with :func:`step_timer`).
        amp: 'bf16' or 'fp16': run each step under ``torch.autocast`` in that dtype.
        channels_last: model and input in channels-last memory format.
        compile: ``torch.compile`` each model (``compile_mode``: its ``mode``); the first call
            compiles, is timed on its own (``LatencyResult.compile_s``) and precedes ``warmup``.

    Each model is moved to ``device`` (and to channels-last with ``channels_last``); its train/eval
    mode and, with ``train``, its parameters' ``.grad`` and its buffers (BatchNorm running statistics,
    which train-mode forwards on the random batch update) are restored afterwards.

    Raises:
        BenchOptionError: options :func:`check_bench_options` rejects.
    """
    dev = check_bench_options(device, amp, compile, compile_mode)
    x = torch.randn(batch_size, *input_size, device=dev)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    results = {name: LatencyResult(name, batch_size, []) for name in models}
    autocast = (lambda: torch.autocast(dev.type, dtype=AMP_DTYPES[amp])) if amp else nullcontext
    # CUDA graphs reuse their output buffers: tell torch a new step begins before each call
    mark_step = torch.compiler.cudagraph_mark_step_begin if compile_mode == 'reduce-overhead' else (lambda: None)

    def step(model):
        mark_step()
        with autocast():
            out = model(x)
        if train:
            out.float().sum().backward()

    with fixed_threads(num_threads), _restored_state(models, train):
        runnable = {}
        for name, m in models.items():
            m.to(dev, memory_format=torch.channels_last if channels_last else torch.preserve_format).train(train)
            runnable[name] = torch.compile(m, mode=None if compile_mode == 'default' else compile_mode) \
                if compile else m
        timer = step_timer(dev)
        faults = minor_page_faults if dev.type == 'cpu' else None
        ctx = torch.enable_grad if train else torch.inference_mode
        with ctx():
            if compile:
                for name, m in runnable.items():
                    timer.start()
                    step(m)
                    results[name].compile_s = timer.stop() / 1e3
            for m in runnable.values():
                for _ in range(warmup):
                    step(m)
            for _ in range(repeats):
                for name, m in runnable.items():
                    if train:
                        models[name].zero_grad(set_to_none=True)
                    before = faults() if faults else 0
                    timer.start()
                    step(m)
                    results[name].times_ms.append(timer.stop())
                    if faults:
                        results[name].page_faults.append(faults() - before)
    return results


def timm_record(result: LatencyResult, param_count: int, img_size: int, train: bool = False,
                baseline: Optional[LatencyResult] = None) -> Dict[str, object]:
    """One model's result in the field names of timm's ``benchmark.py`` (``infer_samples_per_sec``,
    ``infer_step_time``, ``infer_batch_size``, ``infer_img_size``, ``param_count``; ``train_*`` for
    training), plus ours: median / p10 / p90 ms, compile seconds and the same-run ratio to ``baseline``.

    timm's samples/s is ``batch / mean step time`` and its step time the mean in ms; ours (the
    table's images/s) uses the median, which one disturbed step moves less.
    """
    p = 'train' if train else 'infer'
    record: Dict[str, object] = {
        'model': result.name,
        f'{p}_samples_per_sec': round(result.batch_size / (result.mean_ms / 1e3), 2),
        f'{p}_step_time': round(result.mean_ms, 3),
        f'{p}_batch_size': result.batch_size,
        f'{p}_img_size': img_size,
        'param_count': round(param_count / 1e6, 2),
        f'{p}_median_ms': round(result.median_ms, 3),
        f'{p}_p10_ms': round(result.p10_ms, 3),
        f'{p}_p90_ms': round(result.p90_ms, 3),
        f'{p}_compile_s': None if result.compile_s is None else round(result.compile_s, 2),
        f'{p}_page_faults': result.median_page_faults,  # CPU: fresh pages of a timed batch (median); else None
    }
    if baseline is not None:
        record['vs_baseline'] = round(result.median_ms / baseline.median_ms, 4)  # < 1: faster than the baseline
        record['speedup_vs_baseline'] = round(baseline.median_ms / result.median_ms, 4)  # images/s ratio
    return record
