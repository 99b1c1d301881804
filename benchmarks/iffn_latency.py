"""IFFN inference latency relative to its baseline, and where the time goes (CPU).

Command (results and discussion: docs/iffn_speed.md):

    .venv/bin/python benchmarks/iffn_latency.py                 # eager: training form, deployed
    .venv/bin/python benchmarks/iffn_latency.py --compile       # + torch.compile of both models
    .venv/bin/python benchmarks/iffn_latency.py --threads 2 --runs 5 --breakdown-repeats 0   # target, 5 runs
    .venv/bin/python benchmarks/iffn_latency.py --threads 2 --runs 5 --breakdown-repeats 0 --steady-malloc
    .venv/bin/python benchmarks/iffn_latency.py --threads 2 --breakdown-repeats 0 --steady-malloc \
        --compile --compile-chunk-bytes 8388608 16777216    # + compiled with batch slices kept

Target: the deployed IFFN-S at most 0.95x the latency of DeiT-S at batch 32; the line
after the eager table gives the verdict on the median over ``--runs`` interleaved runs (model
order reversed every other run) with their min / median / max.

What is measured, all at ``--batch-size`` (32) in inference mode (eval + torch.inference_mode),
the models interleaved batch by batch in one run (vitblocks.profile.benchmark_models), so
drift and other load on the machine hit every model alike:

1. end to end, median wall-clock ms per batch and images/s of
   * the IFFN model in training form (eval mode, straightforward eager code),
   * the IFFN model deployed with ``vitblocks.deploy.reparameterize`` (BN folded, inference path),
   * the baseline (also passed through ``reparameterize``; DeiT has nothing to fold),
   and the ratios IFFN / baseline;
2. with ``--compile``: ``torch.compile`` of the deployed IFFN model and of the baseline, same
   protocol, so the ratio compares compiled with compiled; ``--compile-chunk-bytes B [B ...]`` adds
   the compiled deployed model with its batch slices of B bytes kept while torch.compile traces (the
   layer itself runs the whole batch when compiled, ``batch_slice_size``), in the same interleaved run;
3. a per-component breakdown of one FFN (the first block's, on the input it really receives,
   e.g. 32 x 196 tokens x 384 channels for iffn_deit_small): every ATen op the FFN runs is timed
   wall-clock (median over repeats, ms per batch) and attributed to a component in execution
   order (fc1 -> activations -> norm C' -> depthwise block -> fc2 -> output norm), with copies
   (concat, contiguous) listed as layout copies. torch.profiler is not used: on this VM its CPU
   timestamps come in 4 ms steps.
"""
import argparse
import copy
import platform
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Callable, Dict, List, Optional
from unittest import mock

import timm
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import vitblocks  # noqa: F401  (registers the iffn_* models with timm)
from vitblocks.deploy import reparameterize
from vitblocks.layers import IFFNDeployed
from vitblocks.layers import iffn_deployed as iffn_layer
from vitblocks.layers.layout import slice_step
from vitblocks.layers.rational_gelu import RationalGELU
from vitblocks.models import find_ffn_slots
from vitblocks.profile import count_macs, fault_note, fixed_threads, input_size_of

from _ratio_runs import (add_malloc_option, apply_malloc_option, does_work, forward_ops, interleaved_runs,
                         target_line)

TARGET = 0.95  # deployed IFFN-S / DeiT-S median latency, batch 32


def add_model_options(p: argparse.ArgumentParser) -> None:
    """``--models IFFN_MODEL BASELINE`` and ``--batch-size`` (also benchmarks/iffn_slices.py)."""
    p.add_argument('--models', nargs=2, metavar=('IFFN_MODEL', 'BASELINE'),
                   default=['iffn_deit_small_patch16_224', 'deit_small_patch16_224'],
                   help='the IFFN model and its baseline (default: %(default)s)')
    p.add_argument('--batch-size', type=int, default=32, help='images per batch (default 32)')


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    p.add_argument('--threads', type=int, help="torch intra-op threads (default: torch's default)")
    p.add_argument('--warmup', type=int, default=3, help='untimed batches per model (default 3)')
    p.add_argument('--repeats', type=int, default=10, help='timed batches per model, median reported (default 10)')
    p.add_argument('--runs', type=int, default=1,
                   help='interleaved eager runs; the target line gives min/median/max of the ratio (default 1)')
    p.add_argument('--compile', action='store_true', help='also time torch.compile of both models')
    p.add_argument('--breakdown-repeats', type=int, default=10,
                   help='timed FFN calls per variant for the breakdown (default 10; 0 skips it)')
    p.add_argument('--chunk-bytes', type=int,
                   help='IFFNDeployed.inference_chunk_bytes for the deployed model: batch slices of this many bytes of '
                        'hidden features, 0 = whole batch (default: the layer\'s, 8 MiB)')
    p.add_argument('--compile-chunk-bytes', type=int, nargs='+', metavar='BYTES', default=[],
                   help='with --compile: also time the compiled deployed model with batch slices of BYTES of hidden '
                        'features kept while torch.compile traces (one model per value; the layer itself runs '
                        'the whole batch when compiled)')
    add_malloc_option(p, '--glibc-no-mmap')  # the old name of the option
    args = p.parse_args(argv)
    if args.compile_chunk_bytes and not args.compile:
        p.error('--compile-chunk-bytes times compiled models: add --compile')
    if any(b <= 0 for b in args.compile_chunk_bytes):
        p.error(f'--compile-chunk-bytes takes positive byte counts (the whole batch is the plain compiled row), '
                f'got {args.compile_chunk_bytes}')
    return args


@contextmanager
def slices_while_compiling():
    """IFFN's batch slices also while torch.compile traces: the layer's ``batch_slice_size`` without its
    compile check. Keep it on while the compiled models run (dynamo guards on the function it traced)."""
    with mock.patch.object(iffn_layer, 'batch_slice_size', slice_step):
        yield


def iffn_copy(model: nn.Module, **settings) -> nn.Module:
    """A copy of ``model`` with IFFNDeployed class settings set on each of its deployed IFFN layers, e.g.
    ``inference_chunk_bytes=0`` (the whole batch) or ``compile_rational_gelu=False`` (torch's GELU)."""
    unknown = [name for name in settings if not hasattr(IFFNDeployed, name)]
    if unknown:
        raise ValueError(f'IFFN has no setting {", ".join(unknown)}')
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, IFFNDeployed):
            for name, value in settings.items():
                setattr(m, name, value)
    return model


def cpu_name() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or 'unknown CPU'


def table(header: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    def fmt(r):
        return '  '.join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return '\n'.join([fmt(header), fmt(['-' * w for w in widths])] + [fmt(r) for r in rows])


def latency_rows(results, baseline_key: str, costs: Optional[Dict[str, tuple]] = None) -> List[List[str]]:
    base = results[baseline_key]
    rows = []
    for name, r in results.items():
        # each round times every model once, back to back: the ratio within a round cancels slow drift
        per_round = statistics.median(t / b for t, b in zip(r.times_ms, base.times_ms))
        rows.append([name, f'{r.median_ms:.1f}', f'{r.p10_ms:.1f}', f'{r.p90_ms:.1f}', f'{r.images_per_s:.1f}',
                     f'{r.median_ms / base.median_ms:.3f}x', f'{per_round:.3f}x']
                    + ([str(c) for c in costs[name]] if costs else []))
    return rows


LATENCY_HEADER = ['model', 'median ms/batch', 'p10 ms', 'p90 ms', 'images/s', 'vs baseline', 'per-round ratio']


# ----------------------------------------------------------------------------- breakdown

class OpTimer(TorchDispatchMode):
    """Time every ATen op (wall clock, CPU ops are synchronous) and label it with ``classify``."""

    def __init__(self, classify: Callable):
        super().__init__()
        self.classify = classify
        self.totals: Dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.totals[self.classify(func, args)] += (time.perf_counter() - t0) * 1e3
        return out


COMPONENTS = ['fc1', "activations (+concat)", "norm C'", 'depthwise block', 'layout copies', 'fc2',
              'output norm', 'other ops']
_COPIES = {'cat', 'clone', 'contiguous', '_to_copy', 'copy_', 'copy'}


def make_classifier(c_in: int, c_hidden: int, c_out: int):
    """Attribute ops to FFN components by execution order: a component starts at its marker op.

    Markers: the matmul/1x1 conv reading ``c_in`` channels is fc1, the one reading ``c_hidden``
    channels is fc2, the LayerNorm over ``c_hidden`` is the hidden norm, the depthwise conv starts
    the depthwise block; element-wise ops belong to the component they follow.
    """
    state = {'phase': 'other ops'}
    after = {'fc1': 'activations (+concat)', "norm C'": 'depthwise block', 'depthwise block': 'depthwise block',
             'fc2': 'other ops', 'output norm': 'other ops'}

    def marker(name: str, args) -> Optional[str]:
        if name in ('addmm', 'mm', 'linear'):
            mat = args[1] if name == 'addmm' else args[0]
            return {c_in: 'fc1', c_hidden: 'fc2'}.get(mat.shape[-1])
        if name in ('conv2d', 'convolution', '_convolution', 'mkldnn_convolution'):
            w = args[1]
            if w.shape[-1] == 1 and w.shape[-2] == 1 and w.shape[1] > 1:  # 1x1 conv = channels-first fc
                return {c_in: 'fc1', c_hidden: 'fc2'}.get(w.shape[1])
            return 'depthwise block'
        if name in ('native_layer_norm', 'layer_norm'):
            return {c_hidden: "norm C'", c_out: 'output norm'}.get(args[0].shape[-1])
        return None

    def classify(func, args) -> str:
        name = func.__name__.split('.')[0]
        m = marker(name, args)
        if m is not None:
            state['phase'] = after[m]
            return m
        if name in _COPIES:
            return 'layout copies'
        if not does_work(func):
            return 'other ops'
        return state['phase']
    return classify


def ffn_dims(ffn: nn.Module):
    fc1, fc2 = ffn.fc1, ffn.fc2
    def dims(m):
        return (m.in_features, m.out_features) if isinstance(m, nn.Linear) else (m.in_channels, m.out_channels)
    (c_in, _), (c_hidden, c_out) = dims(fc1), dims(fc2)
    return c_in, c_hidden, c_out


def first_ffn(model: nn.Module):
    """(qualified name, module) of the first channel MLP of a supported timm model."""
    parent, attr, qualname, _ = find_ffn_slots(model)[0]
    return qualname, getattr(parent, attr)


def first_ffn_and_input(model: nn.Module, batch_size: int, input_size):
    """The first channel MLP of ``model`` and the tensor it receives in a real forward."""
    qualname, ffn = first_ffn(model)
    seen = {}
    handle = ffn.register_forward_pre_hook(lambda m, args: seen.setdefault('x', args[0].clone()))
    try:
        with torch.inference_mode():
            model(torch.randn(batch_size, *input_size))
    finally:
        handle.remove()
    return qualname, ffn, seen['x']


def breakdown(ffns: Dict[str, tuple], repeats: int, num_threads: Optional[int]):
    """Per-component ms per call (median over ``repeats``) of several (ffn, input) pairs, interleaved."""
    per_call = {name: defaultdict(list) for name in ffns}
    whole = {name: [] for name in ffns}
    with fixed_threads(num_threads), torch.inference_mode():
        for ffn, x in ffns.values():  # warm-up
            ffn(x)
        for _ in range(repeats):
            for name, (ffn, x) in ffns.items():
                t0 = time.perf_counter()
                ffn(x)
                whole[name].append((time.perf_counter() - t0) * 1e3)
                with OpTimer(make_classifier(*ffn_dims(ffn))) as timer:
                    ffn(x)
                for comp in COMPONENTS:
                    per_call[name][comp].append(timer.totals.get(comp, 0.0))
                per_call[name]['sum of ops'].append(sum(timer.totals.values()))
    med = {name: {c: statistics.median(v) for c, v in comps.items()} for name, comps in per_call.items()}
    return med, {name: statistics.median(v) for name, v in whole.items()}


# ----------------------------------------------------------------------------- main

def baseline_with_rational_gelu(model: nn.Module) -> Optional[nn.Module]:
    """A copy of the baseline with every exact ``nn.GELU`` replaced by ``RationalGELU`` (None if it has none):
    the same GELU formula on both sides, so the ratio shows what the IFFN architecture alone gains."""
    model, found = copy.deepcopy(model), False
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.GELU) and child.approximate == 'none':
                setattr(parent, name, RationalGELU())
                found = True
    return model if found else None


def compiled_rows(args, deployed: nn.Module, baseline: nn.Module, size, threads: int) -> None:
    """``--compile``: the compiled deployed model (rational GELUs, the default; torch's GELU; batch slices
    kept) against the compiled baseline, plain and with the rational GELU, over ``--runs`` interleaved runs."""
    iffn_name, base_name = args.models
    base_key = f'{base_name} (baseline, compiled)'
    # with slices kept while tracing, the plain compiled rows must run the whole batch explicitly
    plain = iffn_copy(deployed, inference_chunk_bytes=0) if args.compile_chunk_bytes else deployed
    eager = {f'{iffn_name} (deployed, compiled)': plain,
             f'{iffn_name} (deployed, compiled, torch GELU)': iffn_copy(plain, compile_rational_gelu=False)}
    eager.update({f'{iffn_name} (deployed, compiled, {b / 2 ** 20:g} MiB slices)':
                  iffn_copy(deployed, inference_chunk_bytes=b)
                  for b in args.compile_chunk_bytes})
    eager[base_key] = baseline
    rational_base = baseline_with_rational_gelu(baseline)
    if rational_base is not None:
        eager[f'{base_name} (baseline, compiled, rational GELU)'] = rational_base
    compiled = {name: torch.compile(m) for name, m in eager.items()}
    compile_s, x = {}, torch.randn(args.batch_size, *size)
    with slices_while_compiling() if args.compile_chunk_bytes else nullcontext():
        with fixed_threads(args.threads), torch.inference_mode():
            for name, m in compiled.items():
                ref = (baseline if name.startswith(f'{base_name} ') else deployed)(x)
                t0 = time.perf_counter()
                out = m(x)
                compile_s[name] = time.perf_counter() - t0
                rel = ((out - ref).abs().max() / ref.abs().max()).item()
                print(f'{name}: max relative difference to eager {rel:.1e}')
        runs = interleaved_runs(compiled, args.runs, batch_size=args.batch_size, input_size=size, warmup=args.warmup,
                                repeats=args.repeats, num_threads=args.threads)
    print(f'\ntorch.compile (default mode, inductor), ms per batch of {args.batch_size}'
          + (f' (the last of {args.runs} runs)' if args.runs > 1 else '') + '; first call (compile): '
          + ', '.join(f'{n} {s:.0f} s' for n, s in compile_s.items()))
    print(table(LATENCY_HEADER, latency_rows(runs[-1], base_key)))
    iffn_key = f'{iffn_name} (deployed, compiled)'
    ratios = [r[iffn_key].median_ms / r[base_key].median_ms for r in runs]
    print(target_line(f'compiled deployed {iffn_name} / compiled {base_name} latency, batch {args.batch_size}, '
                      f'{threads} thread(s)', ratios, TARGET, at_least=False))
    if rational_base is not None:
        same = [r[iffn_key].median_ms / r[f'{base_name} (baseline, compiled, rational GELU)'].median_ms for r in runs]
        print(f'same GELU formula in both (the baseline with RationalGELU): median {statistics.median(same):.3f}x '
              f'[{", ".join(f"{v:.3f}" for v in same)}]')


def build_models(iffn_name: str, base_name: str):
    """(IFFN model in training form, eval mode; its deployed form; the baseline through ``reparameterize``),
    random weights from seed 0 (also benchmarks/iffn_slices.py)."""
    torch.manual_seed(0)
    iffn_train = timm.create_model(iffn_name).eval()
    baseline = reparameterize(timm.create_model(base_name))
    return iffn_train, reparameterize(iffn_train), baseline


def main(argv=None):
    args = parse_args(argv)
    allocator = apply_malloc_option(args)
    iffn_name, base_name = args.models
    iffn_train, deployed, baseline = build_models(iffn_name, base_name)
    if args.chunk_bytes is not None:
        deployed = iffn_copy(deployed, inference_chunk_bytes=args.chunk_bytes)
    size = input_size_of(iffn_train)
    threads = args.threads or torch.get_num_threads()

    with torch.inference_mode():  # the deployed model computes the same function
        x = torch.randn(2, *size)
        ref = iffn_train(x)
        rel = ((deployed(x) - ref).abs().max() / ref.abs().max()).item()
    macs_iffn, macs_base = count_macs(iffn_train).total, count_macs(baseline).total

    print(f'torch {torch.__version__}, timm {timm.__version__}, {cpu_name()}, {threads} threads, {allocator}')
    print(f'{iffn_name} vs {base_name}: batch {args.batch_size} x {"x".join(map(str, size))}, inference mode '
          f'(eval + torch.inference_mode), {args.warmup} warm-up + {args.repeats} timed batches per model, interleaved')
    print(f'MACs per image: {macs_iffn / 1e9:.3f} G vs {macs_base / 1e9:.3f} G = {macs_iffn / macs_base:.3f}x; '
          f'deployed vs training form: max relative difference {rel:.1e}')
    chunk = args.chunk_bytes if args.chunk_bytes is not None else IFFNDeployed.inference_chunk_bytes
    print('deployed IFFN: BN folded, inference path, '
          + (f'batch slices of {chunk / 2 ** 20:.1f} MiB of hidden features\n' if chunk else 'whole batch at once\n'))

    models = {f'{iffn_name} (training form, eval)': iffn_train, f'{iffn_name} (deployed)': deployed,
              f'{base_name} (baseline)': baseline}
    runs = interleaved_runs(models, args.runs, batch_size=args.batch_size, input_size=size, warmup=args.warmup,
                            repeats=args.repeats, num_threads=args.threads)
    x = torch.randn(args.batch_size, *size)
    with fixed_threads(args.threads):
        # (ops, fresh pages) per forward; the pages of the last run's timed batches (median)
        costs = {name: (forward_ops(m, x), runs[-1][name].median_page_faults) for name, m in models.items()}
    print('eager, ms per batch of', args.batch_size, f'(the last of {args.runs} runs)' if args.runs > 1 else '')
    print(table(LATENCY_HEADER + ['ops/forward', 'faults/forward'],
                latency_rows(runs[-1], f'{base_name} (baseline)', costs)))
    note = fault_note({name: c[1] for name, c in costs.items() if name != f'{iffn_name} (training form, eval)'},
                      args.steady_malloc)
    if note:
        print(note)
    ratios = [r[f'{iffn_name} (deployed)'].median_ms / r[f'{base_name} (baseline)'].median_ms for r in runs]
    print(target_line(f'deployed {iffn_name} / {base_name} latency, batch {args.batch_size}, {threads} thread(s)',
                      ratios, TARGET, at_least=False))

    if args.compile:
        compiled_rows(args, deployed, baseline, size, threads)

    if args.breakdown_repeats > 0:
        qual_i, ffn_train, x_i = first_ffn_and_input(iffn_train, args.batch_size, size)
        _, ffn_dep = first_ffn(deployed)
        qual_b, ffn_base, x_b = first_ffn_and_input(baseline, args.batch_size, size)
        variants = {'Mlp (baseline)': (ffn_base, x_b), 'IFFN training form': (ffn_train, x_i),
                    'IFFN deployed': (ffn_dep, x_i)}
        comps, whole = breakdown(variants, args.breakdown_repeats, args.threads)
        print(f'\nwhere the time goes: one FFN ({qual_i}; baseline {qual_b}), input {tuple(x_i.shape)} '
              f'(baseline {tuple(x_b.shape)}), ms per call, median of {args.breakdown_repeats}')
        rows = [[c] + [f'{comps[v][c]:.2f}' for v in variants] for c in COMPONENTS + ['sum of ops']]
        rows.append(['whole FFN, untimed ops'] + [f'{whole[v]:.2f}' for v in variants])
        rows.append(['whole FFN vs Mlp'] + [f'{whole[v] / whole["Mlp (baseline)"]:.2f}x' for v in variants])
        print(table(['component'] + list(variants), rows))
        print("(per-op timing adds ~10 us of Python per op; 'other ops' = views and allocations; the deployed "
              'FFN runs its components once per batch slice)')


if __name__ == '__main__':
    main()
