"""`vitblocks analyze ANALYSIS MODEL`: analyses of a model (collapse: the residual-growth probe)."""
import argparse
import re
from pathlib import Path

import torch
from timm.models import load_checkpoint

from ..analysis import plot_residual_growth, residual_growth
from ..profile import input_size_of
from .common import CliError, build_model, describe_model, parse_block_cfg, positive_int, render_table, resolve

NAME = 'analyze'

EPILOG = """\
examples:
  vitblocks analyze collapse deit_small_patch16_224
  vitblocks analyze collapse mabvit_prglu_vit_small_patch16_18x1_224 --out prglu18.png
  vitblocks analyze collapse deit_tiny_patch16_224 --batch-size 4 --input-size 3 224 224
  vitblocks analyze collapse vit_small_patch16_224 --checkpoint runs/vit_s/last.pth.tar --no-plot
"""

COLLAPSE_EPILOG = """\
examples:
  vitblocks analyze collapse deit_small_patch16_224
  vitblocks analyze collapse mabvit_glu_vit_small_patch16_224 --batch-size 16 --out glu.png
  vitblocks analyze collapse vit_small_patch16_224 --checkpoint vit_s.pth --no-plot

Per block: the mean per-token L2 norm of the residual stream entering it, of the attention and
MLP branch outputs added to it, their ratios (MABViT's representation-collapse hypothesis: the
stream grows with depth, the branch updates do not), and cos(X_in, X_out). Inputs are standard
normal images; without --checkpoint the weights are a fresh random init, so the numbers show
the architecture at initialization.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='analyses of a model (collapse: residual-growth probe)',
                              description='Analyses that run a model and report on its internals.', epilog=EPILOG)
    sub = p.add_subparsers(dest='analysis', metavar='ANALYSIS', required=True)
    c = sub.add_parser('collapse', help='per-block norms of the residual stream vs the attention/MLP outputs',
                       description='Residual-growth probe (MABViT): per block, the norm of the residual stream next '
                                   'to the norm of each branch output, printed and plotted.',
                       epilog=COLLAPSE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument('model', help='timm or vitblocks ViT-style model name (see `vitblocks list`)')
    c.add_argument('--batch-size', type=positive_int, metavar='N', default=8, help='probe images (default 8)')
    c.add_argument('--input-size', nargs=3, type=positive_int, metavar=('C', 'H', 'W'),
                   help='input size (default: the model\'s pretrained config, usually 3 224 224)')
    c.add_argument('--checkpoint', metavar='PATH', help='load these weights (timm checkpoint or state dict)')
    c.add_argument('--block-cfg', nargs='+', metavar='KEY=VALUE', help='override a vitblocks model\'s block config')
    c.add_argument('--seed', type=int, default=0, help='seed for the weights and the probe images (default 0)')
    c.add_argument('--out', metavar='PNG', help='plot file (default: collapse_<model>.png in the current directory)')
    c.add_argument('--no-plot', action='store_true', help='print the table only')
    c.set_defaults(run=run_collapse)


def run_collapse(args) -> int:
    name = resolve(args.model)
    block_cfg = parse_block_cfg(args.block_cfg)
    torch.manual_seed(args.seed)
    model = build_model(name, block_cfg)
    if args.checkpoint:
        if not Path(args.checkpoint).is_file():
            raise CliError(f'--checkpoint {args.checkpoint}: no such file')
        try:
            load_checkpoint(model, args.checkpoint)
        except (RuntimeError, KeyError, ValueError) as e:
            raise CliError(f'cannot load {args.checkpoint} into {name}: {type(e).__name__}: {e}') from None
    size = tuple(args.input_size) if args.input_size else input_size_of(model)
    inputs = torch.randn(args.batch_size, *size)
    try:
        report = residual_growth(model, inputs, name=name)
    except ValueError as e:  # not a ViT-style model
        raise CliError(str(e)) from None
    except (AssertionError, RuntimeError) as e:  # e.g. a fixed-size ViT given another --input-size
        raise CliError(f'forward on a {"x".join(map(str, size))} input failed: {type(e).__name__}: {e}') from None

    weights = f'weights from {args.checkpoint}' if args.checkpoint else f'random init (seed {args.seed})'
    print(f'model   {name}  ({describe_model(name, block_cfg)})')
    print(f'input   {args.batch_size} x {" x ".join(map(str, size))} standard normal images; {weights}')
    print('norms   mean per-token L2 norm; attn/X = |attn| / |X_in|, mlp/X = |mlp| / |X_in + attn|')
    print()
    rows = [[b.index, f'{b.stream_in:.3f}', f'{b.attn:.3f}', f'{b.attn_ratio:.3f}', f'{b.stream_mid:.3f}',
             f'{b.mlp:.3f}', f'{b.mlp_ratio:.3f}', f'{b.cosine:.3f}'] for b in report.blocks]
    print('\n'.join(render_table(['block', '|X_in|', '|attn|', 'attn/X', '|X_mid|', '|mlp|', 'mlp/X', 'cos(in,out)'],
                                 rows, 'rrrrrrrr')))
    if not args.no_plot:
        out = Path(args.out or f'collapse_{re.sub(r"[^A-Za-z0-9_.-]", "_", name)}.png')
        try:
            path = plot_residual_growth(report, out)
        except ImportError as e:
            raise CliError(f'{e} (or pass --no-plot)') from None
        except OSError as e:
            raise CliError(f'cannot write the plot to {out}: {e}') from None
        print(f'\nplot    {path}')
    return 0
