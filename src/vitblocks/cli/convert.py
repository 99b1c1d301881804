"""`vitblocks convert SRC DST --model NAME`: an authors' released checkpoint -> safetensors in our layout."""
import argparse
import json
import pickle
import re
from pathlib import Path

import timm
import torch
from timm.models import clean_state_dict

from ..deploy import reparameterize
from ..deploy.io import save_deployed, write_safetensors
from ..models.convert_authors import AUTHORS_MODELS, AuthorsCheckpointError, detect_authors_layout
from ..profile import count_params
from .common import CliError, build_model, check_writable_file, parse_block_cfg, resolve

NAME = 'convert'
FORMAT = 'vitblocks.converted/1'  # metadata['format'] of a training-form file written here

EPILOG = """\
examples:
  vitblocks convert RePaViT_Base.pth repavit_base.safetensors --model repa_prenorm_deit_base_patch16_224
  vitblocks convert RePaViT_Base.pth repavit_base_folded.safetensors --model repa_prenorm_deit_base_patch16_224 --deploy
  vitblocks convert iffn_deit_tiny.pth iffn_deit_tiny.safetensors --model iffn_deit_tiny_patch16_224

Recognized layouts: the authors' RePaViT (Ackesnal/RePaViT, --channel_idle --feature_norm=BatchNorm)
and IFFN DeiT (AMD-AIG-AIMA/AMD_IFFN) checkpoints; docs/repa.md and docs/iffn_weights.md list the
key mapping. Without --deploy the file holds the training form and loads with
timm.create_model(MODEL, checkpoint_path=DST); with --deploy it holds the folded model and loads
with vitblocks.deploy.io.load_deployed(MODEL, DST). The entry read is 'model' (the weights the
authors evaluate); --ema reads 'model_ema' instead.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help="convert the authors' released RePaViT / IFFN checkpoints to safetensors",
                              description="Load an authors' checkpoint (.pth) into a vitblocks model, converting "
                                          "their key layout, and write it as safetensors in ours: the training "
                                          "form, or with --deploy the re-parameterized form.",
                              epilog=EPILOG)
    p.add_argument('src', metavar='SRC', help="the authors' checkpoint file (.pth)")
    p.add_argument('dst', metavar='DST', help='the .safetensors file to write (directories are created)')
    p.add_argument('--model', required=True, help='vitblocks model of the same size, e.g. '
                                                  'repa_prenorm_deit_base_patch16_224, iffn_deit_tiny_patch16_224')
    p.add_argument('--deploy', action='store_true', help='write the re-parameterized (folded) model')
    p.add_argument('--ema', action='store_true', help="read the checkpoint's 'model_ema' entry instead of 'model'")
    p.add_argument('--block-cfg', nargs='+', metavar='KEY=VALUE',
                   help='block config the checkpoint was trained with, e.g. idle_ratio=0.5 (RePa default 0.75)')
    p.add_argument('--model-args', nargs='+', metavar='KEY=VALUE',
                   help='timm kwargs of MODEL, e.g. num_classes=100 (default: the registered model)')
    p.set_defaults(run=run)


def _read_state_dict(path: Path, ema: bool) -> dict:
    """The state dict under 'model' ('model_ema' with --ema) of a torch checkpoint, or a bare state dict."""
    if not path.is_file():
        raise CliError(f'no checkpoint at {path}: the file does not exist')
    try:
        # weights only, as timm reads checkpoints; training scripts pickle their argparse.Namespace too
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # on a file that is no checkpoint torch's unpickler raises anything (KeyError, ...)
        raise CliError(_unreadable(path, e)) from None
    if not isinstance(checkpoint, dict):
        raise CliError(f'{path} holds a {type(checkpoint).__name__}, not a checkpoint dict or a state dict')
    key = 'model_ema' if ema else 'model'
    if checkpoint.get(key) is not None:
        return clean_state_dict(checkpoint[key])  # strips DDP / torch.compile prefixes
    if not ema and checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        return clean_state_dict(checkpoint)  # a bare state dict
    raise CliError(f"{path} has no {key!r} entry (entries: {', '.join(map(str, checkpoint))[:200]})"
                   + ('; drop --ema' if ema else ''))


def _unreadable(path: Path, error: Exception) -> str:
    """Why torch.load failed on ``path``, told from the file's first bytes and the error."""
    detail = ' '.join(str(error).split())
    try:
        with open(path, 'rb') as f:
            head = f.read(16)
    except OSError:  # unreadable (permissions, a vanished file): torch's own error says why
        return f'cannot read {path} as a torch checkpoint ({detail[:200]})'
    if not head:
        return f'{path} is empty, not a torch checkpoint'
    if len(head) > 8 and head[8:9] == b'{' and int.from_bytes(head[:8], 'little') < 1 << 30:
        return (f'{path} is a safetensors file, not a torch checkpoint (.pth): convert reads the authors\' .pth '
                'files; a safetensors file in our layout loads as it is (timm.create_model(MODEL, '
                'checkpoint_path=SRC))')
    if not (head.startswith(b'PK\x03\x04') or head.startswith(b'\x80')):  # torch.save: a zip archive, or a pickle
        return (f'{path} is not a torch checkpoint (torch.save writes a zip archive, or a pickle in the legacy '
                f'format; this file starts with {head[:8]!r})')
    unsafe = re.search(r'GLOBAL (\S+)', detail)  # the weights-only unpickler met a class it may not build
    if isinstance(error, pickle.UnpicklingError) and unsafe:
        return (f'{path} holds pickled objects other than tensors ({unsafe.group(1)}); if you trust it, save '
                "torch.load(SRC, weights_only=False)['model'] to a new file and convert that")
    return f'cannot read {path} as a torch checkpoint ({detail[:200]}); is it complete (not truncated)?'


def _size_hint(state_dict: dict, model: torch.nn.Module) -> str:
    """Which ViT the checkpoint is, next to the model, in the numbers that pick the right name."""
    def describe(width, depth, classes):
        return f'width {width}, {depth} blocks, {classes} classes'
    blocks = {int(k.split('.')[1]) for k in state_dict if k.startswith('blocks.')}
    ckpt = describe(state_dict['pos_embed'].shape[-1], len(blocks), state_dict['head.weight'].shape[0]) \
        if 'pos_embed' in state_dict and 'head.weight' in state_dict else 'no ViT'
    return (f'the checkpoint has {ckpt}, the model {describe(model.embed_dim, len(model.blocks), model.num_classes)} '
            f'(widths: tiny 192, small 384, base 768, large 1024, huge 1280; --model-args num_classes=N)')


def run(args) -> int:
    name = resolve(args.model)
    src, dst = Path(args.src), Path(args.dst)
    if dst.suffix != '.safetensors':
        raise CliError(f'DST must end with .safetensors (timm chooses its reader by the extension), got {dst}')
    check_writable_file(dst, 'DST')  # before the checkpoint is read and converted, not after
    block_cfg, model_args = parse_block_cfg(args.block_cfg), parse_block_cfg(args.model_args, '--model-args')
    state_dict = _read_state_dict(src, args.ema)
    layout = detect_authors_layout(state_dict)
    if layout is None:
        raise CliError(f"{src} is in no authors' layout vitblocks knows (RePaViT: blocks.N.attn.norm.*, IFFN DeiT: "
                       f"blocks.N.mlp.act1.move1.scale); a checkpoint in our layout needs no conversion")
    model = build_model(name, block_cfg, base_kwargs=model_args)
    if not getattr(model, 'accepts_authors_checkpoints', False):
        raise CliError(f"{src} is an authors' {layout} checkpoint, which {name} cannot hold; use one of "
                       f'{AUTHORS_MODELS[layout]}')
    try:
        model.load_state_dict(state_dict)  # the model's pre-hook converts the authors' layout
    except AuthorsCheckpointError as e:
        raise CliError(str(e)) from None
    except RuntimeError as e:  # missing / unexpected keys, shape mismatch
        problems = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]  # one per tensor
        more = f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''
        raise CliError(f'{src} ({layout} layout) does not fit {name}: {_size_hint(state_dict, model)}; '
                       f'first problem: {problems[0] if problems else str(e)[:300]}{more}') from None
    model.eval()
    try:
        if args.deploy:
            model = reparameterize(model)
            path = save_deployed(model, dst, name=name, block_cfg=block_cfg or None)
        else:
            metadata = {'format': FORMAT, 'architecture': name, 'source': f'{layout}: {src.name}',
                        'torch': torch.__version__, 'timm': timm.__version__}
            for key, value in (('block_cfg', block_cfg), ('model_args', model_args)):
                if value:
                    metadata[key] = json.dumps(value, sort_keys=True)
            path = write_safetensors(model, dst, metadata)
    except OSError as e:  # e.g. the disk filled up: the write is atomic, nothing half-written is left at DST
        raise CliError(f'DST {dst}: cannot write it ({e.strerror or e})') from None
    form = 'deployed (re-parameterized)' if args.deploy else 'training form'
    print(f"{src}: the authors' {layout} layout, {len(state_dict)} tensors -> {name}")
    print(f'wrote {path} ({form}, {count_params(model) / 1e6:.2f} M params, {path.stat().st_size / 2 ** 20:.1f} MiB)')
    return 0
