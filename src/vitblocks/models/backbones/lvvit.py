"""LV-ViT (Jiang et al., "All Tokens Matter: Token Labeling for Training Better Vision
Transformers", NeurIPS 2021) as a timm ``VisionTransformer``: ``lvvit_s``, ``lvvit_m``, ``lvvit_l``.

What LV-ViT changes in a ViT (from the paper and the authors' model definition):

* Patch embedding: a convolutional stem, ``7x7/2 conv - BN - ReLU``, two ``3x3 conv - BN - ReLU``
  (64 channels, no conv bias), then a ``p/2 x p/2`` stride-``p/2`` projection to the width, so
  the total stride is still the patch size p = 16.
* Residual scaling: both residual branches are divided by a fixed ``skip_lam`` (2 for S and M):
  ``x = x + f(norm(x)) / skip_lam``. It is a constant, not a learnable layer-scale.
* No qkv bias, MLP ratio 3, class token, learned position embedding, LayerNorm eps 1e-5.
  (The authors' RePa code also multiplies the FFN input by ``skip_lam`` before its BatchNorm,
  which BatchNorm cancels up to its eps; we leave it out.)
* A second classifier, ``aux_head``, on every patch token (the token-labeling head). At
  inference the authors score an image as ``head(cls) + 0.5 * max over tokens of
  aux_head(patch tokens)``; ``forward_head`` always returns that score, so plain cross-entropy
  training trains both heads. Token-labeling training itself (dense targets, MixToken) is not
  implemented. The aux head is part of the published parameter and MAC counts (26.2 M / 6.1 G
  for S needs its 0.385 M and 0.075 GMACs), so it is built by default (``aux_head=False`` drops it).

Everything else is timm's ``VisionTransformer`` (forward_features, forward_intermediates,
``features_only``, ``dynamic_img_size``), so ``swap_ffn`` finds ``blocks[i].mlp`` as in any ViT
and ``swap_residual_ffn`` (RePa) moves the fixed ``1/skip_lam`` of the FFN branch into the unit.

| model | width | depth | heads | params | GMACs (no attn matmuls) | with attn matmuls |
| --- | ---: | ---: | ---: | ---: | ---: | ---: |
| ``lvvit_s`` | 384 | 16 | 6 | 26.15 M | 6.07 | 6.55 |
| ``lvvit_m`` | 512 | 20 | 8 | 55.83 M | 11.88 | 12.68 |

(``count_macs`` at 224 px, norms not counted; RePa's Table 1 counter, norms at 5 MACs per
element without the attention matmuls, gives 6.10 and 11.92.)
"""
from functools import partial
from typing import Optional

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import PatchEmbed
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from ..residual_blocks import ResidualFFNViTBlock
from ..slots import ResidualRecipe, register_slots

__all__ = ['LVViT', 'LVViTBlock', 'ConvStemPatchEmbed', 'ConstantScale']


class ConstantScale(nn.Module):
    """Multiply by a fixed number (no parameter): LV-ViT's residual-branch scale ``1 / skip_lam``."""

    def __init__(self, value: float):
        super().__init__()
        self.value = float(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.value

    def extra_repr(self) -> str:
        return f'{self.value:g}'


class ConvStemPatchEmbed(PatchEmbed):
    """timm ``PatchEmbed`` whose projection is LV-ViT's 4-layer convolutional stem.

    ``proj`` = conv7x7/2-BN-ReLU, 2 x (conv3x3-BN-ReLU), conv (p/2)x(p/2) stride p/2 -> embed_dim.
    Grid size, strict/dynamic image size and padding behave as in timm's ``PatchEmbed`` (the total
    stride is the patch size).
    """

    def __init__(self, img_size=224, patch_size=16, in_chans: int = 3, embed_dim: int = 768, stem_width: int = 64,
                 bias: bool = True, device=None, dtype=None, **kwargs):
        super().__init__(img_size, patch_size, in_chans, embed_dim, bias=bias, device=device, dtype=dtype, **kwargs)
        if any(p % 2 for p in self.patch_size):
            raise ValueError(f'LV-ViT\'s stem halves the image first, so the patch size must be even; '
                             f'got {self.patch_size}')
        dd = {'device': device, 'dtype': dtype}
        half = (self.patch_size[0] // 2, self.patch_size[1] // 2)

        def conv_bn_relu(c_in, kernel, stride):
            return [nn.Conv2d(c_in, stem_width, kernel, stride, kernel // 2, bias=False, **dd),
                    nn.BatchNorm2d(stem_width, **dd), nn.ReLU(inplace=True)]

        self.proj = nn.Sequential(  # (B, 3, H, W) -> (B, D, H/p, W/p)
            *conv_bn_relu(in_chans, 7, 2), *conv_bn_relu(stem_width, 3, 1), *conv_bn_relu(stem_width, 3, 1),
            nn.Conv2d(stem_width, embed_dim, half, half, bias=bias, **dd))


class LVViTBlock(Block):
    """timm ``Block`` whose residual branches are scaled by the constant ``1 / skip_lam`` (LV-ViT)."""

    def __init__(self, dim: int, num_heads: int, skip_lam: float = 1.0, init_values: Optional[float] = None,
                 **kwargs):
        if init_values is not None:
            raise ValueError('LV-ViT scales its residual branches by the fixed 1/skip_lam; a learnable layer '
                             f'scale (init_values={init_values}) would replace it. Leave init_values unset.')
        if skip_lam <= 0:
            raise ValueError(f'skip_lam must be positive, got {skip_lam}')
        super().__init__(dim, num_heads, **kwargs)
        self.skip_lam = float(skip_lam)
        self.ls1 = ConstantScale(1. / skip_lam)  # x + attn(norm1(x)) / skip_lam
        self.ls2 = ConstantScale(1. / skip_lam)  # x + mlp(norm2(x)) / skip_lam


class LVViT(VisionTransformer):
    """LV-ViT: timm ``VisionTransformer`` with the conv stem, fixed residual scaling and aux head.

    Args:
        skip_lam: residual-branch divisor (2 for LV-ViT-S/M, 3 for L).
        stem_width: channels of the convolutional stem (64; 128 for LV-ViT-L).
        aux_head: build the token-labeling head on the patch tokens (see module docstring).
        **kwargs: timm ``VisionTransformer`` arguments (``embed_dim``, ``depth``, ``num_heads``,
            ``img_size``, ``num_classes``, ``dynamic_img_size``, ...).
    """

    def __init__(self, skip_lam: float = 2.0, stem_width: int = 64, aux_head: bool = True, **kwargs):
        for key in ('embed_layer', 'block_fn', 'init_values'):
            if kwargs.get(key) is not None:
                raise ValueError(f'LV-ViT fixes {key} (conv stem, blocks scaled by 1/skip_lam); build a timm '
                                 'VisionTransformer instead to change it')
        # the authors' nn.LayerNorm has eps 1e-5 (timm's ViT default is 1e-6)
        kwargs = dict(dict(qkv_bias=False, mlp_ratio=3., norm_layer=partial(nn.LayerNorm, eps=1e-5)), **kwargs)
        super().__init__(embed_layer=partial(ConvStemPatchEmbed, stem_width=stem_width),
                         block_fn=partial(LVViTBlock, skip_lam=skip_lam), **kwargs)
        self.use_aux_head = aux_head
        self.aux_head = self._make_aux_head()

    def _make_aux_head(self) -> Optional[nn.Linear]:
        if not self.use_aux_head or self.num_classes <= 0:
            return None
        ref = self.head.weight
        head = nn.Linear(self.embed_dim, self.num_classes, device=ref.device, dtype=ref.dtype).train(self.training)
        if ref.device.type != 'meta':
            nn.init.trunc_normal_(head.weight, std=.02)
            nn.init.zeros_(head.bias)
        return head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        super().reset_classifier(num_classes, global_pool)
        self.aux_head = self._make_aux_head()

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Class-token logits plus 0.5 x the per-class max of the aux head over the patch tokens."""
        # timm's VisionTransformer.forward_head spelled out: TorchScript compiles no super() call
        pooled = self.head_drop(self.fc_norm(self.pool(x)))  # (B, N, D) -> (B, D): the class token
        if pre_logits:
            return pooled
        logits = self.head(pooled)
        if self.aux_head is None:
            return logits
        aux = self.aux_head(x[:, self.num_prefix_tokens:])  # (B, N, D) -> (B, N, num_classes)
        return logits + 0.5 * aux.amax(dim=1)


# the slot protocol (models/slots.py): swap_ffn finds blocks[i].mlp as in any timm VisionTransformer (LVViT
# inherits its declaration); swap_residual_ffn rewires the block as a timm Block, and its constant 1/skip_lam
# (ls2) moves into the unit as branch_scale. Once rewired it runs timm's token-mixer half (ls1 still divides).
register_slots(LVViTBlock, residual_ffn=ResidualRecipe(ResidualFFNViTBlock, 'mlp', 'norm2', 'drop_path2',
                                                       constant_scale='ls2'))


def _cfg(**kwargs):
    # fixed_input_size: the patch embedding checks the image size (strict_img_size), as timm's ViT configs declare
    return dict(dict(url='', num_classes=1000, input_size=(3, 224, 224), fixed_input_size=True, pool_size=None,
                     crop_pct=0.9, interpolation='bicubic', mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
                     first_conv='patch_embed.proj.0', classifier=('head', 'aux_head')), **kwargs)


default_cfgs = generate_default_cfgs({  # read by timm's register_model; crop_pct as in the authors' configs
    'lvvit_s': _cfg(),
    'lvvit_m': _cfg(crop_pct=1.0),
    'lvvit_l': _cfg(crop_pct=1.0, input_size=(3, 288, 288)),  # trained and evaluated at 288 px
})


def _create_lvvit(variant: str, pretrained: bool = False, **kwargs) -> LVViT:
    if pretrained:
        raise RuntimeError(f'{variant}: vitblocks ships no weights (nothing is downloaded); pass checkpoint_path= '
                           'to timm.create_model to load a checkpoint')
    out_indices = kwargs.pop('out_indices', 3)
    return build_model_with_cfg(LVViT, variant, pretrained,
                                feature_cfg=dict(out_indices=out_indices, feature_cls='getter'), **kwargs)


@register_model
def lvvit_s(pretrained: bool = False, **kwargs) -> LVViT:
    """LV-ViT-S: width 384, 16 blocks, 6 heads, MLP ratio 3, skip_lam 2 (26.2 M params)."""
    args = dict(patch_size=16, embed_dim=384, depth=16, num_heads=6, skip_lam=2.)
    return _create_lvvit('lvvit_s', pretrained, **dict(args, **kwargs))


@register_model
def lvvit_m(pretrained: bool = False, **kwargs) -> LVViT:
    """LV-ViT-M: width 512, 20 blocks, 8 heads, MLP ratio 3, skip_lam 2 (55.8 M params)."""
    args = dict(patch_size=16, embed_dim=512, depth=20, num_heads=8, skip_lam=2.)
    return _create_lvvit('lvvit_m', pretrained, **dict(args, **kwargs))


@register_model
def lvvit_l(pretrained: bool = False, **kwargs) -> LVViT:
    """LV-ViT-L: width 768, 24 blocks, 12 heads, MLP ratio 3, skip_lam 3, 128-channel stem, 288 px (150 M params)."""
    args = dict(img_size=288, patch_size=16, embed_dim=768, depth=24, num_heads=12, skip_lam=3., stem_width=128)
    return _create_lvvit('lvvit_l', pretrained, **dict(args, **kwargs))
