"""The learning-rate schedule: timm's schedulers, with what is *state* saved and restored on resume.

A schedule has a shape (its kind, length, warm-up, floor: always built from the current config,
so a resume with more epochs lengthens a cosine) and a state (where it is: the optimizer step for
the step-driven schedules; for ``plateau`` also the counters of torch's ``ReduceLROnPlateau``,
which timm's ``PlateauLRScheduler.state_dict`` leaves out). Only the state comes from a
checkpoint, so a resumed plateau run decays its learning rate at the same epochs as an
uninterrupted one.

``plateau`` is driven by the epoch's validation top-1 (timm's train.py default metric, mode
'max'): stepped once per completed epoch that was evaluated (``eval_interval``), never mid-epoch.

Layer-wise LR decay (``layer_decay``, ``experiments/optim.py``) gives each parameter group an ``lr_scale``;
every group's lr is the schedule's lr x its scale. timm's schedulers multiply it in at every update
(``Scheduler.update_groups``, the warm-up included); ``sched=none`` has no scheduler, so the scales are
applied here once, and ``plateau``'s torch ``ReduceLROnPlateau`` (which multiplies the groups' current lrs, so
keeps their ratios) gets each group's floor ``min_lr x lr_scale`` and no minimal decay (``eps``).
"""
import warnings
from typing import Any, Dict, Optional

from timm.scheduler import PlateauLRScheduler, create_scheduler_v2
from torch.optim import Optimizer

from .config import TrainConfig

__all__ = ['build_scheduler', 'scheduler_state', 'restore_scheduler']

# what ReduceLROnPlateau changes as it runs (its other attributes are the shape: mode, factor, patience, ...)
PLATEAU_COUNTERS = ('best', 'num_bad_epochs', 'cooldown_counter', 'last_epoch')


def build_scheduler(cfg: TrainConfig, optimizer: Optimizer, steps_per_epoch: int):
    """timm's scheduler for ``cfg.sched`` (None for 'none'), stepped per optimizer update, except
    ``plateau``, which timm steps per epoch only."""
    if cfg.sched == 'none':  # a constant lr: each group's, scaled once (the optimizer is fresh, at the base lr)
        for group in optimizer.param_groups:
            group['lr'] *= group.get('lr_scale', 1.0)
        return None
    plateau = cfg.sched == 'plateau'
    with warnings.catch_warnings():
        # timm deprecates plateau because its counters are not in timm's checkpoints; ours saves them
        warnings.filterwarnings('ignore', message='PlateauLRScheduler is deprecated', category=FutureWarning)
        scheduler, _ = create_scheduler_v2(
            optimizer, sched=cfg.sched, num_epochs=cfg.epochs, warmup_epochs=cfg.warmup_epochs,
            warmup_lr=cfg.warmup_lr, min_lr=cfg.min_lr, decay_epochs=cfg.decay_epochs, decay_rate=cfg.decay_rate,
            patience_epochs=cfg.patience_epochs, plateau_mode='max', step_on_epochs=plateau,
            updates_per_epoch=steps_per_epoch)
    if plateau:
        _scale_plateau_floor(scheduler.lr_scheduler, optimizer)
    return scheduler


def _scale_plateau_floor(plateau, optimizer: Optimizer) -> None:
    """torch's ``ReduceLROnPlateau`` floors every group at ``min_lr`` and skips a group's decay when it changes
    the lr by less than ``eps`` (1e-8, absolute, one value for all groups). Under layer-wise decay a group's floor
    is ``min_lr x lr_scale`` (else all groups would end at one lr), and ``eps`` is 0 (else the low groups, whose
    lrs are that much smaller, would stop decaying before the head: any absolute threshold splits them); a
    decay is then skipped only at the floor."""
    scales = [group.get('lr_scale', 1.0) for group in optimizer.param_groups]
    if any(scale != 1.0 for scale in scales):
        plateau.min_lrs = [floor * scale for floor, scale in zip(plateau.min_lrs, scales)]
        plateau.eps = 0.0


def scheduler_state(scheduler) -> Optional[Dict[str, Any]]:
    """The part of ``scheduler`` a checkpoint keeps (plain numbers: loads with weights_only)."""
    if scheduler is None:
        return None
    if isinstance(scheduler, PlateauLRScheduler):
        return {'plateau': {k: getattr(scheduler.lr_scheduler, k) for k in PLATEAU_COUNTERS}}
    return {}  # step-driven: the position is the checkpoint's global_step


def restore_scheduler(scheduler, state: Optional[Dict[str, Any]], global_step: int) -> None:
    """Put a freshly built ``scheduler`` (this run's shape) at the saved position."""
    if scheduler is None:
        return
    if isinstance(scheduler, PlateauLRScheduler):
        # the decayed lr itself is in the optimizer's param groups, restored with the optimizer
        for k in PLATEAU_COUNTERS:
            setattr(scheduler.lr_scheduler, k, state['plateau'][k])
    else:
        scheduler.step_update(num_updates=global_step)

