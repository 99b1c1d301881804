"""vitblocks.profile.steady_malloc: after it, re-allocating a large tensor touches no fresh page.

mallopt changes the whole process for good, so every check that calls it for real runs in a child
process; the in-process tests fake it or stop before it."""
import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vitblocks.cli as cli
from vitblocks.cli import bench as bench_cli
from vitblocks.profile import allocator
from vitblocks.profile.allocator import FAULTS_NOTED, AllocatorError, fault_note, steady_malloc

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, 'PYTHONPATH': str(ROOT / 'src')}
GLIBC = sys.platform.startswith('linux') and hasattr(ctypes.CDLL(None), 'gnu_get_libc_version')
needs_glibc = pytest.mark.skipif(not GLIBC, reason='glibc only')

# a 64 MiB tensor (above glibc's largest dynamic mmap threshold, 32 MiB) filled and freed 8 times;
# prints the minor page faults of the last 5 (the first 3 are warm-up)
CHILD = """
import sys, torch
from vitblocks.profile import minor_page_faults, steady_malloc
if sys.argv[1] == 'steady':
    steady_malloc()
torch.set_num_threads(1)
faults = []
for _ in range(8):
    before = minor_page_faults()
    torch.empty(16 * 2 ** 20).fill_(1.0)  # 64 MiB of float32, freed at once
    faults.append(minor_page_faults() - before)
print(sum(faults[3:]))
"""
PAGES = 5 * 64 * 2 ** 20 // 4096  # 4 KiB pages the last 5 fills touch


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, '-c', CHILD, mode], env=ENV, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def _thp_always() -> bool:
    try:
        return '[always]' in Path('/sys/kernel/mm/transparent_hugepage/enabled').read_text()
    except OSError:
        return False


@needs_glibc
def test_steady_malloc_reuses_touched_pages():
    assert _faults('steady') < PAGES // 100  # 0 here
    if not _thp_always():  # with 2 MiB huge pages a fresh mapping faults 512x less: no contrast to show
        assert _faults('default') > PAGES // 2  # glibc maps each 64 MiB block anew: 81,925 here


def test_steady_malloc_refuses_other_platforms(monkeypatch):
    monkeypatch.setattr(allocator.sys, 'platform', 'darwin')
    with pytest.raises(AllocatorError, match='needs glibc.*darwin.*jemalloc'):
        steady_malloc()


def test_steady_malloc_refuses_a_libc_that_is_not_glibc(monkeypatch):
    monkeypatch.setattr(allocator.sys, 'platform', 'linux')
    monkeypatch.setattr(allocator.ctypes, 'CDLL', lambda name: object())  # musl: no gnu_get_libc_version
    with pytest.raises(AllocatorError, match='not glibc'):
        steady_malloc()


def test_bench_steady_malloc_is_applied_before_the_models_and_reported(monkeypatch, capsys, tmp_path):
    calls = []
    real_build = bench_cli.build_model
    monkeypatch.setattr(bench_cli, 'steady_malloc', lambda: calls.append('malloc') or '2.99')
    monkeypatch.setattr(bench_cli, 'build_model', lambda *a, **k: calls.append('model') or real_build(*a, **k))
    argv = ['bench', 'deit_tiny_patch16_224', '--img-size', '32', '--num-classes', '10', '--batch-size', '2',
            '--warmup', '0', '--repeats', '1', '--threads', '1', '--steady-malloc', '--json', str(tmp_path / 'b.json')]
    assert cli.main(argv) == 0
    assert calls == ['malloc', 'model']
    assert 'steady malloc (glibc 2.99)' in capsys.readouterr().out
    assert '"steady_malloc": true' in (tmp_path / 'b.json').read_text()


def test_bench_steady_malloc_errors_are_one_line(monkeypatch, capsys):
    def refuse():
        raise AllocatorError('steady_malloc needs glibc (Linux); this is darwin')
    monkeypatch.setattr(bench_cli, 'steady_malloc', refuse)
    assert cli.main(['bench', 'deit_tiny_patch16_224', '--steady-malloc']) == 2
    assert capsys.readouterr().err.strip() == \
        'vitblocks bench: error: --steady-malloc: steady_malloc needs glibc (Linux); this is darwin'
    assert cli.main(['bench', 'deit_tiny_patch16_224', '--steady-malloc', '--device', 'cuda']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'does nothing on --device cuda' in err


@needs_glibc
@pytest.mark.parametrize('script, args', [
    ('afbo_latency.py', ['--threads', '1', '--layer-repeats', '0']),
    pytest.param('repa_throughput.py', ['--sizes', 'base', '--threads', '1'], marks=pytest.mark.slow),
    pytest.param('iffn_latency.py', ['--models', 'iffn_deit_tiny_patch16_224', 'deit_tiny_patch16_224',
                                     '--threads', '1', '--breakdown-repeats', '0'], marks=pytest.mark.slow),
])
def test_benchmark_scripts_take_steady_malloc(script, args):
    """The option reaches the benchmark scripts: header, target line, and a faults/fwd column below the
    scripts' note threshold for every model (the heap may still grow by a few pages in a forward; the
    exact check is test_steady_malloc_reuses_touched_pages)."""
    cmd = [sys.executable, str(ROOT / 'benchmarks' / script), *args, '--batch-size', '2', '--warmup', '1',
           '--repeats', '1', '--runs', '2', '--steady-malloc']
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert 'steady malloc (glibc ' in text
    assert re.search(r'\(target [<>]= \d\.\d\dx: (met|MISSED)\); over 2 runs min ', text), text
    model_rows = [line for line in text.splitlines() if re.search(r'deit_tiny|DeiT-base', line)
                  and re.search(r'\d\s*$', line) and 'target' not in line]
    assert len(model_rows) >= 2, text
    assert all(int(line.split()[-1]) < FAULTS_NOTED for line in model_rows), model_rows


def test_a_fault_difference_between_models_is_pointed_out():
    note = fault_note({'afbo_deit_tiny_patch16_224': 0, 'deit_tiny_patch16_224': 114270})
    assert note.startswith('note: deit_tiny_patch16_224 took 114,270 fresh pages per forward and '
                           'afbo_deit_tiny_patch16_224 0:') and note.endswith('--steady-malloc compares compute')
    assert fault_note({'a': 5, 'b': 5 + FAULTS_NOTED - 1}) == ''
    assert fault_note({'a': 5, 'b': 5 + FAULTS_NOTED}) != ''
    assert fault_note({'a': 0, 'b': 1797}, steady=True).endswith('(with --steady-malloc on: the heap grew during '
                                                                  'that forward)')
