"""vitblocks' blocks inside Hugging Face ``transformers`` models (text and vision); docs/language_models.md.

``pip install vitblocks[hf]``. Entry points: :func:`swap_ffn`, :func:`swap_value_attention`,
:func:`save_pretrained`, :func:`from_pretrained`, :func:`count_macs`; ``vitblocks.deploy.reparameterize`` and
``vitblocks.profile.count_params`` work on the swapped models as they are.
"""
from .counting import count_macs, example_inputs
from .families import FAMILIES, supported_layer_classes
from .io import WEIGHTS_NAME, from_pretrained, save_pretrained
from .swap import CONFIG_KEY, list_hf_ffns, swap_ffn
from .value_attention import swap_value_attention

__all__ = ['swap_ffn', 'swap_value_attention', 'save_pretrained', 'from_pretrained', 'count_macs', 'example_inputs',
           'list_hf_ffns', 'supported_layer_classes', 'FAMILIES', 'CONFIG_KEY', 'WEIGHTS_NAME']
