"""The five `vitblocks analyze` analyses: options, printed tables and plots (loading is in analyze.py)."""
import argparse
from pathlib import Path
from typing import Optional

import torch

from .. import analysis
from ..analysis.figures import png_figure
from ..deploy import reparameterize
from .common import CliError, positive_int, render_table

DEFAULT_IMAGES = {'lipschitz': 8, 'entropy': 64, 'gradcam': 4, 'breakdown': 1, 'collapse': 16}


def add_options(name: str, p: argparse.ArgumentParser) -> None:
    if name == 'lipschitz':
        p.add_argument('--solver', default='SCS', choices=['SCS', 'CLARABEL'], help='cvxpy SDP solver (default SCS)')
        p.add_argument('--iters', type=positive_int, default=30, help='power iterations (default 30)')
        p.add_argument('--blocks', nargs='+', type=int, metavar='I', help='only these block indices (default all)')
    elif name == 'entropy':
        p.add_argument('--bins', type=positive_int, default=256, help='histogram bins per channel (default 256)')
    elif name == 'breakdown':
        p.add_argument('--repeats', type=positive_int, default=5, help='timed forwards (default 5)')
        p.add_argument('--warmup', type=positive_int, default=2, help='untimed forwards first (default 2)')
        p.add_argument('--device', default='cpu', help="'cpu' or 'cuda' (default cpu)")
        p.add_argument('--deploy', action='store_true',
                       help='also time the deployed (re-parameterized) form of every model that has one')


def _fmt(v: Optional[float], digits: int = 4) -> str:
    return '-' if v is None else f'{v:.{digits}f}'


def _plot(out: Optional[Path], draw) -> None:
    if out is None:
        return
    try:
        print(f'\nplot    {draw(out)}')
    except OSError as e:
        raise CliError(f'cannot write the plot to {out}: {e}') from None


def _header(models, images) -> None:
    for m in models:
        print(f'model   {m.label}')
    print(f'input   {images[4]}')


def run_lipschitz(args, models, images, device, out) -> int:
    _header(models, images)
    print('bounds  L2 Lipschitz constant of the FFN as IFFN Thm 4.3 reads it, f(x) = sum_i W1_i phi_i(W0 x + b0) + b1:')
    print('        naive = sum_i |W1_i| max|slope_i| |W0|; SDP = sum_i sqrt(rho_i) (Eq. 9, cvxpy ' + args.solver + ');')
    print('        f >= max Jacobian norm of f over the input tokens; module >= the same for the module as built')
    rows_all = {}
    for m in models:
        try:
            rows = analysis.model_lipschitz(m.model, images[0], solver=args.solver, iters=args.iters,
                                            blocks=args.blocks)
        except ValueError as e:
            raise CliError(str(e)) from None
        rows_all[m.name] = rows
        print(f'\n{m.name}')
        table = [[r.name, r.kind, _fmt(r.naive), _fmt(r.sdp), _fmt(r.empirical), _fmt(r.module_empirical),
                  '-' if r.slope_min is None else f'[{r.slope_min:.3f}, {r.slope_max:.3f}]', r.note] for r in rows]
        print('\n'.join(render_table(['ffn', 'type', 'naive', 'SDP', 'f >=', 'module >=', 'slopes [p, q]', 'note'],
                                     table, 'llrrrrll')))
    _plot(out, lambda path: _plot_lipschitz(rows_all, path))
    return 0


def _plot_lipschitz(rows_all, path):
    with png_figure(path, figsize=(6.5, 3.6)) as (_, ax):
        for k, (name, rows) in enumerate(rows_all.items()):
            rows = [r for r in rows if r.sdp is not None]
            i = [r.block for r in rows]  # the model's block index, also where --blocks or unsupported FFNs skip some
            ax.plot(i, [r.naive for r in rows], f'C{k}:', label=f'{name} naive')
            ax.plot(i, [r.sdp for r in rows], f'C{k}-o', label=f'{name} SDP')
            ax.plot(i, [r.empirical for r in rows], f'C{k}--^', label=f'{name} empirical')
        ax.set(xlabel='block', ylabel='Lipschitz constant (bound)', yscale='log',
               title='FFN Lipschitz bounds per block')
        ax.grid(alpha=.3)
        ax.legend(fontsize=6)
    return path


def run_entropy(args, models, images, device, out) -> int:
    _header(models, images)
    reports = []
    for m in models:
        try:
            reports.append(analysis.block_entropy(m.model, images[0], name=m.name, bins=args.bins))
        except ValueError as e:
            raise CliError(str(e)) from None
    print(f'entropy per-channel Shannon entropy of block outputs, {args.bins} bins, '
          f'bits (max {reports[0].max_entropy:.2f}); mean over channels\n')
    depth = max(len(r.blocks) for r in reports)
    rows = [[i] + [_fmt(r.blocks[i].mean, 3) if i < len(r.blocks) else '' for r in reports] for i in range(depth)]
    rows.append(['mean'] + [_fmt(r.average, 3) for r in reports])
    print('\n'.join(render_table(['block'] + [r.model for r in reports], rows, 'r' * (1 + len(reports)))))
    _plot(out, lambda path: analysis.plot_entropy(reports, path))
    return 0


def run_gradcam(args, models, images, device, out) -> int:
    _header(models, images)
    x, raw, labels, classes = images[:4]
    maps, rows = {}, []
    for m in models:
        with torch.no_grad():
            pred = m.model.eval()(x).argmax(-1).tolist()
        try:
            maps[m.name] = analysis.gradcam_maps(m.model, x, targets=pred)
        except ValueError as e:
            raise CliError(str(e)) from None
        name = (lambda c: classes[c]) if classes else str
        for b, c in enumerate(pred):
            cam = maps[m.name][b]
            rows.append([m.name, b, name(labels[b]) if labels else '-', name(c), cam.shape[0], cam.shape[1],
                         f'{float((cam >= 0.5).mean()):.3f}'])
    print('maps    Grad-CAM of the predicted class at the last block (its norm1 if the model has prefix tokens, else '
          'its output); area = share of pixels with map >= 0.5\n')
    print('\n'.join(render_table(['model', 'image', 'label', 'predicted', 'H', 'W', 'area'], rows, 'lrllrrr')))
    pics = raw if raw is not None else (x - x.min()) / (x.max() - x.min())
    titles = [classes[c] for c in labels] if classes else None
    _plot(out, lambda path: analysis.plot_gradcam(pics, maps, path, titles))
    return 0


def run_breakdown(args, models, images, device, out) -> int:
    _header(models, images)
    entries = []
    for m in models:
        entries.append((m.name, m.model, m.input_size))
        if args.deploy:
            deployed = reparameterize(m.model)
            n_old = sum(p.numel() for p in m.model.parameters())
            if sum(p.numel() for p in deployed.parameters()) != n_old:  # something was folded
                entries.append((f'{m.name} (deployed)', deployed, m.input_size))
    results = []
    for name, model, size in entries:
        x = torch.randn(args.num_images, *size).to(device)
        results.append(analysis.latency_breakdown(model.to(device), x, name=name, warmup=args.warmup,
                                                  repeats=args.repeats))
    comps = list(analysis.breakdown.COMPONENTS)
    print(f'latency ms per batch of {args.num_images} on {device}, median of {args.repeats} (threads '
          f'{torch.get_num_threads()}); other = residual adds, position embedding, pooling, ...;'
          f' plain = the forward without timing hooks\n')
    rows = [[r.model] + [f'{r.components_ms[c]:.2f}' for c in comps] +
            [f'{r.other_ms:.2f}', f'{r.hooked_total_ms:.2f}', f'{r.plain_total_ms:.2f}', f'{100 * r.share("ffn"):.1f}']
            for r in results]
    print('\n'.join(render_table(['model'] + comps + ['other', 'total', 'plain', 'FFN %'], rows,
                                 'l' + 'r' * (len(comps) + 4))))
    _plot(out, lambda path: analysis.plot_breakdown(results, path))
    return 0


def run_collapse(args, models, images, device, out) -> int:
    _header(models, images)
    curves = {}
    for m in models:
        try:
            growth = analysis.residual_growth(m.model, images[0], name=m.name)
            div = analysis.sequential_vs_parallel(m.model, images[0])
        except ValueError as e:
            raise CliError(str(e)) from None
        curves[m.name] = div
        print(f'\n{m.name}: mean per-token L2 norms; seq-par = |X_seq - X_par| between the sequential and the '
              f'parallel composition of the block\'s own weights')
        rows = [[b.index, f'{b.stream_in:.3f}', f'{b.attn_ratio:.3f}', f'{b.mlp_ratio:.3f}', f'{b.cosine:.3f}',
                 f'{d.distance:.4f}', f'{d.relative:.4f}', f'{d.relative_to_update:.3f}']
                for b, d in zip(growth.blocks, div)]
        print('\n'.join(render_table(['block', '|X_in|', 'attn/X', 'mlp/X', 'cos(in,out)', 'seq-par', 'seq-par/X',
                                      'seq-par/update'], rows, 'rrrrrrrr')))
    _plot(out, lambda path: analysis.plot_divergence(curves, path))
    return 0


RUNNERS = {'lipschitz': run_lipschitz, 'entropy': run_entropy, 'gradcam': run_gradcam, 'breakdown': run_breakdown,
           'collapse': run_collapse}
