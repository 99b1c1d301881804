"""Backbone knowledge: surgery (swap blocks into timm models) and registered variants."""
from . import iffn  # noqa: F401  (registers the IFFN models)
from . import afbo  # noqa: F401  (registers the AFBO FFNs, their counterparts and the AFBO models)
from .registry import VariantSpec, get_variant, list_models, register_variant, resolve_model_name
from .surgery import SUPPORTED_FAMILIES, find_ffn_slots, swap_ffn
from .repa import list_residual_ffns, swap_residual_ffn  # registers the RePa models
from .mabvit import add_pre_logits, make_parallel, swap_value_attention  # registers the MABViT models
from .ninformer import swap_gating_unit  # registers the NiNformer-paper models
from . import blocks_bench  # noqa: F401  (registers the CIFAR-10 blocks benchmark models)
