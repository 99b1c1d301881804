"""SCHEME models: AFBO Table 3's SCHEME rows, "build the timm backbone, swap in SCHEME".

``scheme_g<G1><G2>_<timm base>`` is the backbone with every channel MLP replaced by SCHEME
(:mod:`vitblocks.layers.scheme`) at expansion E = 8 and group numbers (G1, G2) for fc1 and fc2:
SCHEME-12 = ``scheme_g12_*``, SCHEME-44 = ``scheme_g44_*``. The models are built in training form
(with the CCA branch); the published counts are of the deployed form,
``vitblocks.deploy.reparameterize(model)`` or ``block_cfg={'cca': False}``.
"""
from .registry import VariantSpec, register_variant
from .surgery import swap_ffn

__all__ = ['SCHEME_TABLE3_MODELS']

# (timm base, (G1, G2)): the SCHEME rows of AFBO's Table 3
SCHEME_TABLE3_MODELS = (
    ('poolformer_s12', (1, 2)),
    ('poolformer_s12', (4, 4)),
    ('poolformer_s24', (1, 2)),
    ('swin_tiny_patch4_window7_224', (4, 4)),
    ('swin_tiny_patch4_window7_224', (1, 2)),
)


def _swap_scheme(model, cfg):
    return swap_ffn(model, 'scheme', **cfg)


for _base, (_g1, _g2) in SCHEME_TABLE3_MODELS:
    register_variant(VariantSpec(
        name=f'scheme_g{_g1}{_g2}_{_base}', method='scheme', base=_base, build=_swap_scheme,
        cfg=dict(groups=(_g1, _g2), mlp_ratio=8),
        description=f'SCHEME-{_g1}{_g2} (AFBO Table 3): block-diagonal MLP, E = 8, groups ({_g1}, {_g2}), CCA'))
