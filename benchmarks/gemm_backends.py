"""The GEMMs of DeiT, deployed RePa and IFFN through MKL (``F.linear``) and through oneDNN (CPU).

Command (results: docs/repa.md, "Other GEMM backends"):

    .venv/bin/python benchmarks/gemm_backends.py --threads 2 --steady-malloc

Speeding up the GEMMs of a deployed model by a different backend is no gain of the block if the
baseline's GEMMs gain as much. This times each linear-layer shape of vanilla DeiT-S/B, deployed RePa-DeiT-B
(the one-GEMM unit ``C -> 2C`` at theta 0.75, and fc2) and deployed IFFN-S at the benchmarks' batches
(B x 197 or B x 196 tokens) through torch's ``F.linear`` (MKL's sgemm on x86) and through oneDNN's
linear (``torch.ops.mkldnn._linear_pointwise``, what inductor's CPU freezing emits, here with an
unpacked weight), fp32, interleaved, median ms per call, and GMAC/s.
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _ratio_runs import add_malloc_option, apply_malloc_option  # noqa: E402

from vitblocks.profile import fixed_threads, interleaved_times  # noqa: E402

# (label, tokens per image, in, out, images): the repo's benchmark batches (DeiT-B 16, DeiT-S 32)
SHAPES = [
    ('DeiT-S fc1', 197, 384, 1536, 32),
    ('DeiT-S fc2', 197, 1536, 384, 32),
    ('IFFN-S fc1 (C -> 2C)', 196, 384, 768, 32),
    ('IFFN-S fc2, one 6-image slice', 196, 1536, 384, 6),
    ('DeiT-B qkv', 197, 768, 2304, 16),
    ('DeiT-B fc1', 197, 768, 3072, 16),
    ('DeiT-B fc2', 197, 3072, 768, 16),
    ('RePa-B deployed unit (C -> 2C)', 197, 768, 1536, 16),
    ('RePa-B deployed fc2', 197, 768, 768, 16),
]


def onednn_linear():
    """oneDNN's linear, or a SystemExit saying why this torch has none."""
    if not torch.backends.mkldnn.is_available():
        raise SystemExit('this torch was built without oneDNN (torch.backends.mkldnn.is_available() is False)')
    op = getattr(torch.ops.mkldnn, '_linear_pointwise', None)
    if op is None:
        raise SystemExit(f'torch {torch.__version__} has no torch.ops.mkldnn._linear_pointwise')
    return lambda x, w, b: op(x, w, b, 'none', [], '')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--threads', type=int, help="torch intra-op threads (default: torch's default)")
    p.add_argument('--warmup', type=int, default=3, help='untimed rounds (default 3)')
    p.add_argument('--repeats', type=int, default=15, help='timed rounds, medians reported (default 15)')
    p.add_argument('--scale', type=float, default=1.0,
                   help='multiply the token counts (M) by this, e.g. 0.01 for a smoke run (default 1)')
    add_malloc_option(p)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.scale <= 0:
        p.error(f'--repeats must be >= 1, --warmup >= 0 and --scale > 0, got {args.repeats}, {args.warmup}, '
                f'{args.scale}')
    allocator = apply_malloc_option(args)
    onednn = onednn_linear()
    threads = args.threads or torch.get_num_threads()
    print(f'torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {threads} threads, {allocator}; '
          f'fp32, {args.warmup} warm-up + {args.repeats} timed rounds, interleaved')
    print(f'{"shape":32} {"M x K -> N":>20} {"F.linear ms":>11} {"GMAC/s":>6} {"oneDNN ms":>9} {"GMAC/s":>6} '
          f'{"F.linear/oneDNN":>15}')
    gen = torch.Generator().manual_seed(0)
    with fixed_threads(args.threads), torch.inference_mode():
        for label, tokens, k, n, images in SHAPES:
            m = max(1, round(tokens * images * args.scale))
            x = torch.randn(m, k, generator=gen)
            w = torch.randn(n, k, generator=gen) * k ** -0.5
            b = torch.zeros(n)
            ref, out = F.linear(x, w, b), onednn(x, w, b)
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-4:
                raise SystemExit(f'{label}: oneDNN and F.linear differ by {err:.1e} (relative); not the same GEMM')
            times = interleaved_times({'mkl': lambda: F.linear(x, w, b), 'onednn': lambda: onednn(x, w, b)},
                                      args.repeats, warmup=args.warmup)
            mkl_ms, dnn_ms = statistics.median(times['mkl']), statistics.median(times['onednn'])
            gmac = m * k * n / 1e9
            print(f'{label:32} {f"{m} x {k} -> {n}":>20} {mkl_ms:11.2f} {gmac / mkl_ms * 1e3:6.0f} {dnn_ms:9.2f} '
                  f'{gmac / dnn_ms * 1e3:6.0f} {mkl_ms / dnn_ms:14.2f}x')


if __name__ == '__main__':
    main()
