"""Smoke runs and input errors of CPU speed benchmarks: benchmarks/iffn_slices.py (one IFFN FFN at
several batch-slice sizes against the baseline's Mlp), benchmarks/gemm_backends.py (the models' GEMM
shapes through F.linear and through oneDNN) and benchmarks/cpu_runtimes.py (deployed against vanilla models
in PyTorch eager, torch.compile, ONNX Runtime and OpenVINO). Their figures are in docs/iffn_speed.md and
docs/repa.md."""
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import timm
import torch

from vitblocks.deploy import reparameterize
from vitblocks.profile import count_macs

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


# --- benchmarks/cpu_runtimes.py ---------------------------------------------------------------------------------

TINY_PAIR = ['--pair', 'bench_afbo_vit_tiny_patch4_32', 'bench_vanilla_vit_tiny_patch4_32', '--model-arg', 'depth=1']
QUICK = ['--runs', '1', '--rounds', '1', '--warmup', '0', '--threads', '1']


def _tiny_mac_ratio():
    deployed = reparameterize(timm.create_model('bench_afbo_vit_tiny_patch4_32', depth=1))
    vanilla = timm.create_model('bench_vanilla_vit_tiny_patch4_32', depth=1)
    return count_macs(deployed).total / count_macs(vanilla).total


def _ratio_rows(out):
    """{batch: [cells]} of the ratio table's rows (the first table printed)."""
    return {int(m.group(1)): m.group(3).split(' | ') for m in
            re.finditer(r'^\| bench_afbo_vit_tiny_patch4_32 / bench_vanilla_vit_tiny_patch4_32 \| (\d+) \| '
                        r'([\d.]+x) \| (.+) \|$', out, re.M)}


@pytest.mark.skipif(not all(importlib.util.find_spec(p) for p in ('onnx', 'onnxscript', 'onnxruntime')),
                    reason='needs onnx, onnxscript and onnxruntime')
def test_cpu_runtimes_times_a_pair_in_eager_and_onnxruntime(benchmarks_on_path, capsys, tmp_path):
    import cpu_runtimes
    records = cpu_runtimes.main([*TINY_PAIR, *QUICK, '--runtimes', 'eager', 'onnxruntime', '--batch-sizes', '1', '2',
                                 '--out', str(tmp_path / 'table.md'), '--ort-profile', str(tmp_path / 'profile')])
    out = capsys.readouterr().out
    assert 'ISA ' in out and 'torch CPU capability' in out and '1 intra-op thread(s) in every runtime' in out
    mac_ratio = _tiny_mac_ratio()
    assert [(r['runtime'], r['batch'], r['status']) for r in records] == [
        ('eager', 1, 'ok'), ('eager', 2, 'ok'), ('onnxruntime', 1, 'ok'), ('onnxruntime', 2, 'ok')]
    for r in records:
        assert r['mac_ratio'] == pytest.approx(mac_ratio, rel=1e-9)
        assert math.isfinite(r['ratio']) and r['ratio'] > 0
        assert r['ratio'] == pytest.approx(r['deployed_ms'] / r['vanilla_ms'])  # one run: the ratio of its medians
        assert r['deployed_check']['max_abs_error'] < 1e-4 and r['vanilla_check']['max_abs_error'] < 1e-4
    rows = _ratio_rows(out)
    assert sorted(rows) == [1, 2], out
    for r in records:
        column = 0 if r['runtime'] == 'eager' else 1
        assert rows[r['batch']][column] == f'{r["ratio"]:.2f}x'
    assert f'| {mac_ratio:.2f}x |' in out
    saved = json.loads((tmp_path / 'table.json').read_text())
    assert saved['machine']['threads'] == 1 and saved['machine']['model_kwargs'] == {'depth': 1}
    assert [r['ratio'] for r in saved['records']] == [r['ratio'] for r in records]
    assert '| PyTorch eager | ONNX Runtime |' in (tmp_path / 'table.md').read_text()
    for r in records[2:]:  # the profiles: every op type's share of the kernel time, summing to 1
        for role in ('deployed', 'vanilla'):
            profile = r['ort_profile'][role]
            assert Path(profile['file']).is_file() and profile['runs'] == 1
            assert sum(share for *_, share in profile['ops']) == pytest.approx(1)
            assert profile['ms_per_run'] == pytest.approx(sum(ms for _, _, ms, _ in profile['ops']))
            assert any(op == 'MatMul' or op.endswith('MatMul') for op, *_ in profile['ops'])
            assert sum(n['share'] for n in profile['nodes']) == pytest.approx(1)
            assert {n['op'] for n in profile['nodes']} == {op for op, *_ in profile['ops']}
            assert all(n['bytes'] > 0 and n['outputs'] for n in profile['nodes'])
    assert out.count('ONNX Runtime profile, ') == 4
    assert sorted(p.suffix for p in (tmp_path / 'profile').glob('*')) == ['.json'] * 4 + ['.onnx'] * 2


@pytest.mark.slow
@pytest.mark.skipif(not all(importlib.util.find_spec(p) for p in ('onnx', 'onnxscript', 'openvino')),
                    reason='needs onnx, onnxscript and openvino')
def test_cpu_runtimes_times_a_pair_compiled_and_in_openvino(benchmarks_on_path, capsys):
    import cpu_runtimes
    records = cpu_runtimes.main([*TINY_PAIR, *QUICK, '--runtimes', 'compile', 'openvino', '--batch-sizes', '1', '3',
                                 '--inductor-freezing'])
    assert [(r['runtime'], r['batch'], r['status']) for r in records] == [
        ('compile', 1, 'ok'), ('compile', 3, 'ok'), ('openvino', 1, 'ok'), ('openvino', 3, 'ok')]
    for r in records:
        assert math.isfinite(r['ratio']) and r['ratio'] > 0
        assert r['deployed_check']['max_abs_error'] < 1e-4 and r['vanilla_check']['max_abs_error'] < 1e-4
    assert sorted(_ratio_rows(capsys.readouterr().out)) == [1, 3]


def _boom():
    raise RuntimeError('boom')


@pytest.mark.parametrize('call, status, error', [
    (lambda model, x: model(x) + 0.01, 'wrong', 'PyTorch eager deployed: max abs error 0.01 against eager PyTorch'),
    (lambda model, x: model(x)[:, :3], 'wrong', 'PyTorch eager deployed: output shape (1, 3), eager (1, 10)'),
    (lambda model, x: model(x) * float('nan'), 'wrong', 'PyTorch eager deployed: output not finite'),
    (lambda model, x: _boom(), 'failed', 'RuntimeError: boom'),
])
def test_cpu_runtimes_reports_a_wrong_or_failing_runtime_never_as_a_ratio(benchmarks_on_path, capsys, monkeypatch,
                                                                           call, status, error):
    import _cpu_runtimes
    import cpu_runtimes
    monkeypatch.setattr(_cpu_runtimes.Eager, 'load', lambda self, model, onnx_path: _cpu_runtimes.Loaded(
        lambda x: lambda: call(model, x)))
    records = cpu_runtimes.main([*TINY_PAIR, *QUICK, '--runtimes', 'eager', '--batch-sizes', '1', '--targets'])
    out = capsys.readouterr().out
    assert [r['status'] for r in records] == [status] and 'ratio' not in records[0]
    assert error in records[0]['error']
    assert _ratio_rows(out)[1] == [status, '']  # no ratio, no target for a custom pair
    assert f'batch 1: not measured ({status})' in out


def test_cpu_runtimes_judges_each_target_on_the_median_over_runs(benchmarks_on_path):
    import cpu_runtimes
    from _cpu_runtimes_report import verdict_lines
    repa, poolformer = cpu_runtimes.PAIRS['repa-deit-b'], cpu_runtimes.PAIRS['afbo-poolformer-s12']
    record = dict(pair=repa.label, runtime='onnxruntime', batch=16, status='ok', ratios=[0.70, 0.62, 0.60],
                  mac_ratio=0.6)
    cpu_runtimes.judge(record, repa)  # throughput ratios 1.43, 1.61, 1.67: median 1.61 >= 1.55
    assert record['target']['met'] and record['target']['median'] == pytest.approx(1 / 0.62)
    assert verdict_lines([record])[0].startswith('RePa-DeiT-B / DeiT-B, ONNX Runtime, batch 16, throughput: 1.61x '
                                                 '(target >= 1.55x: met)')
    record = dict(pair=poolformer.label, runtime='eager', batch=1, status='ok', ratios=[1.40, 1.35], mac_ratio=1.2)
    cpu_runtimes.judge(record, poolformer)  # within 10% of the MAC ratio: at most 1.32x; median 1.375x
    assert not record['target']['met'] and record['target']['threshold'] == pytest.approx(1.32)
    assert record['target']['describe'] == 'latency <= 1.32x (1.10 x MACs)'


@pytest.mark.parametrize('args, message', [
    (['--batch-sizes', '0'], '--batch-sizes takes distinct sizes >= 1'),
    (['--batch-sizes', '4', '4'], '--batch-sizes takes distinct sizes >= 1'),
    (['--runs', '0'], '--runs must be at least 1'),
    (['--check-tol', 'nan'], '--check-tol must be a positive number'),
    (['--runtimes', 'eager', '--ort-profile', 'p'], '--ort-profile profiles ONNX Runtime'),
    (['--model-arg', 'depth'], "--model-arg 'depth': expected KEY=VALUE"),
    (['--model-arg', 'depth=1', '--model-arg', 'depth=2'], '--model-arg gives depth twice'),
    (['--runtimes', 'eager', 'eager'], "--runtimes names one twice: ['eager', 'eager']"),
    (['--out', 'table.csv'], 'give a name with suffix .md or .json'),
    (['--models', 'deit'], "invalid choice: 'deit'"),
    (['--runtimes', 'eager', '--ort-spinning', 'off'], '--ort-spinning is an option of the onnxruntime runtime'),
    (['--runtimes', 'onnxruntime', '--inductor-freezing'], '--inductor-freezing is an option of the compile runtime'),
])
def test_cpu_runtimes_refuses_bad_arguments(benchmarks_on_path, capsys, args, message):
    import cpu_runtimes
    with pytest.raises(SystemExit) as e:
        cpu_runtimes.parse_args(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cpu_runtimes_skips_a_runtime_not_installed_unless_named(benchmarks_on_path, capsys, monkeypatch):
    import _cpu_runtimes
    import cpu_runtimes
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(_cpu_runtimes.importlib.util, 'find_spec',
                        lambda name, *a: None if name == 'openvino' else find_spec(name, *a))
    chosen = cpu_runtimes.open_runtimes(cpu_runtimes.parse_args(['--models', 'afbo-deit-t']))
    assert 'openvino' not in chosen and 'eager' in chosen
    assert 'skipping OpenVINO: OpenVINO needs the openvino package: pip install openvino' in capsys.readouterr().out
    with pytest.raises(SystemExit, match='--runtimes openvino: OpenVINO needs the openvino package'):
        cpu_runtimes.open_runtimes(cpu_runtimes.parse_args(['--runtimes', 'eager', 'openvino']))


def test_onnx_ffn_forms_checks_and_times_every_form(benchmarks_on_path, capsys):
    pytest.importorskip('onnxruntime')
    pytest.importorskip('onnxscript')
    import onnx_ffn_forms
    onnx_ffn_forms.main(['--block', 'afbo', '--batch-size', '1', '--repeats', '1', '--threads', '1'])
    out = capsys.readouterr().out
    assert 'first FFN of afbo_deit_tiny_patch16_224, input (1, 197, 192)' in out
    rows = {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^\s+(timm Mlp|reference|grouped, channels-first|export)\s+[\d.]+\s+([\d.]+)x$', out, re.M)}
    assert set(rows) == {'timm Mlp', 'reference', 'grouped, channels-first', 'export'}, out
    assert rows['timm Mlp'] == 1.0 and all(r > 0 for r in rows.values())


def test_onnx_ffn_forms_refuses_a_form_that_computes_otherwise(benchmarks_on_path, monkeypatch):
    pytest.importorskip('onnxruntime')
    pytest.importorskip('onnxscript')
    import onnx_ffn_forms
    monkeypatch.setattr(onnx_ffn_forms.GroupedChannelsFirst, 'forward', lambda self, x: x[..., :1] * 0 + x.sum())
    with pytest.raises(SystemExit, match="form 'grouped, channels-first' computes other outputs"):
        onnx_ffn_forms.main(['--block', 'afbo', '--batch-size', '1', '--repeats', '1', '--threads', '1'])
