"""`vitblocks reproduce ninformer-table1 | cifar10-blocks`: train a table's models, print ours (vs the paper).

The options and the checks of what they may be together live here; the harnesses are in
``vitblocks.reproduce``, and what the targets share (run folders, child processes, budget, report) in
``vitblocks.reproduce.common``. ``--plan evidence`` is ``cli/reproduce_evidence.py``."""
import re
import sys
import time
from pathlib import Path

from ..data import DataError
from ..experiments import CheckpointError, ConfigError, TrainingDiverged, TrainingInterrupted, parse_overrides
from ..experiments.config import load_recipe
from ..reproduce import blocks_benchmark as bench
from ..reproduce.common import (archive_outputs, budget_line, child_command, is_finished, report_unfinished,
                                result_changing_keys, run_children, write_table)
from ..reproduce.jobs import Job
from ..reproduce.ninformer_table1 import (NINFORMER_DATASETS, ninformer_data, ninformer_finished, ninformer_jobs,
                                          ninformer_log, ninformer_own_models, ninformer_run_config,
                                          ninformer_table1, table_rows)
from .common import CliError, positive_float, positive_int
from .reproduce_evidence import run_evidence

NAME = 'reproduce'
TARGETS = ('ninformer-table1', 'cifar10-blocks')
_NINFORMER_ONLY = ('datasets', 'models', 'dropout', 'no_train', 'ablation', 'ablations_first')
_BLOCKS_ONLY = ('configs', 'seeds', 'no_latency', 'latency_batch', 'repeats', 'plan')

EPILOG = """\
examples:
  vitblocks reproduce ninformer-table1                                  # the paper's protocol: 100 epochs
  vitblocks reproduce ninformer-table1 --datasets mnist --max-steps 40 --test-subset 2000 --threads 2
  vitblocks reproduce ninformer-table1 --datasets mnist,cifar10 --epochs 1 --device cuda
  vitblocks reproduce ninformer-table1 --device cuda --jobs 8 --set compile=true compile_mode=reduce-overhead
  vitblocks reproduce cifar10-blocks --device cuda --jobs 27 --set compile=true compile_mode=reduce-overhead
  vitblocks reproduce ninformer-table1 --device cuda --jobs 8 --time-limit 600   # a GPU job with a 15-minute limit
  vitblocks reproduce ninformer-table1 --output runs/gpu-t1 --no-train --set matmul_precision=high   # as they are
  vitblocks reproduce ninformer-table1 --jobs 8 --time-limit 1500 --ablation torchinit cifar10/NiNformer \
      'model_kwargs={block_cfg: {init: torch}}' --ablation seed1 cifar10/ViT seed=1   # beside, paused first
  vitblocks reproduce cifar10-blocks --configs vanilla,repa --seeds 0 --max-steps 20 --threads 2
  vitblocks reproduce cifar10-blocks --plan evidence --device cuda --jobs 16 --time-limit 3000 \
      --archive evidence.tgz          # a job with a wall-clock limit; run it again in the next job to resume

ninformer-table1: NiNformer's Table 1 (ViT, MlpMixer, LocalViT, NiNformer; --models takes row
labels or model names, any case). Datasets are looked up as <data root>/mnist, /cifar10, /cifar100
(--data-root, else the roots in $VITBLOCKS_DATA, else ./data). CIFAR-100 is not available here:
its column stays empty unless a cifar100 folder exists.
cifar10-blocks: nine configurations of one small ViT (vanilla, iffn, afbo, swiglu, repa,
mabvit_glu, mabvit_parallel, mabvit_glu_parallel, ninformer) x seeds 0,1,2 on <data root>/cifar10
with the cifar10_blocks recipe; the table gives top-1 mean +- std over seeds, params, GMACs and CPU
latency relative to vanilla, and RePa's top-1 after folding. --configs also takes the locality
controls and the papers' ablations (vitblocks.models.blocks_bench). --plan evidence runs them all, most
telling first: the locality and size controls (3 seeds), the papers' ablations (3 seeds), then the main
rows on a 100-epoch schedule (seed 0, in --output/long); it prints each claim against its control with
a verdict (holds / does not hold / not separable), writes evidence.json, and --archive PATH packs the
runs (no checkpoints) into one .tar.gz to carry to the next job.
Accuracy is top-1 on the un-augmented test split. Runs go to --output/<dataset>/<model> or
--output/<config>/seed<k>; finished runs are reused (results.json alone suffices) and interrupted ones
resumed from last.pth, so re-running continues where it stopped. --jobs N trains N runs at once, each
in its own process logging next to its run folder (small models leave a GPU mostly idle).
--time-limit S finishes as many runs as fit in S seconds: runs projected to end later are paused
(checkpoint kept), the one furthest from its end first, and resume when time frees or on a re-run.
--ablation NAME ROWS KEY=VALUE... trains Table 1 rows again with more config (ROWS: comma-separated
DATASET/ROW, e.g. cifar10/NiNformer) into <output>-NAME, beside the table's runs and under the same
--time-limit, where they are paused before any of the table's (--ablations-first: after them, and
started first); each prints its own table after the main one.
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
    p.add_argument('--plan', choices=('evidence',),
                   help='cifar10-blocks: run a plan of configurations instead of --configs: "evidence" = the '
                        'locality controls, the papers\' ablations, then the main rows at 100 epochs, with verdicts')
    p.add_argument('--archive', metavar='PATH',
                   help='ninformer-table1, cifar10-blocks --plan evidence: pack the runs under --output (configs, '
                        'metrics, results, logs, tables; no checkpoints) into this .tar.gz at the end, finished or '
                        'not: the file a job with a wall-clock limit carries out')
    p.add_argument('--no-latency', action='store_true', help='cifar10-blocks: skip the CPU latency measurement')
    p.add_argument('--latency-batch', type=positive_int, help='cifar10-blocks: images per timed batch (default 32)')
    p.add_argument('--repeats', type=positive_int, help='cifar10-blocks: timed batches per model (default 10)')
    p.add_argument('--train-only', action='store_true', help='train (or reuse) the runs and print no table '
                                                             '(what --jobs children do)')
    p.add_argument('--no-train', action='store_true',
                   help='ninformer-table1: train nothing; print the table from the runs under --output as they '
                        'are (an unfinished run: its last test evaluation, marked; a missing one: empty), e.g. '
                        'runs copied back from a GPU job')
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
                        'not outlive them (a GPU job with a time limit, a preemptible node)')
    p.add_argument('--ablation', nargs='+', action='append', metavar='NAME ROWS KEY=VALUE',
                   help='ninformer-table1, repeatable: also train ROWS (comma-separated DATASET/ROW, e.g. '
                        'cifar10/NiNformer) with these config overrides on top of --set, into <output>-NAME; under '
                        '--time-limit they share the pool and are paused before every Table 1 run')
    p.add_argument('--ablations-first', action='store_true',
                   help='ninformer-table1, with --ablation and --time-limit or --jobs: the ablations start first and '
                        'are paused last, after every Table 1 run (where an ablation is what the time is for)')
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


# --- ninformer-table1 ---------------------------------------------------------------------------------

def _ninformer(args) -> int:
    datasets = [d.strip() for d in (args.datasets or 'mnist,cifar10').split(',') if d.strip()]
    unknown = [d for d in datasets if d not in NINFORMER_DATASETS]
    if unknown:
        raise CliError(f'--datasets: unknown {", ".join(unknown)}; Table 1 has {", ".join(NINFORMER_DATASETS)}')
    dropout = 0.5 if args.dropout is None else args.dropout
    if args.no_train:
        contradicting = _given(args, ('train_only', 'time_limit', 'ablations_first'))
        contradicting += ['--jobs'] if args.jobs > 1 else []
        if contradicting:
            raise CliError(f'--no-train prints the runs as they are; {", ".join(contradicting)} would train them')
    t0 = time.perf_counter()
    models = args.models.split(',') if args.models else None
    jobs = ninformer_jobs(datasets, models)  # every --models name must match a row, before anything trains
    own = ninformer_own_models(datasets)  # the paper's own model: the row the table is for, paused last
    ablations = _ablations(args, dropout)
    if args.ablations_first and not (ablations and (args.jobs > 1 or args.time_limit)):
        raise CliError('--ablations-first orders the --ablation runs before the table\'s in the pool of --jobs or '
                       '--time-limit; ' + ('give --ablation' if not ablations else 'give --jobs N or --time-limit S'))
    for ds in dict.fromkeys(datasets + [ds for _, pairs, _ in ablations for ds, _ in pairs]):
        ninformer_data(ds, args.data_root)  # and every dataset must be there
    if args.jobs > 1 or args.time_limit:  # runs in child processes; none for a run finished already
        # under --time-limit the lowest priority is paused first: the ablations (-1, or 2 with --ablations-first),
        # then the baselines (0), NiNformer's own rows (1); the pool starts them in list order
        ablation_priority = 2 if args.ablations_first else -1
        groups = [(args.output, jobs, [], lambda model: int(model in own), '')]
        groups += [(_ablation_output(args, name), pairs, settings, lambda model: ablation_priority, f'{name}:')
                   for name, pairs, settings in ablations]
        if args.ablations_first:
            groups = groups[1:] + groups[:1]
        children = [Job(f'{prefix}{ds}/{model}', _ninformer_child(args, ds, model, dropout, output, settings),
                        ninformer_log(output, ds, model), Path(output) / ds / model, priority=priority(model))
                    for output, pairs, settings, priority, prefix in groups for ds, model in pairs
                    if not ninformer_finished(ds, model, output, dropout=dropout, **_run_config(args, settings))]
        if children and report_unfinished(run_children(args, children)):
            archive_outputs(args, [args.output] + [_ablation_output(args, name) for name, _, _ in ablations])
            return 1
    runs = _table1_runs(args, datasets, models, dropout, args.output, [])
    ablation_runs = [(name, settings, [r for ds, ms in _by_dataset(pairs) for r in
                                       _table1_runs(args, [ds], ms, dropout, _ablation_output(args, name), settings)])
                     for name, pairs, settings in ablations]
    if args.train_only:
        for name, r in [('', r) for r in runs] + [(f'{n}: ', r) for n, _, rs in ablation_runs for r in rs]:
            print(f'{name}{r.dataset} {r.label}: ' + (f'top-1 {r.top1:.2f} ({r.run_dir})' if r.top1 is not None
                                                      else r.note))
        return 0
    missing = [] if 'cifar100' in datasets else [
        'note: CIFAR-100 (paper: 53.78 for NiNformer) is not run: it is not available here']
    write_table(args, 'NiNformer Table 1: test top-1 % (ours: un-augmented test split)', table_rows(runs),
                _ninformer_budget(args, dropout, []), t0, missing)
    for name, settings, rs in ablation_runs:
        print()
        write_table(args, f'NiNformer Table 1, ablation {name} ({" ".join(settings)}): test top-1 %',
                    table_rows(rs), _ninformer_budget(args, dropout, settings), t0,
                    output=_ablation_output(args, name))
    archive_outputs(args, [args.output] + [_ablation_output(args, name) for name, _, _ in ablation_runs])
    return 0


def _ninformer_budget(args, dropout: float, settings) -> str:
    """The budget line: epochs and the like, and the dropout the runs have (``mlp_drop`` in --set or ``settings``
    over --dropout)."""
    return f'{budget_line(args, 100)}; dropout {parse_overrides(args.overrides + settings).get("mlp_drop", dropout)}'


def _table1_runs(args, datasets, models, dropout, output, settings):
    return ninformer_table1(datasets, output=output, dropout=dropout, threads=args.threads, models=models,
                            train=not args.no_train, **_run_config(args, settings))


def _run_config(args, settings):
    """The config arguments of ``ninformer_run_config`` and ``ninformer_table1`` (but dropout and threads) for a run
    with these settings after --set."""
    return dict(data_root=args.data_root, extra=parse_overrides(args.overrides + settings), epochs=args.epochs,
                max_steps=args.max_steps, train_subset=args.train_subset, test_subset=args.test_subset,
                device=args.device)


def _ablation_output(args, name: str) -> str:
    return f'{str(args.output).rstrip("/")}-{name}'


def _by_dataset(pairs):
    """[(dataset, [model, ...])] in first-seen order."""
    out = {}
    for ds, model in pairs:
        out.setdefault(ds, []).append(model)
    return list(out.items())


def _ablations(args, dropout: float):
    """``--ablation`` as [(name, [(dataset, model)], [KEY=VALUE])], each checked: a name a folder can take, once;
    rows of Table 1; overrides that parse and change the run."""
    out, names = [], set()
    for spec in args.ablation or ():
        if len(spec) < 3:
            raise CliError(f'--ablation {" ".join(spec)}: expected NAME ROWS KEY=VALUE [KEY=VALUE ...], e.g. '
                           f'--ablation torchinit cifar10/NiNformer \'model_kwargs={{block_cfg: {{init: torch}}}}\'')
        name, rows, settings = spec[0], spec[1], spec[2:]
        if not re.fullmatch(r'[A-Za-z0-9][A-Za-z0-9_.-]*', name) or name in names:
            raise CliError(f'--ablation {name}: ' + ('given twice' if name in names else
                                                     'a name of letters, digits, ".", "_" and "-" (its folder is '
                                                     '<output>-NAME)'))
        names.add(name)
        pairs = []
        for item in rows.split(','):
            ds, sep, row = item.strip().partition('/')
            if not sep or ds not in NINFORMER_DATASETS or not row:
                raise CliError(f'--ablation {name}: {item!r} is not DATASET/ROW (DATASET one of '
                               f'{", ".join(NINFORMER_DATASETS)}, ROW a Table 1 row, e.g. cifar10/NiNformer)')
            pairs += ninformer_jobs([ds], [row])
        try:
            parse_overrides(settings)
        except ConfigError as e:
            raise CliError(f'--ablation {name}: {e}') from None
        ds, model = pairs[0]
        configs = [ninformer_run_config(ds, model, dropout=dropout, **_run_config(args, extra))
                   for extra in ([], settings)]
        if configs[0] is not None and not result_changing_keys(*configs):
            raise CliError(f'--ablation {name}: {" ".join(settings)} is what the table\'s {ds} {model} run has '
                           f'already, or changes nothing its result depends on; the ablation would train the same '
                           f'run')
        out.append((name, pairs, settings))
    return out


def _ninformer_child(args, dataset: str, model: str, dropout: float, output=None, settings=()):
    return child_command(args, args.target, ['--datasets', dataset, '--models', model, '--dropout', str(dropout)],
                         output or args.output, settings)


# --- cifar10-blocks -----------------------------------------------------------------------------------

def _blocks(args) -> int:
    if args.archive and not args.plan:
        raise CliError('--archive packs the runs of --plan evidence; give --plan evidence')
    if args.plan:
        return run_evidence(args)
    configs = bench.select_configs(args.configs.split(',') if args.configs else None)
    try:
        seeds = [int(s) for s in (args.seeds or ','.join(map(str, bench.BENCH_SEEDS))).split(',') if s.strip()]
    except ValueError:
        raise CliError(f'--seeds {args.seeds}: expected comma-separated integers, e.g. 0,1,2') from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise CliError(f'--seeds {args.seeds}: expected distinct integers >= 0, e.g. 0,1,2')
    data = bench.bench_data(args.data_root)  # fails before anything trains
    t0 = time.perf_counter()
    budget = dict(epochs=args.epochs, max_steps=args.max_steps, train_subset=args.train_subset,
                  test_subset=args.test_subset, device=args.device, extra=parse_overrides(args.overrides))
    if args.jobs > 1 or args.time_limit:  # runs in child processes; none for a run finished already
        children = [Job(f'{c}/seed{s}', _blocks_child(args, c, s), Path(args.output) / c / f'seed{s}.log',
                        Path(args.output) / c / f'seed{s}') for c in configs for s in seeds
                    if not is_finished(bench.bench_config(c, s, data, **budget), Path(args.output) / c / f'seed{s}')]
        if children and report_unfinished(run_children(args, children)):
            return 1
    runs = bench.run_benchmark(configs, seeds, args.data_root, args.output, threads=args.threads, **budget)
    if args.train_only:
        for r in runs:
            fold = f', folded {r.fold["folded_top1"]:.2f}' if r.fold else ''
            print(f'{r.config} seed {r.seed}: top-1 {r.results["final"]["top1"]:.2f}{fold} ({r.run_dir})')
        return 0
    summaries = bench.summarize(runs, latency=not args.no_latency, latency_batch=args.latency_batch or 32,
                                repeats=args.repeats or 10, threads=args.threads)
    budget = f'{budget_line(args, load_recipe("cifar10_blocks")["epochs"])}; seeds {",".join(map(str, seeds))}'
    write_table(args, 'CIFAR-10 blocks benchmark: test top-1 % of one small ViT with each paper\'s block',
                bench.table(summaries), budget, t0,
                [f'paper: {bench.PAPER_CLAIMS[s.config]}' for s in summaries if s.config in bench.PAPER_CLAIMS])
    bench.write_outputs(runs, summaries, args.output, args.latency_batch or 32)
    return 0


def _blocks_child(args, config: str, seed: int):
    return child_command(args, args.target, ['--configs', config, '--seeds', str(seed)], args.output)
