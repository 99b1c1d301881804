"""One deployed IFFN FFN at several batch-slice sizes against its baseline's ``Mlp`` (CPU).

Command (results: docs/iffn_speed.md, "CPU speed target, 2026-11-28"):

    .venv/bin/python benchmarks/iffn_slices.py --threads 2 --steady-malloc
    .venv/bin/python benchmarks/iffn_slices.py --threads 2 --steady-malloc --chunk-bytes 8388608 16777216 0

The whole-model ratio of ``iffn_latency.py --chunk-bytes B`` moves by a few percent from run to run on a
noisy host, more than the slice size changes it. This times the first block's FFN alone, on the input it
really receives in a forward (e.g. 32 x 196 x 384 for iffn_deit_small), once per slice size
(``IFFNDeployed.inference_chunk_bytes``; 0 = the whole batch) and the baseline's first ``Mlp`` on its own input,
all interleaved round by round. Printed per size: the median ms per call, the ratio of medians to the
``Mlp``, and the per-round ratio (the median of each round's ratio, less moved by drift).
"""
import argparse
import statistics
import sys
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ratio_runs import add_malloc_option, apply_malloc_option  # noqa: E402
from iffn_latency import add_model_options, build_models, first_ffn, first_ffn_and_input  # noqa: E402

from vitblocks.layers import IFFNDeployed  # noqa: E402
from vitblocks.profile import fixed_threads, input_size_of, interleaved_times  # noqa: E402

MIB = 2 ** 20
DEFAULT_SIZES = [1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, 0]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    p.add_argument('--chunk-bytes', type=int, nargs='+', metavar='BYTES', default=DEFAULT_SIZES,
                   help='slice sizes in bytes of hidden features, 0 = whole batch (default: 1, 2, 4, 8, 16, 32 MiB, 0)')
    p.add_argument('--threads', type=int, help="torch intra-op threads (default: torch's default)")
    p.add_argument('--warmup', type=int, default=3, help='untimed rounds (default 3)')
    p.add_argument('--repeats', type=int, default=25, help='timed rounds, medians reported (default 25)')
    add_malloc_option(p)
    args = p.parse_args(argv)
    if any(b < 0 for b in args.chunk_bytes):
        p.error(f'--chunk-bytes takes byte counts >= 0 (0 = whole batch), got {args.chunk_bytes}')
    if len(set(args.chunk_bytes)) != len(args.chunk_bytes):
        p.error(f'--chunk-bytes names a size twice: {args.chunk_bytes}')
    if args.repeats < 1 or args.warmup < 0:
        p.error(f'--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}')
    return args


def main(argv=None):
    args = parse_args(argv)
    allocator = apply_malloc_option(args)
    iffn_name, base_name = args.models
    iffn_train, deployed, baseline = build_models(iffn_name, base_name)
    qual_i, ffn = first_ffn(deployed)
    if not isinstance(ffn, IFFNDeployed):
        raise SystemExit(f'{iffn_name}: its first FFN ({qual_i}) is a {type(ffn).__name__}, not a deployed IFFN')
    size = input_size_of(iffn_train)
    _, _, x_i = first_ffn_and_input(iffn_train, args.batch_size, size)
    qual_b, mlp, x_b = first_ffn_and_input(baseline, args.batch_size, size)

    def sliced(b):
        def call():
            ffn.inference_chunk_bytes = b
            ffn(x_i)
        return call

    with fixed_threads(args.threads), torch.inference_mode():
        times = interleaved_times({**{b: sliced(b) for b in args.chunk_bytes}, 'base': lambda: mlp(x_b)},
                                  args.repeats, warmup=args.warmup)
    base = times.pop('base')

    threads = args.threads or torch.get_num_threads()
    print(f'torch {torch.__version__}, timm {timm.__version__}, {threads} threads, {allocator}')
    print(f'{iffn_name} deployed {qual_i}, input {tuple(x_i.shape)}, against {base_name} {qual_b}, input '
          f'{tuple(x_b.shape)}; {args.warmup} warm-up + {args.repeats} timed rounds, interleaved')
    base_ms = statistics.median(base)
    print(f'{"slice":>12}  {"median ms":>9}  {"vs Mlp":>6}  {"per-round":>9}')
    for b, ts in times.items():
        label = f'{b / MIB:g} MiB' if b else 'whole batch'
        per_round = statistics.median(t / m for t, m in zip(ts, base))
        print(f'{label:>12}  {statistics.median(ts):9.2f}  {statistics.median(ts) / base_ms:5.3f}x  {per_round:8.3f}x')
    print(f'{"Mlp":>12}  {base_ms:9.2f}  {1:5.3f}x  {1:8.3f}x')


if __name__ == '__main__':
    main()
