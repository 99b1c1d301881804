"""The CIFAR-10 blocks benchmark: every paper's block in one small ViT, one recipe, three seeds.

``run_benchmark`` trains (or reuses, or resumes) ``<output>/<config>/seed<k>`` for each of the nine
configurations of ``vitblocks.models.blocks_bench`` with the ``cifar10_blocks`` recipe, and for
RePa evaluates the trained model and its folded (deployed) form in fp32 on the test split
(``fold.json``: both top-1s and how many predictions differ). ``summarize`` measures each
configuration (top-1 per seed, params, GMACs and CPU latency of the deployed form) and ``table``
renders it (top-1 mean and sample std over seeds, the difference to vanilla, latency relative to
vanilla), and ``write_outputs`` saves the summary and the plots. The command line is
``vitblocks reproduce cifar10-blocks``; the run folders are handled by :mod:`.common`.
"""
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from timm.utils import reparameterize_model

from ..data import DataError, data_roots
from ..experiments.checkpoint import load_model_weights
from ..experiments.config import TrainConfig, load_config, load_recipe, merge
from ..experiments.plots import TradeoffPoint, plot_curves, plot_tradeoff
from ..experiments.runlog import read_json, write_json
from ..experiments.setup import create_model, make_loader, resolve_device, setup_data
from ..models.blocks_bench import BLOCK_CONFIGS, MAIN_CONFIGS, bench_model_name
from ..profile import benchmark_models, count_macs, count_params, fixed_threads
from .common import budget_overrides, find_dataset, run_or_reuse

__all__ = ['BENCH_CONFIGS', 'ALL_CONFIGS', 'BENCH_SEEDS', 'BenchRun', 'bench_config', 'select_configs',
           'run_benchmark', 'check_fold', 'summarize', 'table', 'write_outputs', 'PAPER_CLAIMS']

BENCH_CONFIGS = MAIN_CONFIGS  # the default table: each paper's block in its default setting
ALL_CONFIGS = tuple(c[0] for c in BLOCK_CONFIGS)  # + the locality controls and the papers' ablations
BENCH_SEEDS = (0, 1, 2)
# configurations evaluated after folding, whose folded accuracy must equal the trained one
FOLDED = ('repa', 'repa_idle_25', 'repa_idle_50', 'repa_idle_100')

# what each paper claims against the vanilla block, at its own scale (ImageNet-1k; NiNformer: CIFAR-10),
# for the table's notes and the README; the numbers are the papers' top-1 %
PAPER_CLAIMS = {
    'iffn': 'IFFN Table 1: DeiT-Ti 72.2 -> 72.6 (+0.4) with 12.6% fewer params and 12.7% fewer FLOPs',
    'afbo': 'AFBO Table 2: DeiT-T 72.2 -> 74.6 (+2.4) at 6.0 vs 5.7 M params',
    'swiglu': 'AFBO Table 3: SwiGLU on DeiT-T 72.6 (+0.4 over the FFN), 2.0 below AFBO',
    'repa': 'RePa Table 2: DeiT-Tiny 72.1 -> 64.2 (-7.9) but 32.6% faster after folding; the gap shrinks with size',
    'mabvit_glu': 'MABViT: Ti/16 72.44 -> 73.29 (+0.85) with SwiGLU on V',
    'mabvit_parallel': 'MABViT: Ti/16 72.44 -> 70.99 (-1.45) as a parallel block',
    'mabvit_glu_parallel': 'MABViT: Ti/16 GLU parallel 72.25 (-0.19 vs standard, +1.26 vs parallel)',
    'ninformer': 'NiNformer Table 1: CIFAR-10 ViT 65.74 -> NiNformer 81.59 (+15.85)',
}


@dataclass
class BenchRun:
    config: str
    seed: int
    run_dir: Path
    results: Dict = field(default_factory=dict)
    fold: Optional[Dict] = None  # RePa: fold.json


def select_configs(names: Optional[Sequence[str]]) -> List[str]:
    """The configurations ``names`` asks for (the nine main ones when None), in benchmark order; unknown names
    are an error."""
    if names is None:
        return list(BENCH_CONFIGS)
    wanted = [n.strip().lower() for n in names if n.strip()]
    unknown = [n for n in wanted if n not in ALL_CONFIGS]
    if unknown or not wanted:
        raise DataError(f'--configs: unknown {", ".join(unknown) or "(empty)"}; the benchmark has '
                        f'{", ".join(ALL_CONFIGS)}')
    return [c for c in ALL_CONFIGS if c in wanted]


def bench_config(config: str, seed: int, data: Path, epochs: Optional[int] = None, max_steps: Optional[int] = None,
                 train_subset: Optional[int] = None, test_subset: Optional[int] = None, device: str = 'auto',
                 threads: Optional[int] = None, extra: Optional[Dict] = None) -> TrainConfig:
    """The config of one benchmark run: the ``cifar10_blocks`` recipe, the configuration's model, the seed,
    then the budget and ``extra`` overrides (every configuration gets the same ones)."""
    layer = {'model': bench_model_name(config), 'data': str(data), 'device': device, 'seed': seed, 'progress': 'auto'}
    budget = budget_overrides(epochs, max_steps, train_subset, test_subset, threads)
    return merge(load_recipe('cifar10_blocks'), layer, budget, extra or {})


def bench_data(data_root: Optional[str]) -> Path:
    path = find_dataset('cifar10', data_root)
    if path is None:
        raise DataError(f'cifar10/ not found under {data_root or ", ".join(map(str, data_roots()))}; '
                        f'give --data-root DIR with DIR/cifar10')
    return path


def run_benchmark(configs: Sequence[str], seeds: Sequence[int], data_root: Optional[str], output: str,
                  **budget) -> List[BenchRun]:
    """Train, reuse or resume every (configuration, seed) run; ``budget``: ``bench_config``'s keyword arguments."""
    path = bench_data(data_root)
    runs = []
    for config in configs:
        for seed in seeds:
            cfg = bench_config(config, seed, path, **budget)
            run = BenchRun(config, seed, Path(output) / config / f'seed{seed}')
            run.results = run_or_reuse(cfg, run.run_dir)
            if config in FOLDED:
                run.fold = check_fold(cfg, run.run_dir, run.results)
            runs.append(run)
    return runs


@torch.no_grad()
def check_fold(cfg: TrainConfig, run_dir: Path, results: Dict) -> Optional[Dict]:
    """Top-1 of the trained model and of its folded form on the run's test split, in fp32 (no autocast, no TF32:
    folding is exact in real arithmetic, so only float rounding may tell them apart), written to ``fold.json``.
    Reused while it is of the run's final step; None (not checked) when the weights are gone."""
    out = run_dir / 'fold.json'
    fold = read_json(out)  # None when there is none yet or it is unreadable: checked again
    if isinstance(fold, dict) and fold.get('global_step') == results['global_step']:
        return fold
    if not (run_dir / 'last.pth').exists():
        return None
    device = resolve_device(cfg.device)
    model = create_model(cfg, len(results['classes']))
    model.load_state_dict(load_model_weights(run_dir / 'last.pth'))
    model.to(device).eval()
    folded = reparameterize_model(model)
    data = setup_data(cfg, model)
    loader = make_loader(cfg, data, False, device)
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        correct, differ, n, max_diff = [0, 0], 0, 0, 0.0
        for x, y in loader.epoch(0):
            a, b = model(x).float(), folded(x).float()
            correct[0] += int((a.argmax(1) == y).sum())
            correct[1] += int((b.argmax(1) == y).sum())
            differ += int((a.argmax(1) != b.argmax(1)).sum())
            max_diff = max(max_diff, float((a - b).abs().max()))
            n += y.numel()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
    fold = {'global_step': results['global_step'], 'num_images': n, 'trained_top1': 100.0 * correct[0] / n,
            'folded_top1': 100.0 * correct[1] / n, 'predictions_differ': differ, 'max_logit_diff': max_diff,
            'trained_params': count_params(model), 'folded_params': count_params(folded)}
    write_json(out, fold)
    return fold


def _mean_std(values: Sequence[float]) -> str:
    if len(values) == 1:
        return f'{values[0]:.2f}'
    return f'{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}'


@dataclass
class ConfigSummary:
    config: str
    top1: List[float]
    params: int
    deployed_params: int
    gmacs: float
    latency_ms: Optional[float] = None
    trained_fp32_top1: List[float] = field(default_factory=list)  # RePa: fold.json, before and after folding
    folded_top1: List[float] = field(default_factory=list)
    fold_differ: List[int] = field(default_factory=list)


def summarize(runs: Sequence[BenchRun], latency: bool = True, latency_batch: int = 32, repeats: int = 10,
              threads: Optional[int] = None) -> List[ConfigSummary]:
    """One summary per configuration: final top-1 per seed, params (trained / deployed form), GMACs per image
    of the deployed form, and the deployed form's CPU latency (ms per batch, inference, all models measured
    interleaved by ``vitblocks.profile.benchmark_models``, as ``vitblocks bench``)."""
    by_config: Dict[str, List[BenchRun]] = {}
    for r in runs:
        by_config.setdefault(r.config, []).append(r)
    out, models = [], {}
    with fixed_threads(threads):
        for config, rs in by_config.items():
            model = create_model(load_config(rs[0].run_dir / 'config.yaml'), len(rs[0].results['classes'])).eval()
            deployed = reparameterize_model(model)
            with torch.no_grad():
                gmacs = count_macs(deployed, input_size=(3, 32, 32)).gmacs
            s = ConfigSummary(config, [r.results['final']['top1'] for r in rs], count_params(model),
                              count_params(deployed), gmacs)
            for r in rs:
                if r.fold is not None:
                    s.trained_fp32_top1.append(r.fold['trained_top1'])
                    s.folded_top1.append(r.fold['folded_top1'])
                    s.fold_differ.append(r.fold['predictions_differ'])
            out.append(s)
            models[config] = deployed
        if latency:
            timed = benchmark_models(models, batch_size=latency_batch, input_size=(3, 32, 32), repeats=repeats,
                                     num_threads=threads, device='cpu')
            for s in out:
                s.latency_ms = timed[s.config].median_ms
    return out


def table(summaries: Sequence[ConfigSummary]):
    """(headers, rows, alignment, notes) for ``render_table``."""
    ref = next((s for s in summaries if s.config == 'vanilla'), None)
    headers = ['config', 'top-1 % (mean ± std)', 'vs vanilla', 'seeds', 'params M', 'GMACs', 'CPU latency vs vanilla']
    rows, notes = [], []
    for s in summaries:
        mean = statistics.mean(s.top1)
        delta = f'{mean - statistics.mean(ref.top1):+.2f}' if ref is not None and s is not ref else '-'
        params = f'{s.params / 1e6:.2f}' + (f' ({s.deployed_params / 1e6:.2f} folded)'
                                           if s.deployed_params != s.params and s.config in FOLDED else '')
        lat = f'{s.latency_ms / ref.latency_ms:.2f}x' if ref is not None and ref.latency_ms and s.latency_ms else '-'
        rows.append([s.config, _mean_std(s.top1), delta, str(len(s.top1)), params, f'{s.gmacs:.4f}', lat])
        if s.config in FOLDED:
            if len(s.folded_top1) == len(s.top1):
                notes.append(f'{s.config}: fp32 top-1 before folding {_mean_std(s.trained_fp32_top1)}, after '
                             f'{_mean_std(s.folded_top1)}; predictions that differ after folding, per seed: '
                             f'{", ".join(map(str, s.fold_differ))}')
            else:
                notes.append(f'{s.config}: folded accuracy not checked for {len(s.top1) - len(s.folded_top1)} seed(s) '
                             f'(no last.pth)')
    notes.append('top-1: final epoch, un-augmented test split; std: sample std over seeds; GMACs and latency of the '
                 'deployed form (timm reparameterize_model), latency: ms per batch on this CPU, measured interleaved')
    return headers, rows, 'lrrrrrr', notes


def write_outputs(runs: Sequence[BenchRun], summaries: Sequence[ConfigSummary], output, latency_batch: int) -> None:
    """summary.json, every run's curves.png and tradeoff.png (accuracy vs GMACs and vs latency, measured at
    ``latency_batch`` images a batch) in ``output``."""
    out = Path(output)
    write_json(out / 'summary.json', [{
        'config': s.config, 'top1': s.top1, 'params': s.params, 'deployed_params': s.deployed_params,
        'gmacs': s.gmacs, 'cpu_latency_ms': s.latency_ms, 'trained_fp32_top1': s.trained_fp32_top1,
        'folded_top1': s.folded_top1, 'fold_predictions_differ': s.fold_differ} for s in summaries])
    try:
        for r in runs:
            plot_curves(r.run_dir)
        points = [TradeoffPoint(s.config, sum(s.top1) / len(s.top1), s.gmacs, s.latency_ms) for s in summaries]
        print(plot_tradeoff(points, out / 'tradeoff.png', f'batch {latency_batch}, CPU'))
    except ImportError as e:  # matplotlib missing
        print(f'no plots: {e}', file=sys.stderr)
