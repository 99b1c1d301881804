"""Baseline FFNs the papers compare against, registered under the swap API."""
from timm.layers import Mlp
from torch import nn

from .activations import get_base_activation
from .registry import register_ffn

_ACT_CLASSES = {'gelu': nn.GELU, 'softplus': nn.Softplus, 'elu': nn.ELU, 'silu': nn.SiLU, 'swish': nn.SiLU,
                'relu': nn.ReLU}


@register_ffn('mlp')
def timm_mlp(in_features, hidden_features=None, out_features=None, act_layer='gelu', layout=None, **kwargs):
    """timm's plain ``Mlp`` (the baseline FFN). ``act_layer`` may be a name, e.g. 'softplus'
    for the baseline rows of IFFN Table 3."""
    if isinstance(act_layer, str):
        act_layer = _ACT_CLASSES[get_base_activation(act_layer)]
    return Mlp(in_features, hidden_features, out_features, act_layer=act_layer,
               use_conv=bool(layout and layout.channels_first), **kwargs)
