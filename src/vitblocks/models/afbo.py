"""AFBO models: every AFBO Table 2 backbone that timm has, with its FFNs replaced by AFBO.

Each model is "build the timm backbone, ``swap_ffn(model, 'afbo', gccm_groups=G1,
occm_groups=G2)``" with G1 = 2 (4 for Swin-B, below), SiLU on the OCCM branch (pre-act), 3x3
depthwise spatial modelling and the backbone's own hidden width (M = its MLP ratio). The block config is
overridable: ``timm.create_model('afbo_deit_tiny_patch16_224', block_cfg={'variant': 'scfbo_gc'})``.

OCCM group numbers G2 (the paper is not consistent: App. A.1 says G2 = 3 for Swin, LVT and the
MLP models and 4 elsewhere, Sec. 4.1 says 3 for all): we take A.1, except where Table 2's
parameter count says otherwise or the widths forbid it:

* DeiT-T: G2 = 4 (A.1; Table 7's G1=2, G2=4 row is Table 2's DeiT-T row, 6.0 M / 74.6%).
* DeiT-S, DeiT-B: G2 = 3. Table 2 gives them *fewer* parameters than the FFN (-0.3 M, -2.1 M);
  G2 = 4 gives more (+0.4 M, +0.8 M), G2 = 3 fewer (-0.2 M, -1.6 M).
* Swin-T, Swin-S: G2 = 3 (A.1).
* Swin-B: G1 = 4, G2 = 4. A.1's G2 = 3 divides none of its widths (128 ... 1024). With G1 = 2 no
  G2 fits Table 2's -3.1 M: G2 = 4 adds 1.0 M, G2 = 2 removes 6.0 M (3.4% off) *and* degenerates
  OCCM, whose groups read G2 - 1 = 1 input group, into the block-diagonal map of Eq. 5 (no
  cross-group interaction, the point of OCCM). The per-block change is 4d^2 (1/(2 G1) - 1/G2)
  plus the two depthwise convs, so -3.1 M needs 1/(2 G1) - 1/G2 near -1/8: G1 = G2 = 4, a pair the
  paper itself trains (Table 7's last row). Ours: 85.29 M (paper 84.7 M, +0.7%), 15.67 GMACs.
* PoolFormer, PVTv2-B1, GC ViT: G2 = 4 (A.1; 3 does not divide their 64-channel stage either).

A model's own G1/G2 apply only where the chosen maps read them: ``block_cfg={'variant': 'scfbo_gc'}``
on an AFBO model drops its G2 (no OCCM branch), while an explicit ``occm_groups`` with no OCCM
branch is an error (:class:`~vitblocks.layers.AFBO`).

LVT (Yang et al., 2022) is not in timm: ``afbo_lvt`` (G1 = 2, G2 = 2: 3 divides no LVT width) is vitblocks' LVT
(``models/backbones/lvt.py``) with AFBO in its stages and AFBO's channel maps only in its class-attention
blocks (one class token, no grid), which Table 2's 5.2 M needs.
All Table 2 and Table 16 backbones are built (the ones timm lacks by vitblocks' own backbone files).

* CycleMLP-B1, Hire-MLP-Tiny (vitblocks' ``cyclemlp_b1``, ``hiremlp_tiny``): G1 = 4, G2 = 4. A.1's
  G2 = 3 divides none of their widths (64, 128, 320, 512). Table 2 prints the change, -0.2 M and
  +0.1 G for both: G1 = G2 = 4 gives -0.26 M / +0.07 G, G1 = 2 with G2 = 2 -0.75 M, with G2 = 4 +0.23 M.

Backbones vitblocks adds to timm (``AFBO_OWN_BACKBONES``, at the end of this file):

* EdgeViT-XXS (Table 16, ``models/backbones/edgevit.py``): G1 = 2, G2 = 4 (A.1's setting for the backbones it
  does not name), both FFNs of every LGL block replaced (5 channels-first FFNs of the local
  aggregations, 7 token FFNs): 4.207 M, Table 16's 4.2 M. G2 = 3 gives 4.106 M; replacing only
  the token FFNs 4.161 M.
* Pyramid VisionLLaMA-S/B/L (Table 2, ``models/backbones/vision_llama.py``): G1 = 2, G2 = 4 (3 does not divide
  the 64-channel first stage of S), and M = 4: AFBO takes the block's nominal 4d expansion, not the
  SwiGLU's 2/3-scaled hidden width (with that width AFBO would remove 5.0 / 10.0 / 19.7 M instead of
  the published +0.1 / +0.4 / +0.5 M). Ours: -1.47 / +0.72 / -4.54 M against the authors' backbones.
"""
from functools import partial

from ..layers.afbo import AFBO  # registers the AFBO FFNs
from ..layers import ffn_counterparts as _counterparts  # noqa: F401  (registers GLU, SwiGLU, ConvGLU, ...)
from . import backbones  # noqa: F401  (registers the bases timm lacks: cyclemlp_b1, edgevit_xxs, lvt, ...)
from .backbones.lvt import swap_class_block_ffns
from .registry import VariantSpec, register_variant
from .surgery import swap_ffn

__all__ = ['AFBO_TABLE2_BASES']

# (timm base, G1 = gccm_groups, G2 = occm_groups)
AFBO_TABLE2_BASES = (
    ('deit_tiny_patch16_224', 2, 4),
    ('deit_small_patch16_224', 2, 3),
    ('deit_base_patch16_224', 2, 3),
    ('swin_tiny_patch4_window7_224', 2, 3),
    ('swin_small_patch4_window7_224', 2, 3),
    ('swin_base_patch4_window7_224', 4, 4),
    ('poolformer_s12', 2, 4),
    ('poolformer_s24', 2, 4),
    ('poolformer_s36', 2, 4),
    ('poolformer_m36', 2, 4),
    ('poolformer_m48', 2, 4),
    ('pvt_v2_b1', 2, 4),
    ('gcvit_xxtiny', 2, 4),
    ('gcvit_xtiny', 2, 4),
    ('cyclemlp_b1', 4, 4),  # vitblocks' backbones (models/backbones/cyclemlp.py, hiremlp.py)
    ('hiremlp_tiny', 4, 4),
)


def drop_unread_groups(cfg, model_groups):
    """``cfg`` without the model's own group numbers (``model_groups``) that the maps it chose do not read
    (``variant='scfbo_gc'`` has no OCCM, ``order='sm'`` no maps), so such a block_cfg works on every AFBO
    model; a group number the user set to another value stays, and AFBO refuses it."""
    used = AFBO.group_args_used(cfg.get('variant'), cfg.get('left_map'), cfg.get('right_map'),
                                cfg.get('order', 'cm_sm'))
    return {k: v for k, v in cfg.items() if not (k in model_groups and k not in used and v == model_groups[k])}


def _swap_afbo(model, cfg, model_groups):
    return swap_ffn(model, 'afbo', **drop_unread_groups(cfg, model_groups))


for _base, _g1, _g2 in AFBO_TABLE2_BASES:
    _groups = dict(gccm_groups=_g1, occm_groups=_g2)
    register_variant(VariantSpec(
        name=f'afbo_{_base}', method='afbo', base=_base, build=partial(_swap_afbo, model_groups=_groups),
        cfg=dict(_groups),
        description=f'AFBO Table 2 (G1={_g1}, G2={_g2}, 3x3 depthwise, SiLU on the OCCM branch)'))


# AFBO on backbones vitblocks registers with timm: (base, block config, description)
AFBO_OWN_BACKBONES = (
    ('edgevit_xxs', dict(gccm_groups=2, occm_groups=4),
     'AFBO Table 16 (G1=2, G2=4, 3x3 depthwise, SiLU on the OCCM branch; both FFNs of every LGL block)'),
) + tuple(
    (f'pyramid_visionllama_{size}', dict(gccm_groups=2, occm_groups=4, mlp_ratio=4),
     'AFBO Table 2 (G1=2, G2=4, M=4 in place of the SwiGLU FFN, 3x3 depthwise, SiLU on the OCCM branch)')
    for size in ('s', 'b', 'l'))

for _base, _cfg, _description in AFBO_OWN_BACKBONES:
    _groups = {k: _cfg[k] for k in ('gccm_groups', 'occm_groups')}
    register_variant(VariantSpec(
        name=f'afbo_{_base}', method='afbo', base=_base, build=partial(_swap_afbo, model_groups=_groups),
        cfg=dict(_cfg), description=_description))


# LVT: AFBO in the stages, its channel maps only in the class-attention blocks (see the module docstring)
_AFBO_LVT_GROUPS = dict(gccm_groups=2, occm_groups=2)  # G1, G2 of afbo_lvt (AFBO Table 2)


def _swap_afbo_lvt(model, cfg):
    swap_ffn(model, 'afbo', **drop_unread_groups(cfg, _AFBO_LVT_GROUPS))
    class_cfg = {**cfg, 'order': 'cm', 'spatial': None}
    swap_class_block_ffns(model, 'afbo', **drop_unread_groups(class_cfg, _AFBO_LVT_GROUPS))


register_variant(VariantSpec(
    name='afbo_lvt', method='afbo', base='lvt', build=_swap_afbo_lvt, cfg=dict(_AFBO_LVT_GROUPS),
    description='AFBO Table 2 LVT + AFBO (G1=2, G2=2: 3 divides no LVT width; class-attention blocks: '
                'channel mapping only)'))
