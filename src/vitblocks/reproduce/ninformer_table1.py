"""NiNformer's Table 1: train the paper's models with its recipe and print ours next to its table.

``ninformer_table1``: the four models of NiNformer's Table 1 (ViT, MLP-Mixer, LocalViT,
NiNformer; rows and published accuracies from ``vitblocks/papers/ninformer.yaml``) trained with
the ``ninformer`` recipe (Adam 1e-3, batch 128, 100 epochs; as the authors' script: normalization
by 0.5/0.5, dropout 0.5 in every feed-forward net, random crop with 4-pixel padding and flips, the
last two on CIFAR only) and evaluated on the un-augmented test split (the authors' script
evaluates with the training augmentation; we do not).

Runs go to ``<output>/<dataset>/<model>``; a finished run is reused, an interrupted one is
resumed, and one run on a smaller budget (``--max-steps``, ``--epochs``) is continued, so the
command can be re-run after a crash or with a larger budget (the run folders: :mod:`.common`).
"""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..data import DataError, data_roots
from ..experiments.config import TrainConfig, load_recipe, merge
from ..experiments.runlog import read_stop_record
from ..papers import load_paper
from .common import budget_overrides, find_dataset, is_finished, read_run, run_or_reuse

__all__ = ['NINFORMER_DATASETS', 'TableRun', 'ninformer_table1', 'ninformer_config', 'ninformer_run_config',
           'ninformer_finished', 'ninformer_jobs', 'ninformer_data', 'table_rows', 'select_rows', 'ninformer_rechecks',
           'ninformer_log', 'ninformer_own_models']

# dataset -> (paper table number, folder name, recipe overrides). The authors' script is a
# CIFAR script (random crop with 4-pixel padding, horizontal flips); the paper states no
# augmentation, and a mirrored digit is another digit, so MNIST trains without either (measured:
# 1 epoch of NiNformer on MNIST, fp32: 92.65% with flips, 95.93% without, dropout 0.5 in every MLP).
NINFORMER_DATASETS = {
    'mnist': ('1-MNIST', 'mnist', {'hflip': 0.0, 'crop_padding': 0}),
    'cifar10': ('1-CIFAR10', 'cifar10', {}),
    'cifar100': ('1-CIFAR100', 'cifar100', {}),
}


@dataclass
class TableRun:
    dataset: str
    label: str
    model: str
    paper_top1: Optional[float]
    top1: Optional[float] = None
    best_top1: Optional[float] = None
    steps: int = 0
    epochs: float = 0.0
    seconds: float = 0.0
    run_dir: Optional[Path] = None
    note: str = ''


def _row_names(row) -> List[str]:
    """The names ``--models`` accepts for a paper row, lower-case: its label, the label without its
    parenthesis ('NiNformer (ours)' -> 'ninformer'), its model name, and that without the input
    suffix ('ninformer_vit_patch4_28' -> 'ninformer_vit_patch4')."""
    label = row.label.lower()
    return [label, label.split(' (')[0], row.model.lower(), row.model.lower().rsplit('_', 1)[0]]


def select_rows(rows, models: Optional[Sequence[str]], what: str = 'Table 1'):
    """The rows ``models`` names (case-insensitive: see ``_row_names``), in table order; every name must
    match a row, so a typo is an error rather than a table with a missing row."""
    if models is None:
        return list(rows)
    wanted = [m.strip() for m in models if m.strip()]
    unknown = [m for m in wanted if not any(m.lower() in _row_names(r) for r in rows)]
    if unknown or not wanted:
        raise DataError(f'--models: unknown {", ".join(unknown) or "(empty)"}; {what} has '
                        f'{", ".join(r.label.split(" (")[0] for r in rows)} (row labels or model names, e.g. '
                        f'{rows[0].model})')
    return [r for r in rows if any(m.lower() in _row_names(r) for m in wanted)]


def _table_rows(ds: str, models: Optional[Sequence[str]]):
    if ds not in NINFORMER_DATASETS:
        raise DataError(f'unknown dataset {ds!r}; Table 1 has {", ".join(NINFORMER_DATASETS)}')
    return select_rows(load_paper('ninformer').table(NINFORMER_DATASETS[ds][0]).rows, models)


def ninformer_jobs(datasets: Sequence[str], models: Optional[Sequence[str]] = None) -> List[Tuple[str, str]]:
    """The (dataset, model name) pairs ``ninformer_table1`` trains, in its order (one job each)."""
    return [(ds, row.model) for ds in datasets for row in _table_rows(ds, models)]


def ninformer_own_models(datasets: Sequence[str]) -> List[str]:
    """The model names of the paper's own rows (labelled '... (ours)' in its table) for ``datasets``."""
    return [row.model for ds in datasets for row in _table_rows(ds, None) if row.label.endswith('(ours)')]


def ninformer_table1(datasets: Sequence[str] = ('mnist', 'cifar10'), epochs: Optional[int] = None,
                     max_steps: Optional[int] = None, train_subset: Optional[int] = None,
                     test_subset: Optional[int] = None, device: str = 'auto', data_root: Optional[str] = None,
                     output: str = 'runs/ninformer-table1', dropout: float = 0.5, threads: Optional[int] = None,
                     models: Optional[Sequence[str]] = None, extra: Optional[Dict] = None,
                     train: bool = True) -> List[TableRun]:
    """Train and evaluate the Table 1 rows for ``datasets``; returns one ``TableRun`` per row. With
    ``train=False`` nothing trains: each row is what its run folder holds (``read_run``), an unfinished
    run's last test evaluation with a note, a missing one empty."""
    out: List[TableRun] = []
    plan = [(ds, _table_rows(ds, models)) for ds in datasets]  # check every name before training anything
    paths = {ds: ninformer_data(ds, data_root) for ds in datasets}
    for ds, rows in plan:
        folder, path = NINFORMER_DATASETS[ds][1], paths[ds]
        for row in rows:
            run = TableRun(ds, row.label, row.model, row.top1)
            out.append(run)
            if path is None:
                run.note = f'{folder} not found under {data_root or "the data roots"}; CIFAR-100 is not available here'
                continue
            cfg = ninformer_config(ds, row, path, epochs=epochs, max_steps=max_steps, train_subset=train_subset,
                                   test_subset=test_subset, device=device, dropout=dropout, threads=threads,
                                   extra=extra)
            run.run_dir = Path(output) / ds / row.model
            res = run_or_reuse(cfg, run.run_dir) if train else read_run(cfg, run.run_dir)
            if res is None:
                run.note = f'{row.model}: not run yet'
                continue
            if res.get('unfinished'):
                run.note = f'{row.model}: unfinished, its last test evaluation (epoch {res["epochs"]:g})'
            run.top1, run.best_top1 = res['final']['top1'], res.get('best_top1')
            run.steps, run.epochs, run.seconds = res['global_step'], res['epochs'], res['seconds']
            if test_subset and not res.get('unfinished'):
                run.note = f'first {res["final"]["num_images"]} test images only'
    return out


def ninformer_run_config(ds: str, model: str, data_root: Optional[str] = None, dropout: float = 0.5,
                         extra: Optional[Dict] = None, **budget) -> Optional[TrainConfig]:
    """The config ``ninformer_table1`` trains ``model`` on ``ds`` with (``budget``: its epochs, max_steps,
    train_subset, test_subset, device, threads); None where the dataset is not available (CIFAR-100)."""
    path = ninformer_data(ds, data_root)
    if path is None:
        return None
    (row,) = [r for r in _table_rows(ds, None) if r.model == model]
    return ninformer_config(ds, row, path, dropout=dropout, extra=extra, **budget)


def ninformer_finished(ds: str, model: str, output: str, **config) -> bool:
    """Whether ``ninformer_table1`` would reuse the finished run of ``model`` on ``ds`` under ``output`` instead of
    training it (``config``: ``ninformer_run_config``'s arguments)."""
    cfg = ninformer_run_config(ds, model, **config)
    return cfg is not None and is_finished(cfg, Path(output) / ds / model)


def ninformer_data(ds: str, data_root: Optional[str]) -> Optional[Path]:
    """The folder of Table 1 dataset ``ds``; a missing one is an error, except CIFAR-100 (not available here:
    its column is documented to stay empty)."""
    folder = NINFORMER_DATASETS[ds][1]
    path = find_dataset(folder, data_root)
    if path is None and ds != 'cifar100':
        raise DataError(f'{folder}/ not found under {data_root or ", ".join(map(str, data_roots()))}; '
                        f'give --data-root DIR with DIR/{folder}')
    return path


def ninformer_config(ds: str, row, data: Path, epochs: Optional[int] = None, max_steps: Optional[int] = None,
                     train_subset: Optional[int] = None, test_subset: Optional[int] = None, device: str = 'auto',
                     dropout: float = 0.5, threads: Optional[int] = None, extra: Optional[Dict] = None) -> TrainConfig:
    """The config one Table 1 run trains with: the ``ninformer`` recipe, the dataset's overrides
    (``NINFORMER_DATASETS``), the row's model, then the budget and ``extra`` overrides."""
    layer = {'model': row.model, 'data': str(data), 'device': device, 'progress': 'auto',
             'model_kwargs': dict(row.base_kwargs), 'mlp_drop': dropout,
             'num_classes': row.base_kwargs.get('num_classes')}
    budget = budget_overrides(epochs, max_steps, train_subset, test_subset, threads)
    return merge(load_recipe('ninformer'), NINFORMER_DATASETS[ds][2], layer, budget, extra or {})


def table_rows(runs: Sequence[TableRun]):
    """(headers, rows, column alignment, notes): our top-1 next to the paper's, one row per model,
    one column group per dataset (the CLI renders it)."""
    datasets = list(dict.fromkeys(r.dataset for r in runs))
    labels = list(dict.fromkeys(r.label for r in runs))
    by = {(r.dataset, r.label): r for r in runs}
    headers = ['model']
    for ds in datasets:
        headers += [f'{ds} ours %', 'best %', 'paper %', 'delta', 'epochs']
    body = []
    for label in labels:
        row = [label]
        for ds in datasets:
            r = by.get((ds, label))
            paper = f'{r.paper_top1:.2f}' if r is not None and r.paper_top1 is not None else '-'
            if r is None or r.top1 is None:
                row += ['-', '-', paper, '-', '-']
            else:
                best = f'{r.best_top1:.2f}' if r.best_top1 is not None else '-'
                row += [f'{r.top1:.2f}', best, paper, f'{r.top1 - r.paper_top1:+.2f}', f'{r.epochs:.2f}']
        body.append(row)
    notes = sorted({f'{r.dataset}: {r.note}' for r in runs if r.note})
    notes.append('ours: after the last epoch; best: the highest of the per-epoch test evaluations (chosen on the '
                 'test split, so optimistic); delta: ours - paper')
    return headers, body, 'l' + 'rrrrr' * len(datasets), notes


def ninformer_log(output, ds: str, model: str) -> Path:
    """Where ``vitblocks reproduce ninformer-table1 --jobs N`` writes the output of run ``ds/model``."""
    return Path(output) / ds / f'{model}.log'


def ninformer_rechecks(output: str, datasets: Sequence[str] = ('mnist', 'cifar10'),
                       margin: float = 1.0) -> List[Tuple[str, str, str]]:
    """The Table 1 runs under ``output`` that need an ablation to explain them, as (dataset, model, why):
    those that stopped on a non-finite loss (no ``results.json``, and their ``stopped.json`` says
    'diverged', or, for runs made before runs kept that record, their ``<model>.log`` says
    ``stopped: loss is``) and those that finished more than ``margin`` points below the paper. Runs not
    there, still going, or stopped for another reason (interrupted, an error) are not listed."""
    out = []
    for ds in datasets:
        for row in _table_rows(ds, None):
            run_dir = Path(output) / ds / row.model
            results, log = run_dir / 'results.json', ninformer_log(output, ds, row.model)
            if results.exists():
                top1 = json.loads(results.read_text())['final']['top1']
                if row.top1 is not None and top1 < row.top1 - margin:
                    out.append((ds, row.model, f'below the paper: {top1:.2f} vs {row.top1:.2f}'))
            elif _diverged(run_dir, log):
                out.append((ds, row.model, 'diverged'))
    return out


def _diverged(run_dir: Path, log: Path) -> bool:
    stop = read_stop_record(run_dir)
    if stop is not None:
        return stop['reason'] == 'diverged'
    return log.exists() and 'stopped: loss is ' in log.read_text(errors='replace')
