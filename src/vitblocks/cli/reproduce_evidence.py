"""`vitblocks reproduce cifar10-blocks --plan evidence`: the controls, ablations and long schedule of the blocks
benchmark (vitblocks.reproduce.blocks_evidence), most telling runs first, inside a wall-clock limit."""
import time
from pathlib import Path

from ..experiments import parse_overrides
from ..experiments.runlog import read_json, write_json
from ..reproduce import blocks_benchmark as bench
from ..reproduce.blocks_evidence import EVIDENCE_PLAN, remaining_runs, verdict_table, verdicts
from ..reproduce.common import (archive_outputs, budget_line, child_command, is_finished, report_unfinished,
                                run_children, write_table)
from ..reproduce.jobs import Job
from .common import CliError


def run_evidence(args) -> int:
    """Train (or resume) what the plan still lacks, in plan order (later tiers paused first under
    --time-limit), then report what is finished: the verdicts, the long schedule, ``evidence.json``, and with
    --archive one ``.tar.gz`` of the runs. Exit 0 when the whole plan is finished, 1 otherwise."""
    if args.configs or args.seeds:
        raise CliError('--plan evidence chooses the configurations and seeds itself; drop --configs / --seeds')
    data = bench.bench_data(args.data_root)  # fails before anything trains
    t0 = time.perf_counter()
    out = Path(args.output)
    budget = dict(max_steps=args.max_steps, train_subset=args.train_subset, test_subset=args.test_subset,
                  device=args.device, extra=parse_overrides(args.overrides))

    def run_dir(tier, config, seed):
        return out / tier.name / config / f'seed{seed}'

    def config_of(tier, config, seed):
        return bench.bench_config(config, seed, data, epochs=tier.epochs or args.epochs, **budget)

    def finished(tier, config, seed):
        return is_finished(config_of(tier, config, seed), run_dir(tier, config, seed))

    todo = remaining_runs(EVIDENCE_PLAN, finished)
    priority = {tier: len(EVIDENCE_PLAN) - i for i, tier in enumerate(EVIDENCE_PLAN)}  # the first paused last
    children = [Job('/'.join(p for p in (tier.name, c, f'seed{s}') if p),
                    _child(args, tier, c, s), run_dir(tier, c, s).with_suffix('.log'),
                    run_dir(tier, c, s), priority=priority[tier]) for tier, c, s in todo]
    print(f'evidence plan: {len(children)} run(s) to train of '
          f'{sum(len(t.configs) * len(t.seeds) for t in EVIDENCE_PLAN)}', flush=True)
    incomplete = bool(children) and report_unfinished(run_children(args, children))
    report = _report(args, out, _finished_top1(out), t0)
    write_json(out / 'evidence.json', report)
    archive_outputs(args, [out])
    left = remaining_runs(EVIDENCE_PLAN, finished)
    if left:
        print('not finished: ' + ', '.join('/'.join(p for p in (t.name, c, f'seed{s}') if p) for t, c, s in left))
    return 1 if incomplete or left else 0


def _child(args, tier, config, seed):
    argv = child_command(args, 'cifar10-blocks', ['--configs', config, '--seeds', str(seed)],
                         Path(args.output) / tier.name)
    if tier.epochs:
        argv += ['--epochs', str(tier.epochs)]  # after the budget's: argparse keeps the last
    return argv


def _finished_top1(out: Path):
    """{tier name: {config: {seed: final top-1}}} of every finished run under ``out``."""
    found = {}
    for tier in EVIDENCE_PLAN:
        for config in tier.configs:
            for seed in tier.seeds:
                results = read_json(out / tier.name / config / f'seed{seed}' / 'results.json')
                if isinstance(results, dict) and 'final' in results:
                    found.setdefault(tier.name, {}).setdefault(config, {})[seed] = results['final']['top1']
    return found


def _report(args, out: Path, top1, t0: float) -> dict:
    main = top1.get('', {})
    budget = budget_line(args, 20)
    runs = [bench.BenchRun(config, seed, out / config / f'seed{seed}',
                           read_json(out / config / f'seed{seed}' / 'results.json'),
                           read_json(out / config / f'seed{seed}' / 'fold.json') if config in bench.FOLDED else None)
            for config in bench.ALL_CONFIGS if config in main for seed in sorted(main[config])]
    if runs:  # top-1 mean +- std, params, GMACs, CPU latency of every finished configuration, and the trade-off plot
        summaries = bench.summarize(runs, latency=not args.no_latency, latency_batch=args.latency_batch or 32,
                                    repeats=args.repeats or 10, threads=args.threads)
        write_table(args, "CIFAR-10 blocks benchmark: the blocks, their controls and the papers' ablations",
                    bench.table(summaries), budget, t0, output=out)
        bench.write_outputs(runs, summaries, out, args.latency_batch or 32)
        print()
    rows = verdicts(main)
    if rows:
        write_table(args, 'CIFAR-10 blocks benchmark: each claim against its control (paired by seed)',
                    verdict_table(rows), budget, t0, output=out / 'verdicts')
    long = top1.get('long', {})
    if long:
        headers = ['config', 'top-1 % (100 epochs)', 'vs vanilla']
        ref = long.get('vanilla', {}).get(0)
        table_rows = [[c, f'{v[0]:.2f}', f'{v[0] - ref:+.2f}' if ref is not None and c != 'vanilla' else '-']
                      for c, v in long.items() if 0 in v]
        write_table(args, 'CIFAR-10 blocks benchmark, 100 epochs, seed 0', (headers, table_rows, 'lrr', []),
                    budget_line(args, 100), t0, output=out / 'long')
    return {'top1': {tier: {c: {str(s): v for s, v in seeds.items()} for c, seeds in configs.items()}
                     for tier, configs in top1.items()}, 'verdicts': rows}

