"""Module surgery: put a registered FFN into the channel-mixer slots of timm backbones.

This file holds the only backbone knowledge in vitblocks: for each supported timm family,
where its channel MLPs are, what layout their input has, and how the 2-D grid is tracked
when the input resolution changes.

| family (timm class)           | slot                      | layout seen by the FFN                      |
| ----------------------------- | ------------------------- | ------------------------------------------- |
| VisionTransformer (ViT, DeiT, | ``blocks[i].mlp``         | tokens ``(B, P + H*W, C)``, P prefix tokens |
| distilled DeiT, reg tokens)   | (``mlp_channels`` of a    | (grid from the patch embedding)             |
|                               | ``MixerBlock``)           |                                             |
| SwinTransformer               | ``layers[s].blocks[i].mlp`` | tokens ``(B, H*W, C)`` (grid = block input) |
| MetaFormer (PoolFormer)       | ``stages[s].blocks[i].mlp`` | channels-first ``(B, C, H, W)``           |
|                               |                           | (CAFormer's attention stages: tokens        |
|                               |                           | ``(B, H*W, C)``, grid from the stage's      |
|                               |                           | downsampling)                               |
| MlpMixer                      | ``blocks[i].mlp_channels``  | tokens ``(B, H*W, C)``; token MLPs untouched |
| PyramidVisionTransformerV2    | ``stages[s].blocks[i].mlp`` | tokens ``(B, H*W, C)``; grid = the block's   |
| (PVTv2)                       |                           | ``feat_size`` argument, read every forward  |
| GlobalContextVit (GC ViT)     | ``stages[s].blocks[i].mlp`` | channels-last ``(B, H, W, C)`` (carries its grid) |
| LVT (``vitblocks.models.lvt``) | ``stages[s].blocks[i].mlp`` | channels-last ``(B, H, W, C)`` (carries its grid) |
| CycleMLPNet (``models.cyclemlp``) | ``stages[s].blocks[i].mlp`` | channels-last ``(B, H, W, C)`` |
| HireMLPNet (``models.hiremlp``) | ``stages[s].blocks[i].mlp`` | channels-first ``(B, C, H, W)`` |
| EdgeViT (``vitblocks.models.edgevit``) | ``stages[s].blocks[i].local_agg.mlp`` | channels-first ``(B, C, H, W)`` |
|                               | ``stages[s].blocks[i].global_attn.mlp`` | channels-last ``(B, H, W, C)`` |
| PyramidVisionLLaMA (``models.vision_llama``) | ``stages[s].blocks[i].mlp`` (SwiGLU) | channels-last ``(B, H, W, C)`` |

PVTv2 blocks call their MLP as ``mlp(x, feat_size)``. The grid-aware FFNs (those with a ``TokenLayout``)
take that argument as timm's ``MlpWithDepthwiseConv`` does and set their layout from it on every call
(eager, torch.fx and TorchScript alike, so a model traced before its first forward has its grid); an
FFN without a ``feat_size`` argument gets a forward pre-hook that drops it (eager only).

The grid hooks are eager-only (``torch.jit.is_scripting()`` returns early, timm's pattern): a scripted
ViT/Mixer/Swin keeps the grid its layouts had when it was scripted, the size its fixed-size timm
config declares, and ``check_grid`` names any other size.
"""
import inspect
from typing import Callable, List, Optional, Tuple

import torch
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from timm.models.gcvit import GlobalContextVit
from timm.models.metaformer import MetaFormer
from timm.models.mlp_mixer import MixerBlock, MlpMixer
from timm.models.pvt_v2 import Block as PvtV2Block
from timm.models.pvt_v2 import PyramidVisionTransformerV2
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..layers import FFN_INHERITS, TokenLayout, activation_name, create_ffn
from .lvt import LVT
from .cyclemlp import CycleMLPNet
from .hiremlp import HireMLPNet
from .edgevit import EdgeViT, LocalAggregation
from .vision_llama import PyramidVisionLLaMA
from .weight_decay import expose_no_weight_decay

__all__ = ['swap_ffn', 'find_ffn_slots', 'SUPPORTED_FAMILIES']

SUPPORTED_FAMILIES = ('VisionTransformer', 'SwinTransformer', 'MetaFormer', 'MlpMixer', 'PyramidVisionTransformerV2',
                      'GlobalContextVit', 'LVT', 'CycleMLPNet', 'HireMLPNet',
                      'EdgeViT', 'PyramidVisionLLaMA')

# A slot: (parent module, attribute name, qualified name, layout for the new FFN).
Slot = Tuple[nn.Module, str, str, TokenLayout]


def _tracing_symbolically() -> bool:
    """torch.fx tracing: shapes are proxies, and a hook's update of the layout is not recorded in the
    graph. The hooks then leave the layout as the last eager forward (or the build) set it, so a traced
    model runs at that input size; the spatial layers are FX leaves (``vitblocks.layers``) whose
    ``check_grid`` names any mismatch."""
    return is_fx_symbolic_tracing()  # not is_fx_tracing(): that one logs a deprecation warning per process


def _track_patch_grid(patch_embed: nn.Module, args: Tuple[torch.Tensor], output: torch.Tensor) -> None:
    """Forward hook on a patch embedding: record the grid of this forward in the shared layout."""
    if torch.jit.is_scripting():  # TorchScript compiles hooks: typed arguments, and nothing past this line
        return
    if _tracing_symbolically():
        return
    layout = patch_embed._vitblocks_layout
    if output.ndim == 4:  # dynamic_img_size: (B, H, W, C)
        layout.grid_size = (output.shape[1], output.shape[2])
    else:  # (B, H*W, C): fixed or padded size, computed from the image
        layout.grid_size = tuple(patch_embed.dynamic_feat_size(tuple(args[0].shape[-2:])))


def _track_block_grid(block: nn.Module, args: Tuple[torch.Tensor]) -> None:
    """Forward pre-hook on a Swin block, whose input is ``(B, H, W, C)``."""
    if torch.jit.is_scripting():
        return
    if _tracing_symbolically():
        return
    x = args[0]
    block._vitblocks_layout.grid_size = (x.shape[1], x.shape[2])


def _track_stage_grid(downsample: nn.Module, args: Tuple[torch.Tensor], output: torch.Tensor) -> None:
    """Forward hook on a MetaFormer stage's downsampling, whose output ``(B, C, H, W)`` the stage turns into tokens."""
    if torch.jit.is_scripting():
        return
    if _tracing_symbolically():
        return
    downsample._vitblocks_layout.grid_size = (output.shape[-2], output.shape[-1])


def _tracked_layout(module: nn.Module, make: Callable[[], TokenLayout], hook: Callable,
                    pre: bool = False) -> TokenLayout:
    """The layout kept on ``module`` (made and attached on first use, with ``hook`` registered as its forward
    hook, or pre-hook with ``pre``, to keep its grid current); the same one for every slot that asks again."""
    layout = getattr(module, '_vitblocks_layout', None)
    if layout is None:
        layout = make()
        _attach(module, layout)
        (module.register_forward_pre_hook if pre else module.register_forward_hook)(hook)
    return layout


def _stage_token_layout(stage: nn.Module) -> TokenLayout:
    """One layout for the blocks of a channels-last MetaFormer stage: timm's ``MetaFormerStage`` reshapes the
    downsampled ``(B, C, H, W)`` map to tokens ``(B, H*W, C)`` (no prefix), so a hook on its downsampling
    records the grid of every forward."""
    return _tracked_layout(stage.downsample, lambda: TokenLayout(None, 0), _track_stage_grid)


def _shared_patch_layout(patch_embed: nn.Module, num_prefix_tokens: int) -> TokenLayout:
    """One layout for all blocks of a plain ViT/Mixer, kept current by a hook on the patch embed."""
    return _tracked_layout(patch_embed, lambda: TokenLayout(tuple(patch_embed.grid_size), num_prefix_tokens),
                           _track_patch_grid)


def _block_layout(block: nn.Module, grid_size) -> TokenLayout:
    """A Swin block's layout, kept current by a pre-hook on the block (its input is ``(B, H, W, C)``)."""
    return _tracked_layout(block, lambda: TokenLayout(tuple(grid_size) if grid_size is not None else None, 0),
                           _track_block_grid, pre=True)


def _attach(module: nn.Module, layout: TokenLayout) -> None:
    """Keep the layout a hook updates on the timm module it hooks, outside that module's tree (a plain
    attribute, not a submodule): timm's module and its state dict stay as timm builds them, and the
    layout is listed once, under the FFNs that use it."""
    object.__setattr__(module, '_vitblocks_layout', layout)


def _drop_feat_size(mlp: nn.Module, args):
    """Forward pre-hook on an FFN without a ``feat_size`` argument in a PVTv2 block: call it with the tokens only."""
    return args[:1]


def _takes_feat_size(mlp: nn.Module) -> bool:
    return 'feat_size' in inspect.signature(mlp.forward).parameters


def find_ffn_slots(model: nn.Module) -> List[Slot]:
    """List the channel-MLP slots of a supported timm model (empty list if unsupported)."""
    slots: List[Slot] = []
    if isinstance(model, VisionTransformer):
        layout = _shared_patch_layout(model.patch_embed, model.num_prefix_tokens)
        for i, blk in enumerate(model.blocks):
            # a ViT whose blocks are Mixer blocks (NiNformer's Mixer baseline) keeps its MLP in mlp_channels
            attr = 'mlp_channels' if isinstance(blk, MixerBlock) else 'mlp'
            slots.append((blk, attr, f'blocks.{i}.{attr}', layout))
    elif isinstance(model, SwinTransformer):
        for s, stage in enumerate(model.layers):
            for i, blk in enumerate(stage.blocks):
                slots.append((blk, 'mlp', f'layers.{s}.blocks.{i}.mlp',
                              _block_layout(blk, getattr(blk, 'input_resolution', None))))
    elif isinstance(model, MetaFormer):
        for s, stage in enumerate(model.stages):
            for i, blk in enumerate(stage.blocks):
                if isinstance(blk.mlp.fc1, nn.Conv2d):  # 1x1-conv MLPs on (B, C, H, W) maps (PoolFormer, ConvFormer)
                    layout = TokenLayout(None, 0, True)
                else:  # timm runs a channels-last stage (CAFormer's attention stages) on tokens (B, H*W, C)
                    layout = _stage_token_layout(stage)
                slots.append((blk, 'mlp', f'stages.{s}.blocks.{i}.mlp', layout))
    elif isinstance(model, MlpMixer):
        layout = _shared_patch_layout(model.stem, 0)
        for i, blk in enumerate(model.blocks):
            slots.append((blk, 'mlp_channels', f'blocks.{i}.mlp_channels', layout))
    elif isinstance(model, PyramidVisionTransformerV2):
        for s, stage in enumerate(model.stages):
            for i, blk in enumerate(stage.blocks):
                # the grid comes with each call (feat_size); one layout per block, none shared
                slots.append((blk, 'mlp', f'stages.{s}.blocks.{i}.mlp', TokenLayout(None, 0)))
    elif isinstance(model, (GlobalContextVit, LVT, CycleMLPNet)):
        for s, stage in enumerate(model.stages):
            for i, blk in enumerate(stage.blocks):  # the blocks run on (B, H, W, C) maps
                slots.append((blk, 'mlp', f'stages.{s}.blocks.{i}.mlp', TokenLayout(None, 0, False)))
    elif isinstance(model, HireMLPNet):
        for s, stage in enumerate(model.stages):
            for i, blk in enumerate(stage.blocks):  # 1x1-conv MLPs on (B, C, H, W) maps
                slots.append((blk, 'mlp', f'stages.{s}.blocks.{i}.mlp', TokenLayout(None, 0, True)))
    elif isinstance(model, EdgeViT):
        for s, stage in enumerate(model.stages):
            for i, blk in enumerate(stage.blocks):  # both FFNs of an LGL block (no local part where r = 1)
                if isinstance(blk.local_agg, LocalAggregation):
                    slots.append((blk.local_agg, 'mlp', f'stages.{s}.blocks.{i}.local_agg.mlp',
                                  TokenLayout(None, 0, True)))
                slots.append((blk.global_attn, 'mlp', f'stages.{s}.blocks.{i}.global_attn.mlp',
                              TokenLayout(None, 0, False)))
    elif isinstance(model, PyramidVisionLLaMA):
        for s, stage in enumerate(model.stages):
            for i, blk in enumerate(stage.blocks):  # SwiGLU FFNs on (B, H, W, C) maps
                slots.append((blk, 'mlp', f'stages.{s}.blocks.{i}.mlp', TokenLayout(None, 0, False)))
    return slots


def _mlp_dims(mlp: nn.Module) -> Tuple[int, int, int, bool]:
    """(in, hidden, out, bias) of a timm Mlp-like module (Linear or 1x1-conv fc1/fc2; timm's SwiGLU has
    the gate and value halves of fc1 as fc1_g, fc1_x)."""
    fc1, fc2 = mlp.fc1 if hasattr(mlp, 'fc1') else mlp.fc1_g, mlp.fc2

    def in_out(m):
        return (m.in_features, m.out_features) if isinstance(m, nn.Linear) else (m.in_channels, m.out_channels)

    (c_in, hidden), (_, c_out) = in_out(fc1), in_out(fc2)
    return c_in, hidden, c_out, fc1.bias is not None


SWAPPED_ATTR = '_vitblocks_ffn'  # set on every module swap_ffn / swap_residual_ffn puts into a model: its registry name


def check_not_swapped(old: nn.Module, qualname: str) -> None:
    """Refuse a slot that already holds a block vitblocks swapped in: its module no longer has the backbone
    MLP's widths (IFFN's fc1 is half the hidden width, GLU's double, AFBO has no fc1), and a residual unit
    owns the block's pre-norm and shortcut, so a second swap would build the wrong width, drop the residual
    or fail deep inside."""
    swapped = getattr(old, SWAPPED_ATTR, None)
    if swapped is None and type(old).__module__.startswith('vitblocks.layers'):  # e.g. a fused (deployed) unit
        swapped = type(old).__name__
    if swapped is not None:
        raise ValueError(f'{qualname} already holds {swapped!r}, swapped in by vitblocks: its widths are not the '
                         f"backbone MLP's; swap into a freshly built timm model (the timm base, not a vitblocks "
                         f'model)')


def hidden_width(c_in: int, mlp_ratio: Optional[float], default: int, qualname: str) -> int:
    """The hidden width for ``mlp_ratio`` (``default``, the replaced MLP's, when it is None). A ratio that gives
    no channel is an error: the FFNs read a hidden width of 0 as "not given" and fall back to their default."""
    if mlp_ratio is None:
        return default
    hidden = int(round(c_in * mlp_ratio)) if isinstance(mlp_ratio, (int, float)) and mlp_ratio > 0 else 0
    if hidden < 1:
        raise ValueError(f'mlp_ratio={mlp_ratio!r} gives {qualname} (width {c_in}) no hidden channel; '
                         f'give a ratio > 0 with width x ratio >= 0.5 (e.g. 4), or None to keep the MLP\'s width')
    return hidden


def _inherited(name: str, old: nn.Module, cfg: dict) -> dict:
    """The knobs the new FFN takes over from the MLP it replaces (``register_ffn(inherits=...)``),
    unless the caller set them: the two dropout rates, and the activation by its registry name."""
    knobs = {}
    wanted = [k for k in FFN_INHERITS.get(name, ()) if k not in cfg]
    if 'drop' in wanted and isinstance(getattr(old, 'drop1', None), nn.Dropout):
        drop2 = old.drop2.p if isinstance(getattr(old, 'drop2', None), nn.Dropout) else 0.
        knobs['drop'] = (old.drop1.p, drop2)
    if 'act_layer' in wanted and isinstance(getattr(old, 'act', None), nn.Module):
        try:
            knobs['act_layer'] = activation_name(type(old.act))
        except ValueError as e:
            raise ValueError(f'swap_ffn: {name!r} takes over the activation of the MLP it replaces, and {e}; '
                             f'pass act_layer= explicitly') from None
    return knobs


def swap_ffn(model: nn.Module, name: str, *, mlp_ratio: Optional[float] = None,
             include: Optional[Callable[[str], bool]] = None, **cfg) -> int:
    """Replace the channel MLPs of a timm model with the FFN registered as ``name``.

    Args:
        model: a timm model of a supported family (see ``SUPPORTED_FAMILIES``); changed in place.
        name: registered FFN name (``vitblocks.layers.list_ffns()``), e.g. 'iffn'.
        mlp_ratio: hidden width relative to the input width; default keeps the original width.
        include: optional predicate on the slot's qualified name (e.g. ``'blocks.3.mlp'``)
            selecting which slots to replace.
        **cfg: constructor arguments of the FFN (``kernel_size=5``, ``act_layer='silu'``, ...).
            Knobs the FFN shares with the replaced MLP (its ``register_ffn(inherits=...)``, listed in
            ``vitblocks.layers.FFN_INHERITS``: the dropout rates for every FFN but ``sum_nonlinear``, which
            has no dropout; the activation for IFFN, SCHEME and ``mlp``) default to the MLP's values.

    Returns:
        The number of modules replaced. New modules are freshly initialized, on the device and
        dtype of the module they replace, in the model's current train/eval mode. The model's
        ``no_weight_decay()`` then also names what the new modules keep out of weight decay
        (``models.weight_decay``), so timm's optimizer factory groups them as vitblocks' trainer does.

    Raises:
        ValueError: if the model has no supported slot (or ``include`` selected none), or a selected
            slot already holds a block vitblocks swapped in (build the timm base afresh instead).
    """
    slots = find_ffn_slots(model)
    if not slots:
        raise ValueError(f'swap_ffn found no channel MLP in {type(model).__name__}; supported timm families: '
                         f'{", ".join(SUPPORTED_FAMILIES)}')
    selected = [slot for slot in slots if include is None or include(slot[2])]
    for parent, attr, qualname, _ in selected:  # all checked before any is replaced
        check_not_swapped(getattr(parent, attr), qualname)
        hidden_width(_mlp_dims(getattr(parent, attr))[0], mlp_ratio, 0, qualname)
    count = 0
    for parent, attr, qualname, layout in selected:
        old = getattr(parent, attr)
        c_in, hidden, c_out, bias = _mlp_dims(old)
        hidden = hidden_width(c_in, mlp_ratio, hidden, qualname)
        ref = old.fc2.weight
        kwargs = dict(bias=bias, **_inherited(name, old, cfg), **cfg)
        new = create_ffn(name, c_in, hidden, c_out, layout=layout, device=ref.device, dtype=ref.dtype, **kwargs)
        new.train(old.training)
        setattr(new, SWAPPED_ATTR, name)
        if isinstance(parent, PvtV2Block) and not _takes_feat_size(new):
            new.register_forward_pre_hook(_drop_feat_size)  # the block calls mlp(x, feat_size)
        setattr(parent, attr, new)
        count += 1
    if count == 0:
        raise ValueError(f'swap_ffn: include= selected none of the {len(slots)} slots of {type(model).__name__} '
                         f'(e.g. {slots[0][2]!r})')
    expose_no_weight_decay(model)  # timm's optimizer factory asks the model only
    return count
