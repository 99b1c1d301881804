"""AFBO models: every AFBO Table 2 backbone that timm has, with its FFNs replaced by AFBO.

Each model is "build the timm backbone, ``swap_ffn(model, 'afbo', gccm_groups=G1,
occm_groups=G2)``" with G1 = 2, SiLU on the OCCM branch (pre-act), 3x3 depthwise spatial
modelling and the backbone's own hidden width (M = its MLP ratio). The block config is
overridable: ``timm.create_model('afbo_deit_tiny_patch16_224', block_cfg={'variant': 'scfbo_gc'})``.

OCCM group numbers G2 (the paper is not consistent: App. A.1 says G2 = 3 for Swin, LVT and the
MLP models and 4 elsewhere, Sec. 4.1 says 3 for all): we take A.1, except where Table 2's
parameter count says otherwise or the widths forbid it:

* DeiT-T: G2 = 4 (A.1; Table 7's G1=2, G2=4 row is Table 2's DeiT-T row, 6.0 M / 74.6%).
* DeiT-S, DeiT-B: G2 = 3. Table 2 gives them *fewer* parameters than the FFN (-0.3 M, -2.1 M);
  G2 = 4 gives more (+0.4 M, +0.8 M), G2 = 3 fewer (-0.2 M, -1.6 M).
* Swin-T, Swin-S: G2 = 3 (A.1). Swin-B: G2 = 2, since 3 divides none of its widths
  (128 ... 1024); of 2 and 4 only 2 keeps the published parameter cut (-3.1 M; ours -6.0 M,
  G2 = 4 would add 1.0 M).
* PoolFormer, PVTv2-B1, GC ViT: G2 = 4 (A.1; 3 does not divide their 64-channel stage either).

LVT (Yang et al., 2022) is not in timm: ``afbo_lvt`` (G2 = 2) is registered in ``models/lvt.py``.
Table 2 backbones not provided: CycleMLP-B1, HireMLP-Tiny, Pyramid-VisionLLaMA-S/B/L; EdgeViT-xxs
(Table 16) neither.
"""
from ..layers import afbo as _afbo_layers  # noqa: F401  (registers the AFBO FFNs)
from ..layers import ffn_counterparts as _counterparts  # noqa: F401  (registers GLU, SwiGLU, ConvGLU, ...)
from .registry import VariantSpec, register_variant
from .surgery import swap_ffn

__all__ = ['AFBO_TABLE2_BASES']

# (timm base, G2 = occm_groups); G1 = gccm_groups = 2 for all
AFBO_TABLE2_BASES = (
    ('deit_tiny_patch16_224', 4),
    ('deit_small_patch16_224', 3),
    ('deit_base_patch16_224', 3),
    ('swin_tiny_patch4_window7_224', 3),
    ('swin_small_patch4_window7_224', 3),
    ('swin_base_patch4_window7_224', 2),
    ('poolformer_s12', 4),
    ('poolformer_s24', 4),
    ('poolformer_s36', 4),
    ('poolformer_m36', 4),
    ('poolformer_m48', 4),
    ('pvt_v2_b1', 4),
    ('gcvit_xxtiny', 4),
    ('gcvit_xtiny', 4),
)


def _swap_afbo(model, cfg):
    return swap_ffn(model, 'afbo', **cfg)


for _base, _g2 in AFBO_TABLE2_BASES:
    register_variant(VariantSpec(
        name=f'afbo_{_base}', method='afbo', base=_base, build=_swap_afbo,
        cfg=dict(gccm_groups=2, occm_groups=_g2),
        description=f'AFBO Table 2 (G1=2, G2={_g2}, 3x3 depthwise, SiLU on the OCCM branch)'))
