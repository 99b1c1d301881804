"""Run timm's own model tests (``tests/test_models.py`` of a timm checkout) over vitblocks models.

    python scripts/timm_conformance.py --timm-tests ~/src/pytorch-image-models            # every model
    python scripts/timm_conformance.py --timm-tests ~/src/pytorch-image-models/tests \\
        --models 'afbo_lvt' 'repa_lvvit_*' --kinds 'default_cfgs*' --jobs 2 --out /tmp/conf
    python scripts/timm_conformance.py --summarize /tmp/conf      # the table of a run, finished or not
    python scripts/timm_conformance.py --summarize /tmp/all /tmp/fixed   # /tmp/fixed's cases replace /tmp/all's

Nothing is downloaded: ``--timm-tests`` is a timm checkout (or its ``tests/`` folder) that you
provide, ideally at the installed timm version. Each model joins the test kinds its timm family
joins (``scripts/timm_conformance_plugin.py`` says how models are routed); the cases run in
``--jobs`` pytest processes, each with one torch thread by default. The result is a pass/fail
table, model x test kind, printed and written to ``OUT/table.md``; ``OUT/results-*.jsonl`` hold one
line per finished case (with the failure message) and ``OUT/shard-*.log`` pytest's own output.
Exit status 1 if a case failed or did not run. After fixing a model, re-run only it (``--models``)
and merge the runs' tables with ``--summarize``; the table names each run's commit.

Cells: ``pass``, ``FAIL``, ``skip`` (timm skipped the case, e.g. a fixed input size over its limit),
``-`` (the model is not in that kind: timm's filters leave its family out), ``not run`` (collected,
no result: the run was stopped).
"""
import argparse
import datetime
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
PLUGIN = 'timm_conformance_plugin'
ORDER = {'failed': 3, 'passed': 1, 'skipped': 2}  # the worst report of a case (setup, call, teardown) wins
CELL = {'passed': 'pass', 'failed': 'FAIL', 'skipped': 'skip', None: 'not run'}


def find_test_file(path: Path) -> Path:
    for candidate in (path / 'test_models.py', path / 'tests' / 'test_models.py'):
        if candidate.is_file():
            return candidate
    raise SystemExit(f'--timm-tests {path}: no test_models.py there or in {path / "tests"}; give the path of a '
                     f'timm checkout (git clone https://github.com/huggingface/pytorch-image-models, at the '
                     f'installed timm version) or of its tests/ folder')


def select_models(patterns):
    import vitblocks
    from vitblocks.models import list_backbones
    every = sorted(vitblocks.list_models() + list_backbones())
    if not patterns:
        return every
    chosen, unmatched = set(), []
    for pattern in patterns:
        hits = fnmatch.filter(every, pattern)
        chosen.update(hits)
        if not hits:
            unmatched.append(pattern)
    if unmatched:
        raise SystemExit(f'--models {" ".join(unmatched)}: matches no registered model (vitblocks list shows them; '
                         f'patterns are shell-style, e.g. "repa_lvvit_*")')
    return sorted(chosen)


def _git_commit(path: Path, mark_changes: bool = False):
    """The commit checked out at ``path`` (None outside git); ``mark_changes``: '+changes' if files differ from it."""
    git = ['git', '-C', str(path)]
    try:
        commit = subprocess.run([*git, 'rev-parse', 'HEAD'], capture_output=True, text=True, check=True).stdout.strip()
        changed = mark_changes and subprocess.run([*git, 'status', '--porcelain', '--untracked-files=no'],
                                                  capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ('+changes' if changed else '')


def describe_run(test_file: Path, models, args) -> dict:
    import timm
    return dict(
        started=datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
        timm_version=timm.__version__, test_file=str(test_file),
        test_file_sha256=hashlib.sha256(test_file.read_bytes()).hexdigest(),
        timm_commit=_git_commit(test_file.parent), vitblocks_commit=_git_commit(SCRIPTS.parent, mark_changes=True),
        models=len(models), kinds=args.kinds or ['*'], jobs=args.jobs, time_limit_s=args.time_limit,
        threads=args.threads)


def run_shards(test_file: Path, models, args, out: Path):
    env = dict(os.environ, VITBLOCKS_CONFORMANCE_MODELS=','.join(models),
               VITBLOCKS_CONFORMANCE_KINDS=','.join(args.kinds or []),
               VITBLOCKS_CONFORMANCE_TIME_LIMIT=str(args.time_limit), VITBLOCKS_CONFORMANCE_THREADS=str(args.threads),
               OMP_NUM_THREADS=str(args.threads), TIMEOUT=str(int(args.time_limit)),
               PYTHONPATH=os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get('PYTHONPATH')])))
    procs = []
    for shard in range(args.jobs):
        log = open(out / f'shard-{shard}.log', 'w')
        cmd = [sys.executable, '-m', 'pytest', str(test_file), '-p', PLUGIN, '-p', 'no:cacheprovider', '-v',
               '-W', 'ignore::pytest.PytestUnknownMarkWarning']
        procs.append((subprocess.Popen(cmd, cwd=test_file.parent, stdout=log, stderr=subprocess.STDOUT,
                                       env=dict(env, VITBLOCKS_CONFORMANCE_SHARD=f'{shard}/{args.jobs}',
                                                VITBLOCKS_CONFORMANCE_RESULTS=str(out / f'results-{shard}.jsonl'),
                                                VITBLOCKS_CONFORMANCE_COLLECTED=str(out / f'collected-{shard}.jsonl'))),
                      log))
    for proc, log in procs:
        proc.wait()
        log.close()
    # pytest exits 0 (all passed), 1 (some failed) or 5 (nothing collected); anything else broke the run
    broken = [i for i, (p, _) in enumerate(procs) if p.returncode not in (0, 1, 5)]
    if broken:
        print(f'pytest did not finish in shard(s) {broken}: see {out}/shard-<i>.log', file=sys.stderr)
    return not broken


def _short(commit):
    return commit and commit[:12] + ('+changes' if commit.endswith('+changes') else '')


def _read_jsonl(out: Path, stem: str):
    return [json.loads(line) for path in sorted(out.glob(f'{stem}-*.jsonl'))
            for line in path.read_text().splitlines() if line.strip()]


def _read_run(out: Path) -> tuple:
    """A run's description, its collected cases and each case's worst report (setup, call, teardown)."""
    run = json.loads((out / 'run.json').read_text()) if (out / 'run.json').is_file() else {}
    collected = {r['nodeid']: r for r in _read_jsonl(out, 'collected')}
    outcome = {}
    for r in _read_jsonl(out, 'results'):
        prev = outcome.get(r['nodeid'])
        if prev is None or ORDER[r['outcome']] > ORDER[prev['outcome']]:
            outcome[r['nodeid']] = r
    return run, dict(collected, **{k: v for k, v in outcome.items() if k not in collected}), outcome


def summarize(*outs: Path) -> tuple:
    """The markdown table of the runs in ``outs`` (finished or not) and whether every case passed. A later run
    replaces the earlier runs' cases of the models it ran: all of them if it ran every kind (a model's kinds
    may change with its code), else those of the kinds it ran."""
    runs, cases, outcome = [], {}, {}
    for out in outs:
        run, run_cases, run_outcome = _read_run(out)
        every_kind = '*' in run.get('kinds', ['*'])

        def scope(case):  # what a case of this run replaces: its model's cases, or those of its model and kind
            return case['model'], None if every_kind else case['kind']

        ran = {scope(c) for c in run_cases.values()}
        replaced = [n for n, c in cases.items() if scope(c) in ran]
        for n in replaced:
            cases.pop(n)
            outcome.pop(n, None)
        cases.update(run_cases)
        outcome.update(run_outcome)
        runs.append((run, len(run_cases), len(replaced)))
    kinds = sorted({c['kind'] for c in cases.values()})
    cells = defaultdict(lambda: defaultdict(Counter))  # model -> kind -> Counter of cells
    for nodeid, case in cases.items():
        cells[case['model']][case['kind']][CELL[outcome[nodeid]['outcome'] if nodeid in outcome else None]] += 1
    short = [k.replace('test_model_', '') for k in kinds]

    def cell(counter):
        if not counter:
            return '-'
        return ', '.join(f'{k} x{n}' if n > 1 else k for k, n in sorted(counter.items()))

    lines = []
    for i, (run, n_cases, n_replaced) in enumerate(runs):
        if not run:
            continue
        merged = f'run {i + 1} of {len(runs)}, {n_cases} cases ({n_replaced} of the earlier replaced): ' \
            if len(runs) > 1 else ''
        lines += [f"{merged}timm {run['timm_version']}, `{Path(run['test_file']).name}` sha256 "
                  f"{run['test_file_sha256'][:12]}"
                  f"{', timm commit ' + run['timm_commit'][:12] if run.get('timm_commit') else ''}; vitblocks "
                  f"{_short(run.get('vitblocks_commit')) or 'source outside git'}; started {run['started']}; "
                  f"{run['models']} models, kinds {' '.join(run['kinds'])}, {run['jobs']} job(s) x "
                  f"{run['threads']} thread(s), {run['time_limit_s']:g} s per case.", '']
    totals = Counter(CELL[outcome[n]['outcome'] if n in outcome else None] for n in cases)
    lines += ['| test kind | cases | pass | FAIL | skip | not run |', '| --- | ---: | ---: | ---: | ---: | ---: |']
    for kind, name in zip(kinds, short):
        c = Counter(CELL[outcome[n]['outcome'] if n in outcome else None]
                    for n, case in cases.items() if case['kind'] == kind)
        lines.append(f"| `{name}` | {sum(c.values())} | {c['pass']} | {c['FAIL']} | {c['skip']} | {c['not run']} |")
    lines.append(f"| all | {sum(totals.values())} | {totals['pass']} | {totals['FAIL']} | {totals['skip']} "
                 f"| {totals['not run']} |")
    lines += ['', '| model | ' + ' | '.join(f'`{s}`' for s in short) + ' |', '| --- |' + ' --- |' * len(kinds)]
    for model in sorted(cells):
        lines.append(f'| `{model}` | ' + ' | '.join(cell(cells[model][k]) for k in kinds) + ' |')
    problems = [(n, outcome.get(n)) for n in sorted(cases) if n not in outcome or outcome[n]['outcome'] == 'failed']
    skipped = [(n, outcome[n]) for n in sorted(outcome) if outcome[n]['outcome'] == 'skipped']
    if problems:
        lines += ['', 'Failed or not run:', '']
        lines += [f"* `{n}`: {r['message'] if r else 'not run'}" for n, r in problems]
    if skipped:
        lines += ['', 'Skipped by timm:', '']
        lines += [f"* `{n}`: {r['message']}" for n, r in skipped]
    return '\n'.join(lines) + '\n', bool(cases) and not problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument('--timm-tests', type=Path, help="a timm checkout or its tests/ folder (nothing is fetched)")
    parser.add_argument('--models', nargs='+', default=[], metavar='PATTERN',
                        help='registered models to run (shell-style patterns); default: every registered model')
    parser.add_argument('--kinds', nargs='+', default=[], metavar='PATTERN',
                        help="test kinds to run, as timm's test names ('test_model_' may be left out) "
                             "(shell-style, e.g. 'default_cfgs*' 'forward'), run in this order ('default_cfgs*' '*': "
                             "those first, then the rest); default: every kind in timm's file order")
    parser.add_argument('--jobs', type=int, default=1, help='pytest processes side by side (default 1)')
    parser.add_argument('--threads', type=int, default=1, help='torch threads per process (default 1)')
    parser.add_argument('--time-limit', type=float, default=1200.,
                        help="seconds per case, replacing timm's own limits, which are sized for its CI "
                             'runners (default 1200)')
    parser.add_argument('--out', type=Path, default=Path('timm_conformance'), help='output folder (default '
                        './timm_conformance); an earlier run there is replaced')
    parser.add_argument('--summarize', type=Path, nargs='+', metavar='OUT',
                        help='print the table of the run in OUT, finished or not, and rewrite OUT/table.md; runs '
                             'nothing. Several OUT: one table, each later run replacing the earlier runs\' cases '
                             'of the models it ran (all their kinds if it ran every kind, else the kinds it ran); '
                             'written to the last OUT/table-merged.md')
    args = parser.parse_args(argv)
    if args.summarize is not None:
        if args.timm_tests is not None:
            parser.error('--summarize reads an earlier run and runs nothing; leave out --timm-tests')
        for out in args.summarize:
            if not any(out.glob('collected-*.jsonl')):
                parser.error(f'--summarize {out}: no collected-*.jsonl there; give the --out folder of a run')
        table, ok = summarize(*args.summarize)
        last = args.summarize[-1]
        (last / ('table.md' if len(args.summarize) == 1 else 'table-merged.md')).write_text(table)
        print(table, end='')
        return 0 if ok else 1
    if args.timm_tests is None:
        parser.error('--timm-tests PATH is required: the path of a timm checkout or of its tests/ folder')
    if args.jobs < 1 or args.threads < 1 or args.time_limit <= 0:
        parser.error(f'--jobs {args.jobs}, --threads {args.threads}, --time-limit {args.time_limit:g}: '
                     f'each must be positive')
    test_file = find_test_file(args.timm_tests.expanduser().resolve())
    models = select_models(args.models)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob('results-*.jsonl'), *out.glob('collected-*.jsonl'), *out.glob('shard-*.log'),
                out / 'table.md']:
        old.unlink(missing_ok=True)
    (out / 'run.json').write_text(json.dumps(describe_run(test_file, models, args), indent=1) + '\n')
    finished = run_shards(test_file, models, args, out)
    table, ok = summarize(out)
    (out / 'table.md').write_text(table)
    print(table, end='')
    print(f'written to {out / "table.md"}')
    return 0 if ok and finished else 1


if __name__ == '__main__':
    sys.exit(main())
