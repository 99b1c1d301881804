"""vitblocks' blocks inside Hugging Face ``transformers`` models (text and vision); docs/language_models.md.

``pip install vitblocks[hf]``. Entry points: :func:`swap_ffn`, :func:`swap_value_attention`,
:func:`save_pretrained`, :func:`from_pretrained`; ``vitblocks.deploy.reparameterize`` and ``vitblocks.profile``
work on the swapped models.
"""
from .families import FAMILIES, supported_layer_classes
from .swap import CONFIG_KEY, list_hf_ffns, swap_ffn

__all__ = ['swap_ffn', 'list_hf_ffns', 'supported_layer_classes', 'FAMILIES', 'CONFIG_KEY']
