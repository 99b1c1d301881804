"""Latency per component (RePa Fig. 3: patch embedding, token mixer and FFN time across model sizes).

Each component module (found by timm attribute name, :mod:`.components`) gets a pre- and a
post-forward hook that read the clock, synchronizing the device first on CUDA, so a component's
time is the wall time between entering and leaving it. The hooked forward's total minus the
components is ``other`` (residual additions, position embedding, window partitioning, pooling).
The model is also timed without hooks, interleaved with the hooked runs so machine drift hits
both alike: the hooked total staying within a few percent of it shows the hooks do not distort
what they measure. Timings are per batch in milliseconds, medians over ``repeats`` (a shared
machine's outliers move means by tens of percent); ``other`` is the median over runs of each
hooked run's total minus its components (within one run, so load spikes cancel).
"""
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Sequence, Union

import torch
from torch import nn

from .components import COMPONENTS, component_modules
from .figures import png_figure

__all__ = ['LatencyBreakdown', 'latency_breakdown', 'plot_breakdown']


@dataclass
class LatencyBreakdown:
    model: str
    batch_size: int
    device: str
    components_ms: Dict[str, float] = field(default_factory=dict)  # COMPONENTS -> median ms per batch
    hooked_total_ms: float = 0.0  # the forward with the timing hooks
    plain_total_ms: float = 0.0  # the forward without them
    other_ms: float = 0.0  # median over runs of (hooked total - components) of the same run

    def share(self, component: str) -> float:
        return self.components_ms[component] / self.hooked_total_ms


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


@torch.inference_mode()
def latency_breakdown(model: nn.Module, images: torch.Tensor, name: str = '', warmup: int = 2,
                      repeats: int = 5) -> LatencyBreakdown:
    """Time ``model(images)`` per component (eval mode, on ``images.device``)."""
    parts = component_modules(model)
    if not parts:
        raise ValueError(f'{type(model).__name__}: no component modules (patch_embed, attn/token_mixer, mlp, '
                         f'norm*, head) found; see vitblocks.analysis.components')
    device = images.device
    spent = {c: 0.0 for c in COMPONENTS}  # seconds in the current forward
    started: Dict[str, float] = {}

    def enter(key):
        def hook(module, args):
            _sync(device)
            started[key] = time.perf_counter()
        return hook

    def leave(key, comp):
        def hook(module, args, out):
            _sync(device)
            spent[comp] += time.perf_counter() - started.pop(key)
        return hook

    def timed_forward() -> float:
        _sync(device)
        t0 = time.perf_counter()
        model(images)
        _sync(device)
        return time.perf_counter() - t0

    was_training = model.training
    model.eval()
    handles = []
    try:
        for _ in range(warmup):
            model(images)
        plain, hooked, other, per_comp = [], [], [], {c: [] for c in COMPONENTS}
        for _ in range(repeats):
            plain.append(timed_forward())
            handles = [h for n, c, m in parts for h in (m.register_forward_pre_hook(enter(n)),
                                                         m.register_forward_hook(leave(n, c)))]
            spent.update({c: 0.0 for c in COMPONENTS})
            hooked.append(timed_forward())
            for c in COMPONENTS:
                per_comp[c].append(spent[c])
            other.append(hooked[-1] - sum(spent.values()))
            for h in handles:
                h.remove()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)

    def median_ms(seconds):
        return 1e3 * statistics.median(seconds)

    return LatencyBreakdown(name or type(model).__name__, images.shape[0], str(device),
                            {c: median_ms(v) for c, v in per_comp.items()}, median_ms(hooked), median_ms(plain),
                            median_ms(other))


def plot_breakdown(results: Sequence[LatencyBreakdown], path: Union[str, Path], title: str = '') -> Path:
    """Stacked bars, one per model, of the component times (RePa Fig. 3 style); FFN share on top."""
    x = list(range(len(results)))
    bottom = [0.0] * len(results)
    with png_figure(path, figsize=(1.2 + 1.1 * len(results), 4)) as (_, ax):
        for k, comp in enumerate(list(COMPONENTS) + ['other']):
            vals = [r.other_ms if comp == 'other' else r.components_ms[comp] for r in results]
            ax.bar(x, vals, bottom=bottom, color=f'C{k}', label=comp)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, r in enumerate(results):
            ax.text(i, bottom[i], f'FFN {100 * r.share("ffn"):.0f}%', ha='center', va='bottom', fontsize=7)
        ax.set_xticks(x, [r.model for r in results], rotation=30, ha='right', fontsize=7)
        ax.set(ylabel=f'ms per batch of {results[0].batch_size} ({results[0].device})',
               title=title or 'latency breakdown')
        ax.legend(fontsize=7)
    return Path(path)
