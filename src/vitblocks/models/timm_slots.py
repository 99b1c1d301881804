"""The slots of the timm families vitblocks swaps into, declared once (``slots.register_slots``).

| family (timm class)           | ``'ffn'`` slot              | layout seen by the FFN                      |
| ----------------------------- | --------------------------- | ------------------------------------------- |
| VisionTransformer (ViT, DeiT, | ``blocks[i].mlp``           | tokens ``(B, P + H*W, C)``, P prefix tokens |
| distilled DeiT, reg tokens)   | (``mlp_channels`` of a      | (grid from the patch embedding, one layout  |
|                               | ``MixerBlock``)             | shared by all blocks)                       |
| SwinTransformer               | ``layers[s].blocks[i].mlp`` | tokens ``(B, H*W, C)`` (grid = block input) |
| MetaFormer (PoolFormer)       | ``stages[s].blocks[i].mlp`` | channels-first ``(B, C, H, W)`` (CAFormer's |
|                               |                             | attention stages: tokens ``(B, H*W, C)``,   |
|                               |                             | grid from the stage's downsampling)         |
| MlpMixer                      | ``blocks[i].mlp_channels``  | tokens ``(B, H*W, C)``; token MLPs untouched |
| PyramidVisionTransformerV2    | ``stages[s].blocks[i].mlp`` | tokens ``(B, H*W, C)``; grid = the block's  |
| (PVTv2)                       |                             | ``feat_size`` argument, read every forward  |
| GlobalContextVit (GC ViT)     | ``stages[s].blocks[i].mlp`` | channels-last ``(B, H, W, C)`` (carries its grid) |

``'attention'`` and ``'gating'``: ``blocks[i].attn`` of a VisionTransformer (the gating slot's layout is the
fixed token grid). ``'residual_ffn'``: timm's ``Block``, ``SwinTransformerBlock``, ``MetaFormerBlock`` and
``MixerBlock`` (see ``residual_surgery.py``).

The grid hooks are eager-only (``torch.jit.is_scripting()`` returns early, timm's pattern): a scripted
ViT/Mixer/Swin keeps the grid its layouts had when it was scripted, the size its fixed-size timm
config declares, and ``check_grid`` names any other size.
"""
from typing import List, Tuple

import torch
from timm.models.gcvit import GlobalContextVit
from timm.models.metaformer import MetaFormer, MetaFormerBlock
from timm.models.mlp_mixer import MixerBlock, MlpMixer
from timm.models.pvt_v2 import PyramidVisionTransformerV2
from timm.models.swin_transformer import SwinTransformer, SwinTransformerBlock
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ..layers import TokenLayout
from .residual_blocks import (ResidualFFNMetaFormerBlock, ResidualFFNMixerBlock, ResidualFFNSwinBlock,
                              ResidualFFNViTBlock)
from .slots import (CHANNELS_LAST, TOKENS, ResidualRecipe, Slot, register_slots, stage_block_slots,
                    tracing_symbolically, tracked_layout)

__all__: List[str] = []


# --- grid tracking ------------------------------------------------------------------------------

def _track_patch_grid(patch_embed: nn.Module, args: Tuple[torch.Tensor], output: torch.Tensor) -> None:
    """Forward hook on a patch embedding: record the grid of this forward in the shared layout."""
    if torch.jit.is_scripting():  # TorchScript compiles hooks: typed arguments, and nothing past this line
        return
    if tracing_symbolically():
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
    if tracing_symbolically():
        return
    x = args[0]
    block._vitblocks_layout.grid_size = (x.shape[1], x.shape[2])


def _track_stage_grid(downsample: nn.Module, args: Tuple[torch.Tensor], output: torch.Tensor) -> None:
    """Forward hook on a MetaFormer stage's downsampling, whose output ``(B, C, H, W)`` the stage turns into tokens."""
    if torch.jit.is_scripting():
        return
    if tracing_symbolically():
        return
    downsample._vitblocks_layout.grid_size = (output.shape[-2], output.shape[-1])


def _shared_patch_layout(patch_embed: nn.Module, num_prefix_tokens: int) -> TokenLayout:
    """One layout for all blocks of a plain ViT/Mixer, kept current by a hook on the patch embed."""
    return tracked_layout(patch_embed, lambda: TokenLayout(tuple(patch_embed.grid_size), num_prefix_tokens),
                          _track_patch_grid)


def _block_layout(block: nn.Module, grid_size) -> TokenLayout:
    """A Swin block's layout, kept current by a pre-hook on the block (its input is ``(B, H, W, C)``)."""
    return tracked_layout(block, lambda: TokenLayout(tuple(grid_size) if grid_size is not None else None, 0),
                          _track_block_grid, pre=True)


def _stage_token_layout(stage: nn.Module) -> TokenLayout:
    """One layout for the blocks of a channels-last MetaFormer stage: timm's ``MetaFormerStage`` reshapes the
    downsampled ``(B, C, H, W)`` map to tokens ``(B, H*W, C)`` (no prefix), so a hook on its downsampling
    records the grid of every forward."""
    return tracked_layout(stage.downsample, lambda: TokenLayout(None, 0), _track_stage_grid)


# --- the families -------------------------------------------------------------------------------

def _vit_ffn(model: VisionTransformer) -> List[Slot]:
    layout = _shared_patch_layout(model.patch_embed, model.num_prefix_tokens)
    slots = []
    for i, blk in enumerate(model.blocks):
        # a ViT whose blocks are Mixer blocks (NiNformer's Mixer baseline) keeps its MLP in mlp_channels
        attr = 'mlp_channels' if isinstance(blk, MixerBlock) else 'mlp'
        slots.append(Slot(blk, attr, f'blocks.{i}.{attr}', layout))
    return slots


def _vit_attention(model: VisionTransformer) -> List[Slot]:
    """Every block's ``attn``, in block order (the swap skips a block whose ``attn`` is not an attention)."""
    return [Slot(blk, 'attn', f'blocks.{i}.attn') for i, blk in enumerate(model.blocks)]


def _vit_gating(model: VisionTransformer) -> List[Slot]:
    """Every block's ``attn``; the layout is the fixed token grid a gating unit mixes (no dynamic size)."""
    if model.dynamic_img_size:
        raise ValueError('the gating unit mixes a fixed number of tokens; build the model with '
                         'dynamic_img_size=False (fixed img_size)')
    layout = TokenLayout(tuple(model.patch_embed.grid_size), model.num_prefix_tokens)
    return [Slot(blk, 'attn', f'blocks.{i}.attn', layout) for i, blk in enumerate(model.blocks)]


def _swin_ffn(model: SwinTransformer) -> List[Slot]:
    return [Slot(blk, 'mlp', f'layers.{s}.blocks.{i}.mlp', _block_layout(blk, getattr(blk, 'input_resolution', None)))
            for s, stage in enumerate(model.layers) for i, blk in enumerate(stage.blocks)]


def _metaformer_ffn(model: MetaFormer) -> List[Slot]:
    slots = []
    for s, stage in enumerate(model.stages):
        for i, blk in enumerate(stage.blocks):
            if isinstance(blk.mlp.fc1, nn.Conv2d):  # 1x1-conv MLPs on (B, C, H, W) maps (PoolFormer, ConvFormer)
                layout = TokenLayout(None, 0, True)
            else:  # timm runs a channels-last stage (CAFormer's attention stages) on tokens (B, H*W, C)
                layout = _stage_token_layout(stage)
            slots.append(Slot(blk, 'mlp', f'stages.{s}.blocks.{i}.mlp', layout))
    return slots


def _mixer_ffn(model: MlpMixer) -> List[Slot]:
    layout = _shared_patch_layout(model.stem, 0)
    return [Slot(blk, 'mlp_channels', f'blocks.{i}.mlp_channels', layout) for i, blk in enumerate(model.blocks)]


register_slots(VisionTransformer, ffn=_vit_ffn, attention=_vit_attention, gating=_vit_gating)
register_slots(SwinTransformer, ffn=_swin_ffn)
register_slots(MetaFormer, ffn=_metaformer_ffn)
register_slots(MlpMixer, ffn=_mixer_ffn)
# PVTv2 blocks call mlp(x, feat_size): the grid comes with each call, one layout per block, none shared
register_slots(PyramidVisionTransformerV2, ffn=stage_block_slots(TOKENS))
register_slots(GlobalContextVit, ffn=stage_block_slots(CHANNELS_LAST))  # blocks run on (B, H, W, C) maps

register_slots(Block, residual_ffn=ResidualRecipe(ResidualFFNViTBlock, 'mlp', 'norm2', 'drop_path2',
                                                  layer_scale='ls2'))
register_slots(SwinTransformerBlock, residual_ffn=ResidualRecipe(ResidualFFNSwinBlock, 'mlp', 'norm2', 'drop_path2'))
register_slots(MetaFormerBlock, residual_ffn=ResidualRecipe(ResidualFFNMetaFormerBlock, 'mlp', 'norm2', 'drop_path2',
                                                            layer_scale='layer_scale2', res_scale='res_scale2'))
register_slots(MixerBlock, residual_ffn=ResidualRecipe(ResidualFFNMixerBlock, 'mlp_channels', 'norm2', 'drop_path',
                                                       drop_path_shared=True))
