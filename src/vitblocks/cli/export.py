"""`vitblocks export MODEL --format pt2|onnx|safetensors --out PATH`: export a (deployed) model."""
import json
import sys
import time
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..deploy import reparameterize
from ..deploy.export import (DYNAMO_MIN_OPSET, FORMATS, ExportCheckError, ExportDependencyError, check_export,
                             export_onnx, export_pt2, export_torchscript, require_packages, traced_batch_size)
from ..deploy.io import (DeployedCheckpointError, is_deployed_file, load_deployed, read_deployed_metadata,
                         recorded_preprocessing, recorded_sizes, save_deployed)
from ..profile import count_params, input_size_of
from .common import (CliError, add_model_size_args, build_model, check_writable_file, load_trained_model,
                     model_size_kwargs, non_negative_float, parse_block_cfg, positive_int, refuse_exported_file,
                     resolve)

NAME = 'export'

EPILOG = """\
examples:
  vitblocks export repa_deit_base_patch16_224 --reparam --format pt2 --out repa_deit_b.pt2 --check
  vitblocks export repa_deit_base_patch16_224 --reparam --format onnx --out repa_deit_b.onnx --check
  vitblocks export repa_deit_base_patch16_224 --weights deployed.safetensors --format pt2 --out repa_deit_b.pt2
  vitblocks export ninformer_vit_patch4_28 --checkpoint runs/RUN/best.pth --format onnx --out nin.onnx --reparam
  vitblocks export deit_tiny_patch16_224 --num-classes 10 --img-size 32 --format pt2 --out deit32.pt2
  vitblocks export repa_deit_tiny_patch16_224 --checkpoint runs/RUN/best.pth --format safetensors --out d.safetensors

--reparam fuses the model first (vitblocks.deploy.reparameterize): what is exported is the inference
form. --weights loads a deployed checkpoint written by vitblocks.deploy.io.save_deployed into the
model built directly in deploy form (implies --reparam); the file records num_classes, img_size and
in_chans, so they need not be repeated (files written before it did take --num-classes / --img-size).
--checkpoint loads trained weights into the training form (a vitblocks run checkpoint also brings
its num_classes, model_kwargs and input size; other checkpoints take --num-classes / --img-size);
without either the weights are random.
safetensors writes the deployed weights (vitblocks.deploy.io.save_deployed: implies --reparam) with
the model name, sizes and block config, and the preprocessing (input size, mean, std) of a run
checkpoint or --input-size, so `vitblocks eval --checkpoint FILE` evaluates it by the file alone;
--check loads it back by name (load_deployed) and compares it with the model.
pt2 is torch.export + torch.export.save (load it with torch.export.load(PATH).module()). ONNX needs
`pip install onnx onnxscript` (onnxscript for torch's default exporter, which writes PATH.data beside
the file when the weights exceed 2 GB; --onnx-exporter legacy uses torch's TorchScript-based one),
--check of an ONNX file needs onnxruntime. torchscript (torch.jit.trace) is deprecated: use pt2.
Every pt2/onnx/torchscript export is loaded back before it is put in place and run at another batch
size (a .pt2/TorchScript module with autograd on and under no_grad; ONNX in onnxruntime where it is
installed): one that fails or computes other outputs than the model is an error and nothing is
written. --check prints the measured error. A deployed safetensors file records the model name,
sizes, block config, timm kwargs of a vitblocks model, any swap_ffn surgery and its output on a
seeded image, so load_deployed / eval rebuild it by the file alone or refuse it.
"""

# check_export and the loaders tell the formats apart by suffix
SUFFIX = {'pt2': '.pt2', 'onnx': '.onnx', 'safetensors': '.safetensors'}
CHECK_TOL = 1e-3  # --check's default, far above fp32 round-off (docs/repa.md: 1.8e-7 and 6.4e-7 for ONNX)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='export a model (deployed with --reparam) to torch.export (.pt2), ONNX or '
                                         'deployed safetensors',
                              description='Build a model (random init, or deployed weights with --weights), '
                                          'optionally re-parameterize it, and export it to a torch.export program '
                                          '(.pt2), ONNX or a deployed safetensors file; --check compares the '
                                          'exported file with PyTorch on a random batch.',
                              epilog=EPILOG)
    p.add_argument('model', help='timm or vitblocks model name')
    p.add_argument('--format', choices=(*FORMATS, 'safetensors'), required=True,
                   help='pt2 (torch.export), onnx, safetensors (deployed weights + metadata, for vitblocks eval / '
                        'load_deployed), or torchscript (deprecated: torch.jit.trace)')
    p.add_argument('--out', required=True, metavar='PATH', help='file to write (directories are created)')
    p.add_argument('--reparam', action='store_true', help='re-parameterize (fuse) the model before exporting')
    p.add_argument('--weights', metavar='PATH', help='a deployed safetensors checkpoint to load (implies --reparam)')
    p.add_argument('--checkpoint', metavar='PATH',
                   help='trained weights of the training form: a run\'s last.pth/best.pth, a timm .pth, .safetensors')
    add_model_size_args(p)
    p.add_argument('--block-cfg', nargs='+', metavar='KEY=VALUE',
                   help='block config of MODEL (a vitblocks model), e.g. idle_ratio=0.5')
    p.add_argument('--input-size', nargs=3, type=positive_int, metavar=('C', 'H', 'W'),
                   help="input size (default: what the model was built for, or a run checkpoint's input size)")
    p.add_argument('--batch-size', type=positive_int, default=2, metavar='N',
                   help='batch of the example input used for tracing (default 2)')
    p.add_argument('--static-batch', action='store_true',
                   help='fix the batch dimension to --batch-size (default: dynamic)')
    p.add_argument('--opset', type=positive_int, metavar='N', help="ONNX opset (default: the exporter's)")
    p.add_argument('--onnx-exporter', choices=('dynamo', 'legacy'), default='dynamo',
                   help="torch's torch.export-based exporter (default, needs onnxscript) or its TorchScript-based "
                        "one")
    p.add_argument('--check', action='store_true',
                   help='run the exported file (torch.export.load / onnxruntime) and print the max abs error vs '
                        'PyTorch; exit 1 when it exceeds --check-tol')
    p.add_argument('--check-tol', type=non_negative_float, metavar='TOL',
                   help=f'largest max abs error --check accepts (default {CHECK_TOL:g}: fp32 round-off passes, a '
                        f'wrong fold or a frozen dimension does not)')
    p.set_defaults(run=run)


def deployed_model(name: str, weights: str, block_cfg, size_kwargs):
    """A deployed safetensors file loaded by name: the sizes come from the file (given ones must agree)."""
    try:
        return load_deployed(name, weights, block_cfg=block_cfg or None, **size_kwargs)
    except DeployedCheckpointError as e:
        raise CliError(str(e)) from None


def _model(args):
    """(model to export, run checkpoint metadata or {}: its input size, mean, std and config)."""
    name = resolve(args.model)
    block_cfg = parse_block_cfg(args.block_cfg)
    size_kwargs = model_size_kwargs(args)
    if args.weights:
        return deployed_model(name, args.weights, block_cfg, size_kwargs), {}
    if args.checkpoint:
        model, meta = load_trained_model(name, Path(args.checkpoint), block_cfg, size_kwargs)
    else:
        model, meta = build_model(name, block_cfg, size_kwargs), {}
    return (reparameterize(model) if _exports_deployed(args) else model.eval()), meta


def _exports_deployed(args) -> bool:
    """Whether the exported model is the fused form: --reparam, --weights (deployed already), or a
    safetensors file (a deployed file holds the fused form only)."""
    return bool(args.reparam or args.weights or args.format == 'safetensors')


def _save_deployed(args, model, meta, size):
    """``save_deployed`` with the block config and the preprocessing a run trained with, so ``vitblocks eval``
    and ``load_deployed`` need the file alone."""
    block_cfg = parse_block_cfg(args.block_cfg) or meta.get('config', {}).get('model_kwargs', {}).get('block_cfg')
    preprocessing = {k: meta[k] for k in ('mean', 'std') if meta.get(k)}
    if args.input_size or meta.get('input_size'):  # else the model's own, which eval finds without it
        preprocessing['input_size'] = list(size)
    return save_deployed(model, args.out, name=resolve(args.model), block_cfg=block_cfg or None,
                         preprocessing=preprocessing)


def _check_deployed(path: Path, model, size, batch: int) -> float:
    """Max abs error of the file loaded back by its recorded name and sizes (as ``vitblocks eval`` does)."""
    try:
        loaded = load_deployed(None, path)
    except DeployedCheckpointError as e:
        raise CliError(f'wrote {path}, but it does not load by the file alone: {e}') from None
    x = torch.randn(batch, *size)
    return (loaded(x) - model(x)).abs().max().item()


def _check_args(args) -> None:
    if not args.out.strip():
        raise CliError(f'--out is empty; give the file to write, e.g. --out model{SUFFIX.get(args.format, ".pt")}')
    for flag, path in (('--weights', args.weights), ('--checkpoint', args.checkpoint)):
        if path:
            refuse_exported_file(path, flag, 'export from the deployed safetensors file (--weights) or the '
                                             'trained checkpoint (--checkpoint) it was exported from')
    if args.weights and args.checkpoint:
        raise CliError('--weights (deployed) and --checkpoint (training form) both give the weights; pick one')
    if args.checkpoint and is_deployed_file(args.checkpoint):
        raise CliError(f'--checkpoint {args.checkpoint} is a deployed file (save_deployed); pass it as --weights')
    if args.check_tol is not None and not args.check:
        raise CliError('--check-tol is the tolerance of --check; add --check or drop it')
    if args.format == 'safetensors' and args.weights:
        raise CliError(f'--weights {args.weights} is a deployed safetensors file already; copy it instead')
    if args.format == 'safetensors' and args.static_batch:
        raise CliError('--static-batch applies to traced formats (pt2, onnx); a safetensors file holds weights only')
    suffix = Path(args.out).suffix
    want = SUFFIX.get(args.format)
    if want and suffix != want:
        raise CliError(f'--format {args.format} writes a {want} file; name --out {Path(args.out).with_suffix(want)}')
    if args.format == 'torchscript' and suffix in SUFFIX.values():
        raise CliError(f'--format torchscript writes a TorchScript file, not {suffix}; name --out *.pt')
    if args.opset and args.format != 'onnx':
        raise CliError(f'--opset is an ONNX option; drop it for --format {args.format}')
    if args.opset and args.onnx_exporter == 'dynamo' and args.opset < DYNAMO_MIN_OPSET:
        raise CliError(f'--opset {args.opset}: torch\'s dynamo exporter writes opset {DYNAMO_MIN_OPSET} and later '
                       f'(it cannot convert a transformer\'s LayerNormalization down); use --opset '
                       f'{DYNAMO_MIN_OPSET} or later, or --onnx-exporter legacy for older opsets')
    if args.onnx_exporter != 'dynamo' and args.format != 'onnx':
        raise CliError(f'--onnx-exporter is an ONNX option; drop it for --format {args.format}')
    if args.static_batch and args.format == 'torchscript':
        raise CliError('torch.jit.trace fixes what the model fixes; --static-batch applies to pt2 and onnx')


def run(args) -> int:
    _check_args(args)
    check_writable_file(Path(args.out), '--out')  # before a possibly long build and trace
    if args.format == 'onnx':  # a missing package named before the build and the export, not after the file is written
        try:
            dynamo = ('onnxscript',) if args.onnx_exporter == 'dynamo' else ()
            require_packages('onnx', *dynamo, purpose='ONNX export')
            if args.check:
                require_packages('onnxruntime', purpose='checking an ONNX export')
        except ExportDependencyError as e:
            raise CliError(str(e)) from None
    if args.format == 'torchscript':
        print('vitblocks export: warning: --format torchscript is deprecated (torch deprecates TorchScript); use '
              '--format pt2', file=sys.stderr)
    model, meta = _model(args)
    size = tuple(args.input_size or meta.get('input_size') or input_size_of(model))
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            if args.format == 'safetensors':
                path = _save_deployed(args, model, meta, size)
            elif args.format == 'pt2':
                path = export_pt2(model, args.out, input_size=size, batch_size=args.batch_size,
                                  dynamic_batch=not args.static_batch)
            elif args.format == 'onnx':
                path = export_onnx(model, args.out, input_size=size, batch_size=args.batch_size,
                                   dynamic_batch=not args.static_batch, opset=args.opset,
                                   dynamo=args.onnx_exporter == 'dynamo')
            else:
                path = export_torchscript(model, args.out, input_size=size, batch_size=args.batch_size)
    except ExportDependencyError as e:
        raise CliError(str(e)) from None
    except (OSError, SafetensorError) as e:  # a full disk, a quota: writes are atomic, so nothing was replaced
        kept = 'the existing file is unchanged' if Path(args.out).exists() else 'nothing was written'
        raise CliError(f'cannot write {args.out}: {getattr(e, "strerror", None) or e}; {kept}') from None
    except (AssertionError, RuntimeError, ValueError) as e:  # e.g. an input size the model does not take
        raise CliError(f'export on a {"x".join(map(str, size))} input failed: {type(e).__name__}: '
                       f'{" ".join(str(e).split())[:300]}') from None
    deployed = 'deployed' if _exports_deployed(args) else 'training form (no --reparam)'
    weights = f'weights {args.weights or args.checkpoint}' if args.weights or args.checkpoint else 'random init'
    print(f'{args.model}: {count_params(model) / 1e6:.2f} M params, {deployed}, {weights}')
    data = path.with_name(path.name + '.data')  # ONNX external data (weights over 2 GB)
    extra = f' + {data.name} ({data.stat().st_size / 2 ** 20:.1f} MiB)' if args.format == 'onnx' and data.is_file() \
        else ''
    if args.format == 'safetensors':
        metadata = read_deployed_metadata(path)
        built = {k: metadata[k] for k in ('block_cfg', 'build_kwargs') if k in metadata}
        recorded = {**recorded_sizes(metadata), **built, **recorded_preprocessing(metadata)}
        if 'surgery' in metadata:
            recorded['surgery'] = ','.join(step['surgery'] for step in json.loads(metadata['surgery']))
        print(f'wrote safetensors {path} ({path.stat().st_size / 2 ** 20:.1f} MiB, records '
              f'{" ".join(f"{k}={v}" for k, v in recorded.items())})')
    else:
        # a dynamic batch is traced at 2 or more (torch.export fixes a batch of 1); the file runs any batch
        dynamic = not args.static_batch and args.format in ('pt2', 'onnx')
        traced = traced_batch_size(args.batch_size, dynamic and args.onnx_exporter == 'dynamo')
        print(f'wrote {args.format} {path} ({path.stat().st_size / 2 ** 20:.1f} MiB{extra}, input {traced}x'
              f'{"x".join(map(str, size))}{", batch dynamic" if dynamic else ""}, {time.perf_counter() - t0:.1f} s)')
    if args.check:
        batch = args.batch_size if args.static_batch else args.batch_size + 1
        try:
            if args.format == 'safetensors':
                with torch.no_grad():
                    err = _check_deployed(path, model, size, batch)
            else:
                err = check_export(path, model, input_size=size, batch_size=batch)
        except ExportDependencyError as e:
            raise CliError(str(e)) from None
        except ExportCheckError as e:
            print(f'vitblocks export: error: check failed: {e}; the file was written but does not run as it is '
                  f'meant to', file=sys.stderr)
            return 1
        runtime = {'onnx': 'onnxruntime', 'pt2': 'torch.export.load, called with autograd on and under no_grad',
                   'safetensors': 'load_deployed by the file alone'}.get(
            args.format, 'torch.jit.load, called with autograd on and under no_grad')
        print(f'check: max abs error {err:.3g} vs PyTorch ({runtime}, batch {batch})')
        tol = CHECK_TOL if args.check_tol is None else args.check_tol
        if not err <= tol:  # NaN fails too
            print(f'vitblocks export: error: check failed: max abs error {err:.3g} > --check-tol {tol:g}; '
                  f'{args.out} was written but does not compute what the model does', file=sys.stderr)
            return 1
    return 0
