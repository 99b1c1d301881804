"""Save and load swapped models: the swap is in the config, the weights in a file transformers does not read.

``save_pretrained(model, d)`` writes ``config.json`` (with ``config.vitblocks``, the swap spec), the generation
config, and the state dict as ``vitblocks_model.safetensors`` (shared tensors such as GPT-2's tied head stored
once), plus a short README saying how to load it. ``from_pretrained(AutoModelForX, d)`` builds the model from the
config, redoes the swap from the spec and loads the weights strictly (every key, same shapes).

Why a file name of our own: transformers' own loader, given a swapped folder, would build the vanilla model, drop
the vitblocks keys as unexpected, leave the FFNs randomly initialized and return it with a warning. With no
``model.safetensors`` in the folder, ``AutoModel.from_pretrained(d)`` instead fails: ``OSError: ... does not appear
to have a file named model.safetensors`` (or ``pytorch_model.bin``...), so a swapped checkpoint never passes as a
vanilla model.
"""
import json
from pathlib import Path
from typing import Union

from safetensors.torch import load_model, save_model
from torch import nn

from .swap import CONFIG_KEY, swap_ffn
from .value_attention import swap_value_attention

__all__ = ['save_pretrained', 'from_pretrained', 'WEIGHTS_NAME']

WEIGHTS_NAME = 'vitblocks_model.safetensors'
_README = """# A transformers model with vitblocks blocks

Saved by `vitblocks.hf.save_pretrained`; the swap is recorded in `config.json` under `vitblocks`.
Load it with

    import vitblocks.hf
    model = vitblocks.hf.from_pretrained(transformers.{cls}, "{dir}")

(`pip install vitblocks[hf]`). transformers alone cannot load it: it finds no `model.safetensors` here.
"""


def save_pretrained(model: nn.Module, save_directory: Union[str, Path]) -> Path:
    """Write a swapped model to ``save_directory`` (created if needed); returns the weights file."""
    spec = getattr(model.config, CONFIG_KEY, None)
    if not spec:
        raise ValueError(f'{type(model).__name__} has no vitblocks swap recorded in its config; save a vanilla model '
                         f'with model.save_pretrained')
    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    generation = getattr(model, 'generation_config', None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(out)
    path = out / WEIGHTS_NAME
    save_model(model, str(path), metadata={'format': 'pt', CONFIG_KEY: json.dumps(spec)})
    (out / 'README.md').write_text(_README.format(cls=type(model).__name__, dir=out))
    return path


def from_pretrained(auto_class, directory: Union[str, Path], **config_kwargs) -> nn.Module:
    """Build ``auto_class`` (``AutoModel``, ``AutoModelForCausalLM``, a model class, ...) from a folder written by
    :func:`save_pretrained`: config, swap from ``config.vitblocks``, strict weight load; in eval mode, as
    transformers' ``from_pretrained``. ``config_kwargs`` override config attributes."""
    from transformers import AutoConfig
    directory = Path(directory)
    path = directory / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f'{directory} has no {WEIGHTS_NAME}: it was not written by '
                                f'vitblocks.hf.save_pretrained (a vanilla folder loads with {auto_class.__name__}'
                                f'.from_pretrained)')
    config = AutoConfig.from_pretrained(directory, local_files_only=True, **config_kwargs)
    spec = getattr(config, CONFIG_KEY, None)
    if not spec:
        raise ValueError(f'{directory}/config.json records no vitblocks swap (no "{CONFIG_KEY}" entry)')
    model = auto_class.from_config(config)
    layers = set(spec['layers'])
    if spec.get('ffn'):
        swap_ffn(model, spec['ffn'], include=layers.__contains__, mlp_ratio=spec.get('mlp_ratio'),
                 padding=spec.get('padding'), batch_norm=spec.get('batch_norm'), **spec.get('cfg', {}))
    value = spec.get('value_attention')
    if value:
        swap_value_attention(model, value['value_act'], include=set(value['layers']).__contains__)
    setattr(model.config, CONFIG_KEY, spec)
    load_model(model, str(path), strict=True)
    return model.eval()
