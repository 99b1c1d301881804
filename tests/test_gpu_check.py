"""benchmarks/gpu_check.py, the GPU check of the deployed IFFN and AFBO, rehearsed on the CPU (--device cpu --tiny):
every step writes its file, a rerun resumes (skips what exists), a time limit stops before a step, and bad
options are one-line errors. The fused kernels run through Triton's interpreter here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip('triton')

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'benchmarks' / 'gpu_check.py'


def _run(*args, timeout=900):
    env = {**os.environ, 'TRITON_INTERPRET': '1'}
    return subprocess.run([sys.executable, str(SCRIPT), '--device', 'cpu', *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def _check_files(out: Path, models):
    assert json.loads((out / 'env.json').read_text())['device'] == 'cpu'
    kernels = (out / 'kernels.txt').read_text()
    assert 'exit code 0' in kernels and '1 passed' in kernels
    rows = json.loads((out / 'models.json').read_text())['rows']
    timed = {(r['model'], r['setting']) for r in rows}
    for name in models:
        for setting in ('tf32', 'strict', 'bf16'):
            assert (name, setting) in timed
    strict = [r for r in rows if r['setting'] == 'strict']
    assert all(not r['precision']['matmul_tf32'] and not r['precision']['cudnn_tf32'] for r in strict)
    assert all(r['precision']['matmul_tf32'] and r['precision']['cudnn_tf32'] for r in rows if r['setting'] == 'tf32')
    assert all(r['throughput_vs_baseline'] == 1.0 for r in rows if r['model'] == r['baseline'])
    ffn_file = json.loads((out / 'ffn.json').read_text())
    ffn = ffn_file['rows']
    assert {r['model'] for r in ffn} == set(models)
    assert isinstance(ffn_file['launch_configs'], list)  # the interpreter times nothing: the first candidates ran
    assert all(r['model_fused_vs_mlp']['H100'] > 0 and r['model_fused_vs_mlp']['H200'] > 0 for r in ffn)
    assert all(set(r['ms']) == {'training form (reference ops)', 'torch.compile (deployed)',
                                'fused kernels (deployed)', 'vanilla Mlp'} for r in ffn)
    assert all((r['ms']['torch.compile (deployed)'] is None) == (r['setting'] == 'bf16') for r in ffn)
    summary = (out / 'summary.md').read_text()
    assert all(f'| {name} |' in summary for name in models)
    assert '>= 0.88x | 0.88 (AFBO Table 2)' in summary  # the target and the paper's ratio beside ours
    assert 'fused vs Mlp, measured | model (roofline, batch 128): H100 / H200 |' in summary  # side by side
    assert 'not a measurement' in summary and 'Assumptions:' in summary


def test_rehearsal_writes_every_file_and_resumes(tmp_path):
    models = ['iffn_deit_tiny_patch16_224', 'afbo_poolformer_s12']
    run = _run('--tiny', '--out', str(tmp_path), '--models', *models)
    assert run.returncode == 0, run.stderr[-3000:]
    _check_files(tmp_path, models)
    before = (tmp_path / 'models.json').read_text()
    again = _run('--tiny', '--out', str(tmp_path), '--models', *models, '--steps', 'models', 'summary')
    assert again.returncode == 0 and 'models.json exists, skipped' in again.stdout
    assert (tmp_path / 'models.json').read_text() == before


def test_time_limit_stops_before_a_step(tmp_path):
    run = _run('--tiny', '--out', str(tmp_path), '--time-limit', '0', '--steps', 'env', 'models')
    assert run.returncode == 0
    assert 'models: not started, past the time limit' in run.stdout and not (tmp_path / 'models.json').exists()
    assert not list(tmp_path.glob('*.tmp'))


@pytest.mark.parametrize('args,message', [
    (['--out', 'x'], '--device cpu times the CPU paths at full size'),
    (['--tiny', '--models', 'deit_tiny_patch16_224'], "invalid choice: 'deit_tiny_patch16_224'"),
])
def test_bad_options_are_one_line_errors(args, message):
    run = _run(*args, timeout=120)
    assert run.returncode == 2 and message in run.stderr


@pytest.mark.slow
def test_full_rehearsal(tmp_path):
    run = _run('--tiny', '--out', str(tmp_path), timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    from importlib import util
    spec = util.spec_from_file_location('gpu_check', SCRIPT)
    gpu_check = util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    _check_files(tmp_path, list(gpu_check.FFN_CASES))
