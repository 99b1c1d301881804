"""Deployment: re-parameterize trained models for inference.

A re-parameterizable vitblocks layer implements ``fuse()``, returning its inference form
(``IFFN.fuse()`` folds the BatchNorm into the depthwise conv and switches to the fast
inference path). That is timm's protocol, so ``timm.utils.reparameterize_model`` and
``timm``'s ``benchmark.py --reparam`` deploy vitblocks models too; :func:`reparameterize`
is the same walk with the conventions vitblocks wants (copy by default, eval mode).

A fused checkpoint loads into a model built directly in deploy form, e.g.
``timm.create_model('iffn_deit_tiny_patch16_224', block_cfg={'deploy': True})``.
"""
import copy

from timm.utils import reparameterize_model
from torch import nn

__all__ = ['reparameterize']


def reparameterize(model: nn.Module, inplace: bool = False) -> nn.Module:
    """Return ``model`` in its inference form, **in eval mode**.

    Every submodule with a ``fuse()`` method is replaced by what it returns (timm modules with
    ``reparameterize()`` / ``switch_to_deploy()`` are switched too), exactly as
    ``timm.utils.reparameterize_model`` does. The result equals the original model in eval mode
    up to float rounding. Idempotent: deploying a deployed model changes nothing.

    Args:
        model: any model; vitblocks and timm layers that know how to fuse are fused.
        inplace: modify ``model`` itself instead of a deep copy (the default leaves it untouched).

    Returns:
        The deployed model (``model`` itself when ``inplace=True``), switched to eval mode: folded
        BatchNorms are their running statistics, now part of the weights.

    Training a deployed model: as after ``timm.utils.reparameterize_model``, it stays an ordinary
    module, so ``model.train()`` is allowed and gradients flow. What trains is the *folded*
    parametrization: plain weights with the folded BatchNorms inside them (those BatchNorms no
    longer exist, so no batch statistics of theirs are computed or updated), RePa's three merged
    matrices instead of its idle/active FFN, IFFN's depthwise conv without its BatchNorm. That is
    fine-tuning the inference form (e.g. for quantization-aware training), not continuing the
    paper's training: for that, train the training form and deploy it again.
    """
    if not inplace:
        model = copy.deepcopy(model)
    model.eval()  # before fusing, so new modules inherit eval mode
    return reparameterize_model(model, inplace=True)
