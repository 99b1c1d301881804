"""`vitblocks export MODEL --format onnx|torchscript --out PATH`: export a (deployed) model."""
import time
from pathlib import Path

import torch

from ..deploy import reparameterize
from ..deploy.export import FORMATS, ExportDependencyError, check_export, export_onnx, export_torchscript
from ..deploy.io import DeployedCheckpointError, load_deployed
from ..experiments import CheckpointError, ConfigError, load_model_weights, merge
from ..experiments.checkpoint import FORMAT, read_checkpoint
from ..experiments.setup import create_model
from ..profile import count_params, input_size_of
from .common import (CliError, add_model_size_args, build_model, check_writable_file, model_size_kwargs, parse_block_cfg,
                     positive_int, resolve)

NAME = 'export'

EPILOG = """\
examples:
  vitblocks export repa_deit_base_patch16_224 --reparam --format onnx --out repa_deit_b.onnx --check
  vitblocks export repa_deit_base_patch16_224 --weights deployed.safetensors --format onnx --out repa_deit_b.onnx
  vitblocks export repa_poolformer_s12 --reparam --format torchscript --out repa_pf_s12.pt --input-size 3 224 224
  vitblocks export ninformer_vit_patch4_28 --checkpoint runs/RUN/best.pth --format onnx --out nin.onnx --reparam
  vitblocks export deit_tiny_patch16_224 --num-classes 10 --img-size 32 --format torchscript --out deit32.pt

--reparam fuses the model first (vitblocks.deploy.reparameterize): what is exported is the inference
form. --weights loads a deployed checkpoint written by vitblocks.deploy.io.save_deployed into the
model built directly in deploy form (implies --reparam). --checkpoint loads trained weights into the
training form (a vitblocks run checkpoint also brings its num_classes, model_kwargs and input
size; other checkpoints take --num-classes / --img-size); without either the weights are random.
ONNX needs `pip install onnx onnxscript` (onnxscript for torch's default exporter; --onnx-exporter
legacy uses torch's TorchScript-based one), --check of an ONNX file needs onnxruntime.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='export a model (deployed with --reparam) to ONNX or TorchScript',
                              description='Build a model (random init, or deployed weights with --weights), '
                                          'optionally re-parameterize it, and export it to ONNX or TorchScript; '
                                          '--check compares the exported file with PyTorch on a random batch.',
                              epilog=EPILOG)
    p.add_argument('model', help='timm or vitblocks model name')
    p.add_argument('--format', choices=FORMATS, required=True, help='onnx or torchscript (torch.jit.trace)')
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
                   help='ONNX: fix the batch dimension to --batch-size (default: dynamic)')
    p.add_argument('--opset', type=positive_int, metavar='N', help="ONNX opset (default: the exporter's)")
    p.add_argument('--onnx-exporter', choices=('dynamo', 'legacy'), default='dynamo',
                   help="torch's torch.export-based exporter (default, needs onnxscript) or its TorchScript-based "
                        "one")
    p.add_argument('--check', action='store_true',
                   help='run the exported file (onnxruntime / torch.jit.load) and print the max abs error vs PyTorch')
    p.set_defaults(run=run)


def _trained(name: str, path: str, block_cfg, size_kwargs):
    """(model with the trained weights of ``path``, the input size it was trained at or None)."""
    raw = read_checkpoint(Path(path)) if not path.endswith('.safetensors') else None
    if isinstance(raw, dict) and raw.get('format') == FORMAT:  # a vitblocks run: it knows how it was built
        cfg = merge(raw['config'])
        if resolve(cfg.model) != name:
            raise CliError(f'{path} was trained as {cfg.model}, not {name}')
        if block_cfg or size_kwargs:
            raise CliError(f'{path} is a vitblocks run checkpoint: it fixes the model\'s config; drop --block-cfg / '
                           f'--num-classes / --img-size')
        model = create_model(cfg, raw['num_classes'])
        state, size = raw['model'], tuple(raw['input_size'])
    else:
        model, state, size = build_model(name, block_cfg, size_kwargs), load_model_weights(path), None
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise CheckpointError(f'{path}: does not fit {name} ({" ".join(str(e).split())[:200]}); check --num-classes / '
                              f'--img-size / --block-cfg') from None
    return model.eval(), size


def _model(args):
    """(model to export, its input size or None for the model's own)."""
    name = resolve(args.model)
    block_cfg = parse_block_cfg(args.block_cfg)
    size_kwargs = model_size_kwargs(args)
    if args.weights:
        if size_kwargs:
            raise CliError('--weights loads a deployed checkpoint built as MODEL is registered; drop --num-classes / '
                           '--img-size')
        try:
            return load_deployed(name, args.weights, block_cfg=block_cfg or None), None
        except DeployedCheckpointError as e:
            raise CliError(str(e)) from None
    if args.checkpoint:
        try:
            model, size = _trained(name, args.checkpoint, block_cfg, size_kwargs)
        except (CheckpointError, ConfigError) as e:
            raise CliError(str(e)) from None
    else:
        model, size = build_model(name, block_cfg, size_kwargs), None
    return (reparameterize(model) if args.reparam else model.eval()), size


def run(args) -> int:
    if args.weights and args.checkpoint:
        raise CliError('--weights (deployed) and --checkpoint (training form) both give the weights; pick one')
    check_writable_file(Path(args.out), '--out')  # before a possibly long build and trace
    model, trained_size = _model(args)
    size = tuple(args.input_size) if args.input_size else trained_size or input_size_of(model)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            if args.format == 'onnx':
                path = export_onnx(model, args.out, input_size=size, batch_size=args.batch_size,
                                   dynamic_batch=not args.static_batch, opset=args.opset,
                                   dynamo=args.onnx_exporter == 'dynamo')
            else:
                path = export_torchscript(model, args.out, input_size=size, batch_size=args.batch_size)
    except ExportDependencyError as e:
        raise CliError(str(e)) from None
    except (AssertionError, RuntimeError, ValueError) as e:  # e.g. an input size the model does not take
        raise CliError(f'export on a {"x".join(map(str, size))} input failed: {type(e).__name__}: '
                       f'{" ".join(str(e).split())[:300]}') from None
    deployed = 'deployed' if args.reparam or args.weights else 'training form (no --reparam)'
    weights = f'weights {args.weights or args.checkpoint}' if args.weights or args.checkpoint else 'random init'
    print(f'{args.model}: {count_params(model) / 1e6:.2f} M params, {deployed}, {weights}')
    print(f'wrote {args.format} {path} ({path.stat().st_size / 2 ** 20:.1f} MiB, input {args.batch_size}x'
          f'{"x".join(map(str, size))}, {time.perf_counter() - t0:.1f} s)')
    if args.check:
        batch = args.batch_size if args.format == 'onnx' and args.static_batch else args.batch_size + 1
        try:
            err = check_export(path, model, input_size=size, batch_size=batch)
        except ExportDependencyError as e:
            raise CliError(str(e)) from None
        runtime = 'onnxruntime' if args.format == 'onnx' else 'torch.jit.load'
        print(f'check: max abs error {err:.3g} vs PyTorch ({runtime}, batch {batch})')
    return 0
