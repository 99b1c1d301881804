"""`vitblocks analyze ANALYSIS MODEL... [--checkpoint CKPT...] [--data DIR]`: the papers' analyses.

lipschitz (IFFN Thm 4.3), entropy (AFBO Table 18), gradcam (AFBO Figs. 3-4), breakdown (RePa
Fig. 3), collapse (MABViT). This module builds the parser and loads models and images; the
analyses print and plot in :mod:`.analyze_run`.
"""
import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import yaml
from torch import nn

from ..data import DataError, build_dataset, build_pil_transform, eval_split_of
from ..deploy.io import (DeployedCheckpointError, is_deployed_file, load_deployed, read_deployed_metadata,
                         recorded_preprocessing)
from ..profile import input_size_of
from . import analyze_run
from ..analysis.figures import figure_format
from .common import (CliError, build_model, check_writable_file, load_trained_model, parse_block_cfg, positive_int,
                     refuse_exported_file, resolve)

NAME = 'analyze'

EPILOG = """\
examples:
  vitblocks analyze lipschitz iffn_deit_tiny_patch16_224 --checkpoint runs/iffn/last.pth --data cifar10
  vitblocks analyze entropy deit_tiny_patch16_224 iffn_deit_tiny_patch16_224 --checkpoint a.pth b.pth --data cifar10
  vitblocks analyze gradcam deit_tiny_patch16_224 iffn_deit_tiny_patch16_224 --checkpoint a.pth b.pth --data cifar10
  vitblocks analyze breakdown deit_tiny_patch16_224 deit_small_patch16_224 repa_deit_small_patch16_224 --deploy
  vitblocks analyze collapse deit_tiny_patch16_224 mabvit_glu_vit_tiny_patch16_224 --checkpoint a.pth b.pth \\
      --data cifar10

MODEL is a timm or vitblocks name; --checkpoint takes one file per MODEL ('-' = random init):
a vitblocks run's last.pth/best.pth (it carries the model's kwargs, input size and normalization),
a .safetensors, a timm .pth or a bare state dict. --data is a dataset folder, shards or a NAME
(as for `vitblocks train`); its evaluation split is used. Without --data the inputs are standard
normal images. Each analysis prints a table and writes a PNG (--out, or --no-plot).
"""

ANALYSES = {
    'lipschitz': 'FFN Lipschitz constant per block: SDP bound (IFFN Thm 4.3), naive bound, empirical lower bound',
    'entropy': 'feature entropy of each block output, models side by side (AFBO Table 18)',
    'gradcam': 'Grad-CAM maps of the last block for a few images, models side by side (AFBO Figs. 3-4)',
    'breakdown': 'latency per component: patch embedding, token mixer, FFN, norms, head (RePa Fig. 3)',
    'collapse': 'residual growth and sequential-vs-parallel divergence per block (MABViT)',
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='the papers\' analyses: lipschitz, entropy, gradcam, breakdown, collapse',
                              description='Analyses that run a model and report on its internals.', epilog=EPILOG)
    sub = p.add_subparsers(dest='analysis', metavar='ANALYSIS', required=True)
    for name, help_text in ANALYSES.items():
        a = sub.add_parser(name, help=help_text, description=help_text, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        a.add_argument('models', nargs='+', metavar='MODEL', help='timm or vitblocks model name(s)')
        a.add_argument('--checkpoint', '--weights', nargs='+', metavar='CKPT', dest='checkpoints',
                       help="weights, one per MODEL ('-' for random init)")
        a.add_argument('--data', metavar='DIR', help='real images: dataset folder, shards or NAME (evaluation split)'
                       if name != 'breakdown' else 'refused: breakdown times random inputs of each model\'s input size')
        a.add_argument('--num-images', type=positive_int, metavar='N', default=analyze_run.DEFAULT_IMAGES[name],
                       help=f'images to run on (default {analyze_run.DEFAULT_IMAGES[name]})')
        a.add_argument('--input-size', nargs=3, type=positive_int, metavar=('C', 'H', 'W'),
                       help="input size (default: the checkpoint's, else the model's config)")
        a.add_argument('--model-kwargs', metavar='YAML', type=_yaml_dict,
                       help="timm.create_model kwargs for models built here, e.g. '{img_size: 32, patch_size: 4}'")
        a.add_argument('--block-cfg', nargs='+', metavar='KEY=VALUE', help='override a vitblocks model\'s block config')
        a.add_argument('--seed', type=int, default=0, help='seed for random weights, images and image choice')
        a.add_argument('--threads', type=positive_int, help='torch CPU threads')
        a.add_argument('--out', metavar='PNG', help=f'plot file in an existing folder (default {name}.png; '
                       f'.pdf, .svg, ... for another format)')
        a.add_argument('--no-plot', action='store_true', help='print the table only')
        analyze_run.add_options(name, a)
        a.set_defaults(run=run)


def _yaml_dict(text: str) -> dict:
    value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a YAML mapping such as '{{img_size: 32}}', got {text!r}")
    return value


@dataclass
class Loaded:
    name: str  # model name as given
    label: str  # name + where its weights came from
    model: nn.Module
    input_size: Tuple[int, int, int]
    mean: Optional[Tuple[float, ...]]  # normalization the weights were trained with, if known
    std: Optional[Tuple[float, ...]]


def load_model(name: str, checkpoint: Optional[str], block_cfg, input_size, model_kwargs=None,
               analysis: str = 'gradcam') -> Loaded:
    """Build ``name`` and load ``checkpoint`` (a vitblocks run checkpoint rebuilds the model as trained; a deployed
    file, for the analyses of a model's outputs, is loaded by the file alone as ``vitblocks eval`` does)."""
    name = resolve(name)
    if not checkpoint or checkpoint == '-':
        model = build_model(name, block_cfg, model_kwargs)
        size = tuple(input_size) if input_size else _input_size(model)
        return Loaded(name, f'{name} (random init)', model, size, None, None)
    path = Path(checkpoint)
    refuse_exported_file(path, '--checkpoint', 'give the deployed safetensors file or the run checkpoint it was '
                                               'exported from')
    if is_deployed_file(path):
        return _load_deployed(name, path, block_cfg, input_size, model_kwargs, analysis)
    model, meta = load_trained_model(name, path, block_cfg, model_kwargs, overrides='--block-cfg/--model-kwargs')
    size = tuple(input_size) if input_size else tuple(meta.get('input_size') or _input_size(model))
    mean, std = (tuple(meta['mean']), tuple(meta['std'])) if meta.get('mean') else (None, None)
    return Loaded(name, f'{name} ({path})', model, size, mean, std)


# analyses that read the model's outputs (and their gradients) only, which the deployed form computes alike; the
# others read the training form's blocks (its BatchNorms, its unfolded layers)
DEPLOYED_ANALYSES = ('gradcam',)


def _load_deployed(name: str, path: Path, block_cfg, input_size, model_kwargs, analysis: str) -> Loaded:
    """A deployed file (``save_deployed``), built by the name, sizes and config it records."""
    if analysis not in DEPLOYED_ANALYSES:
        raise CliError(f'--checkpoint {path} is a deployed file (folded for inference); {analysis} reads the training '
                       f'form\'s blocks: give the run checkpoint it was deployed from ({", ".join(DEPLOYED_ANALYSES)} '
                       f'takes deployed files)')
    if block_cfg or model_kwargs:
        raise CliError(f'--checkpoint {path} is a deployed file: it records its block config and sizes; drop '
                       f'--block-cfg/--model-kwargs')
    try:
        metadata = read_deployed_metadata(path)
        saved = metadata.get('architecture', '')
        if saved and saved.split('.')[0] != name.split('.')[0]:
            raise CliError(f'--checkpoint {path} holds the deployed weights of {saved}, not {name}; name {saved}')
        model = load_deployed(saved or name, path)
    except DeployedCheckpointError as e:
        raise CliError(str(e)) from None
    recorded = recorded_preprocessing(metadata)
    size = tuple(input_size or recorded.get('input_size') or _input_size(model))
    mean, std = (tuple(recorded['mean']), tuple(recorded['std'])) if recorded.get('mean') and recorded.get('std') \
        else (None, None)
    return Loaded(name, f'{name} (deployed {path})', model, size, mean, std)


def _input_size(model: nn.Module) -> Tuple[int, int, int]:
    """The model's configured input size, with the image size it was built at (``img_size=32``)."""
    c, h, w = input_size_of(model)
    size = getattr(getattr(model, 'patch_embed', None), 'img_size', None) or (h, w)
    return c, int(size[0]), int(size[1])


def load_images(data: Optional[str], n: int, input_size, mean, std, seed: int):
    """``(normalized images, images in [0, 1], labels, class names, description)``."""
    g = torch.Generator().manual_seed(seed)
    if data is None:
        x = torch.randn(n, *input_size, generator=g)
        return x, None, None, None, f'{n} standard normal images {"x".join(map(str, input_size))} (no --data)'
    try:
        split = eval_split_of(data)
        ds = build_dataset(data, split)
    except DataError as e:
        raise CliError(str(e)) from None
    if len(ds) < n:
        raise CliError(f'{data} [{split}] has {len(ds)} images, fewer than --num-images {n}')
    idx = torch.randperm(len(ds), generator=g)[:n].tolist()
    plain = build_pil_transform(input_size, (0.0,) * input_size[0], (1.0,) * input_size[0], training=False,
                                crop_pct=1.0)
    raw = torch.stack([plain(ds.load(i)) for i in idx])  # (N, C, H, W) in [0, 1]
    m = torch.tensor(mean).view(1, -1, 1, 1)  # (C,) -> (1, C, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    labels = [int(ds.targets[i]) for i in idx]
    return (raw - m) / s, raw, labels, ds.classes, f'{n} images of {data} [{split}] {"x".join(map(str, input_size))}'


def _plot_path(args) -> Optional[Path]:
    """Where the plot goes (None with --no-plot), checked before any model is built and run."""
    if args.no_plot:
        if args.out:
            raise CliError(f'--out {args.out} and --no-plot contradict each other; drop one of them')
        return None
    out = Path(args.out or f'{args.analysis}.png')
    try:
        figure_format(out)
    except ValueError as e:
        raise CliError(f'--out {e}') from None
    if not out.parent.is_dir():
        raise CliError(f'--out {out}: no folder {out.parent}; create it first or pick another place')
    check_writable_file(out, '--out')
    return out


def run(args) -> int:
    if args.analysis == 'breakdown' and args.data:  # timing does not depend on pixel values
        raise CliError(f'--data {args.data}: breakdown times each model on random inputs of its own input size '
                       f'(--num-images of them); drop --data')
    out = _plot_path(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpts: List[Optional[str]] = list(args.checkpoints or [None] * len(args.models))
    if len(ckpts) != len(args.models):
        raise CliError(f'{len(args.models)} models but {len(ckpts)} checkpoints; give one per model, '
                       f"'-' for random init")
    block_cfg = parse_block_cfg(args.block_cfg)
    torch.manual_seed(args.seed)
    device = torch.device(getattr(args, 'device', 'cpu'))  # only breakdown runs off the CPU
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise CliError('--device cuda: no CUDA device here; use --device cpu')
    models = [load_model(m, c, block_cfg, args.input_size, args.model_kwargs, args.analysis)
              for m, c in zip(args.models, ckpts)]
    sizes = {m.input_size for m in models}
    if len(sizes) > 1 and args.analysis != 'breakdown':
        raise CliError(f'the models expect different input sizes {sorted(sizes)}; give --input-size')
    ref = models[0]
    mean = ref.mean or tuple(ref.model.pretrained_cfg.get('mean', (0.5,) * ref.input_size[0]))
    std = ref.std or tuple(ref.model.pretrained_cfg.get('std', (0.5,) * ref.input_size[0]))
    if any(m.mean and (m.mean, m.std) != (mean, std) for m in models):
        raise CliError('the checkpoints were trained with different normalizations; analyze them separately')
    images = load_images(args.data, args.num_images, ref.input_size, mean, std, args.seed)
    return analyze_run.RUNNERS[args.analysis](args, models, images, device, out)
