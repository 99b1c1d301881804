"""The GPU speed sweep: every model group at every setting, resumable, one JSON file per run.

A *group* is one backbone with its variants, timed interleaved in one run (vitblocks.profile.
benchmark_models), so each ratio to the vanilla backbone is a same-run ratio:

  deit_tiny/small/base   vanilla, RePa (training form), RePa deployed, IFFN deployed
  vit_large              vanilla, RePa, RePa deployed
  swin_tiny              vanilla, RePa, RePa deployed, AFBO, GLU (M=4), SwiGLU
  swin_base              vanilla, RePa, RePa deployed
  poolformer_s12         vanilla, RePa, RePa deployed, AFBO, GLU (M=4), SwiGLU
  poolformer_s24         vanilla, AFBO, GLU (M=4), SwiGLU
  poolformer_s36         vanilla, RePa, RePa deployed
  mixer_b16              vanilla, RePa, RePa deployed

RePa's backbones are those of its Tables 1 and 2, AFBO's those of its Table 11 (GLU with M = 4
there; SwiGLU at M = 8/3, the parameter-matched counterpart of AFBO's Table 1). A *setting* is
(precision fp32 | bf16 autocast, eager | torch.compile, batch 128 | 1); the paper's own setting,
fp32 eager batch 128, comes first, compiled runs last (they cost the most GPU time).

Each finished (setting, group) is written to OUT/<setting>/<group>.json (atomically: a temp file,
then os.replace) with the records of `vitblocks bench --json` (timm benchmark.py's fields); a
later call skips what exists, so calls under a time budget add up. OUT/env.json records the GPU,
driver, torch, CUDA and timm versions; a folder measured on another setup is refused, so one table never mixes
two machines. scripts/gpu_job.sh runs it inside a GPU job with a time limit and resumes it in the next job; for a
dry run on the CPU: --device cpu --img-size 32 --batches 1 --warmup 0 --repeats 1 --groups deit_tiny.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import timm
import torch

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.cli.common import build_model
from vitblocks.deploy import reparameterize
from vitblocks.profile import benchmark_models, count_params, timm_record

REPA = ('repa', 'repa_deployed')
AFBO = ('afbo', 'glu4', 'swiglu')
GROUPS = {
    'deit_tiny': ('deit_tiny_patch16_224', REPA + ('iffn_deployed',)),
    'deit_small': ('deit_small_patch16_224', REPA + ('iffn_deployed',)),
    'deit_base': ('deit_base_patch16_224', REPA + ('iffn_deployed',)),
    'vit_large': ('vit_large_patch16_224', REPA),
    'swin_tiny': ('swin_tiny_patch4_window7_224', REPA + AFBO),
    'swin_base': ('swin_base_patch4_window7_224', REPA),
    'poolformer_s12': ('poolformer_s12', REPA + AFBO),
    'poolformer_s24': ('poolformer_s24', AFBO),
    'poolformer_s36': ('poolformer_s36', REPA),
    'mixer_b16': ('mixer_b16_224', REPA),
}
# the full sweep (the defaults below): 2 x 2 x 2 settings x 10 groups = 80 runs
MODES, PRECISIONS, BATCHES = ('eager', 'compile'), ('fp32', 'bf16'), (128, 1)


def size_kwargs(name: str, img_size) -> dict:
    """timm kwargs that build ``name`` (a backbone or a vitblocks model on it) for ``img_size`` (None: its default)."""
    if not img_size or 'poolformer' in name:
        return {}  # PoolFormer takes any input size
    if 'swin' in name:  # a dry run's tiny Swin: windows that fit
        return {'img_size': img_size, 'window_size': max(1, img_size // 32)}
    return {'img_size': img_size}


def build_variant(base: str, variant: str, size_kwargs: dict) -> torch.nn.Module:
    """One model of a group, in eval mode (deployed variants re-parameterized)."""
    if variant == 'vanilla':
        return build_model(base, base_kwargs=size_kwargs)
    if variant in ('repa', 'repa_deployed', 'iffn_deployed', 'afbo'):
        model = build_model(f'{variant.split("_")[0]}_{base}', base_kwargs=size_kwargs)
        return reparameterize(model) if variant.endswith('_deployed') else model
    if variant == 'glu4':
        return build_model(base, {'expansion': 4}, size_kwargs, ffn='glu')  # AFBO Table 11's GLU (M = 4)
    if variant == 'swiglu':
        return build_model(base, {}, size_kwargs, ffn='swiglu')  # M = 8/3: the FFN's parameters
    raise ValueError(f'unknown variant {variant}')


def settings(args):
    """(name, precision, compile, batch) in the order they run: the paper's setting first."""
    out = []
    for compiled in args.compile:
        for precision in args.precisions:
            for batch in args.batches:
                out.append((f'{precision}-{compiled}-b{batch}', precision, compiled == 'compile', batch))
    return out


def environment(device: torch.device) -> dict:
    env = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'cudnn': torch.backends.cudnn.version(),
           'timm': timm.__version__, 'python': platform.python_version(), 'device': str(device)}
    if device.type == 'cuda':
        env['gpu'] = torch.cuda.get_device_name(device)
        try:
            env['driver'] = subprocess.run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'],
                                           capture_output=True, text=True, check=True).stdout.split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            env['driver'] = 'unknown (no nvidia-smi)'
    else:
        env['cpu'] = platform.processor() or platform.machine()
    return env


@torch.inference_mode()
def probe(models: dict, size, device: str, precision: str) -> dict:
    """{variant: error} for the models whose eager forward (batch 1) fails in this setting; e.g.
    deployed RePa under autocast (its in-place addmm_ is outside autocast's op list)."""
    failed = {}
    x = torch.randn(1, *size, device=device)
    for v, m in models.items():
        try:
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == 'bf16'):
                m.to(device)(x)
        except RuntimeError as e:
            failed[v] = f'{type(e).__name__}: {" ".join(str(e).split())[:200]}'
    if 'vanilla' in failed:
        raise RuntimeError(f'the vanilla backbone fails: {failed["vanilla"]}')
    return failed


def run_group(args, group: str, precision: str, compiled: bool, batch: int) -> list:
    base, variants = GROUPS[group]
    models = {v: build_variant(base, v, size_kwargs(base, args.img_size)) for v in ('vanilla',) + variants}
    params = {v: count_params(m) for v, m in models.items()}
    size = (3, args.img_size or 224, args.img_size or 224)
    failed = probe(models, size, args.device, precision)  # a model that cannot run here must not stop its group
    for v in failed:
        del models[v]
    results = benchmark_models(models, batch_size=batch, input_size=size, warmup=args.warmup, repeats=args.repeats,
                               device=args.device, amp='bf16' if precision == 'bf16' else None, compile=compiled)
    records = []
    for v, r in results.items():
        rec = timm_record(r, params[v], size[-1], baseline=results['vanilla'])
        rec.update(model=base if v == 'vanilla' else f'{base} {v}', group=group, variant=v,
                   precision='amp_bfloat16' if precision == 'bf16' else 'float32',
                   torchcompile='inductor' if compiled else None, device=args.device)
        records.append(rec)
    records += [{'model': f'{base} {v}', 'group': group, 'variant': v, 'error': e} for v, e in failed.items()]
    for m in models.values():
        m.cpu()
    del models
    torch._dynamo.reset()  # compiled graphs of this group are not needed again
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return records


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f'.{path.name}.tmp')
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)  # a run killed mid-write leaves no half file under the final name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--out', default='runs/gpu_speed', help='results folder (default runs/gpu_speed)')
    p.add_argument('--device', default='cuda')
    p.add_argument('--budget', type=float, default=float('inf'), help='start no new run after this many seconds')
    p.add_argument('--groups', default=','.join(GROUPS), help='comma-separated groups (default all)')
    p.add_argument('--batches', default=','.join(map(str, BATCHES)))
    p.add_argument('--precisions', default=','.join(PRECISIONS))
    p.add_argument('--compile', default=','.join(MODES), help='eager, compile or both (default eager,compile)')
    p.add_argument('--warmup', type=int, default=10, help='untimed batches per model (timm default 10)')
    p.add_argument('--repeats', type=int, default=50, help='timed batches per model (default 50)')
    p.add_argument('--img-size', type=int, help='build every model at this image size (CPU dry runs)')
    args = p.parse_args(argv)
    args.groups = args.groups.split(',')
    args.batches = [int(b) for b in args.batches.split(',')]
    args.precisions = args.precisions.split(',')
    args.compile = args.compile.split(',')
    unknown = [g for g in args.groups if g not in GROUPS] + [c for c in args.compile if c not in ('eager', 'compile')] \
        + [q for q in args.precisions if q not in ('fp32', 'bf16')]
    if unknown:
        p.error(f'unknown {", ".join(unknown)} (groups: {", ".join(GROUPS)}; eager/compile; fp32/bf16)')
    out = Path(args.out)
    env = {**environment(torch.device(args.device)), 'img_size': args.img_size or 224, 'warmup': args.warmup,
           'repeats': args.repeats}
    if (out / 'env.json').is_file():  # resuming: the runs already there must come from the same setup
        before = json.loads((out / 'env.json').read_text())
        changed = [f'{k} {before.get(k)} -> {env.get(k)}'
                   for k in ('gpu', 'cpu', 'torch', 'img_size', 'warmup', 'repeats') if before.get(k) != env.get(k)]
        if changed:
            p.error(f'{out} holds runs measured on another setup ({"; ".join(changed)}): their ratios would be '
                    f'mixed with this machine\'s in one table; give a fresh --out')
    write_json(out / 'env.json', env)
    t0 = time.monotonic()
    todo = [(s, g) for s in settings(args) for g in args.groups if not (out / s[0] / f'{g}.json').is_file()]
    done = 0
    for (name, precision, compiled, batch), group in todo:
        if time.monotonic() - t0 > args.budget:
            break
        t = time.monotonic()
        try:
            records = run_group(args, group, precision, compiled, batch)
        except torch.cuda.OutOfMemoryError as e:  # recorded, so later calls do not retry it
            records = [{'group': group, 'error': f'out of memory: {str(e).splitlines()[0]}'}]
        write_json(out / name / f'{group}.json', records)
        done += 1
        print(f'{name} {group}: {time.monotonic() - t:.0f} s', flush=True)
    left = len(todo) - done
    total = len(settings(args)) * len(args.groups)
    print(f'{total - left} of {total} runs finished' + (f' ({left} left: call again)' if left else ''))
    return 0


if __name__ == '__main__':
    sys.exit(main())
