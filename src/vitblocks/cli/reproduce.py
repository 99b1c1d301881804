"""`vitblocks reproduce ninformer-table1`: train a paper's models with its recipe, print ours vs the paper."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..data import DataError
from ..experiments import CheckpointError, ConfigError, TrainingDiverged, parse_overrides
from ..experiments.reproduce import NINFORMER_DATASETS, ninformer_jobs, ninformer_table1, table_rows
from .common import CliError, positive_int, render_table

NAME = 'reproduce'
TARGETS = ('ninformer-table1',)

EPILOG = """\
examples:
  vitblocks reproduce ninformer-table1                                  # the paper's protocol: 100 epochs
  vitblocks reproduce ninformer-table1 --datasets mnist --max-steps 40 --test-subset 2000 --threads 2
  vitblocks reproduce ninformer-table1 --datasets mnist,cifar10 --epochs 1 --device cuda
  vitblocks reproduce ninformer-table1 --device cuda --jobs 8 --set compile=true compile_mode=reduce-overhead

Datasets are looked up as <data root>/mnist, /cifar10, /cifar100 (--data-root, else the roots in
$VITBLOCKS_DATA, else ./data). CIFAR-100 is not available here: its column stays empty unless
a cifar100 folder exists. Accuracy is top-1 on the un-augmented test split (the authors' script
evaluates with training augmentation). Runs go to --output/<dataset>/<model>; finished runs
are reused and interrupted ones resumed, so re-running continues where it stopped. --jobs 8 trains
all eight Table 1 runs at once (one GPU fits them; each logs to --output/<dataset>/<model>.log).
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='reproduce a paper table: train its models, print ours vs the paper',
                              description='Train and evaluate the models of a paper table with its recipe.',
                              epilog=EPILOG)
    p.add_argument('target', choices=TARGETS)
    p.add_argument('--datasets', default='mnist,cifar10', help=f'comma-separated: {", ".join(NINFORMER_DATASETS)}')
    p.add_argument('--models', help='comma-separated row labels or model names (default: all four)')
    p.add_argument('--epochs', type=positive_int, help='epochs per model (default: the recipe\'s 100)')
    p.add_argument('--max-steps', type=positive_int, help='stop each model after this many steps (a budget)')
    p.add_argument('--train-subset', type=positive_int, metavar='N', help='train on a fixed random N images')
    p.add_argument('--test-subset', type=positive_int, metavar='N', help='evaluate on the first N test images only')
    p.add_argument('--dropout', type=float, default=0.5,
                   help='dropout in the MLP sub-units, the authors\' 0.5 by default (config key mlp_drop)')
    p.add_argument('--device', default='auto')
    p.add_argument('--threads', type=positive_int)
    p.add_argument('--data-root', help='folder holding mnist/, cifar10/ (and cifar100/)')
    p.add_argument('--output', default='runs/ninformer-table1')
    p.add_argument('--md', action='store_true', help='print the table as Markdown')
    p.add_argument('--jobs', type=positive_int, default=1,
                   help='train this many runs at once, each in its own process (small models leave a GPU '
                        'mostly idle: several runs share it well); logs go to OUTPUT/DATASET/MODEL.log')
    p.add_argument('--set', nargs='+', default=[], metavar='KEY=VALUE', dest='overrides',
                   help='extra config overrides for every run, e.g. --set log_interval=10 progress=log')
    p.set_defaults(run=run)


def run(args) -> int:
    datasets = [d.strip() for d in args.datasets.split(',') if d.strip()]
    unknown = [d for d in datasets if d not in NINFORMER_DATASETS]
    if unknown:
        raise CliError(f'--datasets: unknown {", ".join(unknown)}; Table 1 has {", ".join(NINFORMER_DATASETS)}')
    t0 = time.perf_counter()
    models = args.models.split(',') if args.models else None
    if args.jobs > 1:
        failed = _run_jobs(args, datasets, models)
        if failed:
            for log in failed:
                print(f'vitblocks reproduce: run failed, see {log}', file=sys.stderr)
            return 1
    try:
        runs = ninformer_table1(datasets, epochs=args.epochs, max_steps=args.max_steps, train_subset=args.train_subset,
                                test_subset=args.test_subset, device=args.device, data_root=args.data_root,
                                output=args.output, dropout=args.dropout, threads=args.threads, models=models,
                                extra=parse_overrides(args.overrides))
    except (ConfigError, DataError, CheckpointError) as e:
        raise CliError(str(e)) from None
    except TrainingDiverged as e:
        print(f'vitblocks reproduce: stopped: {e}', file=sys.stderr)
        return 1
    headers, rows, align, notes = table_rows(runs)
    title = 'NiNformer Table 1: test top-1 % (ours: un-augmented test split)'
    lines = [f'### {title}' if args.md else title, '']
    lines += render_table(headers, rows, align, fmt='md' if args.md else 'text')
    budget = [f'epochs={args.epochs}' if args.epochs else 'epochs=100 (recipe)']
    budget += [f'max_steps={args.max_steps}'] if args.max_steps else []
    budget += [f'train_subset={args.train_subset}'] if args.train_subset else []
    budget += [f'test_subset={args.test_subset}'] if args.test_subset else []
    lines += ['', f'budget: {", ".join(budget)}; dropout {args.dropout}; wall time {time.perf_counter() - t0:.0f} s; '
                  f'runs in {args.output}']
    lines += [f'note: {n}' for n in notes]
    if 'cifar100' not in datasets:
        lines.append('note: CIFAR-100 (paper: 53.78 for NiNformer) is not run: it is not available here')
    text = '\n'.join(lines)
    print(text)
    Path(args.output).mkdir(parents=True, exist_ok=True)
    (Path(args.output) / ('table.md' if args.md else 'table.txt')).write_text(text + '\n')
    return 0


def _child_argv(args, dataset: str, model: str, threads: int):
    argv = [sys.executable, '-m', 'vitblocks', 'reproduce', args.target, '--datasets', dataset, '--models', model,
            '--dropout', str(args.dropout), '--device', args.device, '--output', args.output,
            '--threads', str(args.threads or threads)]
    for flag in ('epochs', 'max_steps', 'train_subset', 'test_subset', 'data_root'):
        value = getattr(args, flag)
        if value is not None:
            argv += [f'--{flag.replace("_", "-")}', str(value)]
    if args.overrides:
        argv += ['--set', *args.overrides]
    return argv


def _run_jobs(args, datasets, models):
    """Train every (dataset, model) run in its own ``vitblocks reproduce`` process, ``args.jobs`` at once;
    returns the logs of the runs that failed. Finished runs are then reused by the caller's table pass."""
    try:
        jobs = ninformer_jobs(datasets, models)
    except DataError as e:
        raise CliError(str(e)) from None
    threads = max(1, (os.cpu_count() or 1) // min(args.jobs, len(jobs)))
    pending, running, failed = list(jobs), [], []
    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                dataset, model = pending.pop(0)
                log = Path(args.output) / dataset / f'{model}.log'
                log.parent.mkdir(parents=True, exist_ok=True)
                with open(log, 'a') as f:  # appended: a resumed run keeps the log of its first part
                    proc = subprocess.Popen(_child_argv(args, dataset, model, threads), stdout=f,
                                            stderr=subprocess.STDOUT)
                running.append((proc, log))
                print(f'started {dataset}/{model} (log {log})', flush=True)
            time.sleep(1.0)
            for proc, log in list(running):
                if proc.poll() is not None:
                    running.remove((proc, log))
                    print(f'finished {log.parent.name}/{log.stem}: exit {proc.returncode}', flush=True)
                    if proc.returncode != 0:
                        failed.append(log)
    finally:  # interrupted: stop the children too (each keeps its last checkpoint; re-running resumes)
        for proc, _ in running:
            proc.send_signal(signal.SIGINT)
        for proc, _ in running:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return failed
