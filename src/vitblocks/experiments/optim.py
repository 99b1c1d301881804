"""The optimizer of a run: timm's optimizer over timm's parameter groups.

Weight decay skips 1-D tensors, names ending in ``.bias`` and what the model and its submodules name in
``no_weight_decay()`` (``vitblocks.models.no_weight_decay_names``). With ``layer_decay`` the groups are
timm's ``param_groups_layer_decay`` (BEiT's fine-tuning recipe, timm ``train.py --layer-decay``): each
unit of ``model.group_matcher()`` (stem, block, ..., head) gets ``lr_scale = layer_decay ** (units above
it)``, which timm's schedulers multiply into the group's lr at every step (``Scheduler.update_groups``;
``schedule.py`` does it for ``sched=none`` and the floor of ``plateau``). The head's scale is 1, so the
schedule's lr is the head's.
"""
from typing import Any, Dict, List

from timm.optim import create_optimizer_v2, param_groups_layer_decay, param_groups_weight_decay
from torch import nn
from torch.optim import Optimizer

from ..models.layer_groups import expose_group_matcher, has_group_matcher
from ..models.weight_decay import no_weight_decay_names
from .config import ConfigError, TrainConfig

__all__ = ['param_groups', 'build_optimizer', 'schedule_lr']


def param_groups(cfg: TrainConfig, model: nn.Module) -> List[Dict[str, Any]]:
    """timm's weight-decay groups, or with ``cfg.layer_decay`` its layer-decay groups (the same exclusions)."""
    no_decay = no_weight_decay_names(model)
    if cfg.layer_decay is None:
        return param_groups_weight_decay(model, cfg.weight_decay, no_weight_decay_list=no_decay)
    expose_group_matcher(model)  # e.g. timm's MetaFormer (PoolFormer) has none
    if not has_group_matcher(model):
        name = cfg.model or 'the model'
        raise ConfigError(f'layer_decay={cfg.layer_decay:g}: {name} ({type(model).__name__}) has no group_matcher(), '
                          f'which tells timm its blocks from the input to the head; timm would cut its parameter list '
                          f'into runs of 12 tensors instead (one block at several learning rates). Drop layer_decay, '
                          f'or give {type(model).__name__} a group_matcher (see '
                          f'vitblocks.models.layer_groups.GROUP_MATCHERS)')
    # param_groups_weight_decay also skips names ending in '.bias' that are not 1-D; param_groups_layer_decay
    # skips 1-D tensors only, so the pattern keeps the two groupings' weight decay the same
    return param_groups_layer_decay(model, cfg.weight_decay, no_weight_decay_list=no_decay | {'*.bias'},
                                    layer_decay=cfg.layer_decay)


def build_optimizer(cfg: TrainConfig, model: nn.Module, lr: float) -> Optimizer:
    """``create_optimizer_v2`` over :func:`param_groups`, every group at ``lr`` (the schedule scales them)."""
    kwargs: Dict[str, Any] = {}
    if cfg.opt_eps is not None:
        kwargs['eps'] = cfg.opt_eps
    if cfg.opt_betas is not None:
        kwargs['betas'] = tuple(cfg.opt_betas)
    return create_optimizer_v2(param_groups(cfg, model), opt=cfg.opt, lr=lr, weight_decay=cfg.weight_decay,
                               momentum=cfg.momentum, **kwargs)


def schedule_lr(optimizer: Optimizer) -> float:
    """The schedule's learning rate now: the lr of the group with the largest ``lr_scale`` over that scale
    (the head's group, scale 1, under layer-wise decay; without it every group has the same lr)."""
    group = max(optimizer.param_groups, key=lambda g: g.get('lr_scale', 1.0))
    return group['lr'] / group.get('lr_scale', 1.0)
