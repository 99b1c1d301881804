"""NiNformer models: the four models of the NiNformer paper at its Sec. 4 settings.

All four share the paper's skeleton (Procedures 1-4, and the authors' code for NiNformer):
patch 4, width 256, 4 blocks, a convolutional patch embedding, no class token, no position
embedding, no final norm, global average pooling, one linear classifier. 32x32x3 input
(CIFAR-10/100) or 28x28x1 (MNIST); 10 classes by default (``num_classes=100`` for CIFAR-100).

Models (``_32``: 32x32x3 input, ``_28``: 28x28x1), blocks and parameters (10 classes):

* ``ninformer_vit_patch4_*``, NiNformer: gating unit (MLP-Mixer sub-unit, token and channel
  MLP 512) + MLP 512, one shared LayerNorm per block; 2,652,170 / 2,582,478 params.
* ``ninformer_baseline_vit_patch4_*``: learned position embedding, attention (4 heads) + MLP 512;
  2,139,914 / 2,127,882.
* ``ninformer_baseline_mixer_patch4_*``: token MLP 512 + channel MLP 512; 1,335,306 / 1,265,614.
* ``ninformer_baseline_localvit_patch4_*``: attention (4 heads) + locality FFN 512 (3x3
  depthwise); 2,144,010 / 2,135,818.

All four are timm ``VisionTransformer`` s (the ``vit_tiny_patch16_224`` entry with the paper's
arguments) plus surgery: none for ViT, ``swap_ffn(model, 'locality')`` for LocalViT,
:func:`swap_gating_unit` for NiNformer and :func:`mixer_blocks` (timm's ``MixerBlock``) for
MLP-Mixer; timm's ``MlpMixer`` entry points fix patch size and depth, so they cannot take the
paper's settings.

Interpretation notes:

* NiNformer follows the authors' code: ``Linear(x) * MixerBlock(x)`` with no gate activation,
  one LayerNorm instance before both sub-layers of a block (``norm2`` is ``norm1``).
* The paper gives no position embedding, class token or final norm for any of the four models
  (Procedures 1-4 go from patch embedding to blocks to average pooling). We build NiNformer,
  MLP-Mixer and LocalViT that way; their token-mixing MLPs and depthwise convs see where a token
  is. The ViT baseline gets a learned position embedding (like every ViT): without one,
  attention plus average pooling is invariant to permuting the patches, a bag-of-patches model.
  Built that way it reached only 82.83% on MNIST and 57.37% on CIFAR-10 after the paper's 100
  epochs (paper: 97.12 / 65.74; docs/training.md). ``pos_embed='none'`` builds it as printed.
* Dropout: the paper states none; the authors' NiNformer script uses 0.5 in every feed-forward
  net of a block: the token and channel MLPs of the Mixer sub-unit *and* the block's outer FFN
  (Eq. 10), each after its activation and after its second linear layer. Default 0 here;
  ``block_cfg=dict(drop=0.5)`` reproduces the script for NiNformer (all three MLPs), as
  ``mlp_drop=0.5`` does for training (``vitblocks.experiments.setup.mlp_dropout_kwargs``).
* Initialization: the paper states none; the authors' script has no initialization code, so its
  layers start from PyTorch's defaults. Default here: timm's ViT initialization, like the three
  baselines (which have no public script); ``block_cfg=dict(init='torch')`` starts NiNformer as
  the script does (:func:`reset_to_torch_init`).
"""
from functools import partial

import torch
from timm.layers import LayerNorm
from timm.models import checkpoint_seq, named_apply
from timm.models.mlp_mixer import MixerBlock
from timm.models.vision_transformer import VisionTransformer, init_weights_vit_timm
from torch import nn

from ..layers.gating import MixerGatingUnit, check_mlp_widths
from .recipe import recorded_surgery
from .registry import VariantSpec, register_variant
from .slots import find_slots, slot_spec, supported_families
from .surgery import swap_ffn

__all__ = ['swap_gating_unit', 'reset_to_torch_init', 'mixer_blocks', 'MaskFreeVisionTransformer', 'NINFORMER_MODELS',
           'NINFORMER_PAPER_SETTINGS']

# Sec. 4: patch 4, width 256, 4 layers, 4 heads, MLP 512; inner Mixer token / channel MLP 512
NINFORMER_PAPER_SETTINGS = dict(patch_size=4, embed_dim=256, depth=4, num_heads=4, mlp_dim=512,
                                token_mlp_dim=512, channel_mlp_dim=512)


@recorded_surgery()
def swap_gating_unit(model: nn.Module, token_mlp_dim: int = 512, channel_mlp_dim: int = 512,
                     shared_norm: bool = True, drop: float = 0.) -> int:
    """Turn every block of a timm ViT into a NiNformer block (Eq. 8-10), in place.

    ``blocks[i].attn`` becomes a :class:`~vitblocks.layers.MixerGatingUnit` for the model's
    fixed token count; with ``shared_norm`` (the authors' code) ``blocks[i].norm2`` becomes the
    same module as ``norm1``. ``drop`` is the dropout of every feed-forward net of the block, as
    in the authors' script: the Mixer sub-unit's token and channel MLPs and the block's outer
    FFN ``blocks[i].mlp`` (after its activation and after fc2). A model built with timm's
    ``proj_drop_rate`` already has outer-FFN dropout; a different nonzero ``drop`` is an error.
    Returns the number of blocks changed.
    """
    if slot_spec(type(model), 'gating') is None:
        raise ValueError(f'swap_gating_unit supports timm VisionTransformer models, got {type(model).__name__} '
                         f'(gating slots are declared for {", ".join(supported_families("gating"))})')
    slots = find_slots(model, 'gating')  # the layout is the fixed token grid (an error for a dynamic size)
    for blk, attr, _, layout in slots:
        old = getattr(blk, attr)
        dim = old.qkv.in_features if hasattr(old, 'qkv') else old.proj.in_features  # attention or a gating unit
        num_tokens = layout.grid_size[0] * layout.grid_size[1] + layout.num_prefix_tokens
        ref = old.proj.weight
        unit = MixerGatingUnit(dim, num_tokens, token_mlp_dim, channel_mlp_dim, drop=drop,
                               device=ref.device, dtype=ref.dtype)
        setattr(blk, attr, unit.train(blk.training))
        if drop:
            _set_ffn_dropout(blk.mlp, drop)
        if shared_norm:
            blk.norm2 = blk.norm1  # one LayerNorm instance before Eq. 9 and Eq. 10
    return len(slots)


def _set_ffn_dropout(mlp: nn.Module, p: float) -> None:
    """Dropout ``p`` at both dropout points of a timm ``Mlp`` (after the activation, after fc2), as the
    authors' ``FeedForward``; refuses to overwrite a different nonzero rate (e.g. from proj_drop_rate)."""
    if not all(isinstance(getattr(mlp, n, None), nn.Dropout) for n in ('drop1', 'drop2')):
        raise ValueError(f'drop= sets the dropout of the outer FFN, a timm Mlp (drop1, drop2); this block has a '
                         f'{type(mlp).__name__}: give its dropout when building it')
    for name in ('drop1', 'drop2'):
        old = getattr(mlp, name)
        if old.p and old.p != p:
            raise ValueError(f'the outer FFN already has dropout {old.p} (proj_drop_rate) but the NiNformer block '
                             f'config asks for drop={p}; give one of the two')
        setattr(mlp, name, nn.Dropout(p))


WEIGHT_INITS = ('timm', 'torch')


def reset_to_torch_init(model: nn.Module) -> int:
    """Give every layer of ``model`` PyTorch's own default initialization (each module's
    ``reset_parameters``: Kaiming-uniform linears and convolutions with uniform biases, identity
    norms), undoing timm's ViT initialization (trunc-normal 0.02, zero biases). The NiNformer authors'
    script has no initialization code, so its model starts this way. Parameters that are no layer's
    (a position embedding, a class token) keep theirs. Returns the number of layers reset."""
    layers = [m for m in model.modules() if callable(getattr(m, 'reset_parameters', None))]
    for m in layers:
        m.reset_parameters()
    return len(layers)


def _build_ninformer(model, cfg):
    cfg = dict(cfg)
    init = cfg.pop('init', 'timm')
    if init not in WEIGHT_INITS:
        raise ValueError(f"block_cfg init={init!r}: use 'timm' (timm's ViT initialization, the default) or 'torch' "
                         f"(PyTorch's defaults, as the authors' script)")
    swap_gating_unit(model, **cfg)
    if init == 'torch':
        reset_to_torch_init(model)


def _build_vit(model, cfg):
    if cfg:
        raise ValueError(f'the NiNformer-paper ViT takes no block config, got {sorted(cfg)}')


def _build_localvit(model, cfg):
    swap_ffn(model, 'locality', **cfg)


def mixer_blocks(model: nn.Module, token_mlp_dim: int = 512, channel_mlp_dim: int = 512, drop: float = 0.) -> int:
    """Replace every block of a timm ViT with a timm ``MixerBlock`` (token MLP, then channel MLP), in place.

    With no class token, no position embedding and average pooling, a timm ``VisionTransformer``
    whose blocks are Mixer blocks is an MLP-Mixer: patch embedding, Mixer blocks, pooling, head
    (timm's ``MlpMixer`` entry points fix patch size and depth, so it cannot be built through them
    at the paper's settings). New blocks get timm's ViT initialization, like the other models of
    the comparison. Returns the number of blocks.
    """
    if not isinstance(model, VisionTransformer):
        raise ValueError(f'mixer_blocks supports timm VisionTransformer models, got {type(model).__name__}')
    check_mlp_widths(token_mlp_dim=token_mlp_dim, channel_mlp_dim=channel_mlp_dim)
    dim, num_tokens = model.embed_dim, model.patch_embed.num_patches + model.num_prefix_tokens
    ref = model.patch_embed.proj.weight
    ratios = ((token_mlp_dim + .5) / dim, (channel_mlp_dim + .5) / dim)  # MixerBlock sizes MLPs as int(ratio * dim)
    blocks = [MixerBlock(dim, num_tokens, mlp_ratio=ratios, norm_layer=LayerNorm, drop=drop,
                         device=ref.device, dtype=ref.dtype) for _ in model.blocks]
    for blk in blocks:
        named_apply(partial(init_weights_vit_timm, needs_reset=True), blk)
    model.blocks = nn.Sequential(*blocks).train(model.training)
    return len(blocks)


class MaskFreeVisionTransformer(VisionTransformer):
    """A timm ``VisionTransformer`` whose blocks have no attention (Mixer blocks), so its forward takes
    no ``attn_mask`` / ``is_causal``: timm's forward passes them to every block once they are given,
    and a symbolic trace (torch.fx) always gives them (as graph inputs)."""

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:  # timm's, without the mask branch
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        return self.norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _build_mixer(model, cfg):
    mixer_blocks(model, **cfg)
    model.__class__ = MaskFreeVisionTransformer


_P = NINFORMER_PAPER_SETTINGS
_VIT_ARGS = dict(patch_size=_P['patch_size'], embed_dim=_P['embed_dim'], depth=_P['depth'], num_heads=_P['num_heads'],
                 mlp_ratio=_P['mlp_dim'] / _P['embed_dim'], class_token=False, global_pool='avg', pos_embed='none',
                 final_norm=False, num_classes=10)
_INPUTS = {'32': dict(img_size=32, in_chans=3), '28': dict(img_size=28, in_chans=1)}

# (name without the input suffix, timm base, base args, build, block config, what it is, params at 32 / 28)
NINFORMER_MODELS = (
    ('ninformer_vit_patch4', 'vit_tiny_patch16_224', _VIT_ARGS, _build_ninformer,
     dict(token_mlp_dim=_P['token_mlp_dim'], channel_mlp_dim=_P['channel_mlp_dim'], shared_norm=True, drop=0.,
          init='timm'),
     'NiNformer (paper Sec. 3.2/4): gating unit with MLP-Mixer sub-unit (token/channel MLP 512) + MLP 512, '
     'shared LayerNorm', (2_652_170, 2_582_478)),
    ('ninformer_baseline_vit_patch4', 'vit_tiny_patch16_224', dict(_VIT_ARGS, pos_embed='learn'), _build_vit, {},
     'NiNformer-paper ViT baseline: learned position embedding, attention (4 heads) + MLP 512',
     (2_139_914, 2_127_882)),
    ('ninformer_baseline_mixer_patch4', 'vit_tiny_patch16_224', _VIT_ARGS, _build_mixer,
     dict(token_mlp_dim=_P['token_mlp_dim'], channel_mlp_dim=_P['mlp_dim']),
     'NiNformer-paper MLP-Mixer baseline: token MLP 512 + channel MLP 512', (1_335_306, 1_265_614)),
    ('ninformer_baseline_localvit_patch4', 'vit_tiny_patch16_224', _VIT_ARGS, _build_localvit, dict(kernel_size=3),
     'NiNformer-paper Local-ViT baseline: attention (4 heads) + locality FFN 512 (3x3 depthwise, h-swish)',
     (2_144_010, 2_135_818)),
)


def _register(stem, base, args, build, cfg, what, params):
    for (suffix, inputs), count in zip(_INPUTS.items(), params):
        c, size = inputs['in_chans'], inputs['img_size']
        name = f'{stem}_{suffix}'
        register_variant(VariantSpec(
            name=name, method='ninformer', base=base, build=build, cfg=dict(cfg), base_kwargs=dict(args, **inputs),
            description=f'{what}; patch 4, width 256, 4 blocks, avg pool (timm {base} entry with these args); '
                        f'{size}x{size}x{c} input, 10 classes: {count:,} params',
            # the data config of the built model (the timm base is a 224 px ImageNet model); the
            # authors normalize with mean 0.5, std 0.5
            pretrained_cfg=dict(input_size=(c, size, size), fixed_input_size=True,
                                crop_pct=1.0, mean=(0.5,) * c, std=(0.5,) * c, num_classes=10),
            # the authors' dropout is in every feed-forward net of the swapped-in blocks (block_cfg drop); the
            # ViT baseline has no block config: timm's proj_drop_rate
            mlp_drop_kwarg='proj_drop_rate' if build is _build_vit else 'block_cfg'))


for _spec in NINFORMER_MODELS:
    _register(*_spec)
