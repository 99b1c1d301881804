"""Profile the first deployed IFFN/AFBO FFN of a model with torch.profiler: its CPU inference path with and
without batch slicing, and the forward as dispatched (off the CPU the reference path, since 2026-11-23).

Why (docs/gpu_speed.md): on the H100 the deployed IFFN-Ti/S/B ran at 0.27-0.60x vanilla DeiT at batch 128
and AFBO at 0.37-0.66x its backbone, far below their CPU ratios. Both inference paths cut the batch into
slices sized for a CPU's caches (IFFN 8 MiB of hidden features, AFBO 2 MiB per intra-op thread), which on
a GPU means 10-43 launches of every kernel per FFN. The hypothesis to check: the FFN is host-bound (CPU time
per forward well above its CUDA time) with slicing on, and fast with it off (budget 0 = whole batch).

    PYTHONPATH=src python scripts/gpu_profile15.py iffn_deit_small_patch16_224   # on the GPU machine, repo root
    PYTHONPATH=src python scripts/gpu_profile15.py afbo_poolformer_s12 --amp bf16

For each of the three it prints the FFN's slice and kernel counts, its CPU and CUDA time
per forward (median of --repeats profiled calls on the FFN's real input, captured by a hook) and
torch.profiler's table of the ops by device time.
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from vitblocks.cli.common import CliError, build_model
from vitblocks.deploy import reparameterize
from vitblocks.layers import AFBO, IFFN

sys.path.insert(0, str(Path(__file__).parent))
from gpu_issue15 import size_kwargs  # noqa: E402  (the sizes the speed tables' dry runs use)


def ffn_input(model: torch.nn.Module, ffn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input ``ffn`` (a module of ``model``) receives in a forward of ``x``."""
    seen = []
    handle = ffn.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    model(x)
    handle.remove()
    return seen[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('model', help='an iffn_* or afbo_* model, e.g. iffn_deit_small_patch16_224')
    p.add_argument('--batch', type=int, default=128, help='batch size (default 128, the papers\' setting)')
    p.add_argument('--device', default='cuda')
    p.add_argument('--amp', choices=('bf16',), help='bf16 autocast (default fp32)')
    p.add_argument('--img-size', type=int, help='build the model at this image size (CPU dry runs)')
    p.add_argument('--repeats', type=int, default=5, help='profiled FFN calls per budget (default 5)')
    p.add_argument('--rows', type=int, default=12, help='rows of the profiler table (default 12)')
    args = p.parse_args(argv)
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        p.error('--device cuda but torch sees no GPU; run it on the GPU machine (or --device cpu for a dry run)')
    size = args.img_size or 224
    try:
        model = build_model(args.model, base_kwargs=size_kwargs(args.model, args.img_size))
    except CliError as e:
        p.error(str(e))
    model = reparameterize(model).to(args.device).eval()
    ffn = next((m for m in model.modules() if isinstance(m, (IFFN, AFBO))), None)
    if ffn is None:
        p.error(f'{args.model} has no IFFN or AFBO module; give an iffn_* or afbo_* model')
    device = torch.device(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=args.amp == 'bf16'):
        h = ffn_input(model, ffn, torch.randn(args.batch, 3, size, size, device=device))
        # the CPU inference path as the committed H100 tables ran it (the layer's CPU-sized slices), the same
        # path on the whole batch, and the forward as dispatched now (off the CPU: the reference path)
        variants = [('inference path, slice budget', ffn._forward_inference, type(ffn).inference_chunk_bytes),
                    ('inference path, slice budget', ffn._forward_inference, 0),
                    ('forward as dispatched', ffn, type(ffn).inference_chunk_bytes)]
        for label, forward, budget in variants:
            ffn.inference_chunk_bytes = budget
            for _ in range(3):  # warm-up: cuDNN's algorithm choice, the allocator
                forward(h)
            cpu_ms, dev_ms = [], []
            for _ in range(args.repeats):
                with profile(activities=activities) as prof:
                    forward(h)
                    if device.type == 'cuda':
                        torch.cuda.synchronize()
                events = prof.key_averages()
                cpu_ms.append(sum(e.self_cpu_time_total for e in events) / 1e3)
                dev_ms.append(sum(e.self_device_time_total for e in events) / 1e3)
            kernels = sum(e.count for e in events if e.device_type.name == 'CUDA')
            convs = sum(e.count for e in events if e.key == 'aten::conv2d')  # depthwise convs: 1 (IFFN), 2 (AFBO)
            slices = convs // (2 if isinstance(ffn, AFBO) else 1)  # per batch slice
            per_thread = ' per thread' if isinstance(ffn, AFBO) else ''
            what = f'{label} {budget / 2 ** 20:g} MiB{per_thread}' if forward is not ffn else label
            print(f'{args.model} first {type(ffn).__name__}, input {tuple(h.shape)}, {args.amp or "fp32"}, {what}: '
                  f'{slices} batch slice(s), {kernels} CUDA kernels, CPU {statistics.median(cpu_ms):.2f} ms, '
                  f'CUDA {statistics.median(dev_ms):.2f} ms per forward (median of {args.repeats})')
            sort = 'self_cuda_time_total' if device.type == 'cuda' else 'self_cpu_time_total'
            print(events.table(sort_by=sort, row_limit=args.rows))
    return 0


if __name__ == '__main__':
    sys.exit(main())
