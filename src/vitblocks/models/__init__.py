"""Backbone knowledge: surgery (swap blocks into timm models) and registered variants."""
import timm

from . import iffn  # noqa: F401  (registers the IFFN models)
from . import afbo  # noqa: F401  (registers the AFBO FFNs, their counterparts and the AFBO models)
from . import lvvit  # noqa: F401  (registers the LV-ViT backbones lvvit_s, lvvit_m, lvvit_l with timm)
from . import lvt  # noqa: F401  (registers LVT with timm, and iffn_lvt, afbo_lvt)
from . import scheme  # noqa: F401  (registers the SCHEME models of AFBO Table 3)
from . import cyclemlp  # noqa: F401  (registers CycleMLP-B1..B5 with timm)
from . import hiremlp  # noqa: F401  (registers Hire-MLP Tiny..Large with timm)
from . import edgevit  # noqa: F401  (registers EdgeViT-XXS with timm as edgevit_xxs; afbo_edgevit_xxs in afbo.py)
from . import vision_llama  # noqa: F401  (registers pyramid_visionllama_s/b/l with timm; their AFBO models in afbo.py)
from .registry import VariantSpec, get_variant, list_models, register_variant, resolve_model_name
from .surgery import SUPPORTED_FAMILIES, find_ffn_slots, swap_ffn
from .weight_decay import expose_no_weight_decay, no_weight_decay_names
from .layer_groups import expose_group_matcher, has_group_matcher
from .repa import list_residual_ffns, swap_residual_ffn  # registers the RePa models
from .mabvit import add_pre_logits, make_parallel, swap_value_attention  # registers the MABViT models
from .ninformer import swap_gating_unit  # registers the NiNformer-paper models
from . import blocks_bench  # noqa: F401  (registers the CIFAR-10 blocks benchmark models)

__all__ = ['VariantSpec', 'get_variant', 'list_models', 'register_variant', 'resolve_model_name', 'SUPPORTED_FAMILIES',
           'find_ffn_slots', 'swap_ffn', 'expose_no_weight_decay', 'no_weight_decay_names', 'expose_group_matcher',
           'has_group_matcher', 'list_residual_ffns', 'swap_residual_ffn', 'add_pre_logits', 'make_parallel',
           'swap_value_attention', 'swap_gating_unit', 'BACKBONE_MODULES', 'list_backbones']

# backbones the papers use that timm does not have, registered with timm by these modules
BACKBONE_MODULES = ('lvvit', 'lvt', 'cyclemlp', 'hiremlp', 'edgevit', 'vision_llama')


def list_backbones():
    """timm names of the backbones vitblocks adds to timm (e.g. ``lvvit_s``), sorted."""
    return sorted(n for module in BACKBONE_MODULES for n in timm.list_models(module=module))
