"""Registered model variants: "build the timm backbone, swap, (load weights)".

A variant is a timm base model name plus a block swap. ``register_variant`` turns it into a
timm entry point named ``<method>[_<variant>]_<timm base name>``, so after ``import vitblocks``
``timm.create_model('iffn_deit_tiny_patch16_224')`` works, checkpoints load through timm's
``checkpoint_path=`` and data configs resolve from the base model's pretrained config.
"""
import difflib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional

import timm
from timm.models import get_pretrained_cfg, register_model
from timm.models._builder import resolve_pretrained_cfg
from torch import nn

from .features import FEATURE_KWARGS, features_only
from .layer_groups import expose_group_matcher
from .recipe import record_build, registered_build

__all__ = ['register_variant', 'list_models', 'get_variant', 'VariantSpec', 'resolve_model_name']

# pretrained-config fields copied from the timm base model: preprocessing and the model attributes
# timm's tools read (pool_size: forward_features' grid; first_conv / classifier: parameter names).
# Weight sources, tags and the base's test-time sizes (how its weights were evaluated) are not copied.
_CFG_KEYS = ('input_size', 'min_input_size', 'fixed_input_size', 'interpolation', 'crop_pct', 'crop_mode',
             'mean', 'std', 'num_classes', 'pool_size', 'first_conv', 'classifier')


@dataclass(frozen=True)
class VariantSpec:
    """How a registered model is built from a timm base model."""
    name: str
    method: str
    base: str
    build: Callable[[nn.Module, Dict[str, Any]], Any]  # (model, cfg) -> swaps blocks in place
    cfg: Dict[str, Any] = field(default_factory=dict)  # block config, overridable at create time
    base_kwargs: Dict[str, Any] = field(default_factory=dict)  # timm kwargs of the base model
    description: str = ''
    # pretrained-config fields that differ from the base's (a model built at another input size)
    pretrained_cfg: Dict[str, Any] = field(default_factory=dict)
    # where a training config's ``mlp_drop`` goes (vitblocks.experiments.setup.mlp_dropout_kwargs): timm's
    # 'proj_drop_rate' (dropout in the blocks' MLP and attention projection), or 'block_cfg' (``block_cfg['drop']``:
    # the swapped-in blocks' own dropout, e.g. in every feed-forward net of a NiNformer block)
    mlp_drop_kwarg: str = 'proj_drop_rate'


MLP_DROP_KWARGS = ('proj_drop_rate', 'block_cfg')
_VARIANTS: Dict[str, VariantSpec] = {}


def _entrypoint(spec: VariantSpec):
    def create(pretrained: bool = False, block_cfg: Optional[Dict[str, Any]] = None, **kwargs) -> nn.Module:
        if pretrained:
            raise RuntimeError(f'{spec.name} has no published pretrained weights; train one with `vitblocks train` '
                               f'or pass checkpoint_path= to timm.create_model')
        kwargs.pop('cache_dir', None)  # no weights to download
        cfg = _resolve_cfg(spec, kwargs.pop('pretrained_cfg', None), kwargs.pop('pretrained_cfg_overlay', None))
        # features_only wraps the *swapped* model, so the timm base is built whole (see features.py)
        feature_kwargs = {k: kwargs.pop(k) for k in FEATURE_KWARGS if k in kwargs}
        # the base is built with our config, so timm derives num_classes / in_chans / img_size (fixed-size
        # families) from it exactly as for its own models, a pretrained_cfg_overlay included
        base_kwargs = dict(spec.base_kwargs)
        if cfg.get('fixed_input_size') and 'img_size' in base_kwargs:  # a variant built at its own size
            base_kwargs['img_size'] = tuple(cfg['input_size'][-2:])  # = the registered one, unless overlaid
        given = dict(kwargs)  # what rebuilds this model by name (vitblocks.models.recipe)
        model = timm.create_model(spec.base, pretrained=False, pretrained_cfg=cfg, **{**base_kwargs, **kwargs})
        with registered_build():  # the swaps are the name's, not a user's surgery
            spec.build(model, {**spec.cfg, **(block_cfg or {})})
        record_build(model, spec.name, block_cfg, given)
        expose_group_matcher(model)  # timm's layer-wise LR decay needs one; timm's MetaFormer has none
        model.pretrained_cfg = model.default_cfg = cfg
        if feature_kwargs.pop('features_only', False):
            return features_only(model, spec.name, **feature_kwargs)
        if feature_kwargs:
            raise ValueError(f'{", ".join(sorted(feature_kwargs))} apply with features_only=True only')
        return model
    create.__name__ = spec.name
    create.__qualname__ = spec.name
    create.__module__ = __name__
    create.__doc__ = _what(spec)
    return create


def _what(spec: VariantSpec) -> str:
    return f'{spec.description or spec.name}: timm {spec.base} with {spec.method} blocks.'


default_cfgs: Dict[str, Dict[str, Any]] = {}  # read by timm's register_model


def _resolve_cfg(spec: VariantSpec, pretrained_cfg: Any, overlay: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The model's pretrained config as timm's builder resolves it: the registered one (or a user's
    ``pretrained_cfg`` dict / ``PretrainedCfg``), updated with ``pretrained_cfg_overlay``."""
    if isinstance(pretrained_cfg, str):  # a weight tag ('name.tag'): vitblocks registers none
        raise RuntimeError(f'{spec.name} has no pretrained tag {pretrained_cfg!r} (vitblocks registers no weights); '
                           f'use the name without a tag and pass checkpoint_path= to timm.create_model')
    return resolve_pretrained_cfg(spec.name, pretrained_cfg, overlay).to_dict()


def register_variant(spec: VariantSpec) -> VariantSpec:
    """Register ``spec`` as a timm model. Never overwrites a timm name."""
    if spec.name in _VARIANTS:
        raise ValueError(f'model {spec.name!r} is already registered by vitblocks')
    if spec.name in timm.list_models():
        raise ValueError(f'{spec.name!r} is a timm model name; vitblocks names are <method>_<timm name>')
    if spec.mlp_drop_kwarg not in MLP_DROP_KWARGS:
        raise ValueError(f'{spec.name}: mlp_drop_kwarg={spec.mlp_drop_kwarg!r}; use one of '
                         f'{", ".join(MLP_DROP_KWARGS)}')
    base_cfg = asdict(get_pretrained_cfg(spec.base))
    unknown = set(spec.pretrained_cfg) - set(_CFG_KEYS)
    if unknown:
        raise ValueError(f'{spec.name}: pretrained_cfg keys {sorted(unknown)} are not data/model fields '
                         f'({", ".join(_CFG_KEYS)})')
    if 'input_size' in spec.pretrained_cfg and base_cfg.get('pool_size') and 'pool_size' not in spec.pretrained_cfg:
        raise ValueError(f'{spec.name}: a new input_size changes the feature grid; give pool_size too')
    # the config says what the model is (timm's `description` field): a tool that reads configs rather than
    # names (a ViT-based model need not be called vit_*) finds the timm base family there
    default_cfgs[spec.name] = {**{k: base_cfg[k] for k in _CFG_KEYS if k in base_cfg}, **spec.pretrained_cfg,
                               'description': _what(spec)}
    _VARIANTS[spec.name] = spec
    register_model(_entrypoint(spec))
    return spec


def get_variant(name: str) -> VariantSpec:
    """The spec of a registered model; a weight tag (``name.tag``) names the same architecture."""
    return _VARIANTS[resolve_model_name(name, vitblocks_only=True).split('.')[0]]


def list_models(pattern: str = '', method: Optional[str] = None) -> List[str]:
    """Names of the models vitblocks registers, optionally filtered by substring or method."""
    return sorted(n for n, s in _VARIANTS.items() if pattern in n and (method is None or s.method == method))


def resolve_model_name(name: str, vitblocks_only: bool = False) -> str:
    """Return ``name`` if it is a known model (vitblocks or timm), else raise with suggestions."""
    known = set(_VARIANTS) if vitblocks_only else set(_VARIANTS) | set(timm.list_models())
    base = name.split('.')[0]
    if base in known:
        return name
    close = difflib.get_close_matches(base, sorted(known), n=3, cutoff=0.6)
    hint = f' Did you mean: {", ".join(close)}?' if close else ' See `vitblocks list`.'
    raise ValueError(f'unknown model {name!r}.{hint}')

