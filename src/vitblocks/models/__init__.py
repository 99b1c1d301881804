"""Backbone knowledge: surgery (swap blocks into timm models) and registered variants."""
import timm

from . import timm_slots  # noqa: F401  (declares the timm families' slots, first in SUPPORTED_FAMILIES)
from . import backbones  # noqa: F401  (registers LV-ViT, LVT, CycleMLP, Hire-MLP, EdgeViT, Pyramid VisionLLaMA)
from . import iffn  # noqa: F401  (registers the IFFN models, iffn_lvt included)
from . import afbo  # noqa: F401  (registers the AFBO FFNs, their counterparts and the AFBO models, afbo_lvt included)
from . import scheme  # noqa: F401  (registers the SCHEME models of AFBO Table 3)
from .backbones import BACKBONE_MODULES
from .registry import VariantSpec, get_variant, list_models, register_variant, resolve_model_name
from .slots import supported_families
from .surgery import find_ffn_slots, swap_ffn
from .weight_decay import expose_no_weight_decay, no_weight_decay_names
from .layer_groups import expose_group_matcher, has_group_matcher
from .repa import list_residual_ffns, swap_residual_ffn  # registers the RePa models
from .mabvit import add_pre_logits, make_parallel, swap_value_attention  # registers the MABViT models
from .ninformer import swap_gating_unit  # registers the NiNformer-paper models
from . import blocks_bench  # noqa: F401  (registers the CIFAR-10 blocks benchmark models)

__all__ = ['VariantSpec', 'get_variant', 'list_models', 'register_variant', 'resolve_model_name', 'SUPPORTED_FAMILIES',  # noqa: F822
           'find_ffn_slots', 'swap_ffn', 'expose_no_weight_decay', 'no_weight_decay_names', 'expose_group_matcher',
           'has_group_matcher', 'list_residual_ffns', 'swap_residual_ffn', 'add_pre_logits', 'make_parallel',
           'swap_value_attention', 'swap_gating_unit', 'BACKBONE_MODULES', 'list_backbones']


def __getattr__(name: str):
    """``SUPPORTED_FAMILIES``: the model classes that declare ``'ffn'`` slots (``models/slots.py``)."""
    if name == 'SUPPORTED_FAMILIES':
        return supported_families('ffn')
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def list_backbones():
    """timm names of the backbones vitblocks adds to timm (e.g. ``lvvit_s``), sorted."""
    return sorted(n for module in BACKBONE_MODULES for n in timm.list_models(module=module))
