"""Shared by the speed benchmarks: repeat an interleaved run R times (``--runs R``) and print one
target line with the min / median / max of a same-run ratio over the runs.

One run is one :func:`vitblocks.profile.benchmark_models` call: every model timed batch by batch
in turn, so drift and other load hit them alike within the run. Between runs the model order is
reversed, so the model that runs right after the other (and inherits the allocator and cache
state it left) is not always the same one.
"""
import os
import statistics
from typing import Dict, List, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vitblocks.profile import AllocatorError, LatencyResult, benchmark_models, steady_malloc


def interleaved_runs(models: Dict[str, nn.Module], runs: int, **bench_kwargs) -> List[Dict[str, LatencyResult]]:
    """``runs`` interleaved runs of ``models`` (``bench_kwargs`` go to ``benchmark_models``), in
    the given order on even runs and reversed on odd ones; each result dict keeps the given order."""
    if runs < 1:
        raise SystemExit(f'--runs must be at least 1, got {runs}')
    names, results = list(models), []
    for r in range(runs):
        order = names if r % 2 == 0 else names[::-1]
        res = benchmark_models({n: models[n] for n in order}, **bench_kwargs)
        results.append({n: res[n] for n in names})
    return results


def add_malloc_option(parser, *aliases: str) -> None:
    parser.add_argument('--steady-malloc', *aliases, dest='steady_malloc', action='store_true',
                        help='glibc keeps every freed block (vitblocks.profile.steady_malloc), so after warm-up no '
                             'model pays for fresh zero-filled pages and the ratio compares compute, not the '
                             "allocation history of the process (the effect of a caching allocator); default: glibc's "
                             'own policy, as a plain `python` process runs')


def apply_malloc_option(args) -> str:
    """Applies ``--steady-malloc`` (call it before building any model); returns the allocator, for the header."""
    if not args.steady_malloc:
        return 'malloc as is'
    try:
        version = steady_malloc()
    except AllocatorError as e:
        raise SystemExit(f'--steady-malloc: {e}') from None
    return f'steady malloc (glibc {version}: no mmapped blocks, no trimming)'


def load_average() -> str:
    return f'{os.getloadavg()[0]:.1f}' if hasattr(os, 'getloadavg') else 'n/a'


def target_line(label: str, ratios: Sequence[float], target: float, at_least: bool) -> str:
    """``label: 1.83x (target >= 1.80x: met)``, judged on the median over the runs, plus the
    min / median / max when there is more than one run."""
    med = statistics.median(ratios)
    met = med >= target if at_least else med <= target
    line = f'{label}: {med:.2f}x (target {">=" if at_least else "<="} {target:.2f}x: {"met" if met else "MISSED"})'
    if len(ratios) > 1:
        line += (f'; over {len(ratios)} runs min {min(ratios):.3f}x, median {med:.3f}x, max {max(ratios):.3f}x '
                 f'[{", ".join(f"{r:.3f}" for r in ratios)}]')
    return line + f'; load average {load_average()}'


# ops that do no work (views, dropout in eval) and allocations that touch no memory
_NO_WORK = {'dropout', 'view', '_unsafe_view', 't', 'transpose', 'permute', 'unsqueeze', 'slice', 'select', 'expand',
            'as_strided', 'reshape', 'flatten', 'alias', 'detach', 'split', 'split_with_sizes', 'unbind', 'squeeze',
            'narrow', 'unflatten', 'new_empty'}


def does_work(func) -> bool:
    """Whether an ATen op (a ``TorchDispatchMode`` ``func``) does work: not a view, not an empty allocation."""
    name = func.__name__.split('.')[0]
    return name not in _NO_WORK and not name.startswith('empty')


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += does_work(func)
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def forward_ops(model: nn.Module, x: torch.Tensor) -> int:
    """ATen ops that do work in one inference forward, a cost other load does not change: with several
    intra-op threads each is a fork/join of the thread pool (each one waits for a descheduled thread).
    The other such cost, the fresh pages the kernel zero-fills, is measured in every timed batch
    (``LatencyResult.page_faults``)."""
    model.eval()
    model(x)  # warm: lazy inits, oneDNN primitive caches
    counter = _OpCounter()
    with counter:
        model(x)
    return counter.ops
