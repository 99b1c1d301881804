"""The timm blocks as ``swap_residual_ffn`` rewires them: forward = timm's token-mixer half, then the residual unit.

Each subclass overrides only ``forward`` (the token-mixer half is timm's, line for line); the surgery sets
``block.__class__`` to it (module-level classes, so models pickle and copy). Which block class becomes which
is declared with its ``ResidualRecipe`` (``models/timm_slots.py``, ``models/backbones/lvvit.py``).
"""
from typing import Optional

import torch
from timm.models.metaformer import MetaFormerBlock
from timm.models.mlp_mixer import MixerBlock
from timm.models.swin_transformer import SwinTransformerBlock
from timm.models.vision_transformer import Block

__all__ = ['ResidualFFNViTBlock', 'ResidualFFNSwinBlock', 'ResidualFFNMetaFormerBlock', 'ResidualFFNMixerBlock']


class ResidualFFNViTBlock(Block):
    """timm ``Block`` whose ``mlp`` is a residual unit (it owns norm2, ls2, drop_path2, shortcut)."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
        return self.mlp(x)


class ResidualFFNSwinBlock(SwinTransformerBlock):
    """timm ``SwinTransformerBlock`` whose ``mlp`` is a residual unit (owns norm2, drop_path2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self._attn(self.norm1(x)))  # (B, H, W, C)
        return self.mlp(x)  # point-wise unit: the (B, H, W, C) map needs no reshape to (B, H*W, C)


class ResidualFFNMetaFormerBlock(MetaFormerBlock):
    """timm ``MetaFormerBlock`` whose ``mlp`` is a residual unit (owns norm2, drop_path2,
    layer_scale2 and res_scale2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res_scale1(x) + self.layer_scale1(self.drop_path1(self.token_mixer(self.norm1(x))))
        return self.mlp(x)


class ResidualFFNMixerBlock(MixerBlock):
    """timm ``MixerBlock`` whose ``mlp_channels`` is a residual unit (owns norm2 and the shortcut;
    ``drop_path`` stays, the token-mixing half still uses it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2))  # (B, N, C)
        return self.mlp_channels(x)
