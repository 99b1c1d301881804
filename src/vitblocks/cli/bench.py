"""`vitblocks bench MODEL [--baseline MODEL]`: latency and throughput, measured interleaved."""
import torch
from timm.utils import reparameterize_model

from ..profile import benchmark_models, input_size_of
from .common import (CliError, add_model_size_args, build_model, model_size_kwargs, non_negative_int, parse_block_cfg,
                     positive_int, render_table, resolve)

NAME = 'bench'

EPILOG = """\
examples:
  vitblocks bench iffn_deit_tiny_patch16_224 --baseline deit_tiny_patch16_224
  vitblocks bench iffn_deit_tiny_patch16_224 --baseline deit_tiny_patch16_224 --reparam --batch-size 8 --threads 1
  vitblocks bench iffn_poolformer_s12 --train --batch-size 16 --repeats 5
  vitblocks bench deit_tiny_patch16_224 --img-size 32 --num-classes 10 --batch-size 64

--num-classes / --img-size build MODEL and the baseline alike.

Models run one timed batch each per round (interleaved), so machine drift hits them alike.
Times are wall-clock ms per batch (median, p10, p90 over --repeats batches); images/s is
batch size / median. "vs baseline" is median time / baseline median time (< 1 is faster).
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='latency/throughput of a model, optionally vs a baseline',
                              description='Time the forward pass (or forward + backward with --train) of a model '
                                          'on a random batch, interleaved with an optional baseline.',
                              epilog=EPILOG)
    p.add_argument('model', help='timm or vitblocks model name')
    p.add_argument('--baseline', metavar='MODEL', help='a second model measured in the same run')
    p.add_argument('--batch-size', type=positive_int, metavar='N', default=32, help='images per batch (default 32)')
    p.add_argument('--threads', type=positive_int, metavar='N',
                   help='torch intra-op threads (default: torch\'s default)')
    p.add_argument('--warmup', type=non_negative_int, metavar='N', default=3,
                   help='untimed batches per model (default 3)')
    p.add_argument('--repeats', type=positive_int, metavar='N', default=10, help='timed batches per model (default 10)')
    p.add_argument('--input-size', nargs=3, type=positive_int, metavar=('C', 'H', 'W'),
                   help='input size (default: what the model was built for, usually 3 224 224)')
    add_model_size_args(p)
    p.add_argument('--reparam', action='store_true',
                   help='deploy every model first with timm.utils.reparameterize_model (calls fuse(); IFFN folds '
                        'its BatchNorm into the depthwise conv)')
    p.add_argument('--train', action='store_true', help='time forward + backward in train mode')
    p.add_argument('--device', default='cpu', help='cpu (default) or cuda')
    p.add_argument('--block-cfg', nargs='+', metavar='KEY=VALUE',
                   help='override the block config of MODEL (a vitblocks model), e.g. kernel_size=5')
    p.set_defaults(run=run)


def run(args) -> int:
    name = resolve(args.model)
    baseline = resolve(args.baseline) if args.baseline else None
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        raise CliError(f'--device {args.device}: CUDA is not available here; use --device cpu')
    if args.reparam and args.train:
        raise CliError('--reparam gives an inference-only model; drop --train or --reparam')
    size_kwargs = model_size_kwargs(args)
    models = {name: build_model(name, parse_block_cfg(args.block_cfg), size_kwargs)}
    if baseline:
        models[f'{baseline} (baseline)'] = build_model(baseline, base_kwargs=size_kwargs)
    if args.reparam:
        models = {k: reparameterize_model(m.eval()) for k, m in models.items()}
    size = tuple(args.input_size) if args.input_size else input_size_of(models[name])
    try:
        results = benchmark_models(models, batch_size=args.batch_size, input_size=size, warmup=args.warmup,
                                   repeats=args.repeats, num_threads=args.threads, device=args.device, train=args.train)
    except (AssertionError, RuntimeError, ValueError) as e:  # e.g. a fixed-size ViT given --input-size 3 64 64
        raise CliError(f'forward on a {"x".join(map(str, size))} input failed: {type(e).__name__}: {e}') from None
    threads = args.threads or torch.get_num_threads()
    mode = 'train (forward + backward)' if args.train else 'inference (eval + torch.inference_mode)'
    print(f'batch {args.batch_size} x {size[0]}x{size[1]}x{size[2]} on {args.device}, {threads} threads, {mode}'
          f'{", reparameterized" if args.reparam else ""}')
    print(f'{args.warmup} warm-up + {args.repeats} timed batches per model, interleaved; times in ms per batch')

    ref = results[f'{baseline} (baseline)'].median_ms if baseline else None
    rows = []
    for label, r in results.items():
        ratio = f'{r.median_ms / ref:.2f}x' if ref else '-'
        rows.append([label, f'{r.median_ms:.1f}', f'{r.p10_ms:.1f}', f'{r.p90_ms:.1f}', f'{r.images_per_s:.1f}',
                     ratio])
    print('\n'.join(render_table(['model', 'median ms', 'p10 ms', 'p90 ms', 'images/s', 'vs baseline'], rows,
                                 'lrrrrr')))
    return 0
