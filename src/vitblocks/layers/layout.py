"""Token layout: how a layer that needs the 2-D grid finds it.

Vision backbones hand their channel mixers tokens in one of two layouts:

* tokens, ``(B, N, C)``: ViT/DeiT (``N = prefix + H*W``, prefix = class, distillation and
  register tokens), Swin (``N = H*W``), MLP-Mixer (``N = H*W``);
* channels-first maps, ``(B, C, H, W)``: PoolFormer / MetaFormer.

A layer that mixes spatially (depthwise convs, pooling, spatial attention) must know the
grid ``(H, W)`` and how many prefix tokens to leave alone. That knowledge lives in a
:class:`TokenLayout`, which the surgery code (``vitblocks.models.surgery``, from the slots each
backbone declares in ``vitblocks.models.slots``) fills in and keeps up to date when the input
resolution changes. The grid is never guessed from ``sqrt(N)``.
"""
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ['TokenLayout', 'split_tokens', 'merge_tokens', 'check_grid', 'apply_spatial']


class TokenLayout(nn.Module):
    """Where the spatial grid is inside a token tensor.

    Args:
        grid_size: ``(H, W)`` of the patch grid, or ``None`` when unknown (token input then
            fails with a clear error; channels-first input carries its own grid).
        num_prefix_tokens: leading tokens that are not on the grid (class, distillation,
            register tokens); they bypass the spatial op.
        channels_first: input is ``(B, C, H, W)`` instead of ``(B, N, C)``.
        sequence: the tokens are a 1-D sequence of any length ``L`` (text): the grid of ``N`` tokens is
            ``(1, N - prefix)``, read from the input on every call, so a map is ``(B, C, 1, L)`` and a spatial
            op built for it runs along the sequence (``vitblocks.hf`` builds its kernels ``(1, k)``).

    Several layers of one model may share a single instance (all blocks of a ViT see the
    same grid), so updating it once per forward updates them all.

    Why a module (stateless: no parameters or buffers, nothing in the state dict): TorchScript
    reads typed attributes of submodules, so a layer that holds its layout as a submodule scripts
    as it is. A scripted model keeps the grid its layouts had when it was scripted (the grid hooks
    of ``vitblocks.models.timm_slots`` are eager-only), except where the input carries the grid:
    maps, Swin blocks, and PVTv2's ``feat_size`` argument.
    """
    grid_size: Optional[Tuple[int, int]]
    num_prefix_tokens: int
    channels_first: bool
    sequence: bool

    def __init__(self, grid_size: Optional[Sequence[int]] = None, num_prefix_tokens: int = 0,
                 channels_first: bool = False, sequence: bool = False):
        super().__init__()
        if sequence and (grid_size is not None or channels_first):
            raise ValueError('a sequence layout reads its length from the input: give no grid_size and no '
                             'channels_first with sequence=True')
        self.grid_size = (int(grid_size[0]), int(grid_size[1])) if grid_size is not None else None
        self.num_prefix_tokens = num_prefix_tokens
        self.channels_first = channels_first
        self.sequence = sequence

    @classmethod
    def resolve(cls, layout: Optional['TokenLayout'], grid_size: Optional[Sequence[int]] = None,
                num_prefix_tokens: int = 0, channels_first: bool = False) -> 'TokenLayout':
        """``layout`` when given (a shared instance), else a new one from the layer's own arguments."""
        if layout is not None:
            return layout
        return cls(grid_size, num_prefix_tokens, channels_first)

    def set_grid(self, feat_size: Optional[List[int]]) -> None:
        """Take the grid a backbone passes with the input (timm's PVTv2 calls ``mlp(x, feat_size)``), if any."""
        if feat_size is not None:
            self.grid_size = (feat_size[0], feat_size[1])

    def check_grid(self, num_tokens: int, owner: str = 'layer') -> Tuple[int, int]:
        """Return the grid for a token tensor with ``num_tokens`` tokens, or raise a clear error."""
        if self.sequence:  # (B, P + L, C): a 1 x L grid of any length
            return 1, num_tokens - self.num_prefix_tokens
        grid = self.grid_size
        if grid is None:
            raise ValueError(
                f'{owner} received token input (B, N, C) but has no grid size; pass grid_size=(H, W) when building '
                'the layer, or swap it into a model with vitblocks.swap_ffn, which tracks the grid.')
        h, w = grid
        expected = self.num_prefix_tokens + h * w
        if num_tokens != expected:
            raise ValueError(
                f'{owner} got {num_tokens} tokens, but its layout expects {self.num_prefix_tokens} prefix tokens '
                f'+ a {h}x{w} grid = {expected}. Update layout.grid_size for this input resolution '
                '(vitblocks.swap_ffn does this automatically for supported backbones in eager mode; a scripted or '
                'traced model runs at the input size it was scripted or traced at).')
        return h, w

    @torch.jit.export  # compiled with every scripted layout, so functions a layer passes its layout to can call it
    def split_tokens(self, x: torch.Tensor, owner: str = 'layer') -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """Split ``(B, N, C)`` tokens into prefix tokens and a channels-first map.

        Returns ``(prefix, fmap)`` where ``prefix`` is ``(B, P, C)`` (or ``None``) and ``fmap`` is a
        ``(B, C, H, W)`` *view* in channels-last memory order: no copy is made when the patch
        tokens are contiguous, and convolutions run on it natively.
        """
        B, N, C = x.shape
        h, w = self.check_grid(N, owner)
        p = self.num_prefix_tokens
        prefix: Optional[torch.Tensor] = None
        patches = x
        if p > 0:
            prefix, patches = x[:, :p], x[:, p:]
        fmap = patches.reshape(B, h, w, C).permute(0, 3, 1, 2)  # (B, H*W, C) -> (B, H, W, C) -> (B, C, H, W)
        return prefix, fmap

    def to_map(self, x: torch.Tensor, owner: str = 'layer') -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """View any supported layout as a ``(B, C, H, W)`` map, plus the prefix tokens set aside.

        * channels-first maps ``(B, C, H, W)`` go straight through;
        * channels-last maps ``(B, H, W, C)`` (timm's NHWC MetaFormers, GC ViT) are viewed as ``(B, C, H, W)``;
        * tokens ``(B, N, C)`` are split with :meth:`split_tokens`.

        :meth:`from_map` puts a map-to-map op's result back in the layout of ``x``.
        """
        if self.channels_first:
            return x, None
        if x.ndim == 4:
            return x.permute(0, 3, 1, 2), None  # (B, H, W, C) -> (B, C, H, W)
        if x.ndim != 3:
            raise ValueError(f'{owner} expects tokens (B, N, C) or a map, got shape {list(x.shape)}')
        prefix, fmap = self.split_tokens(x, owner)
        return fmap, prefix

    def from_map(self, fmap: torch.Tensor, prefix: Optional[torch.Tensor], ndim: int) -> torch.Tensor:
        """Inverse of :meth:`to_map` for an input of ``ndim`` dimensions."""
        if self.channels_first:
            return fmap
        if ndim == 4:
            return fmap.permute(0, 2, 3, 1)  # (B, C, H, W) -> (B, H, W, C)
        return merge_tokens(prefix, fmap)

    def extra_repr(self) -> str:
        seq = ', sequence=True' if self.sequence else ''
        return f'grid_size={self.grid_size}, num_prefix_tokens={self.num_prefix_tokens}, ' \
               f'channels_first={self.channels_first}{seq}'


def check_grid(layout: TokenLayout, num_tokens: int, owner: str = 'layer') -> Tuple[int, int]:
    """Return the grid for a token tensor with ``num_tokens`` tokens, or raise a clear error."""
    return layout.check_grid(num_tokens, owner)


def split_tokens(x: torch.Tensor, layout: TokenLayout, owner: str = 'layer'):
    """:meth:`TokenLayout.split_tokens`: ``(prefix, fmap)`` of ``(B, N, C)`` tokens."""
    return layout.split_tokens(x, owner)


def merge_tokens(prefix: Optional[torch.Tensor], fmap: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_tokens`: ``(B, C, H, W)`` map (+ prefix) back to ``(B, N, C)``."""
    B, C, H, W = fmap.shape
    patches = fmap.permute(0, 2, 3, 1).reshape(B, H * W, C)  # (B, C, H, W) -> (B, H, W, C) -> (B, H*W, C)
    if prefix is None:
        return patches
    return torch.cat([prefix, patches], dim=1)  # (B, P + H*W, C)


def apply_spatial(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, layout: TokenLayout,
                  owner: str = 'layer') -> torch.Tensor:
    """Apply a map-to-map op ``fn: (B, C, H, W) -> (B, C, H, W)`` to any supported layout
    (:meth:`TokenLayout.to_map`); prefix tokens bypass ``fn``. Eager helper: a scriptable layer calls
    ``to_map`` / ``from_map`` around its op itself (TorchScript passes no modules as arguments)."""
    fmap, prefix = layout.to_map(x, owner)
    return layout.from_map(fn(fmap), prefix, x.ndim)


def autocasting(t: torch.Tensor) -> bool:
    """Whether autocast is on for ``t``'s device: a matmul with ``out=`` would bypass it (autocast casts no
    call that passes ``out=``, so it would run in fp32 under bf16 autocast). False in TorchScript."""
    if not torch.jit.is_scripting():
        return torch.amp.is_autocast_available(t.device.type) and torch.is_autocast_enabled(t.device.type)
    return False


def building_graph() -> bool:
    """Whether this call is being recorded into a graph or transformed rather than simply run: ``torch.compile``
    or ``torch.export`` (the default ONNX exporter too) tracing it, ``torch.jit.trace`` (the legacy ONNX exporter),
    or a ``torch.func`` transform (``vmap``, ``grad``). Such a call must take plain functional ops: in-place
    and ``out=`` ops become part of the recorded program (a loaded ``.pt2`` then refuses autograd, the legacy
    ONNX exporter writes a wrong graph, ``vmap`` has no batching rule for them), and a loop over batch slices
    would fix the batch size."""
    if torch.jit.is_scripting():
        return False
    return (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or torch._C._functorch.peek_interpreter_stack() is not None)


def exporting() -> bool:
    """Whether a graph is being recorded for another runtime: ``torch.export`` (``.pt2`` files and the default ONNX
    exporter) or ``torch.jit.trace`` (the legacy ONNX exporter); not ``torch.compile``, which stays in PyTorch."""
    if torch.jit.is_scripting():
        return False
    return torch.compiler.is_exporting() or torch.jit.is_tracing()


def conv_channels_last(conv: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``conv`` (a ``(B, C, H, W)`` op) applied to a channels-last ``(B, H, W, C)`` map; returns ``(B, H, W, C)``.

    For exported graphs: the two layout changes sit right around the conv and nothing else reads them, so ONNX
    Runtime folds both into the layout reorders of its blocked (NCHWc) convolution instead of running two
    transposes of the map, and the element-wise work around the conv stays channels-last."""
    return conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # (B, H, W, C) -> (B, C, H, W) -> (B, H, W, C)


def plain_eager_inference(x: torch.Tensor, training: bool) -> bool:
    """Whether a deployed layer may take its eager fast path (in-place ops, ``out=`` matmuls, batch slices) for
    ``x``: an inference call (eval mode, autograd off) that is simply run, not recorded (:func:`building_graph`),
    and not under autocast (a matmul with ``out=`` would skip its casts). False in TorchScript."""
    if torch.jit.is_scripting():
        return False
    return not (training or torch.is_grad_enabled() or building_graph() or autocasting(x))


def batch_slice_size(batch: int, per_sample_bytes: int, budget_bytes: int) -> Optional[int]:
    """Samples per slice of an inference path that runs the batch in slices whose wide intermediates
    hold about ``budget_bytes``; ``None`` for the whole batch at once: no budget, a batch that fits,
    or while ``torch.compile`` / tracing builds a graph (compilers plan memory themselves, and an
    export must keep the batch size free)."""
    if building_graph():
        return None
    return slice_step(batch, per_sample_bytes, budget_bytes)


def slice_step(batch: int, per_sample_bytes: int, budget_bytes: int) -> Optional[int]:
    """The arithmetic of :func:`batch_slice_size` without its compile / tracing check: samples per slice
    of about ``budget_bytes`` (at least one), ``None`` for no budget or a batch that fits."""
    if not budget_bytes:
        return None
    step = max(1, budget_bytes // per_sample_bytes)
    return step if step < batch else None
