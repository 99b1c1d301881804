"""The blocks on each device: the CPU here, a CUDA GPU where there is one.

What runs on a GPU is not what the CPU tests check: the deployed IFFN and AFBO take their whole-batch
reference forward there (their sliced inference paths are CPU-only), the kernels are cuBLAS / cuDNN /
Triton ones, and bf16 autocast casts on a different list. So every check below runs once per device:
``cpu`` in the suite (CI), ``cuda`` where a GPU is present, which ``scripts/gpu_job.sh`` runs
(``-k cuda``; without a GPU those cases skip). The models are the nine of the CIFAR-10 blocks benchmark
(``bench_<config>_vit_tiny_patch4_32``: one 32x32 ViT, each paper's block swapped in), so every block of
the five papers is covered on a small input. fp32 comparisons run with TF32 off, as ``check_fold`` does.
"""
import json

import pytest
import timm
import torch
import torch.nn.functional as F

import vitblocks.cli as cli
from vitblocks.deploy import reparameterize
from vitblocks.models.blocks_bench import BLOCK_CONFIGS, bench_model_name

CONFIGS = [c[0] for c in BLOCK_CONFIGS]
DEPLOY_PATHS = ['iffn', 'afbo', 'repa']  # the configurations whose deployed form runs other code than training
NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device (run by scripts/gpu_job.sh)')


def _on(request):
    """The device of the case, with full fp32 matmuls and convolutions (no TF32) for the duration."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield torch.device(request.param)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(params=['cpu', pytest.param('cuda', marks=NO_GPU)])
def device(request):
    yield from _on(request)


@pytest.fixture(params=[pytest.param('cpu', marks=pytest.mark.slow), pytest.param('cuda', marks=NO_GPU)])
def device_cpu_slow(request):
    """As ``device``, for the checks whose CPU case is long for the default run (what it covers on the CPU is
    covered there by other tests; it runs with ``-m slow`` and shows that the check itself holds)."""
    yield from _on(request)


def build(config: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(bench_model_name(config)).to(device).eval()


def images(device: torch.device, n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(device)


def rel_max(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference, relative to the largest reference value."""
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize('config', CONFIGS)
def test_deployed_model_equals_its_training_form(device, config):
    """Folding is exact in real arithmetic: only fp32 rounding may separate the deployed model from the trained
    one (the training form runs its reference forward with autograd on; the deployed one its inference path)."""
    model, x = build(config, device), images(device)
    with torch.enable_grad():
        ref = model(x).detach()  # autograd on: every layer's training-form code
    deployed = reparameterize(model)
    with torch.inference_mode():
        out = deployed(x)
    assert out.shape == (4, 10) and rel_max(out, ref) < 1e-5
    if device.type != 'cpu':  # the same numbers as the CPU's, up to the kernels' rounding
        with torch.inference_mode():
            cpu = reparameterize(build(config, torch.device('cpu')))(x.cpu())
        assert rel_max(out.cpu(), cpu) < 1e-4


@pytest.mark.parametrize('config', CONFIGS)
def test_deployed_model_under_bf16_autocast_follows_fp32(device, config):
    """bf16 keeps 8 bits of mantissa: the logits stay within a few percent of fp32 (measured here: 0.2-0.7%)."""
    deployed, x = reparameterize(build(config, device)), images(device)
    with torch.inference_mode():
        ref = deployed(x)
        with torch.autocast(device.type, torch.bfloat16):
            out = deployed(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 0.03


@pytest.mark.parametrize('config', CONFIGS)
def test_training_steps_fit_a_batch_and_reach_every_parameter(device_cpu_slow, config):
    """15 AdamW steps on one batch of 16 random images with random labels, under bf16 autocast on a GPU (the
    setting people train in there) and in fp32 on the CPU (bf16 training on a CPU without oneDNN bf16 kernels
    takes 40-80 s per model, against 2-6 s): the model must memorize the batch (loss from ~2.3 to under a quarter
    of that; measured here 0.05-0.08), and every parameter must get a finite gradient (a parameter no gradient
    reaches would also stall DDP)."""
    device = device_cpu_slow
    amp = device.type == 'cuda'
    model = build(config, device).train()
    x, y = images(device, 16), torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(15):
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        no_grad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
        assert not no_grad, f'no finite gradient for {no_grad[:5]}'
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0], losses


@pytest.mark.parametrize('config', DEPLOY_PATHS)
def test_compiled_deployed_model_equals_eager(device_cpu_slow, config):
    """torch.compile of each deployed form with its own inference path (on the CPU: about a minute in all)."""
    device = device_cpu_slow
    deployed, x = reparameterize(build(config, device)), images(device)
    compiled = torch.compile(deployed)
    with torch.inference_mode():
        ref, out = deployed(x), compiled(x)
    assert rel_max(out, ref) < 1e-4


def test_bench_with_amp_and_compile_times_a_deployed_model_against_its_baseline(device_cpu_slow, tmp_path, capsys):
    """`vitblocks bench --amp bf16 --compile`, deployed RePa against vanilla: CUDA events on a GPU, one record
    per model in timm benchmark.py's fields (tests/test_bench.py runs these options on the CPU by default)."""
    device = device_cpu_slow
    out_json = tmp_path / 'bench.json'
    code = cli.main(['bench', bench_model_name('repa'), '--baseline', bench_model_name('vanilla'), '--reparam',
                     '--device', str(device), '--batch-size', '8', '--warmup', '1', '--repeats', '3',
                     '--amp', 'bf16', '--compile', '--json', str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert ('CUDA events' in out) == (device.type == 'cuda') and 'amp bf16' in out and 'reparameterized' in out
    model, base = json.loads(out_json.read_text())
    assert model['model'] == bench_model_name('repa') and base['baseline'] and not model['baseline']
    assert model['precision'] == base['precision'] == 'amp_bfloat16' and model['torchcompile'] == 'inductor'
    assert model['device'] == str(device) and model['infer_batch_size'] == 8 and model['infer_img_size'] == 32
    assert model['infer_samples_per_sec'] > 0 and model['vs_baseline'] == pytest.approx(
        model['infer_median_ms'] / base['infer_median_ms'], rel=1e-3)
    # deployed RePa (theta 0.75) has fewer parameters than the vanilla model it is timed against
    assert model['param_count'] < base['param_count']
