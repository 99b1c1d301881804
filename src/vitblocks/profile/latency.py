"""Latency / throughput benchmarks with warm-up, medians and same-run baselines.

Models are measured interleaved (one timed batch of each model per round), so slow drift of
the machine (thermal, other load) affects every model alike and ratios stay fair.
Times are wall-clock milliseconds per batch; throughput is images per second.
"""
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

__all__ = ['LatencyResult', 'benchmark_models', 'fixed_threads']


@dataclass
class LatencyResult:
    name: str
    batch_size: int
    times_ms: List[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

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


def _sync(device: torch.device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def benchmark_models(models: Dict[str, nn.Module], batch_size: int = 32, input_size=(3, 224, 224),
                     warmup: int = 3, repeats: int = 10, num_threads: Optional[int] = None,
                     device: str = 'cpu', train: bool = False) -> Dict[str, LatencyResult]:
    """Median latency of several models on the same random batch, measured interleaved.

    Args:
        models: name -> model. Inference mode (``eval`` + ``torch.inference_mode``) unless
            ``train=True``, which times forward + backward of the summed output.
        batch_size, input_size: the batch is ``(batch_size, *input_size)``.
        warmup: untimed batches per model before timing (allocator, kernels, caches).
        repeats: timed batches per model; the median is reported.
        num_threads: torch intra-op threads during the run (default: leave as is).
        device: 'cpu' or 'cuda' (timings synchronize the device).
    """
    dev = torch.device(device)
    x = torch.randn(batch_size, *input_size, device=dev)
    results = {name: LatencyResult(name, batch_size, []) for name in models}

    def step(model):
        if train:
            model(x).float().sum().backward()
        else:
            model(x)

    with fixed_threads(num_threads):
        for m in models.values():
            m.to(dev).train(train)
        ctx = torch.enable_grad if train else torch.inference_mode
        with ctx():
            for m in models.values():
                for _ in range(warmup):
                    step(m)
            _sync(dev)
            for _ in range(repeats):
                for name, m in models.items():
                    if train:
                        m.zero_grad(set_to_none=True)
                    _sync(dev)
                    t0 = time.perf_counter()
                    step(m)
                    _sync(dev)
                    results[name].times_ms.append((time.perf_counter() - t0) * 1e3)
    return results
