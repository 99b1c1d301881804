"""What every target of ``vitblocks reproduce`` shares: NiNformer's Table 1 (:mod:`.ninformer_table1`), the CIFAR-10
blocks benchmark (:mod:`.blocks_benchmark`) and its evidence plan (:mod:`.blocks_evidence`) keep only what is
their own and take the rest from here; none of them imports another for it.

Run folders, for the harnesses:

* :func:`find_dataset`: the data root that holds a dataset;
* :func:`budget_overrides`: the config keys of the budget options (epochs, steps, subsets, threads);
* :func:`run_or_reuse`: reuse a finished run of a config, continue a stopped one, else train it;
  :func:`is_finished`: whether it would reuse (a command starts no process for such a run);
  :func:`read_run`: what a run folder holds, training nothing; :func:`result_changing_keys`: which config keys
  make two runs differ in their result;
* :func:`archive_runs`: the runs of some folders in one ``.tar.gz``, without checkpoints.

The command, as functions of its parsed arguments ``args``:

* :func:`child_command` and :func:`budget_flags`: the command line of one run in its own process, with the
  command's budget and ``--set``;
* :func:`run_children` and :func:`report_unfinished`: those processes, ``--jobs`` at a time inside
  ``--time-limit`` (:mod:`.jobs`), and what did not finish;
* :func:`budget_line`, :func:`write_table` and :func:`archive_outputs`: the report, printed and saved in
  ``--output``, and ``--archive``.
"""
import json
import os
import sys
import tarfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ..data import DataError, data_roots
from ..experiments.config import RESUME_CHANGEABLE, TrainConfig, load_config
from ..experiments.engine import train
from ..experiments.runlog import read_metrics, write_text_atomic
from ..experiments.setup import create_model
from ..profile import count_params
from ..text_tables import render_table
from .jobs import Job, JobsReport, run_jobs

__all__ = ['find_dataset', 'budget_overrides', 'run_or_reuse', 'is_finished', 'read_run', 'result_changing_keys',
           'archive_runs', 'child_command', 'budget_flags', 'run_children', 'report_unfinished', 'budget_line',
           'write_table', 'archive_outputs']


# --- run folders --------------------------------------------------------------------------------------

def find_dataset(name: str, root: Optional[str]) -> Optional[Path]:
    """``<root>/<name>`` for the first root holding it (``root``, else ``data_roots()``), or None."""
    if root and not Path(root).is_dir():
        raise DataError(f'--data-root {root}: no such folder; give the folder that holds {name}/')
    roots = [Path(root)] if root else data_roots()
    for r in roots:
        if (r / name).exists():
            return r / name
    return None


# keys that change how a run is executed but not what it computes up to its budget (grad_accum changes the
# global batch of a run on the same number of processes, so it is not one of them)
_SAME_RESULT = RESUME_CHANGEABLE - {'epochs', 'max_steps', 'grad_accum'}


def _check_same_model(cfg: TrainConfig, results: Dict, run_dir: Path) -> None:
    """A finished run is only reused if the model it trained is still the one its name builds: the
    config holds the name, not the definition, so compare parameter counts (built on the meta device)."""
    with torch.device('meta'):
        params = count_params(create_model(cfg, len(results['classes'])))
    if params != results['params']:
        raise DataError(f'{run_dir} trained a {results["params"]:,}-parameter {cfg.model}, but that name now builds '
                        f'{params:,} parameters (its definition changed since): remove the folder to train it '
                        f'again, or use another --output')


def _differing_keys(a: TrainConfig, b: TrainConfig) -> List[str]:
    """The config keys in which ``a`` and ``b`` differ, sorted."""
    a, b = a.to_dict(), b.to_dict()
    return sorted(k for k, v in a.items() if b.get(k) != v)


def _changed_keys(cfg: TrainConfig, run_dir: Path) -> List[str]:
    """The config keys in which the run in ``run_dir`` (its config.yaml) differs from ``cfg``, sorted."""
    return _differing_keys(cfg, load_config(run_dir / 'config.yaml'))


def _reusable_results(cfg: TrainConfig, run_dir: Path, changed: Sequence[str]) -> Optional[Dict]:
    """The results of the finished run in ``run_dir`` if it differs from ``cfg`` only in keys that do not change
    a result (e.g. --threads, --device) and still builds the same model; else None."""
    results = run_dir / 'results.json'
    if not (set(changed) <= _SAME_RESULT and results.exists()):
        return None
    done_results = json.loads(results.read_text())
    _check_same_model(cfg, done_results, run_dir)
    return done_results


def _refuse_other_config(run_dir: Path, changed: Sequence[str]) -> None:
    """A run that differs from the asked one in keys a resume may not change is an error."""
    if set(changed) - RESUME_CHANGEABLE:
        raise DataError(f'{run_dir} holds a run with another config ({", ".join(changed)} differ); '
                        f'remove it or use another --output')


def result_changing_keys(a: TrainConfig, b: TrainConfig) -> List[str]:
    """The config keys in which ``a`` and ``b`` differ, but those that cannot change a run's result (threads,
    device, logging: a finished run is reused across them), sorted."""
    return [k for k in _differing_keys(a, b) if k not in _SAME_RESULT]


def is_finished(cfg: TrainConfig, run_dir: Path) -> bool:
    """Whether ``run_or_reuse(cfg, run_dir)`` would reuse a finished run rather than train (a harness starts no
    process for it)."""
    if not (run_dir / 'config.yaml').exists():
        return False
    return _reusable_results(cfg, run_dir, _changed_keys(cfg, run_dir)) is not None


def run_or_reuse(cfg: TrainConfig, run_dir: Path) -> Dict:
    """Reuse a finished run of this config (the results alone suffice: checkpoints may be gone), continue
    one that stopped or ran on a smaller budget (only ``RESUME_CHANGEABLE`` keys may differ), else start it."""
    last, results = run_dir / 'last.pth', run_dir / 'results.json'
    if (run_dir / 'config.yaml').exists():
        changed = _changed_keys(cfg, run_dir)
        done_results = _reusable_results(cfg, run_dir, changed)
        if done_results is not None:
            return done_results
        if last.exists():
            _refuse_other_config(run_dir, changed)
            train(cfg, run_dir=run_dir, resume=last)
            return json.loads(results.read_text())
        if results.exists():  # finished, its checkpoints gone: nothing to continue, and its results to keep
            raise DataError(f'{run_dir} holds the results of a run with another config ({", ".join(changed)} '
                            f'differ) and no last.pth to continue it from; remove the folder to train it again, or '
                            f'use another --output')
    train(cfg, run_dir=run_dir)
    return json.loads(results.read_text())


def read_run(cfg: TrainConfig, run_dir: Path) -> Optional[Dict]:
    """What ``run_dir`` holds of a run of ``cfg``, without training: a finished run's results (as
    ``run_or_reuse`` reuses them), else the progress of the same run stopped or still going (another budget
    included): ``final.top1`` of its last test evaluation, ``best_top1``, ``epochs``, ``global_step``,
    ``seconds`` from metrics.csv, and ``unfinished: True``. None if there is no run or no test evaluation yet;
    a run of another config is an error, as for ``run_or_reuse``."""
    if not (run_dir / 'config.yaml').exists():
        return None
    changed = _changed_keys(cfg, run_dir)
    results = _reusable_results(cfg, run_dir, changed)
    if results is not None:
        return results
    _refuse_other_config(run_dir, changed)
    metrics = run_dir / 'metrics.csv'
    evals = [r for r in read_metrics(metrics) if r['split'] == 'val'] if metrics.exists() else []
    if not evals:
        return None
    last = evals[-1]
    return {'final': {'top1': float(last['top1'])}, 'best_top1': max(float(r['top1']) for r in evals),
            'epochs': float(last['epoch']), 'global_step': int(last['step']), 'seconds': float(last['elapsed_s']),
            'unfinished': True}


def budget_overrides(epochs: Optional[int] = None, max_steps: Optional[int] = None, train_subset: Optional[int] = None,
                     test_subset: Optional[int] = None, threads: Optional[int] = None) -> Dict:
    """The config keys of a harness's budget options, only those given."""
    given = {'epochs': epochs, 'max_steps': max_steps, 'train_subset': train_subset, 'val_subset': test_subset,
             'threads': threads}
    return {k: v for k, v in given.items() if v is not None}


def archive_runs(folders: Sequence[Path], archive: Path) -> int:
    """Pack the runs under ``folders`` (configs, metrics, results, logs and the tables; no checkpoints) into one
    ``.tar.gz``, each folder under its own name, written atomically; returns how many finished runs (with
    ``results.json``) it holds."""
    archive = Path(archive)
    tmp = archive.with_name(archive.name + '.tmp')
    finished = 0
    with tarfile.open(tmp, 'w:gz') as tar:
        for folder in map(Path, folders):
            if not folder.is_dir():
                continue
            for path in sorted(folder.rglob('*')):
                if path.is_file() and path.suffix not in ('.pth', '.tmp') and path.resolve() != archive.resolve():
                    tar.add(path, arcname=str(path.relative_to(folder.parent)))
                    finished += path.name == 'results.json'
    tmp.replace(archive)
    return finished


# --- the command: runs in child processes, the report -------------------------------------------------

def child_command(args, target: str, selection: Sequence[str], output, settings: Sequence[str] = ()) -> List[str]:
    """The command line that trains one run of ``target`` in its own process: ``selection`` (the flags that choose
    the run, e.g. ``['--configs', 'iffn', '--seeds', '0']``), --train-only, the device, ``output``, then
    :func:`budget_flags` (``settings``: an ablation's overrides, after --set)."""
    return [sys.executable, '-m', 'vitblocks', 'reproduce', target, *selection, '--train-only', '--device',
            args.device, '--output', str(output)] + budget_flags(args, settings)


def budget_flags(args, settings: Sequence[str] = ()) -> List[str]:
    """A child's flags for the command's budget and --set (then ``settings``, an ablation's: later wins)."""
    argv = []
    for flag in ('epochs', 'max_steps', 'train_subset', 'test_subset', 'data_root'):
        value = getattr(args, flag)
        if value is not None:
            argv += [f'--{flag.replace("_", "-")}', str(value)]
    overrides = list(args.overrides) + list(settings)
    return argv + (['--set', *overrides] if overrides else [])


def budget_line(args, recipe_epochs: int) -> str:
    """The budget of a report: the epochs (``recipe_epochs`` where --epochs is not given) and the other budget
    options given, e.g. ``epochs=20 (recipe), max_steps=40``."""
    budget = [f'epochs={args.epochs}' if args.epochs else f'epochs={recipe_epochs} (recipe)']
    for key in ('max_steps', 'train_subset', 'test_subset'):
        if getattr(args, key):
            budget.append(f'{key}={getattr(args, key)}')
    return ', '.join(budget)


def write_table(args, title: str, table, budget: str, t0: float, notes_after: Sequence[str] = (),
                output=None) -> None:
    """Print the report of a target and save it as --output/table.txt (table.md with --md): the title, the
    table (``table``: headers, rows, alignment, notes), the budget line (``budget``: what the target adds to
    :func:`budget_line`, then the wall time since ``t0``), the table's notes, then ``notes_after``."""
    headers, rows, align, notes = table
    lines = [f'### {title}' if args.md else title, '']
    lines += render_table(headers, rows, align, fmt='md' if args.md else 'text')
    output = Path(output or args.output)
    lines += ['', f'budget: {budget}; wall time {time.perf_counter() - t0:.0f} s; runs in {output}']
    lines += [f'note: {n}' for n in notes] + list(notes_after)
    text = '\n'.join(lines)
    print(text)
    output.mkdir(parents=True, exist_ok=True)
    write_text_atomic(output / ('table.md' if args.md else 'table.txt'), text + '\n')


def run_children(args, children: Sequence[Job]) -> JobsReport:
    """Run ``children`` in their own processes, --jobs at a time, inside --time-limit (:func:`~.jobs.run_jobs`),
    each with --threads intra-op threads (default: the CPU cores shared among the processes running at once);
    the pool's lines are printed as they come."""
    threads = args.threads or max(1, (os.cpu_count() or 1) // min(args.jobs, len(children)))
    return run_jobs(children, args.jobs, threads, time_limit=args.time_limit,
                    echo=lambda line: print(line, flush=True))


def report_unfinished(report: JobsReport) -> bool:
    """Say which runs did not finish and why; True if any did not."""
    for job in report.failed:
        print(f'vitblocks reproduce: run failed, see {job.log}', file=sys.stderr)
    if report.paused or report.not_started:
        names = ', '.join(j.name for j in report.paused + report.not_started)
        print(f'vitblocks reproduce: {len(report.paused) + len(report.not_started)} run(s) not finished within '
              f'--time-limit: {names}; re-run the command to resume them (paused ones from their checkpoints)',
              file=sys.stderr)
    return bool(report.failed or report.paused or report.not_started)


def archive_outputs(args, outputs: Sequence) -> None:
    """--archive: the runs of ``outputs`` (folders: a table's and its ablations') packed into one ``.tar.gz``
    (:func:`archive_runs`); nothing without --archive."""
    if args.archive:
        n = archive_runs([Path(o) for o in outputs], Path(args.archive))
        print(f'archive: {args.archive} ({n} finished run(s), no checkpoints)')
