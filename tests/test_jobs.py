"""`run_jobs` and `reproduce --time-limit`: runs in child processes, paused so that as many as fit finish.

The scheduler tests use stand-in runs (``FAKE_RUN`` below): processes that write ``metrics.csv`` rows
like a training run, share one "device" (each step takes ``step_s`` times the number of stand-ins
going, as runs sharing a GPU do), save a checkpoint and exit 130 on SIGINT, and resume from it.
"""
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from vitblocks.cli import main
from vitblocks.experiments.checkpoint import load_checkpoint
from vitblocks.reproduce.jobs import (Job, remaining_seconds, run_jobs, run_to_pause, shared_finish,
                                       time_limit_window)
from vitblocks.reproduce.ninformer_table1 import ninformer_own_models

ROOT = Path(__file__).resolve().parents[1]

FAKE_RUN = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path
    run_dir, total, step_s, share = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4])
    save_s = float(sys.argv[5])  # how long saving its checkpoint takes once it is asked to stop
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / 'config.yaml').write_text('epochs: 1\\nmax_steps: null\\n')
    last = run_dir / 'last.txt'
    step, elapsed = map(float, last.read_text().split()) if last.exists() else (0, 0.0)
    step = int(step)
    metrics = run_dir / 'metrics.csv'
    if not metrics.exists():
        metrics.write_text('step,epoch,split,loss,top1,top5,lr,images_per_s,elapsed_s\\n')
    stop = []
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))
    me = share / str(os.getpid())
    me.touch()
    t0 = time.monotonic() - elapsed
    while step < total:
        time.sleep(step_s * len(list(share.iterdir())))  # the device is shared by every stand-in going
        step += 1
        with open(metrics, 'a') as f:
            f.write(f'{step},{step / total:.4f},train,1.0,,,0.001,1.0,{time.monotonic() - t0:.4f}\\n')
        if stop:
            time.sleep(save_s)  # still holding its share of the device
            (run_dir / 'last.txt').write_text(f'{step} {time.monotonic() - t0}')
            me.unlink()
            sys.exit(130)
    (run_dir / 'results.json').write_text('{}')
    me.unlink()
''')


@pytest.fixture
def fake_jobs(tmp_path):
    script, share = tmp_path / 'fake_run.py', tmp_path / 'device'
    script.write_text(FAKE_RUN)
    share.mkdir()

    def make(*steps, step_s=0.03, priority=(), save_s=0.0):
        def argv(i, n):
            run_dir = tmp_path / f'run{i}'
            return [sys.executable, str(script), str(run_dir), str(n), str(step_s), str(share), str(save_s)]
        return [Job(f'run{i}', argv(i, n), tmp_path / f'run{i}.log', tmp_path / f'run{i}', priority=int(i in priority))
                for i, n in enumerate(steps)]
    return make


def write_metrics(run_dir, rows, epochs=10, max_steps=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / 'config.yaml').write_text(yaml.safe_dump({'epochs': epochs, 'max_steps': max_steps}))
    lines = ['step,epoch,split,loss,top1,top5,lr,images_per_s,elapsed_s']
    lines += [f'{s},{s / 100:.4f},{split},1.0,,,,,{t}' for s, split, t in rows]
    (run_dir / 'metrics.csv').write_text('\n'.join(lines) + '\n')


def test_remaining_seconds_is_the_steps_left_at_the_pace_of_the_last_window(tmp_path):
    run = tmp_path / 'run'
    # 100 steps per epoch, 10 epochs: 1000 steps. 10 steps/s for the first 20 s, then 20 steps/s (the run
    # beside it finished); the evaluation rows (split val) count like any other
    rows = [(10 * t, 'train', t) for t in range(1, 21)] + [(200 + 20 * t, 'train', 20 + t) for t in range(1, 16)]
    rows.append((500, 'val', 35.0))
    write_metrics(run, rows)
    assert remaining_seconds(run, window=10) == pytest.approx(500 / 20)
    assert remaining_seconds(run, window=17) == pytest.approx(500 / (320 / 17))  # steps 180 -> 500 in 17 s
    assert remaining_seconds(run, window=18) is None  # 34 s of rows (1 s to 35 s): the first window is warm-up
    # only this attempt's rows: resumed from step 300, the pace before it does not count
    assert remaining_seconds(run, after_step=300, window=4) == pytest.approx(25.0)
    assert remaining_seconds(run, after_step=300, window=5) is None  # 9 s of rows after step 300
    write_metrics(run, rows, max_steps=600)  # a step budget ends it earlier
    assert remaining_seconds(run, window=10) == pytest.approx(100 / 20)
    write_metrics(run, rows, epochs=5)
    assert remaining_seconds(run, window=10) == 0  # at step 500 of 500
    (run / 'metrics.csv').write_text((run / 'metrics.csv').read_text() + '510,5.1')  # a row being written
    assert remaining_seconds(run, window=10) == 0
    assert remaining_seconds(tmp_path / 'none', window=10) is None


def test_run_to_pause_is_the_run_furthest_from_its_end_once_the_runs_would_miss_the_limit():
    # projections at the pace of all of them going: on a shared device the last ends after the sum of
    # their times alone (100/2 + 300/2 = 200 s)
    assert shared_finish({'a': 100.0, 'b': 300.0}, 2) == 200
    assert run_to_pause({'a': 100.0, 'b': 300.0}, 400.0) is None
    assert run_to_pause({'a': 100.0, 'b': 300.0, 'c': 900.0}, 400.0) == 'c'  # 433 s
    assert run_to_pause({'a': 500.0, 'b': 300.0}, 400.0) is None  # b ends at 300 s, a then alone at 400 s
    assert run_to_pause({'a': 500.0, 'b': 300.0}, 390.0) == 'a'
    assert run_to_pause({'a': None, 'b': 300.0}, 400.0) is None  # no pace yet: not judged
    assert run_to_pause({'a': None, 'b': 900.0}, 400.0) == 'b'
    assert run_to_pause({}, 400.0) is None
    # a run of higher priority (NiNformer's own model in its Table 1) is paused only after the others
    assert run_to_pause({'a': 100.0, 'b': 300.0, 'c': 900.0}, 400.0, {'c': 1}) == 'b'
    assert run_to_pause({'c': 900.0}, 400.0, {'c': 1}) == 'c'
    assert ninformer_own_models(['mnist', 'cifar10']) == ['ninformer_vit_patch4_28', 'ninformer_vit_patch4_32']
    assert time_limit_window(1560) == 60 and time_limit_window(100) == 5 and time_limit_window(10) == 1


def test_a_run_paused_while_it_starts_is_paused_not_failed(tmp_path):
    # SIGINT before a run sets its handler (importing torch, decoding its data: seconds on a loaded machine)
    # ends it through Python's KeyboardInterrupt, exit -2; it had not trained, and a rerun resumes it
    starting = tmp_path / 'starting.py'
    starting.write_text('import time\ntime.sleep(60)\n')
    job = Job('slow', [sys.executable, str(starting)], tmp_path / 'slow.log', tmp_path / 'slow')
    lines = []
    report = run_jobs([job], parallel=1, threads=1, time_limit=0.5, window=0.1, poll=0.05, echo=lines.append)
    assert report.paused == [job] and not report.failed, lines
    assert 'paused slow (stopped while starting, before its first step)' in lines


def test_a_pool_started_in_the_background_of_a_script_still_pauses_a_starting_run(tmp_path):
    """bash starts a script's ``cmd &`` with SIGINT ignored, and a run would inherit that: paused before it sets
    its own handler, it would go on until killed after the limit's grace. The pool gives its runs SIGINT back."""
    starting = tmp_path / 'starting.py'
    starting.write_text('import time\ntime.sleep(60)\n')
    pool = (f'import sys; sys.path.insert(0, {str(ROOT / "src")!r})\n'
            'from pathlib import Path\n'
            'from vitblocks.reproduce.jobs import Job, run_jobs\n'
            f'job = Job("slow", [sys.executable, {str(starting)!r}], Path({str(tmp_path / "slow.log")!r}), '
            f'Path({str(tmp_path / "slow")!r}))\n'
            'report = run_jobs([job], parallel=1, threads=1, time_limit=0.5, window=0.1, poll=0.05)\n'
            'print("paused", [j.name for j in report.paused], "failed", [j.name for j in report.failed])\n')
    (tmp_path / 'pool.py').write_text(pool)
    t0 = time.monotonic()
    out = subprocess.run(['bash', '-c', f'{sys.executable} {tmp_path / "pool.py"} & wait'], capture_output=True,
                         text=True, timeout=120)
    assert "paused ['slow'] failed []" in out.stdout, out.stdout + out.stderr
    assert 'stopped while starting, before its first step' in out.stdout
    assert time.monotonic() - t0 < 30  # not the 60 s the run sleeps


def test_time_limit_pauses_the_longest_run_so_that_the_others_finish(fake_jobs):
    # 1.5 s, 3 s and 12 s of device time alone: 16.5 s in all. A paused run takes 1.5 s (3 windows) to save
    # and stop: until it has, the pace of the others still has it beside them, and no other run is judged
    jobs = fake_jobs(50, 100, 400, save_s=1.5)
    lines = []
    report = run_jobs(jobs, parallel=3, threads=1, time_limit=6, window=0.5, poll=0.05, echo=lines.append)
    assert [j.name for j in report.paused] == ['run2'] and not report.failed and not report.not_started, lines
    assert (jobs[0].run_dir / 'results.json').exists() and (jobs[1].run_dir / 'results.json').exists()
    step, _ = (jobs[2].run_dir / 'last.txt').read_text().split()
    assert 0 < int(step) < 400 and not (jobs[2].run_dir / 'results.json').exists()  # its checkpoint is kept
    assert any(ln.startswith('pausing run2: the 3 runs going are projected to need') for ln in lines), lines
    assert 'paused run2' in lines and not any(ln.startswith('resumed') for ln in lines)  # 12 s never fit
    assert [ln for ln in lines if ln.startswith('finished')] == ['finished run0: exit 0', 'finished run1: exit 0']


def test_a_run_of_higher_priority_is_paused_after_the_others_even_if_it_needs_more(fake_jobs):
    jobs = fake_jobs(300, 200, priority=[0])  # 9 s and 6 s alone: together past the limit, run0 alone not
    lines = []
    report = run_jobs(jobs, parallel=2, threads=1, time_limit=12, window=0.5, poll=0.05, echo=lines.append)
    assert [j.name for j in report.paused] == ['run1'] and (jobs[0].run_dir / 'results.json').exists(), lines
    assert any(ln.startswith('pausing run1: ') and 'the most of the runs of its priority' in ln for ln in lines), lines


def test_a_paused_run_resumes_when_the_runs_going_end_sooner_than_projected(fake_jobs, tmp_path):
    # another tenant (4 more users of the device) slows both runs 3x for the first 2.5 s: the long run is
    # paused; then the tenant leaves, the short run ends early, and the long one fits again
    tenant = [tmp_path / 'device' / f'tenant{i}' for i in range(4)]
    for t in tenant:
        t.touch()
    threading.Timer(2.5, lambda: [t.unlink() for t in tenant]).start()
    jobs = fake_jobs(100, 120)  # 3 s and 3.6 s alone
    lines = []
    report = run_jobs(jobs, parallel=2, threads=1, time_limit=17.5, window=0.5, poll=0.05, echo=lines.append)
    assert not (report.paused or report.failed or report.not_started), lines
    assert [ln.split(' (')[0] for ln in lines if ln.startswith(('started', 'resumed', 'paused', 'finished'))] == [
        'started run0', 'started run1', 'paused run1', 'finished run0: exit 0', 'resumed run1',
        'finished run1: exit 0'], lines
    steps = [int(ln.split(',')[0]) for ln in (jobs[1].run_dir / 'metrics.csv').read_text().splitlines()[1:]]
    assert steps == list(range(1, 121))  # resumed from its checkpoint, not started over


def test_at_the_limit_the_runs_going_are_paused_and_the_rest_not_started(fake_jobs):
    jobs = fake_jobs(1000, 10)
    lines = []
    report = run_jobs(jobs, parallel=1, threads=1, time_limit=1.5, window=30, poll=0.05, echo=lines.append)
    assert [j.name for j in report.paused] == ['run0'] and [j.name for j in report.not_started] == ['run1']
    assert any(ln.startswith('pausing run0: the time limit (1.5 s) is reached') for ln in lines), lines
    assert not jobs[1].run_dir.exists()
    # without a limit, the same call runs everything (the paused run from its checkpoint)
    report = run_jobs(fake_jobs(60, 10), parallel=2, threads=1, poll=0.05, echo=lines.append)
    assert not (report.paused or report.failed or report.not_started)


def test_reproduce_time_limit_pauses_a_run_that_cannot_finish_and_a_rerun_resumes_it(tmp_path, capsys):
    from _train_helpers import write_shards
    root = tmp_path / 'data'
    write_shards(root / 'mnist', 'train', n=64, per_shard=64, size=28, channels=1, num_classes=10)
    write_shards(root / 'mnist', 'test', n=16, per_shard=16, size=28, channels=1, num_classes=10, seed=1)
    argv = ['reproduce', 'ninformer-table1', '--datasets', 'mnist', '--models', 'MlpMixer', '--max-steps', 100000,
            '--threads', 1, '--data-root', root, '--output', tmp_path / 'out', '--time-limit', 30,
            '--set', 'batch_size=4', 'log_interval=1', 'eval_interval=1000', 'progress=none', 'tensorboard=false']
    code, out, err = run_cli(capsys, *argv)
    assert code == 1 and "not finished within --time-limit: mnist/ninformer_baseline_mixer_patch4_28" in err, out + err
    assert 'pausing mnist/ninformer_baseline_mixer_patch4_28: the run going is projected to need' in out, out
    run_dir = tmp_path / 'out' / 'mnist' / 'ninformer_baseline_mixer_patch4_28'
    step = load_checkpoint(run_dir / 'last.pth')['global_step']
    stop = json.loads((run_dir / 'stopped.json').read_text())
    assert (stop['reason'], stop['signal'], stop['global_step']) == ('interrupted', 'SIGINT', step) and step > 0
    child_log = run_dir.parent / 'ninformer_baseline_mixer_patch4_28.log'
    assert 'vitblocks reproduce: stopped by SIGINT' in child_log.read_text()
    # re-run on a budget it can finish: it resumes from the checkpoint
    argv[argv.index('--max-steps') + 1] = step + 2
    argv[argv.index('--time-limit'):argv.index('--time-limit') + 2] = ['--jobs', 2]  # still in a child process
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert json.loads((run_dir / 'results.json').read_text())['global_step'] == step + 2
    assert not (run_dir / 'stopped.json').exists()
    # the child trained only (its line in its log); the table is the parent's, in --output and on stdout
    assert 'mnist MlpMixer: top-1 ' in child_log.read_text() and 'NiNformer Table 1' not in child_log.read_text()
    assert 'NiNformer Table 1' in out and (tmp_path / 'out' / 'table.txt').read_text().strip() in out


@pytest.mark.parametrize('value', ['0', '-5', 'nan', 'inf', 'soon'])
def test_time_limit_must_be_a_positive_number_of_seconds(value, capsys):
    code, _, err = run_cli(capsys, 'reproduce', 'ninformer-table1', '--time-limit', value)
    assert code == 2 and f"--time-limit: expected a number > 0, got '{value}'" in err


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err
