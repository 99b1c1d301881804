"""scripts/gpu_job.sh: the evidence and speed suites inside a GPU job with a wall-clock limit, resumed in the next
job from one state file; dry-run on the CPU.

What a user relies on: the job outlives the call that started it and a second call watches it instead of starting
another; Table 1 gets the job's time less a margin, and no wave starts that cannot finish in what is left; the one
state file holds every step, and the next job resumes from it (finished runs reused, not retrained). The slow tests
run eight training processes and the sweep's models on two CPU cores.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tests'))


@pytest.fixture(autouse=True)
def _no_gpu_job_outlives_its_test(tmp_path):
    """The job leads its own process session, so a failed test would leave it and its training processes running
    (a second dry run beside it doubled the memory in use): its process group is killed after each test."""
    yield
    try:
        os.killpg(int((tmp_path / 'runs/gpu_job.pid').read_text()), signal.SIGKILL)
    except (OSError, ValueError):  # no job, or it ended already
        pass


@pytest.mark.slow
def test_the_gpu_job_outlives_its_call_and_packs_every_step_into_one_state_file(tmp_path):
    from _train_helpers import write_shards
    for name, size, channels in (('mnist', 28, 1), ('cifar10', 32, 3)):
        write_shards(tmp_path / 'data' / name, 'train', n=128, per_shard=128, size=size, channels=channels,
                     num_classes=10)
        write_shards(tmp_path / 'data' / name, 'test', n=32, per_shard=32, size=size, channels=channels,
                     num_classes=10, seed=1)
    for d in ('src', 'scripts', 'docs', 'tests', 'benchmarks'):
        (tmp_path / d).symlink_to(ROOT / d)
    (tmp_path / 'out').mkdir()
    env = {**os.environ, 'OUT': str(tmp_path / 'out'), 'PYTHON': sys.executable,
           'T1_FLAGS': '--device cpu --data-root data --threads 1 --max-steps 1 --set progress=none tensorboard=false',
           'SWEEP_FLAGS': '--device cpu --img-size 32 --batches 1 --precisions fp32 --compile eager --warmup 0 '
                          '--repeats 1 --groups deit_tiny',
           'CHECK_FLAGS': '--device cpu --tiny --models iffn_deit_tiny_patch16_224 --steps env models summary',
           'TRITON_INTERPRET': '1', 'T1_SEED': '',  # the committed GPU runs: not these runs'
           'EVAL_FLAGS': '--device cpu --threads 1', 'T1_TIME_LIMIT': '3000'}  # every wave starts, slow CPU or not

    def call(seconds):
        return subprocess.run(['bash', 'scripts/gpu_job.sh', str(seconds)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)

    first = call(1)  # returns long before eight training processes can finish
    assert 'GPU job started' in first.stdout and 'GPU job: still running' in first.stdout, first.stdout
    pid = int((tmp_path / 'runs/gpu_job.pid').read_text())
    time.sleep(2)
    os.kill(pid, 0)  # still alive after its call returned (raises if not)
    second = call(800)
    assert f'GPU job running (pid {pid}), watching it' in second.stdout, second.stdout
    assert 'Table 1: 8 of 8 runs finished' in second.stdout and 'GPU job: done' in second.stdout, \
        second.stdout + (tmp_path / 'runs/gpu-t1.log').read_text()[-3000:]
    log = (tmp_path / 'runs/gpu_job.log').read_text()
    assert 'table1 exit 0' in log
    for wave in ('1 (cifar10 NiNformer torchinit first)', '2 (mnist MlpMixer,NiNformer -)',
                 '3 (cifar10 ViT seeds first)', '4 (mnist,cifar10 - torchinit,seeds)'):
        assert f'table1 wave {wave} exit 0' in log, log
    assert 'mps: not available (no nvidia-cuda-mps-control)' in log  # tried before Table 1; none on a CPU
    # the ablations ran in Table 1's pool (no process for a finished run), each printed its own table
    t1_log = (tmp_path / 'runs/gpu-t1.log').read_text()
    for name, run in (('torchinit', 'cifar10/ninformer_vit_patch4_32'), ('seed1', 'cifar10/ninformer_baseline_vit_'
                                                                                  'patch4_32')):
        assert f'started {name}:{run} (log runs/gpu-t1-{name}/{run}.log)' in t1_log, t1_log
        assert f'NiNformer Table 1, ablation {name} (' in t1_log
    # the first wave: the init ablation started before the row it tests (--ablations-first)
    assert t1_log.index('started torchinit:cifar10/ninformer_vit_patch4_32') < \
        t1_log.index('started cifar10/ninformer_vit_patch4_32')
    # the CUDA cases ran (skipped here, on the CPU: the DDP vote, 3 per blocks-benchmark configuration + 3 + 1 of
    # tests/test_on_device.py) and their report is packed
    assert 'cuda tests exit 0' in log
    from vitblocks.models.blocks_bench import BLOCK_CONFIGS
    assert f'{3 * len(BLOCK_CONFIGS) + 5} skipped' in (tmp_path / 'runs/gpu-t1-cudatests.txt').read_text()
    assert 'GPU check exit 0' in log and 'sweep exit 0' in log
    # the committed H100 sweep was seeded in, refused on this other setup, and set aside, not mixed in
    assert (tmp_path / 'runs/gpu_speed-other-setup/env.json').is_file()
    assert json.loads((tmp_path / 'runs/gpu_speed/env.json').read_text())['img_size'] == 32
    assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == ['gpu_job_state.tgz']  # the one state file
    with tarfile.open(tmp_path / 'out/gpu_job_state.tgz') as tar:
        names = tar.getnames()
        summary = tar.extractfile('runs/gpu_check/summary.md').read().decode()
    assert not any(n.endswith('.pth') for n in names)
    assert sum(n.startswith('runs/gpu-t1/') and n.endswith('/results.json') for n in names) == 8
    # one-step runs are far below the paper: every row is rerun in full fp32; none diverged, so none with clipping
    assert len((tmp_path / 'runs/gpu-t1-rechecks.txt').read_text().splitlines()) == 8
    assert sum(n.startswith('runs/gpu-t1-fp32/') and n.endswith('/results.json') for n in names) == 8
    assert not any(n.startswith('runs/gpu-t1-clip') for n in names)
    # every run finished on the machine also evaluated through its training augmentation (the authors' way)
    finished = [n[:-len('results.json')] for n in names if n.endswith('/results.json')]
    assert len(finished) == 19 and 'evaluated 19 run(s) through the training augmentation' in log
    for run in finished:
        aug = json.loads((tmp_path / run / 'eval_train_augment.json').read_text())['train_augment']
        assert len(aug['passes']) == 3 and f'{run}eval_train_augment.json' in names
    fp32 = yaml.safe_load((tmp_path / 'runs/gpu-t1-fp32/mnist/ninformer_vit_patch4_28/config.yaml').read_text())
    assert fp32['matmul_precision'] == 'highest' and 'rechecks: 8 row(s) rerun' in log
    assert 'rechecks (8 ablation runs finished):' in second.stdout
    # beside Table 1, CIFAR-10's NiNformer row from PyTorch's default init (the authors' script)
    assert 'runs/gpu-t1-torchinit/cifar10/ninformer_vit_patch4_32/results.json' in names
    ablation = yaml.safe_load((tmp_path / 'runs/gpu-t1-torchinit/cifar10/ninformer_vit_patch4_32/config.yaml')
                              .read_text())
    assert ablation['model_kwargs'] == {'block_cfg': {'init': 'torch'}} and ablation['mlp_drop'] == 0.5
    # and the CIFAR-10 ViT row with seeds 1 and 2, its seed spread
    for seed in (1, 2):
        run = f'runs/gpu-t1-seed{seed}/cifar10/ninformer_baseline_vit_patch4_32'
        assert f'{run}/results.json' in names
        cfg = yaml.safe_load((tmp_path / run / 'config.yaml').read_text())
        assert (cfg['seed'], cfg['mlp_drop'], cfg['model']) == (seed, 0.5, 'ninformer_baseline_vit_patch4_32')
    # each run's progress line (its last test row), and no stop record: none stopped early
    assert 'runs/gpu-t1/cifar10/ninformer_vit_patch4_32/metrics.csv 1,' in second.stdout
    assert '  stopped: ' not in second.stdout
    assert 'runs/gpu_speed/fp32-eager-b1/deit_tiny.json' in names
    assert '| iffn_deit_tiny_patch16_224 | deit_tiny_patch16_224 |' in summary, summary
    third = call(5)  # nothing left: no new job
    assert 'GPU job finished in an earlier call' in third.stdout
    assert (tmp_path / 'runs/gpu_job.log').read_text().count('GPU job started') == 1


def _job_dir(tmp_path):
    for d in ('src', 'scripts'):
        (tmp_path / d).symlink_to(ROOT / d)
    return tmp_path


def _finished_or_not(root, runs):
    for run, finished in runs.items():
        (root / run).mkdir(parents=True)
        for name in ('config.yaml', 'metrics.csv') + (('results.json',) if finished else ()):
            (root / run / name).write_text(f'{run} {name}')


def test_a_fresh_job_reuses_the_committed_finished_runs(tmp_path):
    """A job on a fresh machine with no earlier state file starts from the runs committed finished (Table 1's,
    the init ablation's and the ViT seeds'), each in the folder its command writes, so only the rest train; an
    unfinished one, whose checkpoint never left its machine, is not copied."""
    job = _job_dir(tmp_path)
    seed = job / 'seed'
    _finished_or_not(seed, {'cifar10/ninformer_baseline_vit_patch4_32': True, 'mnist/ninformer_vit_patch4_28': False})
    _finished_or_not(job / 'seed_torchinit', {'cifar10/ninformer_vit_patch4_32': True})
    _finished_or_not(job / 'seed_seed2', {'cifar10/ninformer_baseline_vit_patch4_32': True})
    env = {**os.environ, 'PYTHON': sys.executable, 'T1_SEED': 'seed'}
    out = subprocess.run(['bash', 'scripts/gpu_job.sh', '--unpack-only'], cwd=job, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    runs = job / 'runs'
    assert sorted(p.relative_to(runs).as_posix() for p in runs.rglob('results.json')) == [
        'gpu-t1-seed2/cifar10/ninformer_baseline_vit_patch4_32/results.json',
        'gpu-t1-torchinit/cifar10/ninformer_vit_patch4_32/results.json',
        'gpu-t1/cifar10/ninformer_baseline_vit_patch4_32/results.json']
    assert (runs / 'gpu-t1/cifar10/ninformer_baseline_vit_patch4_32/metrics.csv').read_text() == \
        'cifar10/ninformer_baseline_vit_patch4_32 metrics.csv'
    assert not (runs / 'gpu-t1/mnist').exists()
    log = (runs / 'gpu_job.log').read_text()
    assert 'reused committed run runs/gpu-t1/cifar10/ninformer_baseline_vit_patch4_32' in log
    assert not (runs / 'gpu_job.pid').exists()  # --unpack-only starts no job


def test_the_next_job_resumes_from_the_state_file_not_the_committed_runs(tmp_path):
    """The state file an earlier job left wins over the committed runs: its finished runs are reused, its
    unfinished ones (whose checkpoints stayed on their machine) start over, and its sweep is kept."""
    job = _job_dir(tmp_path)
    _finished_or_not(job / 'seed', {'cifar10/ninformer_baseline_vit_patch4_32': True})
    _finished_or_not(job / 'earlier/runs/gpu-t1', {'mnist/ninformer_vit_patch4_28': True,
                                                     'cifar10/ninformer_vit_patch4_32': False})
    (job / 'earlier/runs/gpu_speed/fp32-eager-b128').mkdir(parents=True)
    (job / 'earlier/runs/gpu_speed/fp32-eager-b128/deit_tiny.json').write_text('[]')
    (job / '.gpu_state').mkdir()
    with tarfile.open(job / '.gpu_state/gpu_job_state.tgz', 'w:gz') as tar:
        tar.add(job / 'earlier/runs', arcname='runs')
    env = {**os.environ, 'PYTHON': sys.executable, 'T1_SEED': 'seed'}
    subprocess.run(['bash', 'scripts/gpu_job.sh', '--unpack-only'], cwd=job, env=env, check=True, timeout=60)
    assert [p.relative_to(job / 'runs').as_posix() for p in (job / 'runs').rglob('results.json')] == [
        'gpu-t1/mnist/ninformer_vit_patch4_28/results.json']
    assert not (job / 'runs/gpu-t1/cifar10/ninformer_vit_patch4_32').exists()
    assert (job / 'runs/gpu_speed/fp32-eager-b128/deit_tiny.json').read_text() == '[]'


def test_the_committed_table1_runs_are_the_ones_a_fresh_job_reuses():
    """What a fresh job seeds from: finished runs of the current recipe, each with what a reuse reads."""
    seed = ROOT / 'docs/results/ninformer_table1_h100'
    runs = sorted(p.parent for p in seed.glob('*/*/results.json'))
    assert len(runs) >= 5
    for run in runs:
        cfg = yaml.safe_load((run / 'config.yaml').read_text())
        assert (cfg['recipe'], cfg['epochs'], cfg['mlp_drop'], cfg['amp'], cfg['data']) == \
            ('ninformer', 100, 0.5, False, f'.gpu_data/{run.parent.name}')
        assert json.loads((run / 'results.json').read_text())['epochs'] == 100.0


@pytest.mark.slow
def test_a_late_machine_skips_table1_for_the_speed_sweep(tmp_path):
    """A job started with less than T1_MIN seconds left cannot finish any Table 1 run: it trains nothing and
    goes straight to the speed measurements."""
    for d in ('src', 'scripts', 'docs'):
        (tmp_path / d).symlink_to(ROOT / d)
    (tmp_path / 'out').mkdir()
    env = {**os.environ, 'OUT': str(tmp_path / 'out'), 'PYTHON': sys.executable, 'T1_TIME_LIMIT': '200',
           'T1_SEED': '', 'CHECK_FLAGS': 'none',
           'SWEEP_FLAGS': '--device cpu --img-size 32 --batches 1 --precisions fp32 --compile eager --warmup 0 '
                          '--repeats 1 --groups deit_tiny'}
    out = subprocess.run(['bash', 'scripts/gpu_job.sh', '600'], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    assert 'GPU job: done' in out.stdout and 'Table 1: 0 of 8 runs finished' in out.stdout, out.stdout + out.stderr
    log = (tmp_path / 'runs/gpu_job.log').read_text()
    assert 'table1 skipped: T1_TIME_LIMIT 200 s < T1_MIN 400 s' in log and 'sweep exit 0' in log, log
    assert 'table1 exit' not in log and 'mps:' not in log  # nothing to share the GPU between
    assert not list((tmp_path / 'runs').glob('gpu-t1*/*/*/config.yaml'))  # nothing trained


def _fake_python(tmp_path):
    """A Python that runs ``-c`` code (the job's start, the versions line) and only records every other command
    (Table 1's waves, the rechecks, the sweep), one argv a line in calls.txt; a Table 1 wave takes 5 s."""
    calls = tmp_path / 'calls.txt'
    return _fake(tmp_path / 'python', f'[ "$1" = -c ] && exec {sys.executable} "$@"\n'
                                      f'printf "%s|" "$@" >> {calls}; echo >> {calls}\n'
                                      'case "$*" in *reproduce*) sleep 5;; esac\n'), calls


def test_table1_gets_the_jobs_time_less_a_margin_and_no_wave_starts_that_cannot_finish(tmp_path):
    """What is left of the job's wall-clock limit (JOB_SECONDS, 15 minutes by default) less 300 s is Table 1's
    time limit; the first wave, the CIFAR-10 NiNformer row with its init ablation started first, gets all of it,
    and a wave is not started with less than T1_MIN left."""
    job = _job_dir(tmp_path)
    python, calls = _fake_python(tmp_path)
    env = {**os.environ, 'PYTHON': python, 'T1_MPS': '0', 'CHECK_FLAGS': 'none', 'CUDA_TESTS': 'none',
           'JOB_SECONDS': '305', 'T1_MIN': '1'}
    out = subprocess.run(['bash', 'scripts/gpu_job.sh', '60'], cwd=job, env=env, capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert 'GPU job: done' in out.stdout, out.stdout + out.stderr
    reproduce = [c.split('|')[:-1] for c in calls.read_text().splitlines() if 'reproduce' in c]
    assert len(reproduce) == 1, reproduce  # 5 s of the 5: no time for the next wave
    argv = reproduce[0]
    assert argv[argv.index('--datasets') + 1:argv.index('--datasets') + 4] == ['cifar10', '--models', 'NiNformer']
    assert argv[argv.index('--time-limit') + 1] in ('5', '4')  # 305 s less 300, less the second it may have taken
    assert argv[-5:] == ['--ablation', 'torchinit', 'cifar10/NiNformer', 'model_kwargs={block_cfg: {init: torch}}',
                         '--ablations-first']
    log = (job / 'runs/gpu_job.log').read_text()
    assert 'table1 wave 1 (cifar10 NiNformer torchinit first) exit 0' in log
    for wave in ('2 (mnist MlpMixer,NiNformer -)', '3 (cifar10 ViT seeds first)',
                 '4 (mnist,cifar10 - torchinit,seeds)'):
        assert re.search(rf'table1 wave {re.escape(wave)} not started: -?\d+ s left < T1_MIN 1 s', log), log
    assert 'sweep exit 0' in log  # then the speed measurements


@pytest.mark.parametrize('waves', ['cifar10 NiNformer torchnit', 'cifar10 NiNformer torchinit last', 'cifar10 ViT',
                                   'mnist - -; cifar10 ViT seeds,init'])
def test_a_wrong_wave_is_the_calls_error_before_any_job_starts(tmp_path, waves):
    job = _job_dir(tmp_path)
    python, calls = _fake_python(tmp_path)
    out = subprocess.run(['bash', 'scripts/gpu_job.sh', '60'], cwd=job, env={**os.environ, 'PYTHON': python,
                         'T1_WAVES': waves}, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "is not 'DATASETS ROWS ABLATIONS [first]'" in out.stderr, out.stderr
    assert not (job / 'runs').exists() and not calls.exists()


def _fake(path, body):
    path.write_text('#!/bin/bash\n' + body)
    path.chmod(0o755)
    return str(path)
