"""Where the FFN of each supported Hugging Face family lives: one adapter per decoder/encoder layer class.

| family (layer classes) | FFN slot | kept from the family | causal |
| --- | --- | --- | --- |
| BERT, RoBERTa (BertLayer, RobertaLayer) | intermediate; output.dense -> Identity | dropout, res., LN | if decoder |
| GPT-2 (GPT2Block) | mlp (Conv1D c_fc / c_proj) | ln_2, residual, mlp's dropout | yes |
| OpenAI GPT (Block) | mlp (Conv1D c_fc / c_proj) | residual, ln_2 after, dropout | yes |
| LLaMA, Qwen2, Mistral (*DecoderLayer) | mlp (gate / up / down) | RMSNorm pre-norm, residual | yes |
| ViT, DeiT (ViTLayer, DeiTLayer) | mlp (fc1 / fc2) | layernorm_after, dropout, res. | no |

ViT keeps 1 prefix token (class) off the patch grid, DeiT 2 (class, distillation).

RePa is a residual unit (its BatchNorm replaces the pre-FFN norm and its shortcut is folded at deployment): in the
pre-norm families the pre-FFN norm becomes ``Identity``; in the post-norm ones (BERT, GPT-1) its BatchNorm
normalizes the FFN input. The family's residual stays, so the unit's branch ``unit(x) - x`` is what the slot returns.

Classes are found by attribute structure and exact class (a subclass may wire its forward differently).
"""
import importlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ['Family', 'FAMILIES', 'family_of', 'find_layers', 'supported_layer_classes']


@dataclass(frozen=True)
class Family:
    """How a layer class holds its FFN. ``dense`` returns the replaced FFN's weights as (out, in) matrices under
    vitblocks' names ('fc1', 'fc2' or 'gate', 'up', 'down'), with biases (None where absent)."""
    name: str
    classes: Tuple[Tuple[str, str], ...]  # (module, class name)
    get_ffn: Callable[[nn.Module], nn.Module]
    install: Callable[[nn.Module, nn.Module], None]
    dense: Callable[[nn.Module], Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]]
    activation: Callable[[nn.Module], Optional[nn.Module]]
    dropout: Callable[[nn.Module], float]  # the FFN's own output dropout the slot must keep applying
    causal: Callable[[object], bool]  # from the config
    pre_norm: Optional[str] = None  # attribute of the pre-FFN norm (RePa replaces it), None for post-norm
    value: Tuple[Tuple[str, ...], ...] = ()  # candidate paths of the value projection (or fused qkv) in the layer
    fused_qkv: bool = False  # the value is the last third of a Conv1D c_attn
    vision: bool = False


def _linear(m: nn.Linear):
    return m.weight, m.bias


def _conv1d(m: nn.Module):  # transformers' Conv1D stores W as (in, out)
    return m.weight.t(), m.bias


def _bert_install(layer, new):
    layer.intermediate = new
    layer.output.dense = nn.Identity()  # keeps output.dropout and output.LayerNorm(x + ...)


def _set(attr):
    def install(layer, new):
        setattr(layer, attr, new)
    return install


def _llama_dense(layer):
    m = layer.mlp
    return {'gate': _linear(m.gate_proj), 'up': _linear(m.up_proj), 'down': _linear(m.down_proj)}


_BERT = dict(get_ffn=lambda layer: layer.intermediate, install=_bert_install,
             dense=lambda layer: {'fc1': _linear(layer.intermediate.dense), 'fc2': _linear(layer.output.dense)},
             activation=lambda layer: layer.intermediate.intermediate_act_fn, dropout=lambda layer: 0.,
             causal=lambda config: bool(getattr(config, 'is_decoder', False)), value=(('attention', 'self', 'value'),))
_GPT = dict(get_ffn=lambda layer: layer.mlp, install=_set('mlp'),
            dense=lambda layer: {'fc1': _conv1d(layer.mlp.c_fc), 'fc2': _conv1d(layer.mlp.c_proj)},
            activation=lambda layer: layer.mlp.act, dropout=lambda layer: layer.mlp.dropout.p,
            causal=lambda config: True, value=(('attn', 'c_attn'),), fused_qkv=True)
_LLAMA = dict(get_ffn=lambda layer: layer.mlp, install=_set('mlp'), dense=_llama_dense,
              activation=lambda layer: layer.mlp.act_fn, dropout=lambda layer: 0., causal=lambda config: True,
              pre_norm='post_attention_layernorm', value=(('self_attn', 'v_proj'),))
_VIT = dict(get_ffn=lambda layer: layer.mlp, install=_set('mlp'),
            dense=lambda layer: {'fc1': _linear(layer.mlp.fc1), 'fc2': _linear(layer.mlp.fc2)},
            activation=lambda layer: layer.mlp.activation_fn, dropout=lambda layer: 0., causal=lambda config: False,
            pre_norm='layernorm_after', vision=True,
            value=(('attention', 'v_proj'), ('attention', 'attention', 'value')))

_M = 'transformers.models'
FAMILIES: List[Family] = [
    Family('bert', ((f'{_M}.bert.modeling_bert', 'BertLayer'), (f'{_M}.roberta.modeling_roberta', 'RobertaLayer')),
           **_BERT),
    Family('gpt2', ((f'{_M}.gpt2.modeling_gpt2', 'GPT2Block'),), pre_norm='ln_2', **_GPT),
    Family('openai-gpt', ((f'{_M}.openai.modeling_openai', 'Block'),), **_GPT),
    Family('llama', ((f'{_M}.llama.modeling_llama', 'LlamaDecoderLayer'),
                     (f'{_M}.qwen2.modeling_qwen2', 'Qwen2DecoderLayer'),
                     (f'{_M}.mistral.modeling_mistral', 'MistralDecoderLayer')), **_LLAMA),
    Family('vit', ((f'{_M}.vit.modeling_vit', 'ViTLayer'), (f'{_M}.deit.modeling_deit', 'DeiTLayer')), **_VIT),
]


def _layer_classes() -> Dict[type, Family]:
    found = {}
    for family in FAMILIES:
        for module, name in family.classes:
            try:
                found[getattr(importlib.import_module(module), name)] = family
            except (ImportError, AttributeError):  # a family this transformers version lacks
                continue
    return found


def supported_layer_classes() -> List[str]:
    """'family: LayerClass' for every supported layer class."""
    return [f'{family.name}: {name}' for family in FAMILIES for _, name in family.classes]


def family_of(layer: nn.Module) -> Optional[Family]:
    """The adapter of a layer's exact class, or None."""
    return _layer_classes().get(type(layer))


def find_layers(model: nn.Module) -> List[Tuple[str, nn.Module, Family]]:
    """``(qualname, layer, family)`` of every supported transformer layer of ``model``, in order; a clear error if
    there is none."""
    classes = _layer_classes()
    layers = [(name, m, classes[type(m)]) for name, m in model.named_modules() if type(m) in classes]
    if not layers:
        raise ValueError(f'vitblocks.hf found no supported transformer layer in {type(model).__name__}; supported '
                         f'layer classes: {", ".join(supported_layer_classes())}')
    return layers
