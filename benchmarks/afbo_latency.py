"""AFBO inference latency relative to its baseline, and each channel map against a dense matmul (CPU).

Command (results and discussion: docs/afbo.md):

    .venv/bin/python benchmarks/afbo_latency.py                 # batch 32, 1 thread, 10 timed batches
    .venv/bin/python benchmarks/afbo_latency.py --threads 2     # torch's default on this 2-core VM
    .venv/bin/python benchmarks/afbo_latency.py --threads 2 --runs 5 --layer-repeats 0   # target + stability
    .venv/bin/python benchmarks/afbo_latency.py --threads 2 --runs 5 --layer-repeats 0 --steady-malloc

Target: AFBO-T at most 1.08x the latency of DeiT-T at batch 32, stable over repeated
runs; the last line of part 1 gives the verdict on the median over ``--runs`` interleaved runs
(model order reversed every other run) with their min / median / max.

What is measured, all in inference mode (eval + torch.inference_mode), wall-clock:

1. end to end: median ms per batch of ``--batch-size`` (32) images for the AFBO model and its
   baseline, measured interleaved batch by batch in one run (vitblocks.profile.benchmark_models),
   so drift and other load on the machine hit both alike; the ratio of the medians is the figure.
   Also per model: ATen ops per forward (with several threads, each is a fork/join of the thread
   pool) and minor page faults per forward (fresh zero-filled pages; the median of the last run's
   timed batches), two load-independent costs.
   Which model gets fresh pages depends on glibc's allocation history in the process;
   ``--steady-malloc`` makes glibc keep freed memory, so neither does (benchmarks/_ratio_runs.py).
2. one FFN on the input it really gets (the first block's, e.g. 32 x 197 tokens x 192 channels for
   DeiT-T): the AFBO layer against timm's Mlp it replaces, interleaved, median ms per call.
3. each channel map (OCCM with G2, GCCM with G1, block-wise with G2, dense) on the same rows,
   against a dense ``torch.mm`` with the same MACs *and* the same (tokens, Md) output: rows of
   K = MACs/Md channels times a (K, Md) matrix, so both move the same output bytes; interleaved
   call by call. "x dense" is map time / dense time: 1.00 means the map costs what its MACs
   cost. Maps run as in the AFBO inference path: ``forward_into`` writes the output in place.

The default is one intra-op thread: this VM's two cores are shared with other jobs, and with two
threads every parallel region waits for whichever thread the OS has descheduled, which hits the
model with more (smaller) ops harder and makes ratios swing from run to run (docs/afbo.md).
"""
import argparse
import os
import platform
import statistics

import timm
import torch
from timm.layers import Mlp

import vitblocks  # noqa: F401  (registers the afbo_* models with timm)
from vitblocks.deploy import reparameterize
from vitblocks.layers import AFBO, AFBODeployed
from vitblocks.layers.channel_maps import create_channel_map, map_cost
from vitblocks.models import find_ffn_slots
from vitblocks.profile import fault_note, fixed_threads, input_size_of, interleaved_times

from _ratio_runs import add_malloc_option, apply_malloc_option, forward_ops, interleaved_runs, target_line

TARGET = 1.08  # AFBO-T / DeiT-T median latency, batch 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--models', nargs=2, metavar=('AFBO_MODEL', 'BASELINE'),
                   default=['afbo_deit_tiny_patch16_224', 'deit_tiny_patch16_224'],
                   help='the AFBO model and its baseline (default: %(default)s)')
    p.add_argument('--batch-size', type=int, default=32, help='images per batch (default 32)')
    p.add_argument('--threads', type=int, default=1, help='torch intra-op threads (default 1, see above)')
    p.add_argument('--warmup', type=int, default=3, help='untimed batches per model (default 3)')
    p.add_argument('--repeats', type=int, default=10, help='timed batches per model, median reported (default 10)')
    p.add_argument('--runs', type=int, default=1,
                   help='interleaved runs of part 1; the target line gives min/median/max of the ratio (default 1)')
    p.add_argument('--layer-repeats', type=int, default=20,
                   help='timed calls per FFN / channel map in parts 2 and 3 (default 20; 0 skips them)')
    p.add_argument('--chunk-bytes', type=int,
                   help=f'AFBODeployed.inference_chunk_bytes (default {AFBODeployed.inference_chunk_bytes}; '
                        f'0 = whole batch at once)')
    p.add_argument('--chunk-max-threads', type=int,
                   help=f'AFBODeployed.inference_chunk_max_threads: slice only with at most this many threads '
                        f'(default {AFBODeployed.inference_chunk_max_threads})')
    add_malloc_option(p)
    return p.parse_args(argv)


def _first_afbo(model) -> AFBO:
    for parent, attr, _, _ in find_ffn_slots(model):
        layer = getattr(parent, attr)
        if isinstance(layer, AFBO):
            return layer
    raise SystemExit('the model has no AFBO layer')


def _ffn_input(model, layer: AFBO, batch_size: int) -> torch.Tensor:
    """The tensor the first AFBO layer receives for a batch (captured with a forward hook, batch 1)."""
    seen = []
    handle = layer.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.inference_mode():
        model(torch.randn(1, *input_size_of(model)))
    handle.remove()
    x = seen[0]
    return x.expand(batch_size, *x.shape[1:]).contiguous() + 0.01 * torch.randn(batch_size, *x.shape[1:])


def end_to_end(args) -> None:
    afbo_name, base_name = args.models
    # the AFBO model deployed (AFBODeployed layers: the fast CPU path), the baseline as it is
    models = {afbo_name: reparameterize(timm.create_model(afbo_name)), base_name: timm.create_model(base_name)}
    size = input_size_of(models[base_name])
    runs = interleaved_runs(models, args.runs, batch_size=args.batch_size, input_size=size,
                            warmup=args.warmup, repeats=args.repeats, num_threads=args.threads)
    with fixed_threads(args.threads):
        ops = {n: forward_ops(m, torch.randn(args.batch_size, *size)) for n, m in models.items()}
    res = runs[-1]
    faults = {n: r.median_page_faults for n, r in res.items()}  # of the timed batches
    base = res[base_name].median_ms
    print(f'\n1. end to end, batch {args.batch_size}, {args.repeats} interleaved batches per model, ms per batch'
          + (f' (the last of {args.runs} runs)' if args.runs > 1 else ''))
    print(f'  {"model":34s} {"median":>8s} {"p10":>8s} {"p90":>8s} {"img/s":>7s} {"vs baseline":>12s} '
          f'{"ops/fwd":>8s} {"faults/fwd":>10s}')
    for name, r in res.items():
        print(f'  {name:34s} {r.median_ms:8.1f} {r.p10_ms:8.1f} {r.p90_ms:8.1f} {r.images_per_s:7.1f} '
              f'{r.median_ms / base:11.3f}x {ops[name]:8d} {faults[name]:10d}')
    note = fault_note(faults, args.steady_malloc)
    if note:
        print('  ' + note)
    ratios = [r[afbo_name].median_ms / r[base_name].median_ms for r in runs]
    print('  ' + target_line(f'{afbo_name} / {base_name} latency, batch {args.batch_size}, {args.threads} thread(s)',
                             ratios, TARGET, at_least=False))


@torch.inference_mode()
def layers(args) -> None:
    model = reparameterize(timm.create_model(args.models[0]))
    layer = _first_afbo(model)
    x = _ffn_input(model, layer, args.batch_size)
    d, hid = layer.in_features, layer.hidden_features
    mlp = Mlp(d, hid).eval()
    with fixed_threads(args.threads):
        t = interleaved_times({'afbo': lambda: layer(x), 'mlp': lambda: mlp(x)}, args.layer_repeats, warmup=2)
    a, m = statistics.median(t['afbo']), statistics.median(t['mlp'])
    print(f'\n2. one FFN on its real input {tuple(x.shape)}, median ms per call ({args.layer_repeats} calls)')
    print(f'  AFBO {a:.2f} ms, timm Mlp {m:.2f} ms: {a / m:.3f}x')

    rows = x.reshape(-1, d)
    g1 = layer.right_map.groups if layer.map_kinds[1] == 'gccm' else 2
    g2 = layer.left_map.groups if layer.map_kinds[0] == 'occm' else 4
    cases = [('occm', g2), ('gccm', g1), ('grouped', g2), ('dense', 1)]
    print(f'\n3. channel maps {d} -> {hid} on {rows.shape[0]} tokens vs a dense mm with equal MACs and output, '
          f'median ms per call ({args.layer_repeats} calls)')
    print(f'  {"map":14s} {"MACs/token":>10s} {"map ms":>8s} {"dense ms":>9s} {"x dense":>8s} {"map GMAC/s":>11s}')
    for kind, groups in cases:
        cmap = create_channel_map(kind, d, hid, groups).eval()
        macs = map_cost(kind, d, hid, groups)['macs']
        k_eq = macs // hid  # same MACs and same output: (T, K) @ (K, Md)
        rows_eq, w_eq = torch.randn(rows.shape[0], k_eq), torch.randn(k_eq, hid)
        out_map, out_eq = rows.new_empty(rows.shape[0], hid), rows.new_empty(rows.shape[0], hid)
        weight = cmap.bmm_weight()
        with fixed_threads(args.threads):
            t = interleaved_times({'map': lambda: cmap.forward_into(rows, out_map, weight),
                                   'dense': lambda: torch.mm(rows_eq, w_eq, out=out_eq)}, args.layer_repeats, warmup=2)
        tm, td = statistics.median(t['map']), statistics.median(t['dense'])
        label = f'{kind} (G={groups})' if kind != 'dense' else 'dense'
        print(f'  {label:14s} {macs:10d} {tm:8.2f} {td:9.2f} {tm / td:7.2f}x {rows.shape[0] * macs / tm / 1e6:11.1f}')


def main(argv=None):
    args = parse_args(argv)
    allocator = apply_malloc_option(args)
    if args.chunk_bytes is not None:
        AFBODeployed.inference_chunk_bytes = args.chunk_bytes
    if args.chunk_max_threads is not None:
        AFBODeployed.inference_chunk_max_threads = args.chunk_max_threads
    load = os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan')
    print(f'{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {load:.1f}; '
          f'torch {torch.__version__}, {args.threads} thread(s), {allocator}, AFBODeployed.inference_chunk_bytes '
          f'{AFBODeployed.inference_chunk_bytes} per thread'
          + (f' up to {AFBODeployed.inference_chunk_max_threads} thread(s)'
             if AFBODeployed.inference_chunk_max_threads else ''))
    torch.manual_seed(0)
    end_to_end(args)
    if args.layer_repeats:
        layers(args)


if __name__ == '__main__':
    main()
