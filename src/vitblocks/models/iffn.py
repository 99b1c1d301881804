"""IFFN models: every IFFN Table 1 row whose backbone timm has.

The '*' rows of Table 1 (DeiT-B, Swin-B, PoolFormer-M48) use a 5x5 depthwise kernel. LVT (the
"Portable ViT" rows) is not in timm: ``iffn_lvt`` is vitblocks' LVT (``models/backbones/lvt.py``) with
IFFN* (5x5) in its stages and IFFN's channel part in its class-attention blocks (they see one class
token and no grid), which Table 1's 4.98 M needs.

The DeiT models are the authors' DeiT (AMD-AIG-AIMA/AMD_IFFN, ``vision_transformer.py``), so their
released checkpoints load (``timm.create_model(name, checkpoint_path=...)``, see
:mod:`vitblocks.models.convert_authors`) and compute the authors' function:

* no class token, and the head of their ``forward_features``: the final LayerNorm on *every*
  token, then the average (timm ``fc_norm=False``; timm's ``global_pool='avg'`` default would
  average first and normalize after, same parameters but another function);
* both LayerNorms inside the IFFN are torch's ``nn.LayerNorm`` (eps 1e-5), where timm's
  LayerNorm defaults to eps 1e-6 (the block norms stay timm's, eps 1e-6 as theirs).
"""
from torch import nn

from .backbones.lvt import swap_class_block_ffns
from .convert_authors import accept_authors_checkpoints
from .registry import VariantSpec, register_variant
from .surgery import swap_ffn

_DEIT_AUTHORS = dict(class_token=False, global_pool='avg', fc_norm=False)

# (timm base, depthwise kernel size, base-model kwargs)
IFFN_TABLE1_BASES = (
    ('deit_tiny_patch16_224', 3, _DEIT_AUTHORS),
    ('deit_small_patch16_224', 3, _DEIT_AUTHORS),
    ('deit_base_patch16_224', 5, _DEIT_AUTHORS),
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


def _swap_iffn_authors_deit(model, cfg):
    """The authors' DeiT: their IFFN norms are ``nn.LayerNorm`` (eps 1e-5); their keys load."""
    count = swap_ffn(model, 'iffn', **{'norm_layer': nn.LayerNorm, **cfg})
    accept_authors_checkpoints(model)
    return count


for _base, _kernel, _kwargs in IFFN_TABLE1_BASES:
    _deit = _base.startswith('deit_')
    register_variant(VariantSpec(
        name=f'iffn_{_base}', method='iffn', base=_base, build=_swap_iffn_authors_deit if _deit else _swap_iffn,
        cfg=dict(kernel_size=_kernel), base_kwargs=dict(_kwargs),
        description=f'IFFN Table 1 ({_kernel}x{_kernel} depthwise)'
                    + ("; the authors' DeiT: no class token, LayerNorm on every token then average" if _deit else '')))


def _swap_iffn_lvt(model, cfg):
    """IFFN in LVT's stages, and its channel part only in the class-attention blocks (no grid there)."""
    swap_ffn(model, 'iffn', **cfg)
    swap_class_block_ffns(model, 'iffn', **{**cfg, 'spatial_part': False})


register_variant(VariantSpec(
    name='iffn_lvt', method='iffn', base='lvt', build=_swap_iffn_lvt, cfg=dict(kernel_size=5),
    description='IFFN Table 1 LVT + IFFN* (5x5 depthwise; class-attention blocks: channel part only)'))
