"""Layer groups for timm's layer-wise learning-rate decay, where the timm class has none.

timm's ``param_groups_layer_decay`` (``create_optimizer_v2(..., layer_decay=)``, ``train.py
--layer-decay``, ``vitblocks train layer_decay=``) ranks the parameters from the input to the head
with ``model.group_matcher(coarse=False)`` and scales each unit's learning rate by
``layer_decay ** (units above it)``. A model without ``group_matcher`` is silently cut into runs of
12 tensors instead, so one block's weights get several learning rates and the head gets whatever
run its last tensors fall in. timm 1.0.x's ``MetaFormer`` (PoolFormer v1/v2, ConvFormer, CAFormer,
and every vitblocks model built on them: ``iffn_poolformer_*``, ``afbo_poolformer_*``,
``repa_poolformer_*``, ``scheme_*_poolformer_*``) has none.

:func:`expose_group_matcher` gives such a model (in place) the matcher of its class from
``GROUP_MATCHERS``, written in timm's regex form like timm's ConvNeXt. vitblocks' registered models
get it when they are built, and ``vitblocks train`` calls it on every model it trains with
``layer_decay``, so a plain ``timm.create_model('poolformer_s12')`` gets it too. A class that gains
its own ``group_matcher`` in a later timm keeps it.
"""
import functools
from typing import Any, Callable, Dict, Optional

from timm.models.metaformer import MetaFormer
from torch import nn

__all__ = ['GROUP_MATCHERS', 'metaformer_group_matcher', 'expose_group_matcher', 'has_group_matcher']


def metaformer_group_matcher(coarse: bool = False) -> Dict[str, Any]:
    """timm's ``MetaFormer``, from the input up: the stem; per stage its downsampling (conv + norm; none in
    stage 0, whose width does not change) and then each block; ``coarse``: one group per stage. The head
    (``head.norm``, the norm after pooling, and ``head.fc``, a Linear or an MLP head) matches nothing, so
    timm puts it in a last group of its own, as for ConvNeXt, whose ``head.norm`` also follows the pooling."""
    return dict(
        stem=r'^stem\.',
        blocks=r'^stages\.(\d+)\.' if coarse else [
            (r'^stages\.(\d+)\.downsample\.', (-1,)),  # before the stage's block 0
            (r'^stages\.(\d+)\.blocks\.(\d+)\.', None),
        ],
    )


# timm classes without a ``group_matcher`` in the timm vitblocks runs on; one line per class
GROUP_MATCHERS: Dict[type, Callable[..., Dict[str, Any]]] = {MetaFormer: metaformer_group_matcher}


def _matcher_for(model: nn.Module) -> Optional[Callable[..., Dict[str, Any]]]:
    for cls, matcher in GROUP_MATCHERS.items():
        if isinstance(model, cls):
            return matcher
    return None


def expose_group_matcher(model: nn.Module) -> nn.Module:
    """Give ``model`` (in place) the ``group_matcher`` of its class from ``GROUP_MATCHERS`` if it has none.

    Nothing changes for a model that has one (its class's, or one exposed before) or whose class is not
    listed. As ``expose_no_weight_decay``, the answer is a ``functools.partial`` instance attribute: deepcopy
    (EMA), pickling, ``torch.export`` and ``torch.jit.script`` keep working, and state dicts are unchanged.
    """
    matcher = None if hasattr(model, 'group_matcher') else _matcher_for(model)
    if matcher is not None:
        model.group_matcher = functools.partial(matcher)
    return model


def has_group_matcher(model: nn.Module) -> bool:
    """Whether timm's layer-wise LR decay groups ``model`` by its structure (else by runs of 12 tensors)."""
    return callable(getattr(model, 'group_matcher', None))
