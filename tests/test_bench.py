"""`vitblocks bench` options (--amp, --channels-last, --compile, --device, --json) and the timers under them.

The CUDA paths are checked without a GPU where they can be (timer selection, option checks with a
fake CUDA); a real GPU run is scripts/gpu_job.sh (its speed sweep).
"""
import json
import statistics

import pytest
import torch

import vitblocks.cli as cli
from vitblocks.profile import latency
from vitblocks.profile.latency import (CudaEventTimer, LatencyResult, WallTimer, benchmark_models,
                                       check_bench_options, step_timer, timm_record)

TINY = ['deit_tiny_patch16_224', '--img-size', '32', '--num-classes', '10', '--batch-size', '2', '--threads', '1']


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, out, err, *fragments):
    assert code == 2 and out == '' and len(err.strip().splitlines()) == 1 and 'Traceback' not in err, err
    for f in fragments:
        assert f in err, err


# --- the command on the CPU ---------------------------------------------------------------------

def test_bench_amp_bf16_compile_reports_and_writes_timm_fields(tmp_path, capsys):
    """torch.compile (inductor) of a 32 px DeiT-Ti under bf16 autocast: one compile, then timed batches."""
    out_json = tmp_path / 'b.json'
    code, out, err = run_cli(capsys, 'bench', *TINY, '--warmup', 0, '--repeats', 2, '--amp', 'bf16', '--compile',
                             '--json', out_json)
    assert code == 0, err
    assert 'amp bf16' in out and 'torch.compile (mode default)' in out
    compile_s = float(out.split('compile (first call): deit_tiny_patch16_224 ')[1].split(' s')[0])
    assert compile_s > 0
    (record,) = json.loads(out_json.read_text())
    assert record['model'] == 'deit_tiny_patch16_224' and record['precision'] == 'amp_bfloat16'
    assert record['torchcompile'] == 'inductor' and record['infer_batch_size'] == 2 and record['infer_img_size'] == 32
    assert record['param_count'] == 5.49  # DeiT-Ti at 32 px with 10 classes: 5,489,482 parameters
    # timm's samples/s is batch / mean step time; the table's images/s uses the median
    assert record['infer_samples_per_sec'] == pytest.approx(2 / (record['infer_step_time'] / 1e3), rel=1e-3)
    row = next(line for line in out.splitlines() if line.startswith('deit_tiny_patch16_224 '))
    assert float(row.split()[1]) == pytest.approx(record['infer_median_ms'], abs=0.051)


def test_bench_channels_last_fp16_and_baseline_ratio(tmp_path, capsys):
    out_json = tmp_path / 'b.json'
    code, out, err = run_cli(capsys, 'bench', *TINY, '--baseline', 'deit_small_patch16_224', '--warmup', 0,
                             '--repeats', 1, '--amp', 'fp16', '--channels-last', '--json', out_json)
    assert code == 0, err
    assert 'amp fp16' in out and 'channels-last' in out
    model, base = json.loads(out_json.read_text())
    assert base['baseline'] and not model['baseline'] and base['model'] == 'deit_small_patch16_224'
    assert model['vs_baseline'] == pytest.approx(model['infer_median_ms'] / base['infer_median_ms'], rel=1e-3)
    assert model['speedup_vs_baseline'] == pytest.approx(1 / model['vs_baseline'], rel=1e-3)
    # DeiT-S 22,050,664 - 990 classes x 385 - 192 positions x 384 = 21,595,786
    assert base['param_count'] == 21.6 and model['precision'] == 'amp' and model['channels_last']


@pytest.mark.parametrize('argv, fragments', [
    (['--compile-mode', 'max-autotune'], ['--compile-mode max-autotune: given without compiling; add --compile']),
    (['--compile', '--compile-mode', 'reduce-overhead'], ['--compile-mode reduce-overhead: CUDA graphs']),
    (['--device', 'tpu'], ['--device tpu: expected cpu, cuda or cuda:N']),
    (['--weights', 'w.safetensors', '--train'], ['--weights', 'inference-only']),
    (['--amp', 'fp8'], ['--amp', 'invalid choice']),
])
def test_contradictory_options_are_one_line_errors(capsys, argv, fragments):
    assert_one_line_error(*run_cli(capsys, 'bench', *TINY, *argv), *fragments)


def test_cuda_without_a_gpu_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    assert_one_line_error(*run_cli(capsys, 'bench', *TINY, '--device', 'cuda'), 'CUDA is not available')


# --- option checks and timers without a GPU ------------------------------------------------------

def test_amp_that_autocast_would_silently_drop_is_refused(monkeypatch):
    """CPU autocast disables itself (a warning, then fp32) for an unsupported dtype: that must not pass."""
    class NoAutocast:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch, 'autocast', NoAutocast)
    with pytest.raises(ValueError, match="amp='fp16': autocast to torch.float16 is not supported on cpu.*use bf16"):
        check_bench_options('cpu', amp='fp16')


@pytest.mark.parametrize('native', [False, True])
def test_amp_on_a_cpu_without_onednn_kernels_prints_a_note(capsys, monkeypatch, native):
    monkeypatch.setitem(latency.ONEDNN_DTYPE_PROBES, 'bf16', lambda: native)
    code, out, err = run_cli(capsys, 'bench', *TINY, '--warmup', 0, '--repeats', 1, '--amp', 'bf16')
    assert code == 0, err
    assert ('has no oneDNN bf16 kernels' in out) is not native, out
    assert latency.amp_kernel_note('cpu', None) is None  # fp32: nothing to say
    assert latency.amp_kernel_note('cuda', 'bf16') is None  # cuDNN, not oneDNN


def test_what_the_note_says_a_depthwise_conv_without_onednn_kernels_does():
    """Where the note is printed (this CPU has no oneDNN bf16), a depthwise conv under bf16 autocast
    runs torch's fallback once per channel group; in fp32 it is one oneDNN call."""
    if latency.ONEDNN_DTYPE_PROBES['bf16']():
        pytest.skip('this CPU has oneDNN bf16 kernels: the note is not printed here')
    conv, x = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16).eval(), torch.randn(1, 16, 8, 8)

    def slow_conv_calls(amp):
        with torch.inference_mode(), torch.autocast('cpu', torch.bfloat16, enabled=amp), \
                torch.profiler.profile() as prof:
            conv(x)
        return sum(e.count for e in prof.key_averages() if e.key == 'aten::_slow_conv2d_forward')

    assert slow_conv_calls(amp=True) == 16
    assert slow_conv_calls(amp=False) == 0


def test_bf16_on_a_gpu_without_it_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda *a: 'Tesla V100')
    with pytest.raises(ValueError, match="amp='bf16': Tesla V100 has no bfloat16 support; use fp16"):
        check_bench_options('cuda', amp='bf16')


class FakeEvent:
    """A CUDA event on a fake clock: record() reads it, elapsed_time() subtracts."""
    clock = [0.0]
    log = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        self.t = self.clock[0]
        self.log.append('record')

    def synchronize(self):
        self.log.append('event sync')

    def elapsed_time(self, end):
        return end.t - self.t


def test_cuda_steps_are_timed_with_events_after_a_device_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'Event', FakeEvent)
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda device=None: FakeEvent.log.append('device sync'))
    monkeypatch.setattr(torch.cuda, 'current_stream', lambda device=None: f'stream of {device}')
    monkeypatch.setattr(FakeEvent, 'record', lambda self, stream=None: (setattr(self, 't', self.clock[0]),
                                                                        self.log.append(f'record on {stream}')))
    FakeEvent.log.clear()
    timer = step_timer('cuda:1')
    assert isinstance(timer, CudaEventTimer) and timer.device == torch.device('cuda', 1)
    timer.start()
    FakeEvent.clock[0] += 12.5  # the GPU works 12.5 ms
    assert timer.stop() == 12.5
    # the queue is drained before the start event, and the end event is waited for before reading it; both
    # events are recorded on the timed device's stream, not the current device's
    assert FakeEvent.log == ['device sync', 'record on stream of cuda:1', 'record on stream of cuda:1', 'event sync']
    assert isinstance(step_timer('cpu'), WallTimer)


def test_compile_time_is_kept_out_of_the_timed_batches(monkeypatch):
    """The first call of a compiled model (the compilation) is timed apart, before warm-up and repeats."""
    calls = []

    class Model(torch.nn.Module):
        def forward(self, x):
            calls.append(len(calls))
            return x

    monkeypatch.setattr(torch, 'compile', lambda m, mode=None: m)
    times = iter([5000.0, 1.0, 2.0, 3.0])  # ms: the first step (compiling) is slow

    class Timer(WallTimer):
        def stop(self):
            return next(times)

    monkeypatch.setattr(latency, 'step_timer', lambda dev: Timer())
    res = benchmark_models({'m': Model()}, batch_size=1, input_size=(1, 2, 2), warmup=2, repeats=3, compile=True)
    assert res['m'].compile_s == 5.0 and res['m'].times_ms == [1.0, 2.0, 3.0]
    assert len(calls) == 1 + 2 + 3


def test_timm_record_follows_timm_benchmark():
    r = LatencyResult('m', 4, [10.0, 20.0, 60.0])
    base = LatencyResult('b', 4, [40.0, 40.0, 40.0])
    rec = timm_record(r, 5_717_416, 224, baseline=base)
    assert rec['infer_step_time'] == 30.0 and rec['infer_samples_per_sec'] == round(4 / 0.030, 2)
    assert rec['infer_median_ms'] == 20.0 and rec['param_count'] == 5.72 and rec['infer_img_size'] == 224
    assert rec['vs_baseline'] == 0.5 and rec['speedup_vs_baseline'] == 2.0
    assert set(timm_record(r, 1, 32, train=True)) >= {'train_samples_per_sec', 'train_step_time', 'train_batch_size'}
    assert statistics.median(r.times_ms) == r.median_ms


def test_models_get_their_mode_and_gradients_back():
    """Timing sets eval (or train) mode and runs backward; the caller's mode and .grad come back unchanged."""
    trained = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2)).train()
    evaluated = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2)).eval()
    benchmark_models({'t': trained}, batch_size=2, input_size=(1, 2, 2), warmup=1, repeats=2)
    assert trained.training and all(m.training for m in trained.modules())
    grad = torch.full_like(evaluated[0].weight, 7.)
    evaluated[0].weight.grad = grad
    benchmark_models({'e': evaluated}, batch_size=2, input_size=(1, 2, 2), warmup=1, repeats=2, train=True)
    assert not any(m.training for m in evaluated.modules())
    assert evaluated[0].weight.grad is grad and torch.equal(grad, torch.full_like(grad, 7.))
    assert evaluated[0].bias.grad is None


def test_a_train_benchmark_leaves_the_batchnorm_statistics_alone():
    """Train-mode forwards on the random batch update BatchNorm's running statistics; a trained model timed
    with train=True kept them (its eval outputs changed after a benchmark)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2)).eval()
    with torch.no_grad():
        model[1].running_mean.fill_(3.), model[1].running_var.fill_(5.)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    benchmark_models({'m': model}, batch_size=2, input_size=(1, 2, 2), warmup=1, repeats=2, train=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), model.state_dict()


def test_cpu_runs_count_the_fresh_pages_of_each_timed_batch(monkeypatch):
    """Each timed CPU batch records the minor page faults around its step (not around warm-up)."""
    counter = iter(range(0, 10_000, 100))  # every read of the fault counter: 100 more than the last
    monkeypatch.setattr(latency, 'minor_page_faults', lambda: next(counter))

    class Model(torch.nn.Module):
        def forward(self, x):
            return x

    res = benchmark_models({'a': Model(), 'b': Model()}, batch_size=1, input_size=(1, 2, 2), warmup=2, repeats=3)
    assert res['a'].page_faults == [100] * 3 and res['b'].page_faults == [100] * 3
    assert res['a'].median_page_faults == 100
    assert timm_record(res['a'], 1, 2)['infer_page_faults'] == 100
    assert LatencyResult('gpu', 1, [1.0]).median_page_faults is None  # CUDA runs record none
    assert timm_record(LatencyResult('gpu', 1, [1.0]), 1, 2)['infer_page_faults'] is None


def test_bench_points_out_models_whose_fresh_pages_differ(monkeypatch, capsys):
    from vitblocks.cli import bench as bench_cli

    def fake_run(models, batch_size, **kwargs):
        pages = {0: 0, 1: 114_270}
        return {name: LatencyResult(name, batch_size, [10.0], page_faults=[pages[i]]) for i, name in enumerate(models)}
    monkeypatch.setattr(bench_cli, 'benchmark_models', fake_run)
    argv = ['bench', 'afbo_deit_tiny_patch16_224', '--baseline', 'deit_tiny_patch16_224', '--img-size', '32',
            '--num-classes', '10']
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert 'fresh pages' in out and '114,270' in out
    assert ('note: deit_tiny_patch16_224 (baseline) took 114,270 fresh pages per batch and afbo_deit_tiny_patch16_224 '
            '0: the ratio includes glibc zero-filling them; --steady-malloc compares compute') in out


def test_interleaved_times_takes_turns_in_blocks_after_the_warm_up():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ('a', 'b')}
    times = latency.interleaved_times(fns, repeats=2, warmup=1, block=2)
    assert calls == ['a', 'b'] + ['a', 'a', 'b', 'b'] * 2  # one untimed round, then blocks of 2 calls each
    assert {k: len(v) for k, v in times.items()} == {'a': 4, 'b': 4}
    assert all(t >= 0 for v in times.values() for t in v)
