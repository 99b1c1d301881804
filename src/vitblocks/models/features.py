"""``features_only=True`` for registered models: timm's own feature wrappers around the swapped model.

timm turns a model into a feature extractor inside each family's ``_create_*`` function, by
passing a family ``feature_cfg`` to ``build_model_with_cfg``. A vitblocks model is a timm model
*after* surgery, so its entry point builds the base whole, swaps, and then hands the result to
that same ``build_model_with_cfg`` with the feature_cfg the family uses in timm (table below).
``feature_info``, ``out_indices``, ``feature_cls`` ('getter', 'list', 'hook', 'dict', 'fx') and the
output formats then behave exactly as for the timm model: a DeiT/ViT or MLP-Mixer gets timm's
``FeatureGetterNet`` (``forward_intermediates``, last three blocks by default, prefix tokens
dropped, maps ``(B, C, H, W)``), a hierarchical backbone a ``FeatureListNet`` over its four stages.

| family (timm class)          | feature_cfg in timm's ``_create_*``                  |
| ---------------------------- | ---------------------------------------------------- |
| VisionTransformer, MlpMixer  | ``out_indices=3, feature_cls='getter'``              |
| SwinTransformer, MetaFormer, | ``flatten_sequential=True``, ``out_indices`` = every |
| PyramidVisionTransformerV2,  | stage (``model.feature_info`` has one per stage)     |
| GlobalContextVit             |                                                      |
| vitblocks' own backbones     | ``feature_cls='getter'`` over every stage, through   |
| (LVT, CycleMLP, Hire-MLP,    | their ``forward_intermediates`` (as their timm entry |
| EdgeViT, VisionLLaMA)        | points)                                              |
"""
from typing import Any, Dict, Optional

from timm.models import build_model_with_cfg
from timm.models.gcvit import GlobalContextVit
from timm.models.metaformer import MetaFormer
from timm.models.mlp_mixer import MlpMixer
from timm.models.pvt_v2 import PyramidVisionTransformerV2
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torch import nn

__all__ = ['features_only', 'FEATURE_KWARGS']

# create_model kwargs that configure the feature wrapper, not the model
FEATURE_KWARGS = ('features_only', 'out_indices', 'feature_cls')

_GETTER = (VisionTransformer, MlpMixer)
_STAGES = (SwinTransformer, MetaFormer, PyramidVisionTransformerV2, GlobalContextVit)


def _family_feature_cfg(model: nn.Module) -> Dict[str, Any]:
    if isinstance(model, _GETTER):
        return dict(out_indices=3, feature_cls='getter')
    if isinstance(model, _STAGES):
        return dict(flatten_sequential=True, out_indices=tuple(range(len(model.feature_info))))
    if callable(getattr(model, 'forward_intermediates', None)) and isinstance(getattr(model, 'feature_info', None),
                                                                               list):
        return dict(out_indices=tuple(range(len(model.feature_info))), feature_cls='getter')
    raise ValueError(f'features_only is not supported for {type(model).__name__}; supported timm families: '
                     f'{", ".join(c.__name__ for c in _GETTER + _STAGES)}, and models with forward_intermediates')


def features_only(model: nn.Module, name: str, out_indices: Optional[Any] = None,
                  feature_cls: Optional[str] = None) -> nn.Module:
    """Wrap a built (swapped) model as timm would wrap its base with ``features_only=True``.

    Args:
        model: the full model, surgery done.
        name: its registered name (for the pretrained config of the wrapper).
        out_indices: which features, as in timm (int = the last n, or a tuple of indices).
        feature_cls: timm feature wrapper class name; default the family's.
    """
    kwargs: Dict[str, Any] = {}
    if out_indices is not None:
        kwargs['out_indices'] = out_indices
    if feature_cls is not None:
        kwargs['feature_cls'] = feature_cls
    img_size = getattr(model, '_traits', {}).get('img_size')
    if img_size is not None:
        kwargs['img_size'] = img_size  # keep the built size in the traits (not the config's default)
    # build_model_with_cfg calls model_cls(**model kwargs); the model is built already
    return build_model_with_cfg(lambda **_: model, name, pretrained=False, pretrained_cfg=model.pretrained_cfg,
                                feature_cfg=_family_feature_cfg(model), features_only=True, **kwargs)
