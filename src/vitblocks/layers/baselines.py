"""Baseline FFNs the papers compare against, registered under the swap API."""
from timm.layers import Mlp

from .activations import ACTIVATIONS, activation_name
from .registry import register_ffn


@register_ffn('mlp', inherits=('drop', 'act_layer'))
def timm_mlp(in_features, hidden_features=None, out_features=None, act_layer='gelu', layout=None, **kwargs):
    """timm's plain ``Mlp`` (the baseline FFN). ``act_layer`` may be a name, e.g. 'softplus'
    for the baseline rows of IFFN Table 3."""
    act_layer = ACTIVATIONS[activation_name(act_layer)].module
    return Mlp(in_features, hidden_features, out_features, act_layer=act_layer,
               use_conv=bool(layout and layout.channels_first), **kwargs)
