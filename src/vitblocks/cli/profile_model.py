"""`vitblocks profile MODEL`: params, GMACs (both norm conventions) and where they go."""
from collections import defaultdict
from typing import Dict, List, Tuple

import torch
from torch import nn

from ..profile import count_macs, count_params, fixed_threads, input_size_of
from .compare import COUNT_THREADS
from .common import (CliError, add_model_size_args, build_model, describe_model, model_size_kwargs, parse_block_cfg,
                     positive_int, render_table, resolve)

NAME = 'profile'

EPILOG = """\
examples:
  vitblocks profile deit_tiny_patch16_224
  vitblocks profile iffn_poolformer_s12 --depth 3 --top 5
  vitblocks profile iffn_deit_tiny_patch16_224 --block-cfg kernel_size=7
  vitblocks profile iffn_poolformer_s12 --input-size 3 256 256
  vitblocks profile deit_tiny_patch16_224 --img-size 384 --num-classes 10

GMACs are multiply-accumulates of one image (FLOPs = 2 x MACs), attention matmuls included.
"with norms" also counts LayerNorm/GroupNorm/BatchNorm as 2 MACs per element (1 without an
affine), the ptflops convention the IFFN paper's tables use; "without norms" counts
matmuls, convolutions and attention only.
"""

# Components, matched on the module path from the root down (the first matching segment wins,
# so the LayerNorms inside an FFN belong to the FFN).
COMPONENTS = ('stem / patch embed', 'token mixer', 'FFN', 'block norms', 'downsample', 'head', 'other')
_SEGMENTS = {
    'patch_embed': 'stem / patch embed', 'stem': 'stem / patch embed',
    'attn': 'token mixer', 'token_mixer': 'token mixer', 'mlp_tokens': 'token mixer',
    'mlp': 'FFN', 'mlp_channels': 'FFN',
    'downsample': 'downsample',
    'head': 'head', 'fc_norm': 'head', 'head_drop': 'head',
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='params, GMACs and a per-component breakdown of one model',
                              description='Count the parameters and MACs of a timm or vitblocks model (random init, '
                                          'CPU, batch 1) and show where they go.', epilog=EPILOG)
    p.add_argument('model', help='timm or vitblocks model name (see `vitblocks list`)')
    p.add_argument('--input-size', nargs=3, type=positive_int, metavar=('C', 'H', 'W'),
                   help='input size (default: what the model was built for, usually 3 224 224)')
    add_model_size_args(p)
    p.add_argument('--depth', type=positive_int, metavar='N', default=2,
                   help='module depth of the "top modules" list: 1 = blocks, 2 = blocks.0 (default), '
                        '3 = blocks.0.mlp')
    p.add_argument('--top', type=positive_int, metavar='N', default=10,
                   help='how many top modules to list (default 10)')
    p.add_argument('--block-cfg', nargs='+', metavar='KEY=VALUE',
                   help='override a vitblocks model\'s block config, e.g. kernel_size=7 spatial_part=false')
    p.set_defaults(run=run)


def component_of(path: str) -> str:
    """Component of a module path relative to the model, e.g. 'blocks.0.mlp.norm' -> 'FFN'."""
    segments = path.split('.') if path else []
    for depth, seg in enumerate(segments):
        if seg in _SEGMENTS:
            return _SEGMENTS[seg]
        if seg.startswith('norm'):
            return 'head' if depth == 0 else 'block norms'  # the final norm of a ViT/Swin feeds the head
    return 'other'


def exclusive_macs(model: nn.Module, by_module: Dict[str, int]) -> Dict[str, int]:
    """MACs of each module's own ops (its total minus its children's), keyed by path ('' = root).

    FlopCounterMode charges an op to every module on the call stack, and a module whose
    ``forward`` is bypassed (timm's MetaFormer head calls ``head.fc`` directly) has no entry,
    so we subtract the nearest counted descendants instead of direct children.
    """
    root = type(model).__name__

    def counter_key(path):  # FlopCounterMode's name of the module at ``path``
        return f'{root}.{path}' if path else root

    out: Dict[str, int] = {}

    def counted_below(mod: nn.Module, path: str) -> int:
        total = 0
        for name, child in mod.named_children():
            p = f'{path}.{name}' if path else name
            total += by_module[counter_key(p)] if counter_key(p) in by_module else counted_below(child, p)
        return total

    for path, mod in model.named_modules():
        if counter_key(path) in by_module:
            out[path] = by_module[counter_key(path)] - counted_below(mod, path)
    out['(outside modules)'] = by_module.get('Global', 0) - by_module.get(root, 0)
    return out


def breakdown(model: nn.Module, by_module: Dict[str, int]) -> Dict[str, Tuple[int, int]]:
    """component -> (params, MACs), for the components the model has (PoolFormer's pooling token
    mixer is listed with 0 MACs: pooling is not a multiply-accumulate)."""
    macs: Dict[str, int] = defaultdict(int)
    params: Dict[str, int] = defaultdict(int)
    present = set()
    for path, m in exclusive_macs(model, by_module).items():
        macs[component_of(path) if not path.startswith('(') else 'other'] += m
    for path, mod in model.named_modules():
        component = component_of(path)
        params[component] += sum(p.numel() for p in mod.parameters(recurse=False))
        if component != 'other':
            present.add(component)
    return {c: (params[c], macs[c]) for c in COMPONENTS if c in present or params[c] or macs[c]}


def top_modules(model: nn.Module, by_module: Dict[str, int], depth: int) -> List[Tuple[str, int, int]]:
    """[(module path at ``depth``, MACs, params)], largest MACs first."""
    macs: Dict[str, int] = defaultdict(int)
    for path, m in exclusive_macs(model, by_module).items():
        if not path.startswith('('):
            macs['.'.join(path.split('.')[:depth]) or '(root)'] += m
    params: Dict[str, int] = defaultdict(int)
    for path, p in model.named_parameters():
        params['.'.join(path.split('.')[:-1][:depth]) or '(root)'] += p.numel()
    rows = [(n, macs[n], params[n]) for n in set(macs) | set(params) if macs[n] or params[n]]

    def natural_key(name):  # blocks.2 before blocks.10
        return [int(s) if s.isdigit() else s for s in name.split('.')]

    return sorted(rows, key=lambda t: (-t[1], -t[2], natural_key(t[0])))


def run(args) -> int:
    name = resolve(args.model)
    block_cfg = parse_block_cfg(args.block_cfg)
    with torch.no_grad(), fixed_threads(COUNT_THREADS):
        model = build_model(name, block_cfg, model_size_kwargs(args))
        size = tuple(args.input_size) if args.input_size else input_size_of(model)
        try:
            with_norms = count_macs(model, input_size=size, include_norms=True)
            without = count_macs(model, input_size=size, include_norms=False)
        except (AssertionError, RuntimeError, ValueError) as e:  # e.g. a fixed-size ViT given another size
            raise CliError(f'forward on a {"x".join(map(str, size))} input failed: {type(e).__name__}: {e}') from None
    params = count_params(model)

    print(f'model   {name}  ({describe_model(name, block_cfg)})')
    print(f'input   1 x {size[0]} x {size[1]} x {size[2]}')
    print(f'params  {params:,}  ({params / 1e6:.3f} M)')
    print(f'GMACs   {with_norms.gmacs:.3f}  with norms (2 MACs/element with affine; the ptflops convention '
          f'of the IFFN tables)')
    print(f'        {without.gmacs:.3f}  without norms (matmuls, convolutions, attention only)')
    print(f'GFLOPs  {with_norms.gflops:.3f}  (= 2 x GMACs with norms)')

    total_p, total_m = params, with_norms.total

    def percent(part, whole):
        return f'{100.0 * part / whole:.1f}%' if whole else '-'

    rows = [[c, f'{p / 1e6:.3f}', percent(p, total_p), f'{m / 1e9:.3f}', percent(m, total_m)]
            for c, (p, m) in breakdown(model, with_norms.by_module).items()]
    rows.append(['total', f'{total_p / 1e6:.3f}', '100.0%', f'{total_m / 1e9:.3f}', '100.0%'])
    print('\ncomponents (MACs with norms)')
    print('\n'.join(render_table(['component', 'params M', 'share', 'GMACs', 'share'], rows, 'lrrrr', indent='  ')))

    top = top_modules(model, with_norms.by_module, args.depth)
    rows = [[n, f'{m / 1e9:.3f}', percent(m, total_m), f'{p / 1e6:.3f}'] for n, m, p in top[:args.top]]
    more = f', {len(top) - args.top} more not shown' if len(top) > args.top else ''
    print(f'\ntop modules at depth {args.depth} by MACs (with norms{more})')
    print('\n'.join(render_table(['module', 'GMACs', 'share', 'params M'], rows, 'lrrr', indent='  ')))
    return 0
