"""Smoke runs and input errors of two CPU speed benchmarks: benchmarks/iffn_slices.py (one IFFN FFN at
several batch-slice sizes against the baseline's Mlp) and benchmarks/gemm_backends.py (the models' GEMM
shapes through F.linear and through oneDNN). Their figures are in docs/iffn_speed.md and docs/repa.md."""
import re
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / 'benchmarks'


@pytest.fixture
def benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))


def test_iffn_slices_times_every_size_against_the_mlp(benchmarks_on_path, capsys):
    import iffn_slices
    iffn_slices.main(['--models', 'iffn_deit_tiny_patch16_224', 'deit_tiny_patch16_224', '--batch-size', '2',
                      '--threads', '1', '--warmup', '0', '--repeats', '2', '--chunk-bytes', '65536', '0'])
    out = capsys.readouterr().out
    assert 'input (2, 196, 192), against deit_tiny_patch16_224 blocks.0.mlp, input (2, 197, 192)' in out
    rows = {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^\s*(0\.0625 MiB|whole batch|Mlp)\s+[\d.]+\s+([\d.]+)x\s+[\d.]+x$', out, re.M)}
    assert set(rows) == {'0.0625 MiB', 'whole batch', 'Mlp'}, out
    assert rows['Mlp'] == 1.0 and all(r > 0 for r in rows.values())


@pytest.mark.parametrize('args, message', [
    (['--chunk-bytes', '-1'], '--chunk-bytes takes byte counts >= 0'),
    (['--chunk-bytes', '8', '8'], '--chunk-bytes names a size twice: [8, 8]'),
    (['--repeats', '0'], '--repeats must be >= 1'),
])
def test_iffn_slices_refuses_bad_arguments(benchmarks_on_path, capsys, args, message):
    import iffn_slices
    with pytest.raises(SystemExit) as e:
        iffn_slices.parse_args(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_iffn_slices_needs_an_iffn_model(benchmarks_on_path):
    import iffn_slices
    match = r'deit_tiny_patch16_224: its first FFN \(blocks.0.mlp\) is a Mlp, not a deployed IFFN'
    with pytest.raises(SystemExit, match=match):
        iffn_slices.main(['--models', 'deit_tiny_patch16_224', 'deit_tiny_patch16_224', '--batch-size', '1'])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason='this torch has no oneDNN')
def test_gemm_backends_times_every_shape(benchmarks_on_path, capsys):
    import gemm_backends
    gemm_backends.main(['--threads', '1', '--scale', '0.005', '--warmup', '0', '--repeats', '1'])
    out = capsys.readouterr().out
    rows = re.findall(r'^(.+?)\s+(\d+) x (\d+) -> (\d+)\s+[\d.]+\s+\d+\s+[\d.]+\s+\d+\s+([\d.]+)x$', out, re.M)
    assert [r[0] for r in rows] == [s[0] for s in gemm_backends.SHAPES]
    for (label, m, k, n, ratio), (_, tokens, k_s, n_s, images) in zip(rows, gemm_backends.SHAPES):
        assert (int(m), int(k), int(n)) == (max(1, round(tokens * images * 0.005)), k_s, n_s), label
        assert float(ratio) > 0


def test_gemm_backends_says_when_torch_has_no_onednn(benchmarks_on_path, monkeypatch):
    import gemm_backends
    monkeypatch.setattr(torch.backends.mkldnn, 'is_available', lambda: False)
    with pytest.raises(SystemExit, match=r'built without oneDNN'):
        gemm_backends.onednn_linear()


def test_gemm_backends_refuses_bad_arguments(benchmarks_on_path, capsys):
    import gemm_backends
    with pytest.raises(SystemExit) as e:
        gemm_backends.main(['--scale', '0'])
    assert e.value.code == 2 and '--scale > 0' in capsys.readouterr().err
