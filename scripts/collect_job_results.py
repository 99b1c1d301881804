"""Bring the NiNformer Table 1 runs of a GPU job's state file into docs/results and print their tables.

The Table 1 runs ``scripts/gpu_job.sh`` packs into ``gpu_job_state.tgz`` (``runs/gpu-t1*``: config, metrics, results
and log of each run, no checkpoints) go, per group of runs, to the folder the next job seeds from:

    runs/gpu-t1            -> docs/results/ninformer_table1_h100            Table 1
    runs/gpu-t1-torchinit  -> docs/results/ninformer_table1_h100_torchinit  NiNformer from PyTorch's default init
    runs/gpu-t1-seedN      -> docs/results/ninformer_table1_h100_seedN      the CIFAR-10 ViT row with seed N
    runs/gpu-t1-fp32       -> docs/results/ninformer_table1_h100_fp32       rechecks in full fp32
    runs/gpu-t1-clip       -> docs/results/ninformer_table1_h100_clip       rechecks with clip_grad=1.0

A finished run replaces the committed copy (and its unfinished copy); an unfinished one goes to the folder's
``_unfinished`` twin, unless a finished copy or an unfinished one further on is committed already. Each folder gets a
``table.md``, printed by ``vitblocks reproduce ninformer-table1 --no-train`` over the group's runs with the settings
that made them (the command is in the file). It also prints pytest's summary of the suite's CUDA cases the job ran
(``runs/gpu-t1-cudatests.txt``). The file's other members (the speed sweep, the GPU check) are left where they are.

Usage, in the repository root (it unpacks into ./runs and reads ./docs/results; ``.gpu_data`` must hold mnist/
and cifar10/ as in the job, e.g. ``ln -s /work/shared/data .gpu_data``, since a run's config names its data folder):

    python scripts/collect_job_results.py gpu_job_state.tgz [--docs docs/results] [--data-root .gpu_data]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / 'src'
sys.path.insert(0, str(SRC))
from vitblocks.experiments.runlog import read_metrics  # noqa: E402  (after the path: this checkout's vitblocks)

DATASET_ORDER = ('mnist', 'cifar10', 'cifar100')  # Table 1's columns
JOB_SET = ['deterministic=false', 'matmul_precision=high']  # what a GPU job's run computes with (gpu_job_settings.sh)
GROUPS = {  # run group -> (docs folder suffix, the --set values that made its runs, on top of JOB_SET)
    'gpu-t1': ('', []),
    'gpu-t1-torchinit': ('_torchinit', ['model_kwargs={block_cfg: {init: torch}}']),
    'gpu-t1-fp32': ('_fp32', ['matmul_precision=highest']),
    'gpu-t1-clip': ('_clip', ['clip_grad=1.0']),
}
SEED_GROUP = re.compile(r'gpu-t1-seed(\d+)$')
RUN_FILES = ('config.yaml', 'metrics.csv', 'results.json', 'curves.png', 'eval_train_augment.json')


def group_settings(group: str):
    """(docs folder suffix, --set values) of a run group, or None for a folder that is no group."""
    if group in GROUPS:
        suffix, extra = GROUPS[group]
        return suffix, JOB_SET + extra
    seed = SEED_GROUP.match(group)
    return (f'_seed{seed[1]}', JOB_SET + [f'seed={seed[1]}']) if seed else None


def unpack(archive: Path, into: Path) -> Path:
    """Extract the ``runs/gpu-t1*`` members of ``archive`` under ``into``; refuse a member outside ``runs/``."""
    if not archive.is_file():
        sys.exit(f'collect_job_results: {archive}: no such file (the gpu_job_state.tgz a GPU job left in $OUT)')
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            bad = [m.name for m in members if not re.match(r'runs($|/)', m.name) or '..' in m.name
                   or not (m.isfile() or m.isdir())]
            if bad:
                sys.exit(f'collect_job_results: {archive} holds {bad[0]!r}: not a GPU job\'s state (runs/...)')
            table1 = [m for m in members if re.match(r'runs($|/gpu-t1[^/]*(/|$))', m.name)]
            tar.extractall(into, members=table1, filter='data')
    except (tarfile.TarError, EOFError, OSError) as e:
        sys.exit(f'collect_job_results: {archive} is not a readable tar.gz ({e}); copy it again from the job\'s $OUT')
    return into / 'runs'


def last_epoch(run: Path) -> float:
    """The epoch of a run's last test evaluation (0 if none)."""
    metrics = run / 'metrics.csv'
    epochs = [float(r['epoch']) for r in read_metrics(metrics) if r['split'] == 'val'] if metrics.is_file() else []
    return epochs[-1] if epochs else 0.


def place(run: Path, log: Path, dest: Path, unfinished: Path) -> str:
    """Copy one run (``ds/model`` under its group) into ``dest`` or ``unfinished``; say what was done."""
    rel = Path(run.parent.name) / run.name
    finished = (run / 'results.json').is_file()
    if finished:
        target = dest / rel
        if target.is_dir() and (target / 'results.json').is_file() and \
                (target / 'results.json').read_bytes() == (run / 'results.json').read_bytes():
            return f'{rel}: finished, committed already'
        shutil.rmtree(unfinished / rel, ignore_errors=True)
    else:
        if (dest / rel / 'results.json').is_file():
            return f'{rel}: unfinished here, finished in {dest}: kept that'
        target = unfinished / rel
        here, committed = last_epoch(run), last_epoch(target)
        if committed >= here > 0 or here == 0:
            return f'{rel}: unfinished at epoch {here:g}, committed copy at {committed:g}: kept that'
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in RUN_FILES:
        if (run / name).is_file():
            shutil.copy2(run / name, target / name)
    if log.is_file():
        shutil.copy2(log, target.parent / log.name)
    state = 'finished' if finished else f'unfinished at epoch {last_epoch(run):g}'
    return f'{rel}: {state} -> {target}'


def print_table(group_dir: Path, settings, data_root: str) -> str:
    """The group's table, as ``reproduce ninformer-table1 --no-train`` prints it, after its command."""
    runs = sorted(p.parent for p in group_dir.glob('*/*/config.yaml'))
    found = {r.parent.name for r in runs}
    datasets = ','.join(sorted(found, key=lambda d: (DATASET_ORDER + (d,)).index(d)))
    models = ','.join(dict.fromkeys(r.name.rsplit('_', 1)[0] for r in runs))  # without the input size: any dataset
    args = ['reproduce', 'ninformer-table1', '--datasets', datasets, '--models', models, '--data-root', data_root,
            '--output', group_dir.as_posix(), '--md', '--no-train', '--set', *settings]
    out = subprocess.run([sys.executable, '-m', 'vitblocks', *args], capture_output=True, text=True,
                         env={**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, (str(SRC), os.environ.get(
                             'PYTHONPATH'))))})
    command = ' '.join(['vitblocks'] + [f'"{a}"' if ' ' in a else a for a in args])
    if out.returncode != 0:
        sys.exit(f'collect_job_results: {command} failed:\n{out.stderr.strip()[-2000:]}')
    return f'{command}\n\n{out.stdout.strip()}\n'


def augmented_table(group_dir: Path) -> str:
    """Each run's top-1 through its training augmentation (``eval_train_augment.json``, written in the job by
    ``vitblocks eval --train-augment``: how the authors' script measures) beside its clean final top-1."""
    rows = []
    for f in sorted(group_dir.glob('*/*/eval_train_augment.json')):
        res = json.loads(f.read_text())
        (clean,) = res['results'].values()
        aug = res['train_augment']
        passes = ', '.join(f'{p["top1"]:.2f}' for p in aug['passes'])
        rows.append(f'| {f.parent.parent.name}/{f.parent.name} | {clean["top1"]:.2f} | {aug["top1_mean"]:.2f} '
                    f'| {aug["top1_mean"] - clean["top1"]:+.2f} | {passes} |')
    if not rows:
        return ''
    return ('Top-1 through the training augmentation (random crops and flips of the test images, as the authors\' '
            'script evaluates; `vitblocks eval --train-augment 3` in the GPU job):\n\n'
            '| run | clean % | augmented % (mean) | difference | passes |\n| --- | ---: | ---: | ---: | --- |\n'
            + '\n'.join(rows) + '\n')


def cuda_tests_line(report: Path) -> str:
    """One line on the suite's CUDA cases the job ran (pytest's summary, the report's last line)."""
    if not report.is_file():
        return 'CUDA tests: no report in the archive (the job ended before they did)'
    lines = report.read_text(errors='replace').strip().splitlines()
    summary = lines[-1].strip('= ') if lines else 'an empty report'
    return f'CUDA tests: {summary} (runs/{report.name})'


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('archive', type=Path, help="a GPU job's gpu_job_state.tgz")
    ap.add_argument('--docs', type=Path, default=Path('docs/results'), help='where the committed runs live')
    ap.add_argument('--data-root', default='.gpu_data', help='the data folder the runs name (default .gpu_data)')
    args = ap.parse_args(argv)
    if not Path(args.data_root).is_dir():
        sys.exit(f'collect_job_results: {args.data_root}/ not found in {Path.cwd()}: the runs name their data as '
                 f'{args.data_root}/<dataset>; link the shards there, e.g. ln -s /work/shared/data {args.data_root}')
    runs_here = Path('runs')
    with tempfile.TemporaryDirectory() as tmp:
        unpacked = unpack(args.archive, Path(tmp))
        groups = sorted(p for p in unpacked.iterdir() if p.is_dir() and group_settings(p.name))
        if not groups:
            sys.exit(f'collect_job_results: {args.archive} holds no Table 1 run group (runs/gpu-t1, '
                     f'runs/gpu-t1-torchinit, ...)')
        for group in groups:  # into runs/ of this checkout, where the printed commands read them
            shutil.rmtree(runs_here / group.name, ignore_errors=True)
            shutil.copytree(group, runs_here / group.name)
        for extra in unpacked.glob('gpu-t1*.txt'):
            shutil.copy2(extra, runs_here / extra.name)
    print(cuda_tests_line(runs_here / 'gpu-t1-cudatests.txt'))
    env_file = runs_here / 'gpu-t1-env.txt'  # the job machine's GPU, driver, torch and timm
    env = '; '.join(env_file.read_text().split('\n')).strip('; ') if env_file.is_file() else ''
    for group in groups:
        suffix, settings = group_settings(group.name)
        local = runs_here / group.name
        dest = args.docs / f'ninformer_table1_h100{suffix}'
        unfinished = args.docs / f'ninformer_table1_h100{suffix}_unfinished'
        print(f'## {group.name} -> {dest}')
        for run in sorted(p.parent for p in local.glob('*/*/config.yaml')):
            print('  ' + place(run, run.parent / f'{run.name}.log', dest, unfinished))
        table = print_table(local, settings, args.data_root)
        augmented = augmented_table(local)
        print(table + (f'\n{augmented}' if augmented else ''))
        for plot in local.glob('*/tradeoff.png'):
            (dest / plot.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(plot, dest / plot.parent.name / plot.name)
        if dest.is_dir():
            (dest / 'table.md').write_text(f'<!-- printed by collect_job_results.py from {args.archive.name}'
                                           f'{" (" + env + ")" if env else ""}:\n{table.splitlines()[0]}\n'
                                           f'finished runs here, unfinished in ../{unfinished.name}/ -->\n\n'
                                           + '\n'.join(table.splitlines()[2:]) + '\n'
                                           + (f'\n{augmented}' if augmented else ''))
    return 0


if __name__ == '__main__':
    sys.exit(main())
