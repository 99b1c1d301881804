"""Pure ``nn.Module`` building blocks; no backbone knowledge lives here.

Each deployed form (``IFFNDeployed``, ``AFBODeployed``) subclasses its training form and registers itself
with the FFN registry, where the training form's ``fuse()`` finds it; importing it here, next to its
training form, is what makes ``fuse()`` work wherever the layer is importable.
"""
from .activations import (ACTIVATIONS, AGeLU, ArbitraryActivation, ConcatArbitraryActivations, activation_name,
                          create_act, get_base_activation)
from .baselines import timm_mlp
from .iffn import IFFN, DepthwiseBlock, SumOfNonlinearities
from .iffn_deployed import IFFNDeployed
from .rational_gelu import RationalGELU, erf_rational, gelu_rational
from .layout import TokenLayout, apply_spatial, check_grid, merge_tokens, split_tokens
from .registry import FFN_INHERITS, FFN_REGISTRY, create_ffn, list_ffns, register_ffn
from .repa import RePaDeployedFFN, RePaFFN, TokenBatchNorm, active_channels, repa_ffn
from .value_attention import GATED_VALUE_ACTIVATIONS, VALUE_ACTIVATIONS, ParallelBlock, ValueActivationAttention
from .gating import LocalityFFN, MixerGatingUnit
from .channel_maps import (DenseChannelMap, GroupedChannelMap, GroupedCrossChannelMap, OverlappedCycleChannelMap,
                           create_channel_map)
from .afbo import AFBO, SpatialAttention, afbo_full, afbo_grouped, scfbo_gc, scfbo_oc
from .afbo_deployed import AFBODeployed
from .ffn_counterparts import ConvGLU, ConvNeXtFFN, LocalViTFFN, glu, group_ffn, swiglu
from .scheme import SCHEME

__all__ = ['ACTIVATIONS', 'AGeLU', 'ArbitraryActivation', 'ConcatArbitraryActivations', 'activation_name',
           'create_act', 'get_base_activation', 'timm_mlp', 'IFFN', 'IFFNDeployed', 'DepthwiseBlock',
           'SumOfNonlinearities', 'RationalGELU', 'erf_rational', 'gelu_rational', 'TokenLayout', 'apply_spatial',
           'check_grid', 'merge_tokens', 'split_tokens', 'FFN_INHERITS', 'FFN_REGISTRY', 'create_ffn', 'list_ffns',
           'register_ffn', 'RePaDeployedFFN', 'RePaFFN', 'TokenBatchNorm', 'active_channels', 'repa_ffn',
           'GATED_VALUE_ACTIVATIONS', 'VALUE_ACTIVATIONS', 'ParallelBlock', 'ValueActivationAttention',
           'LocalityFFN', 'MixerGatingUnit', 'DenseChannelMap', 'GroupedChannelMap', 'GroupedCrossChannelMap',
           'OverlappedCycleChannelMap', 'create_channel_map', 'AFBO', 'AFBODeployed', 'SpatialAttention',
           'afbo_full', 'afbo_grouped', 'scfbo_gc', 'scfbo_oc', 'ConvGLU', 'ConvNeXtFFN', 'LocalViTFFN', 'glu',
           'group_ffn', 'swiglu', 'SCHEME']

# torch.fx: these layers branch in Python on their input's layout (tokens, channels-first or
# channels-last maps; the grid of their TokenLayout) or on autograd state, which symbolic tracing
# cannot follow. Registered as timm "notrace" modules, timm's FX tools (``FeatureGraphNet``,
# ``timm.models.get_notrace_modules()`` for torchvision's ``create_feature_extractor``) keep them as
# leaf modules that run eagerly inside the traced graph, as timm does with its own such layers.
from timm.layers import register_notrace_module as _register_notrace_module

for _cls in (IFFN, IFFNDeployed, SumOfNonlinearities, AFBO, AFBODeployed, ConvGLU, ConvNeXtFFN, LocalViTFFN,
             LocalityFFN, MixerGatingUnit, RePaFFN, RePaDeployedFFN, ValueActivationAttention, SCHEME):
    _register_notrace_module(_cls)
