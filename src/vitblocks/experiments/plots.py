"""Plots as PNG files (``analysis.figures.png_figure``: Agg backend, saved beside the path and renamed into
place): a run's curves, and accuracy against cost across runs.

- ``plot_curves(run_dir)``: accuracy and loss against epochs (train loss, val loss, val top-1
  and EMA top-1), like NiNformer's Fig. 3-4.
- ``plot_tradeoff(points)``: top-1 against GMACs and against measured latency, one point per
  run, like IFFN's Fig. 1.
"""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from ..analysis.figures import png_figure
from .runlog import read_metrics

__all__ = ['plot_curves', 'plot_tradeoff', 'TradeoffPoint', 'run_summary']


def plot_curves(run_dir: Path, out: Optional[Path] = None) -> Path:
    """``<run>/curves.png``: accuracy (left) and loss (right) against epochs."""
    rows = read_metrics(run_dir / 'metrics.csv')
    if not rows:
        raise ValueError(f'{run_dir / "metrics.csv"}: no rows yet')

    def series(split, key):  # [(epoch, value)] of ``key`` in the rows of ``split`` that have it
        return [(float(r['epoch']), float(r[key])) for r in rows if r['split'] == split and r[key]]

    out = out or run_dir / 'curves.png'
    with png_figure(out, dpi=120, ncols=2, figsize=(10, 4)) as (fig, (acc, loss)):
        for split, label, style in (('val', 'test top-1', 'o-'), ('val_ema', 'EMA test top-1', 's--')):
            pts = series(split, 'top1')
            if pts:
                acc.plot(*zip(*pts), style, label=label, markersize=3)
        acc.set(xlabel='epoch', ylabel='accuracy (%)', title='accuracy')
        for split, label, style in (('train', 'train loss', '-'), ('val', 'test loss', 'o-')):
            pts = series(split, 'loss')
            if pts:
                loss.plot(*zip(*pts), style, label=label, markersize=3)
        loss.set(xlabel='epoch', ylabel='cross-entropy', title='loss')
        for ax in (acc, loss):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        fig.suptitle(run_dir.name, fontsize=10)
    return out


@dataclass
class TradeoffPoint:
    label: str
    top1: float
    gmacs: float
    latency_ms: Optional[float] = None  # per batch, as measured by the caller


def run_summary(run_dir: Path) -> dict:
    path = run_dir / 'results.json'
    if not path.exists():
        raise ValueError(f'{run_dir}: no results.json (the run has not finished)')
    return json.loads(path.read_text())


def plot_tradeoff(points: Sequence[TradeoffPoint], out: Path, latency_note: str = '') -> Path:
    """Top-1 against GMACs (left) and against latency (right, when measured)."""
    with_latency = [p for p in points if p.latency_ms is not None]
    with png_figure(out, dpi=120, ncols=2 if with_latency else 1, figsize=(10 if with_latency else 5.5, 4),
                    squeeze=False) as (_, axes):
        panels: List = [(axes[0][0], [(p.gmacs, p.top1, p.label) for p in points], 'GMACs per image')]
        if with_latency:
            panels.append((axes[0][1], [(p.latency_ms, p.top1, p.label) for p in with_latency],
                           f'latency (ms per batch{", " + latency_note if latency_note else ""})'))
        for ax, pts, xlabel in panels:
            for x, y, label in pts:
                ax.plot(x, y, 'o')
                ax.annotate(label, (x, y), textcoords='offset points', xytext=(4, 4), fontsize=7)
            ax.set(xlabel=xlabel, ylabel='top-1 (%)')
            ax.margins(x=0.3, y=0.1)  # room for the labels
            ax.grid(alpha=0.3)
    return out
