"""Residual-growth probe: how large each block's branch outputs are next to the residual stream.

MABViT's hypothesis ("Representational Collapse", "Methodology"): in a pre-LN transformer the
residual stream ``X`` grows with depth while the attention and MLP outputs added to it stay
about the same size, so deeper blocks change ``X`` less and less (``X_{i+1} ~ X_i``), and a
parallel block behaves like a sequential one. This probe measures exactly that, per block::

    X_mid = X_in  + attn_branch        # attention (token-mixer) update
    X_out = X_mid + mlp_branch         # MLP update (a parallel block adds both to X_in: same sums)

    attn_ratio = |attn_branch| / |X_in|,   mlp_ratio = |mlp_branch| / |X_mid|

where ``|.|`` is the L2 norm over channels of each token, averaged over tokens and images.
``cosine`` is the mean per-token cosine similarity of ``X_in`` and ``X_out``.

Works on timm ViT-style models without editing them: forward hooks on each ``blocks[i]`` and on
its two branch outputs, ``ls1`` and ``ls2`` (timm ``Block``: ``x + ls1(attn(norm1 x))``, then
``+ ls2(mlp(norm2 x))``; ``nn.Identity`` without layer-scale). That covers timm's
VisionTransformer family (ViT, DeiT, ...) and the vitblocks variants built on it (MABViT,
parallel blocks, NiNformer's gating unit in place of attention). Eval mode, so drop-path and
dropout are off.
"""
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from .components import eval_forward_with_hooks
from .figures import png_figure

__all__ = ['BlockNorms', 'CollapseReport', 'residual_growth', 'plot_residual_growth', 'BlockDivergence',
           'sequential_vs_parallel', 'plot_divergence']


@dataclass(frozen=True)
class BlockNorms:
    """Mean per-token L2 norms at one block (see the module docstring)."""
    index: int
    stream_in: float  # |X_in|, the residual stream entering the block
    attn: float  # |attention branch output|, as added to the stream
    stream_mid: float  # |X_in + attention branch|, the stream the MLP output is added to
    mlp: float  # |MLP branch output|
    stream_out: float  # |X_out|
    cosine: float  # mean cos(X_in, X_out) over tokens

    @property
    def attn_ratio(self) -> float:
        return self.attn / self.stream_in

    @property
    def mlp_ratio(self) -> float:
        return self.mlp / self.stream_mid


@dataclass
class CollapseReport:
    model: str
    input_shape: Tuple[int, ...]  # (B, C, H, W) of the probe batch
    blocks: List[BlockNorms] = field(default_factory=list)

    def as_dicts(self) -> List[Dict[str, float]]:
        return [dict(asdict(b), attn_ratio=b.attn_ratio, mlp_ratio=b.mlp_ratio) for b in self.blocks]


def _token_norm(x: torch.Tensor) -> torch.Tensor:
    return x.float().norm(dim=-1).mean()  # (B, N, C) -> mean over (B, N) of the L2 norm over C


def _probe_points(model: nn.Module):
    blocks = getattr(model, 'blocks', None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)) or len(blocks) == 0:
        raise ValueError(f'the collapse probe needs a timm ViT-style model with a .blocks sequence; '
                         f'{type(model).__name__} has none')
    for i, blk in enumerate(blocks):
        if not all(isinstance(getattr(blk, a, None), nn.Module) for a in ('ls1', 'ls2')):
            raise ValueError(f'blocks.{i} is a {type(blk).__name__}; the collapse probe supports timm ViT-style '
                             f'blocks whose branches end in ls1 (attention) and ls2 (MLP), as timm\'s Block')
    return blocks


@torch.no_grad()
def residual_growth(model: nn.Module, inputs: torch.Tensor, name: str = '') -> CollapseReport:
    """Run ``model`` once on ``inputs`` (eval mode, restored after) and measure every block.

    Args:
        model: a timm ViT-style model (``model.blocks[i]`` with ``ls1``/``ls2`` branch ends).
        inputs: an image batch ``(B, C, H, W)``.
        name: label for the report (e.g. the model name).

    Returns:
        A :class:`CollapseReport` with one :class:`BlockNorms` per block.
    """
    blocks = _probe_points(model)
    captured: Dict[Tuple[int, str], torch.Tensor] = {}
    results: List[BlockNorms] = []

    def keep(i: int, key: str):
        def hook(module, args, output):
            captured[(i, key)] = output
        return hook

    def keep_input(i: int):
        def hook(module, args):
            captured[(i, 'in')] = args[0]
        return hook

    def finish(i: int):
        def hook(module, args, output):
            missing = [k for k in ('in', 'attn', 'mlp') if (i, k) not in captured]
            if missing:
                raise RuntimeError(f'blocks.{i} ({type(module).__name__}) did not run its '
                                   f'{" and ".join(missing)} branch through ls1/ls2; the probe cannot see it')
            x_in, a, m = captured.pop((i, 'in')), captured.pop((i, 'attn')), captured.pop((i, 'mlp'))
            x_mid = x_in + a
            cos = torch.nn.functional.cosine_similarity(x_in.float(), output.float(), dim=-1).mean()
            results.append(BlockNorms(i, _token_norm(x_in).item(), _token_norm(a).item(), _token_norm(x_mid).item(),
                                      _token_norm(m).item(), _token_norm(output).item(), cos.item()))
        return hook

    handles = []
    for i, blk in enumerate(blocks):
        handles += [blk.register_forward_pre_hook(keep_input(i)), blk.ls1.register_forward_hook(keep(i, 'attn')),
                    blk.ls2.register_forward_hook(keep(i, 'mlp')), blk.register_forward_hook(finish(i))]
    eval_forward_with_hooks(model, inputs, handles)
    return CollapseReport(model=name or type(model).__name__, input_shape=tuple(inputs.shape), blocks=results)


def plot_residual_growth(report: CollapseReport, path: Union[str, Path], title: Optional[str] = None) -> Path:
    """Plot norms (log scale) and branch/stream ratios per block to a PNG at ``path``; returns the path."""
    idx = [b.index for b in report.blocks]
    with png_figure(path, dpi=120, ncols=2, figsize=(11, 4)) as (fig, (ax_norm, ax_ratio)):
        ax_norm.plot(idx, [b.stream_in for b in report.blocks], 'k-o', label='residual stream |X_in|')
        ax_norm.plot(idx, [b.attn for b in report.blocks], 'C0-s', label='attention branch')
        ax_norm.plot(idx, [b.mlp for b in report.blocks], 'C1-^', label='MLP branch')
        ax_norm.set(yscale='log', xlabel='block', ylabel='mean per-token L2 norm', title='norms')
        ax_ratio.plot(idx, [b.attn_ratio for b in report.blocks], 'C0-s', label='|attn| / |X_in|')
        ax_ratio.plot(idx, [b.mlp_ratio for b in report.blocks], 'C1-^', label='|mlp| / |X_in + attn|')
        ax_ratio.plot(idx, [b.cosine for b in report.blocks], 'k--', label='cos(X_in, X_out)')
        ax_ratio.set(xlabel='block', ylabel='ratio', title='branch update relative to the stream')
        for ax in (ax_norm, ax_ratio):
            ax.legend(fontsize=8)
            ax.grid(alpha=.3)
        b, c, h, w = report.input_shape
        fig.suptitle(title or f'{report.model}: residual growth ({b} inputs, {c}x{h}x{w})')
    return Path(path)


@dataclass(frozen=True)
class BlockDivergence:
    """Sequential vs parallel composition of one block's own attention and MLP weights."""
    index: int
    stream_in: float  # |X_i|, mean per-token L2 norm of the block input
    distance: float  # mean per-token |X_seq - X_par|
    update: float  # mean per-token |X_seq - X_i|, the sequential block's whole update

    @property
    def relative(self) -> float:
        """distance / |X_i|: small means the two compositions give the same stream (the claim)."""
        return self.distance / self.stream_in

    @property
    def relative_to_update(self) -> float:
        return self.distance / self.update if self.update > 0 else 0.0


@torch.no_grad()
def sequential_vs_parallel(model: nn.Module, inputs: torch.Tensor) -> List[BlockDivergence]:
    """MABViT's collapse claim measured directly: at each block, with its input ``X_i`` from the
    model's own forward and its own weights,

        sequential:  X_seq = X_i + A(LN1 X_i);  X_seq += M(LN2 X_seq)     ("Standard Pre-LN", X_{i+2})
        parallel:    X_par = X_i + A(LN1 X_i) + M(LN2 X_i)                ("Parallel Pre-LN", X_{j+1})

    (A, M include layer-scale ``ls1``/``ls2``; LN2 is LN1 in a parallel block with one shared LayerNorm,
    ``shared_norm``, whose ``norm2`` is an identity). The two differ only through ``M(LN2 X_seq) -
    M(LN2 X_i)``, so the distance vanishes when the MLP branch outputs zero, and it is small
    relative to ``|X_i|`` when the stream dominates the attention update (the paper's argument).
    The block's own forward (sequential or parallel) only decides which ``X_i`` the next block sees.
    """
    blocks = _probe_points(model)
    for i, blk in enumerate(blocks):
        if not all(isinstance(getattr(blk, a, None), nn.Module) for a in ('norm1', 'attn', 'norm2', 'mlp')):
            raise ValueError(f'blocks.{i} ({type(blk).__name__}) has no norm1/attn/norm2/mlp; the sequential-vs-'
                             f'parallel measure needs both branches of a timm ViT-style block')
    results: List[BlockDivergence] = []

    def measure(i: int):
        def hook(blk, args, output):  # after the block ran, so grid-tracking pre-hooks have set layouts
            x = args[0]
            norm2 = blk.norm1 if getattr(blk, 'shared_norm', False) else blk.norm2  # ParallelBlock(shared_norm=True)
            mid = x + blk.ls1(blk.attn(blk.norm1(x)))
            seq = mid + blk.ls2(blk.mlp(norm2(mid)))
            par = mid + blk.ls2(blk.mlp(norm2(x)))
            results.append(BlockDivergence(i, _token_norm(x).item(), _token_norm(seq - par).item(),
                                           _token_norm(seq - x).item()))
        return hook

    eval_forward_with_hooks(model, inputs, [blk.register_forward_hook(measure(i)) for i, blk in enumerate(blocks)])
    return results


def plot_divergence(curves: Dict[str, List[BlockDivergence]], path: Union[str, Path]) -> Path:
    """|X_seq - X_par| / |X_i| per block for several models on one axis; returns the PNG path."""
    with png_figure(path, figsize=(6.5, 3.6)) as (_, ax):
        for k, (label, rows) in enumerate(curves.items()):
            ax.plot([r.index for r in rows], [r.relative for r in rows], f'C{k}-o', label=label)
        ax.set(xlabel='block', ylabel='|X_seq - X_par| / |X_in|', yscale='log',
               title='sequential vs parallel composition of the same weights')
        ax.grid(alpha=.3)
        ax.legend(fontsize=8)
    return Path(path)
