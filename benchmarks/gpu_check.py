"""The GPU check of the deployed IFFN and AFBO: kernel numerics, per-FFN and whole-model speed, a profile.

    python benchmarks/gpu_check.py --out gpu_check --time-limit 300   # one CUDA GPU (not yet timed on one)

Steps, each written into ``--out`` as soon as it finishes (atomically), most telling first:

1. ``env.json``: GPU, driver, torch, Triton and CUDA versions.
2. ``kernels.txt``: ``tests/test_fused_kernels.py`` run on the GPU (every fused kernel against its
   reference ops; exact fp32, and bf16).
3. ``models.json``: whole models at batch 128, inference, timed interleaved with their vanilla timm
   model (same run, CUDA events, median of ``--repeats`` batches after ``--warmup``), in three
   settings: fp32 with TF32 for every GEMM and conv (``tf32``, the fair default: vanilla's cuDNN convs
   use TF32 by default), strict fp32 for all (``strict``), and bf16 autocast. Deployed models
   (``vitblocks.deploy.reparameterize``): IFFN-Ti/S/B against DeiT-Ti/S/B; AFBO against Swin-T,
   PoolFormer-S12/S24 and DeiT-T; RePa against DeiT-B.
4. ``ffn.json``: one FFN at batch 128 (the first of each model, on the input it receives there):
   the training form (reference ops), ``torch.compile`` of the deployed form (inductor fuses the
   reference ops), the deployed form's fused kernels, and the vanilla model's ``Mlp``; beside them the
   traffic model's roofline ratio (:mod:`vitblocks.kernels.traffic`), and the launch configuration each
   kernel chose per shape (the fastest of its candidates, timed on its first call).
5. ``profile.txt``: the CUDA kernels of one batch of deployed IFFN-S and AFBO-PoolFormer-S12.
6. ``summary.md``: the tables, with the targets and the papers' own ratios beside ours, the model's
   ratio beside the measured one, and the model's table with its assumptions.

A step whose file exists is skipped, so a job stopped by its wall-clock limit (``--time-limit``:
no step starts after it) resumes where it stopped when the command is run again; ``--redo`` runs
every step again. Rehearsal on the CPU (what ``tests/test_gpu_check.py`` runs):
``--device cpu --tiny``: tiny models, 32-pixel images, batch 2, one timed batch.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import timm
import torch
from torch import nn

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.deploy import reparameterize
from vitblocks.kernels.traffic import ffn_model, model_table
from vitblocks.layers import AFBO, IFFN
from vitblocks.profile import benchmark_models, step_timer
from vitblocks.profile.precision import fp32_precision, precision_settings

ROOT = Path(__file__).resolve().parents[1]
STEPS = ('env', 'kernels', 'models', 'ffn', 'profile', 'summary')
SETTINGS = (('tf32', 'tf32', None), ('strict', 'strict', None), ('bf16', 'tf32', 'bf16'))  # name, fp32 mode, amp
# vanilla timm model -> deployed vitblocks models timed beside it (one interleaved group each)
GROUPS = {
    'deit_tiny_patch16_224': ('iffn_deit_tiny_patch16_224', 'afbo_deit_tiny_patch16_224'),
    'deit_small_patch16_224': ('iffn_deit_small_patch16_224',),
    'deit_base_patch16_224': ('iffn_deit_base_patch16_224', 'repa_deit_base_patch16_224'),
    'swin_tiny_patch4_window7_224': ('afbo_swin_tiny_patch4_window7_224',),
    'poolformer_s12': ('afbo_poolformer_s12',),
    'poolformer_s24': ('afbo_poolformer_s24',),
}
GROUP_OF = {variant: vanilla for vanilla, variants in GROUPS.items() for variant in variants}
# throughput vs vanilla, fp32 batch 128 at TF32 parity: the targets, and the papers' own ratios where printed
TARGETS = {'iffn_deit_tiny_patch16_224': 1.00, 'iffn_deit_small_patch16_224': 1.05, 'iffn_deit_base_patch16_224': 1.10,
           'afbo_poolformer_s12': 0.88, 'afbo_poolformer_s24': 0.87, 'afbo_swin_tiny_patch4_window7_224': 0.81,
           'repa_deit_base_patch16_224': 1.60}
PAPER = {'afbo_poolformer_s12': '0.88 (AFBO Table 2)', 'afbo_poolformer_s24': '0.87 (AFBO Table 2)',
         'afbo_swin_tiny_patch4_window7_224': '0.81 (AFBO Table 2)',
         'repa_deit_base_patch16_224': '1.67 (RePa Table 1)'}
FFN_CASES = ('iffn_deit_tiny_patch16_224', 'iffn_deit_small_patch16_224', 'iffn_deit_base_patch16_224',
             'afbo_deit_tiny_patch16_224', 'afbo_poolformer_s12')


def create(name: str, args) -> nn.Module:
    """``timm.create_model``; with --tiny at 32 pixels (models without an image size, PoolFormer, take any)."""
    if args.tiny and 'poolformer' not in name:
        return timm.create_model(name, img_size=32)
    return timm.create_model(name)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument('--out', type=Path, default=Path('gpu_check'), help='folder for the result files')
    p.add_argument('--device', default='cuda', help="'cuda' (default) or 'cpu' for a rehearsal with --tiny")
    p.add_argument('--steps', nargs='+', choices=STEPS, default=list(STEPS), help='steps to run (default: all)')
    p.add_argument('--batch-size', type=int, default=128)
    p.add_argument('--warmup', type=int, default=5, help='untimed batches per model (default 5)')
    p.add_argument('--repeats', type=int, default=15, help='timed batches per model (default 15)')
    p.add_argument('--models', nargs='+', choices=sorted(TARGETS.keys() | set(FFN_CASES)), default=None,
                   help='only these vitblocks models (with their vanilla models; default: all)')
    p.add_argument('--time-limit', type=float, default=None, help='seconds: no step starts after this')
    p.add_argument('--redo', action='store_true', help='run steps whose files exist again')
    p.add_argument('--tiny', action='store_true', help='tiny inputs: a rehearsal of the whole command on the CPU')
    args = p.parse_args(argv)
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        p.error('--device cuda but torch sees no CUDA GPU; rehearse on the CPU with --device cpu --tiny')
    if args.device == 'cpu' and not args.tiny:
        p.error('--device cpu times the CPU paths at full size for hours; use --tiny for a rehearsal')
    if args.tiny:
        args.batch_size, args.warmup, args.repeats = 2, 0, 1
    return args


def write(path: Path, text: str) -> None:
    """Write ``text`` atomically: a reader (or a resumed run) never sees a half-written file."""
    tmp = path.with_name(path.name + '.tmp')
    tmp.write_text(text)
    os.replace(tmp, path)


def build(name: str, args) -> nn.Module:
    """The model in its deployed form (a vanilla timm model has nothing to fuse: an eval-mode copy)."""
    return reparameterize(create(name, args), inplace=True)


def image_size(args):
    return (3, 32, 32) if args.tiny else (3, 224, 224)


def step_env(args) -> dict:
    env = {'torch': torch.__version__, 'timm': timm.__version__, 'python': platform.python_version(),
           'device': args.device, 'precision_defaults': precision_settings()}
    try:
        import triton
        env['triton'] = triton.__version__
    except ImportError:
        env['triton'] = None
    if args.device.startswith('cuda'):
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return env


def step_kernels(args) -> str:
    cmd = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
           str(ROOT / 'tests' / 'test_fused_kernels.py')]
    if args.tiny:  # the rehearsal: one kernel test is enough to show the step works
        cmd += ['-k', 'test_dwconv_act_residual_without_bias']
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return f'$ {" ".join(cmd)}\nexit code {run.returncode}\n\n{run.stdout[-6000:]}{run.stderr[-2000:]}'


def step_models(args) -> dict:
    rows, size = [], image_size(args)
    for vanilla, variants in GROUPS.items():
        variants = tuple(v for v in variants if args.models is None or v in args.models)
        if not variants:
            continue
        models = {name: build(name, args) for name in (vanilla,) + variants}
        for setting, mode, amp in SETTINGS:
            with fp32_precision(mode) as precision:
                res = benchmark_models(models, args.batch_size, size, warmup=args.warmup, repeats=args.repeats,
                                       device=args.device, amp=amp)
            base = res[vanilla].median_ms
            for name, r in res.items():
                rows.append(dict(model=name, baseline=vanilla, setting=setting, precision=precision, amp=amp,
                                 batch_size=args.batch_size, median_ms=r.median_ms, p10_ms=r.p10_ms, p90_ms=r.p90_ms,
                                 images_per_s=r.images_per_s, throughput_vs_baseline=base / r.median_ms))
        del models
        if args.device.startswith('cuda'):
            torch.cuda.empty_cache()
    return {'rows': rows}


def first_ffn(model: nn.Module):
    """(qualified name, module) of the model's first IFFN or AFBO layer."""
    return next((n, m) for n, m in model.named_modules() if isinstance(m, (IFFN, AFBO)))


def ffn_input(model: nn.Module, qualname: str, size, batch_size: int, device) -> torch.Tensor:
    """What the module ``qualname`` receives for a batch: captured at batch 1, repeated with noise."""
    seen = []
    handle = model.get_submodule(qualname).register_forward_hook(lambda m, inp, out: seen.append(inp[0]))
    with torch.inference_mode():
        model(torch.randn(1, *size))
    handle.remove()
    x = seen[0]
    return (x.expand(batch_size, *x.shape[1:]) + 0.01 * torch.randn(batch_size, *x.shape[1:])).to(device)


def time_calls(fns: dict, device, warmup: int, repeats: int) -> dict:
    """Median ms per call of each function, interleaved, under inference mode."""
    times = {name: [] for name in fns}
    with torch.inference_mode():
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        for _ in range(repeats):
            for name, fn in fns.items():
                timer = step_timer(device)
                timer.start()
                fn()
                times[name].append(timer.stop())
    return {name: statistics.median(t) for name, t in times.items()}


def step_ffn(args) -> dict:
    rows = []
    for name in FFN_CASES:
        if args.models is not None and name not in args.models:
            continue
        training = create(name, args).eval()
        qualname, layer = first_ffn(training)
        vanilla = create(GROUP_OF[name], args).eval()
        mlp = vanilla.get_submodule(qualname).to(args.device)
        x = ffn_input(training, qualname, image_size(args), args.batch_size, args.device)
        layer = layer.to(args.device)
        deployed = layer.fuse()
        # the rehearsal traces without inductor's minutes of C++ compilation
        compiled = torch.compile(deployed, backend='eager' if args.tiny else 'inductor')
        fns = {'training form (reference ops)': lambda: layer(x), 'torch.compile (deployed)': lambda: compiled(x),
               'fused kernels (deployed)': lambda: deployed._forward_fused(x), 'vanilla Mlp': lambda: mlp(x)}
        roofline = ffn_model(name, 128)  # the traffic model at the real shapes, batch 128
        for setting, mode, amp in SETTINGS[::2]:  # tf32 and bf16
            autocast = torch.autocast(x.device.type, dtype=torch.bfloat16) if amp else nullcontext()
            # torch.compile in the fp32 setting only: each compilation costs tens of seconds of the check's minutes
            timed = {k: f for k, f in fns.items() if not (amp and k.startswith('torch.compile'))}
            with fp32_precision(mode) as precision, autocast:
                ms = time_calls(timed, args.device, max(args.warmup, 1), args.repeats)
            ms = {k: ms.get(k) for k in fns}  # every column in one order; None: not timed
            model = roofline[setting]
            rows.append(dict(model=name, layer=qualname, input_shape=list(x.shape), setting=setting,
                             precision=precision, ms=ms,
                             fused_vs_mlp=ms['vanilla Mlp'] / ms['fused kernels (deployed)'],
                             model_fused_vs_mlp=model['ratio'], model_ms=model['ms']))
        torch._dynamo.reset()
    from vitblocks.kernels._common import LaunchTuner  # needs Triton, which the fused kernels need anyway
    return {'rows': rows, 'launch_configs': LaunchTuner.table()}


def step_profile(args) -> str:
    from torch.profiler import ProfilerActivity, profile
    out = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith('cuda') else [])
    sort = 'cuda_time_total' if args.device.startswith('cuda') else 'cpu_time_total'
    size = image_size(args)
    for name in ('iffn_deit_small_patch16_224', 'afbo_poolformer_s12'):
        if args.models is not None and name not in args.models:
            continue
        model = build(name, args).to(args.device)
        x = torch.randn(args.batch_size, *size, device=args.device)
        with torch.inference_mode(), fp32_precision('tf32'):
            model(x)
            with profile(activities=activities) as prof:
                model(x)
                if args.device.startswith('cuda'):
                    torch.cuda.synchronize()
        out.append(f'## {name}, batch {args.batch_size}, fp32 (TF32)\n'
                   + prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))
    return '\n\n'.join(out)


def step_summary(out: Path) -> str:
    lines = ['# GPU check', '']
    env = json.loads((out / 'env.json').read_text()) if (out / 'env.json').exists() else {}
    lines += [f"{env.get('gpu', env.get('device', '?'))}; torch {env.get('torch')}, Triton {env.get('triton')}, "
              f"CUDA {env.get('cuda')}", '']
    if (out / 'models.json').exists():
        rows = json.loads((out / 'models.json').read_text())['rows']
        lines += ['## Whole models: throughput vs the vanilla model (same run, batch %d)' % rows[0]['batch_size'], '',
                  '| model | vs | fp32 (TF32) | fp32 (strict) | bf16 | target | paper |',
                  '| --- | --- | ---: | ---: | ---: | ---: | --- |']
        for name in [r['model'] for r in rows if r['setting'] == 'tf32' and r['model'] != r['baseline']]:
            ratio = {r['setting']: r['throughput_vs_baseline'] for r in rows if r['model'] == name}
            base = next(r['baseline'] for r in rows if r['model'] == name)
            target = TARGETS.get(name)
            lines.append(f"| {name} | {base} | {ratio['tf32']:.2f}x | {ratio['strict']:.2f}x | {ratio['bf16']:.2f}x | "
                         f"{f'>= {target:.2f}x' if target else '-'} | {PAPER.get(name, '-')} |")
        lines.append('')
    if (out / 'ffn.json').exists():
        ffn = json.loads((out / 'ffn.json').read_text())
        rows = ffn['rows']
        lines += ['## One FFN: ms per call, and fused vs Mlp: measured beside the model', '',
                  '| model (layer) | setting | ' + ' | '.join(rows[0]['ms'])
                  + ' | fused vs Mlp, measured | model (roofline, batch 128): H100 / H200 |',
                  '| --- | --- |' + ' ---: |' * (len(rows[0]['ms']) + 2)]
        for r in rows:
            model = r['model_fused_vs_mlp']
            lines.append(f"| {r['model']} ({r['layer']}) | {r['setting']} | "
                         + ' | '.join('-' if v is None else f'{v:.3f}' for v in r['ms'].values())
                         + f" | {r['fused_vs_mlp']:.2f}x | {model['H100']:.2f}x / {model['H200']:.2f}x |")
        lines += ['', '## Launch configurations chosen (fastest candidate per shape)', '',
                  '| kernel | shape key | configuration | candidate |', '| --- | --- | --- | ---: |']
        for c in ffn.get('launch_configs', []):
            lines.append(f"| {c['kernel']} | `{c['key']}` | {c['config']} | {c['candidate']} |")
        if not ffn.get('launch_configs'):
            lines.append('| (none timed: the interpreter runs each kernel\'s first candidate) | | | |')
        lines += ['', '## Traffic model of one FFN', '',
                  model_table(sorted({r['model'] for r in rows}, key=FFN_CASES.index), 128, TARGETS), '']
    if (out / 'kernels.txt').exists():
        tail = (out / 'kernels.txt').read_text().strip().splitlines()
        lines += ['## Kernel tests', '', f'`{tail[0]}`: {tail[1]}; {tail[-1]}', '']
    return '\n'.join(lines)


def main(argv=None):
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    files = {'env': 'env.json', 'kernels': 'kernels.txt', 'models': 'models.json', 'ffn': 'ffn.json',
             'profile': 'profile.txt', 'summary': 'summary.md'}
    for step in STEPS:
        if step not in args.steps:
            continue
        path = args.out / files[step]
        if path.exists() and not args.redo and step != 'summary':
            print(f'{step}: {path} exists, skipped')
            continue
        if args.time_limit is not None and time.monotonic() - start > args.time_limit:
            print(f'{step}: not started, past the time limit of {args.time_limit:.0f} s; run again to resume')
            continue
        t0 = time.monotonic()
        result = {'env': step_env, 'kernels': step_kernels, 'models': step_models, 'ffn': step_ffn,
                  'profile': step_profile, 'summary': lambda a: step_summary(a.out)}[step](args)
        write(path, result if isinstance(result, str) else json.dumps(result, indent=1))
        print(f'{step}: {path} ({time.monotonic() - t0:.0f} s)', flush=True)
    print((args.out / 'summary.md').read_text() if (args.out / 'summary.md').exists() else '')


if __name__ == '__main__':
    main()
