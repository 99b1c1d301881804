"""`vitblocks reproduce ninformer-table1 | cifar10-blocks`: train a table's models, print ours (vs the paper)."""
import os
import sys
import time
from pathlib import Path

from ..data import DataError
from ..experiments import CheckpointError, ConfigError, TrainingDiverged, TrainingInterrupted, parse_overrides
from ..experiments import blocks_benchmark as bench
from ..experiments.plots import TradeoffPoint, plot_curves, plot_tradeoff
from ..experiments.config import load_recipe
from ..experiments.jobs import Job, run_jobs
from ..experiments.runlog import write_json, write_text_atomic
from ..experiments.reproduce import (NINFORMER_DATASETS, ninformer_data, ninformer_jobs, ninformer_log,
                                      ninformer_own_models, ninformer_table1, table_rows)
from .common import CliError, positive_float, positive_int, render_table

NAME = 'reproduce'
TARGETS = ('ninformer-table1', 'cifar10-blocks')
_NINFORMER_ONLY = ('datasets', 'models', 'dropout', 'no_train')
_BLOCKS_ONLY = ('configs', 'seeds', 'no_latency', 'latency_batch', 'repeats')

EPILOG = """\
examples:
  vitblocks reproduce ninformer-table1                                  # the paper's protocol: 100 epochs
  vitblocks reproduce ninformer-table1 --datasets mnist --max-steps 40 --test-subset 2000 --threads 2
  vitblocks reproduce ninformer-table1 --datasets mnist,cifar10 --epochs 1 --device cuda
  vitblocks reproduce ninformer-table1 --device cuda --jobs 8 --set compile=true compile_mode=reduce-overhead
  vitblocks reproduce cifar10-blocks --device cuda --jobs 27 --set compile=true compile_mode=reduce-overhead
  vitblocks reproduce ninformer-table1 --device cuda --jobs 8 --time-limit 1500   # a 30-minute GPU lease
  vitblocks reproduce ninformer-table1 --output runs/gpu-t1 --no-train --set matmul_precision=high   # as they are
  vitblocks reproduce cifar10-blocks --configs vanilla,repa --seeds 0 --max-steps 20 --threads 2

ninformer-table1: NiNformer's Table 1 (ViT, MlpMixer, LocalViT, NiNformer; --models takes row
labels or model names, any case). Datasets are looked up as <data root>/mnist, /cifar10, /cifar100
(--data-root, else the roots in $VITBLOCKS_DATA, else ./data). CIFAR-100 is not available here:
its column stays empty unless a cifar100 folder exists.
cifar10-blocks: nine configurations of one small ViT (vanilla, iffn, afbo, swiglu, repa,
mabvit_glu, mabvit_parallel, mabvit_glu_parallel, ninformer) x seeds 0,1,2 on <data root>/cifar10
with the cifar10_blocks recipe; the table gives top-1 mean +- std over seeds, params, GMACs and CPU
latency relative to vanilla, and RePa's top-1 after folding.
Accuracy is top-1 on the un-augmented test split. Runs go to --output/<dataset>/<model> or
--output/<config>/seed<k>; finished runs are reused (results.json alone suffices) and interrupted ones
resumed from last.pth, so re-running continues where it stopped. --jobs N trains N runs at once, each
in its own process logging next to its run folder (small models leave a GPU mostly idle).
--time-limit S finishes as many runs as fit in S seconds: runs projected to end later are paused
(checkpoint kept), the one furthest from its end first, and resume when time frees or on a re-run.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='reproduce a table: train its models, print ours (vs the paper)',
                              description='Train and evaluate the models of a table with its recipe.', epilog=EPILOG)
    p.add_argument('target', choices=TARGETS)
    p.add_argument('--datasets', help=f'ninformer-table1: comma-separated {", ".join(NINFORMER_DATASETS)} '
                                      f'(default mnist,cifar10)')
    p.add_argument('--models', help='ninformer-table1: comma-separated row labels or model names (default: all four)')
    p.add_argument('--dropout', type=float,
                   help='ninformer-table1: dropout in every feed-forward net, the authors\' 0.5 by default '
                        '(config key mlp_drop)')
    p.add_argument('--configs', help=f'cifar10-blocks: comma-separated, of {", ".join(bench.BENCH_CONFIGS)} '
                                     f'(default: all)')
    p.add_argument('--seeds', help='cifar10-blocks: comma-separated seeds (default 0,1,2)')
    p.add_argument('--no-latency', action='store_true', help='cifar10-blocks: skip the CPU latency measurement')
    p.add_argument('--latency-batch', type=positive_int, help='cifar10-blocks: images per timed batch (default 32)')
    p.add_argument('--repeats', type=positive_int, help='cifar10-blocks: timed batches per model (default 10)')
    p.add_argument('--train-only', action='store_true', help='train (or reuse) the runs and print no table '
                                                             '(what --jobs children do)')
    p.add_argument('--no-train', action='store_true',
                   help='ninformer-table1: train nothing; print the table from the runs under --output as they '
                        'are (an unfinished run: its last test evaluation, marked; a missing one: empty), e.g. '
                        'runs copied back from a GPU lease')
    p.add_argument('--epochs', type=positive_int, help='epochs per run (default: the recipe\'s)')
    p.add_argument('--max-steps', type=positive_int, help='stop each run after this many steps (a budget)')
    p.add_argument('--train-subset', type=positive_int, metavar='N', help='train on a fixed random N images')
    p.add_argument('--test-subset', type=positive_int, metavar='N', help='evaluate on the first N test images only')
    p.add_argument('--device', default='auto')
    p.add_argument('--threads', type=positive_int)
    p.add_argument('--data-root', help='folder holding mnist/, cifar10/ (and cifar100/)')
    p.add_argument('--output', help='default runs/ninformer-table1 or runs/cifar10-blocks')
    p.add_argument('--md', action='store_true', help='print the table as Markdown')
    p.add_argument('--jobs', type=positive_int, default=1,
                   help='train this many runs at once, each in its own process (small models leave a GPU '
                        'mostly idle: several runs share it well); each logs next to its run folder')
    p.add_argument('--time-limit', type=positive_float, metavar='SECONDS',
                   help='finish as many runs as fit in SECONDS of wall time (each run in its own process, --jobs '
                        'at once). While the runs are projected (from their paces) to end later, the one '
                        'furthest from its end is paused (NiNformer\'s own Table 1 rows last), so the others '
                        'finish sooner on the device they share; it keeps its checkpoint and resumes if a '
                        'finished run frees time, or when the command is re-run. For machines whose disk does '
                        'not outlive them (a GPU lease, a preemptible node)')
    p.add_argument('--set', nargs='+', default=[], metavar='KEY=VALUE', dest='overrides',
                   help='extra config overrides for every run, e.g. --set log_interval=10 progress=log')
    p.set_defaults(run=run)


def _given(args, keys):
    return [f'--{k.replace("_", "-")}' for k in keys if getattr(args, k) not in (None, False)]


def run(args) -> int:
    other = _given(args, _BLOCKS_ONLY if args.target == 'ninformer-table1' else _NINFORMER_ONLY)
    if other:
        owner = 'cifar10-blocks' if args.target == 'ninformer-table1' else 'ninformer-table1'
        raise CliError(f'{", ".join(other)}: an option of `reproduce {owner}` only, not of {args.target}')
    args.output = args.output or f'runs/{args.target}'
    try:
        return _ninformer(args) if args.target == 'ninformer-table1' else _blocks(args)
    except (ConfigError, DataError, CheckpointError) as e:
        raise CliError(str(e)) from None
    except TrainingDiverged as e:
        print(f'vitblocks reproduce: stopped: {e}', file=sys.stderr)
        return 1
    except TrainingInterrupted as e:  # SIGINT/SIGTERM, e.g. from a parent's --time-limit: checkpoint saved
        print(f'vitblocks reproduce: stopped by {e}', file=sys.stderr)
        return 130


def _budget_flags(args):
    argv = []
    for flag in ('epochs', 'max_steps', 'train_subset', 'test_subset', 'data_root'):
        value = getattr(args, flag)
        if value is not None:
            argv += [f'--{flag.replace("_", "-")}', str(value)]
    return argv + (['--set', *args.overrides] if args.overrides else [])


def _budget_line(args, recipe_epochs: int):
    budget = [f'epochs={args.epochs}' if args.epochs else f'epochs={recipe_epochs} (recipe)']
    for key in ('max_steps', 'train_subset', 'test_subset'):
        if getattr(args, key):
            budget.append(f'{key}={getattr(args, key)}')
    return ', '.join(budget)


def _write_table(args, title: str, table, budget: str, t0: float, notes_after=()) -> None:
    """Print the report of a target and save it as --output/table.txt (table.md with --md): the title, the
    table (``table``: headers, rows, alignment, notes), the budget line (``budget``: what the target adds to
    ``_budget_line``, then the wall time since ``t0``), the table's notes, then ``notes_after``."""
    headers, rows, align, notes = table
    lines = [f'### {title}' if args.md else title, '']
    lines += render_table(headers, rows, align, fmt='md' if args.md else 'text')
    lines += ['', f'budget: {budget}; wall time {time.perf_counter() - t0:.0f} s; runs in {args.output}']
    lines += [f'note: {n}' for n in notes] + list(notes_after)
    text = '\n'.join(lines)
    print(text)
    Path(args.output).mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(args.output) / ('table.md' if args.md else 'table.txt'), text + '\n')


# --- ninformer-table1 ---------------------------------------------------------------------------------

def _ninformer(args) -> int:
    datasets = [d.strip() for d in (args.datasets or 'mnist,cifar10').split(',') if d.strip()]
    unknown = [d for d in datasets if d not in NINFORMER_DATASETS]
    if unknown:
        raise CliError(f'--datasets: unknown {", ".join(unknown)}; Table 1 has {", ".join(NINFORMER_DATASETS)}')
    dropout = 0.5 if args.dropout is None else args.dropout
    if args.no_train:
        contradicting = _given(args, ('train_only', 'time_limit')) + (['--jobs'] if args.jobs > 1 else [])
        if contradicting:
            raise CliError(f'--no-train prints the runs as they are; {", ".join(contradicting)} would train them')
    t0 = time.perf_counter()
    models = args.models.split(',') if args.models else None
    jobs = ninformer_jobs(datasets, models)  # every --models name must match a row, before anything trains
    own = ninformer_own_models(datasets)  # the paper's own model: the row the table is for, paused last
    for ds in datasets:  # and every dataset must be there
        ninformer_data(ds, args.data_root)
    if args.jobs > 1 or args.time_limit:  # runs in child processes
        children = [Job(f'{ds}/{model}', _ninformer_child(args, ds, model, dropout),
                        ninformer_log(args.output, ds, model), Path(args.output) / ds / model,
                        priority=int(model in own)) for ds, model in jobs]
        if _report_unfinished(_run_children(args, children)):
            return 1
    runs = ninformer_table1(datasets, epochs=args.epochs, max_steps=args.max_steps, train_subset=args.train_subset,
                            test_subset=args.test_subset, device=args.device, data_root=args.data_root,
                            output=args.output, dropout=dropout, threads=args.threads, models=models,
                            extra=parse_overrides(args.overrides), train=not args.no_train)
    if args.train_only:
        for r in runs:
            print(f'{r.dataset} {r.label}: ' + (f'top-1 {r.top1:.2f} ({r.run_dir})' if r.top1 is not None else r.note))
        return 0
    missing = [] if 'cifar100' in datasets else [
        'note: CIFAR-100 (paper: 53.78 for NiNformer) is not run: it is not available here']
    _write_table(args, 'NiNformer Table 1: test top-1 % (ours: un-augmented test split)', table_rows(runs),
                 f'{_budget_line(args, 100)}; dropout {dropout}', t0, missing)
    return 0


def _ninformer_child(args, dataset: str, model: str, dropout: float):
    return [sys.executable, '-m', 'vitblocks', 'reproduce', args.target, '--datasets', dataset, '--models', model,
            '--dropout', str(dropout), '--train-only', '--device', args.device, '--output', args.output] \
        + _budget_flags(args)


# --- cifar10-blocks -----------------------------------------------------------------------------------

def _blocks(args) -> int:
    configs = bench.select_configs(args.configs.split(',') if args.configs else None)
    try:
        seeds = [int(s) for s in (args.seeds or ','.join(map(str, bench.BENCH_SEEDS))).split(',') if s.strip()]
    except ValueError:
        raise CliError(f'--seeds {args.seeds}: expected comma-separated integers, e.g. 0,1,2') from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise CliError(f'--seeds {args.seeds}: expected distinct integers >= 0, e.g. 0,1,2')
    bench.bench_data(args.data_root)  # fails before anything trains
    t0 = time.perf_counter()
    if args.jobs > 1 or args.time_limit:  # runs in child processes
        children = [Job(f'{c}/seed{s}', _blocks_child(args, c, s), Path(args.output) / c / f'seed{s}.log',
                        Path(args.output) / c / f'seed{s}') for c in configs for s in seeds]
        if _report_unfinished(_run_children(args, children)):
            return 1
    runs = bench.run_benchmark(configs, seeds, args.data_root, args.output, epochs=args.epochs,
                               max_steps=args.max_steps, train_subset=args.train_subset, test_subset=args.test_subset,
                               device=args.device, threads=args.threads, extra=parse_overrides(args.overrides))
    if args.train_only:
        for r in runs:
            fold = f', folded {r.fold["folded_top1"]:.2f}' if r.fold else ''
            print(f'{r.config} seed {r.seed}: top-1 {r.results["final"]["top1"]:.2f}{fold} ({r.run_dir})')
        return 0
    summaries = bench.summarize(runs, latency=not args.no_latency, latency_batch=args.latency_batch or 32,
                                repeats=args.repeats or 10, threads=args.threads)
    budget = f'{_budget_line(args, load_recipe("cifar10_blocks")["epochs"])}; seeds {",".join(map(str, seeds))}'
    _write_table(args, 'CIFAR-10 blocks benchmark: test top-1 % of one small ViT with each paper\'s block',
                 bench.table(summaries), budget, t0,
                 [f'paper: {bench.PAPER_CLAIMS[s.config]}' for s in summaries if s.config in bench.PAPER_CLAIMS])
    _blocks_outputs(args, runs, summaries)
    return 0


def _blocks_child(args, config: str, seed: int):
    return [sys.executable, '-m', 'vitblocks', 'reproduce', args.target, '--configs', config, '--seeds', str(seed),
            '--train-only', '--device', args.device, '--output', args.output] + _budget_flags(args)


def _blocks_outputs(args, runs, summaries) -> None:
    """summary.json, every run's curves.png and tradeoff.png (accuracy vs GMACs and vs latency) in --output."""
    out = Path(args.output)
    write_json(out / 'summary.json', [{
        'config': s.config, 'top1': s.top1, 'params': s.params, 'deployed_params': s.deployed_params,
        'gmacs': s.gmacs, 'cpu_latency_ms': s.latency_ms, 'trained_fp32_top1': s.trained_fp32_top1,
        'folded_top1': s.folded_top1, 'fold_predictions_differ': s.fold_differ} for s in summaries])
    try:
        for r in runs:
            plot_curves(r.run_dir)
        points = [TradeoffPoint(s.config, sum(s.top1) / len(s.top1), s.gmacs, s.latency_ms) for s in summaries]
        print(plot_tradeoff(points, out / 'tradeoff.png', f'batch {args.latency_batch or 32}, CPU'))
    except ImportError as e:  # matplotlib missing
        print(f'no plots: {e}', file=sys.stderr)


# --- parallel runs ------------------------------------------------------------------------------------

def _run_children(args, children):
    threads = args.threads or max(1, (os.cpu_count() or 1) // min(args.jobs, len(children)))
    return run_jobs(children, args.jobs, threads, time_limit=args.time_limit,
                    echo=lambda line: print(line, flush=True))


def _report_unfinished(report) -> bool:
    """Say which runs did not finish and why; True if any did not."""
    for job in report.failed:
        print(f'vitblocks reproduce: run failed, see {job.log}', file=sys.stderr)
    if report.paused or report.not_started:
        names = ', '.join(j.name for j in report.paused + report.not_started)
        print(f'vitblocks reproduce: {len(report.paused) + len(report.not_started)} run(s) not finished within '
              f'--time-limit: {names}; re-run the command to resume them (paused ones from their checkpoints)',
              file=sys.stderr)
    return bool(report.failed or report.paused or report.not_started)
