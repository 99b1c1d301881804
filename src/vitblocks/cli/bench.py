"""`vitblocks bench MODEL [--baseline MODEL]`: latency and throughput, measured interleaved."""
import platform
from pathlib import Path

import timm
import torch
from timm.utils import reparameterize_model

from ..deploy.io import model_sizes, read_deployed_metadata, recorded_preprocessing
from ..experiments.runlog import write_json
from ..profile import (AMP_DTYPES, COMPILE_MODES, AllocatorError, BenchOptionError, amp_kernel_note, benchmark_models,
                       check_bench_options, count_params, fault_note, input_size_of, steady_malloc, timm_record)
from .common import (CliError, add_model_size_args, build_model, check_writable_file, model_size_kwargs,
                     non_negative_int, parse_block_cfg, positive_int, render_table, resolve)
from .export import deployed_model

NAME = 'bench'

EPILOG = """\
examples:
  vitblocks bench iffn_deit_tiny_patch16_224 --baseline deit_tiny_patch16_224
  vitblocks bench iffn_deit_tiny_patch16_224 --baseline deit_tiny_patch16_224 --reparam --batch-size 8 --threads 1
  vitblocks bench iffn_poolformer_s12 --train --batch-size 16 --repeats 5
  vitblocks bench deit_tiny_patch16_224 --img-size 32 --num-classes 10 --batch-size 64
  vitblocks bench repa_deit_base_patch16_224 --baseline deit_base_patch16_224 --reparam --device cuda \\
      --batch-size 128 --amp bf16 --compile --json repa_b.json
  vitblocks bench repa_deit_tiny_patch16_224 --weights deployed.safetensors --baseline deit_tiny_patch16_224
  vitblocks bench afbo_deit_tiny_patch16_224 --baseline deit_tiny_patch16_224 --threads 2 --steady-malloc

--num-classes / --img-size build MODEL and the baseline alike; --weights (a deployed safetensors file,
implies --reparam) brings its own, which the baseline is then built with, and is timed at the input size
the file records (unless --img-size or --input-size is given).

Models run one timed batch each per round (interleaved), so machine drift hits them alike. Times are
ms per batch (median, p10, p90 over --repeats batches): wall clock on the CPU, CUDA events on a GPU
(after synchronizing). images/s is batch size / median. "vs baseline" is median time / baseline
median time (< 1 is faster); on the CPU "fresh pages" is the median of the minor page faults of a
timed batch (pages the kernel zero-filled). --compile compiles each model first (the first call,
timed apart); --json writes one record per model with timm benchmark.py's fields (infer_samples_per_sec,
infer_step_time, ..., param_count: timm's samples/s is batch / mean time) plus ours.
On the CPU, glibc's malloc hands large activations out as fresh pages the kernel zero-fills, to one
model more than the other depending on the process's allocation history; --steady-malloc makes it
keep freed memory (as a caching allocator such as jemalloc would), so the ratio compares compute.
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
                   help='deploy every model first with timm.utils.reparameterize_model (calls fuse(): IFFN and AFBO '
                        'become IFFNDeployed / AFBODeployed, with their fast CPU path and fused CUDA kernels; IFFN '
                        'folds its BatchNorm into the depthwise conv)')
    p.add_argument('--weights', metavar='PATH',
                   help='a deployed safetensors file of MODEL (vitblocks.deploy.io.save_deployed); implies --reparam')
    p.add_argument('--train', action='store_true', help='time forward + backward in train mode')
    p.add_argument('--device', default='cpu', help='cpu (default), cuda or cuda:N')
    p.add_argument('--amp', choices=tuple(AMP_DTYPES), help='run under torch.autocast in bfloat16 or float16')
    p.add_argument('--channels-last', action='store_true', help='model and input in channels-last memory format')
    p.add_argument('--compile', action='store_true', help='torch.compile every model (inductor) before timing')
    p.add_argument('--compile-mode', choices=COMPILE_MODES, help="torch.compile's mode (default: torch's default)")
    p.add_argument('--steady-malloc', action='store_true',
                   help='CPU: glibc keeps every freed block (no fresh zero-filled pages after warm-up, for any '
                        'model; vitblocks.profile.steady_malloc)')
    p.add_argument('--json', metavar='PATH', help="also write the results as JSON, in timm benchmark.py's fields")
    p.add_argument('--block-cfg', nargs='+', metavar='KEY=VALUE',
                   help='override the block config of MODEL (a vitblocks model), e.g. kernel_size=5')
    p.set_defaults(run=run)


def _check_args(args) -> None:
    if args.reparam and args.train:
        raise CliError('--reparam gives an inference-only model; drop --train or --reparam')
    if args.weights and args.train:
        raise CliError('--weights loads a deployed (inference-only) model; drop --train or --weights')
    if args.steady_malloc and args.device.split(':')[0] != 'cpu':
        raise CliError(f'--steady-malloc changes how host (CPU) memory is reused; it does nothing on '
                       f'--device {args.device}: drop it')
    try:
        check_bench_options(args.device, args.amp, args.compile, args.compile_mode)
    except BenchOptionError as e:
        reason = e.reason.replace('add compile', 'add --compile')
        raise CliError(f'--{e.option.replace("_", "-")} {e.value}: {reason}') from None
    if args.json:
        check_writable_file(Path(args.json), '--json')  # before the run, not after it


def _models(args, name, baseline):
    size_kwargs = model_size_kwargs(args)
    block_cfg = parse_block_cfg(args.block_cfg)
    if args.weights:
        model = deployed_model(name, args.weights, block_cfg, size_kwargs)
        size_kwargs = model_sizes(model)  # the baseline is built at the file's sizes
    else:
        model = build_model(name, block_cfg, size_kwargs)
    models = {name: model}
    if baseline:
        models[f'{baseline} (baseline)'] = _baseline(baseline, size_kwargs, from_file=bool(args.weights))
    if args.reparam or args.weights:  # --weights implies --reparam: the baseline is compared deployed too
        models = {k: reparameterize_model(m.eval()) for k, m in models.items()}
    return models


def _baseline(name: str, sizes: dict, from_file: bool):
    """The baseline at the model's sizes. The img_size a deployed file records is passed only to a baseline that
    takes one: PoolFormer and the other any-size models are built without it (both run at the model's input)."""
    try:
        return build_model(name, base_kwargs=sizes)
    except CliError:
        if not (from_file and 'img_size' in sizes):
            raise
        return build_model(name, base_kwargs={k: v for k, v in sizes.items() if k != 'img_size'})


def _input_size(args, model) -> tuple:
    """(C, H, W) to time: --input-size; else, for --weights without --img-size, the input size the deployed file
    records (a PoolFormer deployed from a 32 px run is timed at 32 px, not at its config's 224); else the model's."""
    if args.input_size:
        return tuple(args.input_size)
    if args.weights and not args.img_size:
        recorded = recorded_preprocessing(read_deployed_metadata(Path(args.weights))).get('input_size')
        if recorded:
            return tuple(int(v) for v in recorded)
    return input_size_of(model)


def run(args) -> int:
    _check_args(args)
    allocator = None
    if args.steady_malloc:  # before any model or batch is allocated
        try:
            allocator = f'steady malloc (glibc {steady_malloc()})'
        except AllocatorError as e:
            raise CliError(f'--steady-malloc: {e}') from None
    name = resolve(args.model)
    baseline = resolve(args.baseline) if args.baseline else None
    models = _models(args, name, baseline)
    params = {k: count_params(m) for k, m in models.items()}  # before compiling (and timm counts them so too)
    size = _input_size(args, models[name])
    try:
        results = benchmark_models(models, batch_size=args.batch_size, input_size=size, warmup=args.warmup,
                                   repeats=args.repeats, num_threads=args.threads, device=args.device,
                                   train=args.train, amp=args.amp, channels_last=args.channels_last,
                                   compile=args.compile, compile_mode=args.compile_mode)
    except (AssertionError, RuntimeError, ValueError) as e:  # e.g. a fixed-size ViT given --input-size 3 64 64
        raise CliError(f'forward on a {"x".join(map(str, size))} input failed: {type(e).__name__}: '
                       f'{" ".join(str(e).split())[:300]}') from None
    device = torch.device(args.device)
    where = (f'{args.device} ({torch.cuda.get_device_name(device)})' if device.type == 'cuda' else
             f'cpu, {args.threads or torch.get_num_threads()} threads')
    mode = 'train (forward + backward)' if args.train else 'inference (eval + torch.inference_mode)'
    options = [f'amp {args.amp}' if args.amp else 'fp32', 'channels-last' if args.channels_last else '',
               f'torch.compile (mode {args.compile_mode or "default"})' if args.compile else '',
               'reparameterized' if args.reparam or args.weights else '', allocator or '']
    print(f'batch {args.batch_size} x {size[0]}x{size[1]}x{size[2]} on {where}, {mode}, '
          f'{", ".join(o for o in options if o)}')
    print(f'{args.warmup} warm-up + {args.repeats} timed batches per model, interleaved; times in ms per batch'
          + (', CUDA events' if device.type == 'cuda' else ''))
    note = amp_kernel_note(device, args.amp)
    if note:
        print(note)
    if args.compile:
        print('compile (first call): ' + ', '.join(f'{k} {r.compile_s:.1f} s' for k, r in results.items()))

    ref = results[f'{baseline} (baseline)'] if baseline else None
    cpu = device.type == 'cpu'
    rows = []
    for label, r in results.items():
        ratio = f'{r.median_ms / ref.median_ms:.2f}x' if ref else '-'
        rows.append([label, f'{r.median_ms:.1f}', f'{r.p10_ms:.1f}', f'{r.p90_ms:.1f}', f'{r.images_per_s:.1f}',
                     ratio] + ([f'{r.median_page_faults:,}'] if cpu else []))
    header = ['model', 'median ms', 'p10 ms', 'p90 ms', 'images/s', 'vs baseline'] + (['fresh pages'] if cpu else [])
    print('\n'.join(render_table(header, rows, 'l' + 'r' * (len(header) - 1))))
    note = fault_note({k: r.median_page_faults for k, r in results.items()}, args.steady_malloc, 'batch') \
        if cpu else ''
    if note:
        print(note)
    if args.json:
        _write_json(args, results, params, size, ref, device)
    return 0


def _write_json(args, results, params, size, ref, device) -> None:
    """One timm-style record per model, with the run's settings in timm's vocabulary."""
    settings = {'precision': {'bf16': 'amp_bfloat16', 'fp16': 'amp'}.get(args.amp, 'float32'),  # timm's names
                'channels_last': args.channels_last, 'torchcompile': 'inductor' if args.compile else None,
                'torchcompile_mode': args.compile_mode, 'reparam': bool(args.reparam or args.weights),
                'weights': args.weights, 'device': str(device),
                'device_name': torch.cuda.get_device_name(device) if device.type == 'cuda' else
                platform.processor() or platform.machine(),
                'threads': None if device.type == 'cuda' else args.threads or torch.get_num_threads(),
                'steady_malloc': args.steady_malloc,
                'warmup': args.warmup, 'repeats': args.repeats, 'torch': torch.__version__, 'timm': timm.__version__}
    records = []
    for label, r in results.items():
        record = timm_record(r, params[label], size[-1], args.train, ref)
        record.update(model=label.removesuffix(' (baseline)'), baseline=label.endswith(' (baseline)'), **settings)
        records.append(record)
    try:
        write_json(Path(args.json), records)
    except OSError as e:
        raise CliError(f'--json {args.json}: cannot write it ({e.strerror or e}); the results are printed above') \
            from None
    print(f'wrote {args.json} ({len(records)} records)')
