"""vitblocks: new vision-transformer blocks (IFFN, AFBO, MABViT, NiNformer, RePa) for timm backbones.

``import vitblocks`` registers every vitblocks model with timm, so
``timm.create_model('iffn_deit_tiny_patch16_224')`` works.
"""
from . import layers
from .layers import create_ffn, list_ffns
from .deploy import reparameterize
from .models import list_models, swap_ffn, swap_residual_ffn

__version__ = '0.1.0'

__all__ = ['swap_ffn', 'swap_residual_ffn', 'reparameterize', 'list_models', 'list_ffns', 'create_ffn', 'layers',
           '__version__']
