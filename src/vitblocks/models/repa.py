"""RePa models: every RePa Table 1 backbone that timm has, with the channel-idle FFN unit.

Each model is "build the timm backbone, ``swap_residual_ffn(model, 'repa', idle_ratio=0.75)``":
the FFN half of every block (channel MLPs only for MLP-Mixer) becomes a
:class:`~vitblocks.layers.RePaFFN` that owns BatchNorm (in place of the pre-FFN norm), the
layer-scale (PoolFormer), drop-path and the shortcut. ``timm.utils.reparameterize_model`` (or
``.fuse()`` on each unit) gives the deployed model.

* ``repa_vit_huge_patch16_224``: the paper's ViT-H is ViT-H/16 (1280 wide, 32 blocks, 16 heads,
  patch 16, 224 px). timm has only ViT-H/14 at 224 (``vit_huge_patch14_224``), so this model is
  that timm entry built with ``patch_size=16``; the name states the architecture that is built.
* ``repa_lvvit_s``, ``repa_lvvit_m``: LV-ViT (``vitblocks.models.backbones.lvvit``; not in timm) with
  idle ratio 2/3, not 0.75. The paper's default is theta = 1 - mu / rho with mu = 1 (Sec. 4.1),
  and LV-ViT's MLP ratio rho is 3; the authors' LV-ViT code activates exactly C of the 3C hidden
  channels, and only K = C reproduces Table 1's folded sizes (19.1 M / 4.7 GMACs for S; 0.75
  gives 17.9 M). LV-ViT's constant residual scale 1/skip_lam moves into the unit and is folded.
* PoolFormer-M36/M48 have no Table 1 row; they are registered for completeness.
* ``repa_prenorm_{deit_tiny,deit_small,deit_base}_patch16_224``, ``repa_prenorm_vit_{large,huge}_patch16_224``:
  the architecture of the authors' released RePaViT-Tiny/Small/Base/Large/Huge checkpoints
  (Ackesnal/RePaViT, ``repavit.py``), which differs from timm's DeiT/ViT in three places:
  a LayerNorm after the position embedding (timm ``pre_norm=True``, which also drops the patch
  embedding's bias, as theirs), torch's ``nn.LayerNorm`` (eps 1e-5) before attention where timm's
  DeiT uses eps 1e-6 (their final and pre-norms are eps 1e-6, as timm's), and ImageNet mean/std
  with crop 0.875 for every size (their evaluation transform). Class-token pooling and the head
  are timm's. Their checkpoints load with ``timm.create_model(name, checkpoint_path=...)``
  (:mod:`vitblocks.models.convert_authors`).

Options (``timm.create_model(name, block_cfg=...)``): ``idle_ratio`` (theta; a single value or a
list with one value per block, in model order), ``deploy=True`` (build the deployed form directly
so fused checkpoints load), and the other :class:`~vitblocks.layers.RePaFFN` arguments.
"""
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from ..layers.repa import repa_ffn
from . import backbones  # noqa: F401  (registers the LV-ViT bases with timm)
from .convert_authors import accept_authors_checkpoints
from .registry import VariantSpec, register_variant
from .residual_surgery import list_residual_ffns, register_residual_ffn, swap_residual_ffn

__all__ = ['swap_residual_ffn', 'list_residual_ffns', 'REPA_TABLE1_BASES', 'REPA_LVVIT_BASES']

register_residual_ffn('repa', repa_ffn, per_layer=('idle_ratio',))

# (registered name without the 'repa_' prefix, timm base model, base-model kwargs)
REPA_TABLE1_BASES = (
    ('deit_tiny_patch16_224', 'deit_tiny_patch16_224', {}),
    ('deit_small_patch16_224', 'deit_small_patch16_224', {}),
    ('deit_base_patch16_224', 'deit_base_patch16_224', {}),
    ('vit_large_patch16_224', 'vit_large_patch16_224', {}),
    ('vit_huge_patch16_224', 'vit_huge_patch14_224', dict(patch_size=16)),  # ViT-H/16, see module docstring
    ('swin_tiny_patch4_window7_224', 'swin_tiny_patch4_window7_224', {}),
    ('swin_small_patch4_window7_224', 'swin_small_patch4_window7_224', {}),
    ('swin_base_patch4_window7_224', 'swin_base_patch4_window7_224', {}),
    ('poolformer_s12', 'poolformer_s12', {}),
    ('poolformer_s24', 'poolformer_s24', {}),
    ('poolformer_s36', 'poolformer_s36', {}),
    ('poolformer_m36', 'poolformer_m36', {}),
    ('poolformer_m48', 'poolformer_m48', {}),
    ('mixer_b16_224', 'mixer_b16_224', {}),
    ('mixer_l16_224', 'mixer_l16_224', {}),
)


def _swap_repa(model, cfg):
    return swap_residual_ffn(model, 'repa', **cfg)


def _swap_repa_vit(model, cfg):
    """timm's DeiT/ViT with RePa units; an authors' RePaViT file gets a clear error (it needs pre-norm)."""
    count = swap_residual_ffn(model, 'repa', **cfg)
    accept_authors_checkpoints(model)
    return count


def _swap_repa_authors_vit(model, cfg):
    """The authors' RePaViT: their attention pre-norm is torch's nn.LayerNorm, eps 1e-5 (timm DeiT: 1e-6)."""
    count = _swap_repa_vit(model, cfg)
    for block in model.blocks:
        block.norm1.eps = 1e-5
    return count


# LV-ViT (MLP ratio 3): theta = 1 - 1/rho = 2/3, i.e. C active channels, see the module docstring
REPA_LVVIT_BASES = ('lvvit_s', 'lvvit_m')

for _base in REPA_LVVIT_BASES:
    register_variant(VariantSpec(
        name=f'repa_{_base}', method='repa', base=_base, build=_swap_repa, cfg=dict(idle_ratio=2 / 3),
        description='RePa Table 1 (channel-idle FFN, idle ratio 2/3 = 1 - 1/rho for MLP ratio 3)'))

for _name, _base, _kwargs in REPA_TABLE1_BASES:
    _note = f'; timm {_base} built with patch_size=16 (ViT-H/16 as in the paper; timm has only ViT-H/14)' \
        if _kwargs else ''
    _vit = _base.startswith(('deit_', 'vit_'))
    register_variant(VariantSpec(
        name=f'repa_{_name}', method='repa', base=_base, build=_swap_repa_vit if _vit else _swap_repa,
        cfg=dict(idle_ratio=0.75), base_kwargs=dict(_kwargs),
        description=f'RePa Table 1 (channel-idle FFN, idle ratio 0.75){_note}'))
    if _vit:  # the authors' RePaViT-Tiny ... Huge, see the module docstring
        register_variant(VariantSpec(
            name=f'repa_prenorm_{_name}', method='repa', base=_base, build=_swap_repa_authors_vit,
            cfg=dict(idle_ratio=0.75), base_kwargs=dict(_kwargs, pre_norm=True),
            description=f"the authors' RePaViT (pre-norm, bias-free patch embedding; idle ratio 0.75){_note}",
            pretrained_cfg=dict(mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, crop_pct=0.875)))
