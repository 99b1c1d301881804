"""IFFN models: every IFFN Table 1 row whose backbone timm has.

The '*' rows of Table 1 (DeiT-B, Swin-B, PoolFormer-M48) use a 5x5 depthwise kernel. The
authors' DeiT models drop the class token and average-pool the patch tokens, so ours do too.
LVT (the "Portable ViT" rows) is not in timm: ``iffn_lvt`` is registered in ``models/lvt.py``.
"""
from .registry import VariantSpec, register_variant
from .surgery import swap_ffn

_DEIT_NO_CLS = dict(class_token=False, global_pool='avg')

# (timm base, depthwise kernel size, base-model kwargs)
IFFN_TABLE1_BASES = (
    ('deit_tiny_patch16_224', 3, _DEIT_NO_CLS),
    ('deit_small_patch16_224', 3, _DEIT_NO_CLS),
    ('deit_base_patch16_224', 5, _DEIT_NO_CLS),
    ('swin_tiny_patch4_window7_224', 3, {}),
    ('swin_small_patch4_window7_224', 3, {}),
    ('swin_base_patch4_window7_224', 5, {}),
    ('poolformer_s12', 3, {}),
    ('poolformer_s24', 3, {}),
    ('poolformer_s36', 3, {}),
    ('poolformer_m36', 3, {}),
    ('poolformer_m48', 5, {}),
)


def _swap_iffn(model, cfg):
    return swap_ffn(model, 'iffn', **cfg)


for _base, _kernel, _kwargs in IFFN_TABLE1_BASES:
    register_variant(VariantSpec(
        name=f'iffn_{_base}', method='iffn', base=_base, build=_swap_iffn,
        cfg=dict(kernel_size=_kernel), base_kwargs=dict(_kwargs),
        description=f'IFFN Table 1 ({_kernel}x{_kernel} depthwise)'))
