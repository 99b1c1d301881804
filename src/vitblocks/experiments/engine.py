"""The training loop: timm's optimizer, scheduler, losses, mixup and EMA around a plain step.

Exact resume: a checkpoint holds the model, optimizer, scheduler, EMA, grad scaler, every
process's RNG states, and the position (epoch, step in epoch, global step, and whether the
evaluation after that step is still owed: a SIGTERM during an evaluation abandons it and saves
the state from before it). Batches and their augmentation are functions of (seed, epoch, step)
(see ``vitblocks.data.loader``), so a run killed at any point and resumed from its last
checkpoint retraces the uninterrupted run exactly on CPU (GPU kernels may add their own
non-determinism).
"""
import json
import math
import os
import random
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.utils import ModelEmaV3, NativeScaler, dispatch_clip_grad
from torch import nn

from ..data import derive_seed
from ..profile import count_params
from .checkpoint import CheckpointError, keep_in_history, rng_state, save_checkpoint, set_rng_state
from .config import ConfigError, TrainConfig, check_resume_config, save_config
from .distributed import (DistInfo, all_reduce_sum, all_reduce_sum_async, barrier, batchnorm_stats, broadcast_object,
                          init_distributed, is_lost_peer, load_batchnorm_stats, sync_batchnorm_stats)
from .evaluate import EvalResult, evaluate
from .interrupt import StopRequest, TrainingInterrupted
from .optim import build_optimizer, schedule_lr
from .resume import auto_resume_checkpoint, load_on_every_rank
from .runlog import (STOP_RECORD, MetricsLog, Progress, process_age_s, remove_stale_temporaries, write_json,
                     write_stop_record)
from .schedule import build_scheduler, restore_scheduler, scheduler_state
from .setup import (check_same_dataset, create_model, dataset_manifest, enable_grad_checkpointing, load_initial_weights,
                    make_loader, model_input_size, model_name, open_train_split, resolve_device,
                    set_cuda_matmul_precision, setup_data)

__all__ = ['train', 'TrainingDiverged', 'LostProcess', 'RunResult', 'default_run_name', 'Trainer']


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


class LostProcess(RuntimeError):
    """Under DDP, another process of the run went away (killed, crashed) and a collective failed; says which
    checkpoint is intact and how to resume."""


@dataclass
class RunResult:
    run_dir: Path
    final: Optional[EvalResult]
    final_ema: Optional[EvalResult]
    best_top1: float
    global_step: int
    epochs_done: float
    seconds: float


def default_run_name(cfg: TrainConfig) -> str:
    data = Path(cfg.data.rstrip('/')).name.split('.')[0] or 'data'
    return '-'.join(p for p in (cfg.model, data, cfg.recipe) if p)


def seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.manual_seed(seed)
    if deterministic:
        if device.type == 'cuda':  # cuBLAS needs this for deterministic matmuls (set before its first use)
            os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    else:  # fastest cuDNN kernels for the run's fixed shapes, once bit-exact repeats are not asked for
        torch.backends.cudnn.benchmark = True


def record_changes(run_dir: Path, step: int, old: Dict[str, Any], cfg: TrainConfig, keys: Sequence[str]) -> None:
    """Append what a resume was asked to change to the run's ``changes.jsonl``: the step it takes effect at, and each
    key's value before and after (the run's config.yaml holds the values in effect now)."""
    line = {'step': step, 'time': time.strftime('%Y-%m-%dT%H:%M:%S'),
            'changes': {k: [old.get(k), getattr(cfg, k)] for k in sorted(keys)}}
    with open(Path(run_dir) / 'changes.jsonl', 'a') as f:
        f.write(json.dumps(line) + '\n')


def new_run_folder_problem(path: Path) -> Optional[str]:
    """Why a new run cannot go to ``path`` (a file there, or a run already), or None. Checked by the command line
    before the data is decoded, and again by the trainer."""
    if path.exists() and not path.is_dir():
        return f'{path} is a file, not a run folder; pick another --name / --output'
    if (path / 'last.pth').exists():
        return (f'{path} already holds a run (last.pth); resume it with --resume {path}, or pick another --name / '
                f'--output')
    if (path / 'results.json').exists():  # a finished run whose checkpoints are gone
        return (f'{path} already holds a finished run (results.json); a new run there would overwrite its results '
                f'and metrics: pick another --name / --output, or remove the folder')
    return None


class Trainer:
    """One run. ``Trainer(cfg, ...).fit()``; the pieces are attributes so benchmarks can time a step."""

    def __init__(self, cfg: TrainConfig, run_dir: Optional[Path] = None, resume: Optional[Path] = None,
                 model: Optional[nn.Module] = None, changed: Sequence[str] = ()):
        self.cfg = cfg
        self.changed = tuple(changed)  # RESUME_ON_REQUEST keys this resume was asked to change
        self._notes = []  # messages for the progress output, printed once it exists
        self._join_processes()
        if resume is None and cfg.resume == 'auto':
            resume = auto_resume_checkpoint(Path(run_dir) if run_dir is not None else
                                            Path(cfg.output) / (cfg.name or default_run_name(cfg)))
        ckpt = load_on_every_rank(resume, cfg)
        if ckpt is not None:
            check_resume_config(cfg, ckpt.get('config', {}), resume, self.changed)
            self._check_global_batch(ckpt, resume)  # before the run folder's config or metrics are touched
        self._build_model(model, fresh=ckpt is None)
        self._build_data(ckpt, resume)
        self._place_model()
        self._build_optimization()
        self._wrap_model()
        self._reset_position()
        self.run_dir = self._make_run_dir(run_dir, resume, ckpt)
        self.log = MetricsLog(self.run_dir, cfg.tensorboard, fresh=ckpt is None) if self.dist.is_main else None
        if ckpt is not None:
            self._restore(ckpt, resume)
            if self.changed and self.dist.is_main:
                record_changes(self.run_dir, self.global_step, ckpt.get('config', {}), cfg, self.changed)
        self.progress = Progress(cfg.progress, self.dist.is_main, self.total_steps, self.global_batch)
        if self.log is not None and self.log.tb_note:
            self.progress.message(self.log.tb_note)
        for note in self._notes:
            self.progress.message(note)

    # --- setup, in the order __init__ runs it ------------------------------------------------------
    def _join_processes(self) -> None:
        """Threads, device, the process group (under torchrun) and this rank's seed."""
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device)
        self.dist: DistInfo = init_distributed(self.device.type, timeout=timedelta(minutes=cfg.dist_timeout_min))
        if self.device.type == 'cuda':
            set_cuda_matmul_precision(cfg.matmul_precision)
            if self.dist.enabled:
                self.device = torch.device('cuda', self.dist.local_rank)
        seed_everything(derive_seed(cfg.seed, self.dist.rank), cfg.deterministic, self.device)

    def _build_model(self, model: Optional[nn.Module], fresh: bool) -> None:
        """The model (given, or built from the config), with grad checkpointing and initial weights."""
        cfg = self.cfg
        if model is None:
            model_name(cfg)  # an unknown name fails now, not after the training split is decoded for its classes
        self.model = model if model is not None else create_model(cfg, cfg.num_classes or self._peek_classes())
        if cfg.grad_checkpointing:
            enable_grad_checkpointing(self.model, cfg.model or type(self.model).__name__)
        if fresh and cfg.initial_checkpoint:
            self._notes.append(load_initial_weights(self.model, cfg.initial_checkpoint))
        self.num_classes = _num_outputs(self.model, cfg)

    def _build_data(self, ckpt: Optional[Dict[str, Any]], resume: Optional[Path]) -> None:
        """Datasets, loaders and the step budget; a resume must find the same dataset and a budget not behind it."""
        cfg = self.cfg
        self.data = setup_data(cfg, self.model, self.num_classes)
        for key in ('data', 'train_url'):  # moved data: only the same dataset (class names, split sizes) resumes
            if ckpt is not None and ckpt.get('config', {}).get(key, getattr(cfg, key)) != getattr(cfg, key):
                check_same_dataset(ckpt.get('dataset'), self.data, ckpt['config'][key], getattr(cfg, key))
        self.train_loader = make_loader(cfg, self.data, True, self.device, self.dist.rank, self.dist.world_size)
        self.val_loader = make_loader(cfg, self.data, False, self.device, self.dist.rank, self.dist.world_size)
        self.steps_per_epoch = len(self.train_loader) // cfg.grad_accum  # optimizer steps
        if not self.steps_per_epoch:
            raise ConfigError(f'grad_accum={cfg.grad_accum} is more than the {len(self.train_loader)} batches of an '
                              f'epoch; lower grad_accum or batch_size')
        total = cfg.epochs * self.steps_per_epoch
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        if ckpt is not None and ckpt.get('global_step', 0) > self.total_steps:  # before config.yaml is rewritten
            raise ConfigError(f'{resume} is at step {ckpt["global_step"]}, past the {self.total_steps} steps of '
                              f'epochs={cfg.epochs}' + (f', max_steps={cfg.max_steps}' if cfg.max_steps else '') +
                              '; a resume cannot go back: give a larger budget, or evaluate the run as it is '
                              '(vitblocks eval)')

    def _place_model(self) -> None:
        """On its device, BatchNorms synchronized across processes (sync_bn), channels-last memory."""
        cfg = self.cfg
        self.model.to(self.device)
        if cfg.sync_bn and self.dist.enabled:
            if self.device.type != 'cuda':
                raise ConfigError(f'sync_bn=true: torch\'s SyncBatchNorm runs on CUDA devices only, this run is on '
                                  f'{self.device}; drop sync_bn (BatchNorm statistics are then averaged across '
                                  f'processes before each evaluation and save, dist_bn=reduce)')
            # every vitblocks BatchNorm converts (TokenBatchNorm wraps a BatchNorm1d on (M, C))
            self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
        if cfg.channels_last:
            self.model.to(memory_format=torch.channels_last)

    def _build_optimization(self) -> None:
        """Learning rate, optimizer, schedule, EMA, mixed precision, mixup and the loss."""
        cfg = self.cfg
        # the recipe's batch is the global batch: per-process micro-batch x processes x accumulation
        self.global_batch = cfg.batch_size * self.dist.world_size * cfg.grad_accum
        self.lr = cfg.lr if cfg.lr is not None else cfg.lr_base * self.global_batch / cfg.lr_base_size
        # timm's weight-decay groups (1-D tensors and biases undecayed, and the names modules keep out), or its
        # layer-wise LR decay groups with the same exclusions (layer_decay)
        self.optimizer = build_optimizer(cfg, self.model, self.lr)
        self.scheduler = build_scheduler(cfg, self.optimizer, self.steps_per_epoch)
        self.ema = ModelEmaV3(self.model, decay=cfg.model_ema_decay, use_warmup=cfg.model_ema_warmup) \
            if cfg.model_ema else None

        self.use_amp = cfg.amp and self.device.type == 'cuda'
        amp_dtype = torch.float16 if cfg.amp_dtype == 'float16' else torch.bfloat16
        self.autocast = (lambda: torch.autocast('cuda', dtype=amp_dtype)) if self.use_amp else nullcontext
        self.scaler = NativeScaler(device='cuda') if self.use_amp and amp_dtype == torch.float16 else None

        self.mixup = None
        if cfg.mixup > 0 or cfg.cutmix > 0:
            self.mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mixup_prob,
                               switch_prob=cfg.mixup_switch_prob, mode=cfg.mixup_mode, label_smoothing=cfg.smoothing,
                               num_classes=self.num_classes)
            self.criterion = SoftTargetCrossEntropy()
        elif cfg.smoothing > 0:
            self.criterion = LabelSmoothingCrossEntropy(cfg.smoothing)
        else:
            self.criterion = nn.CrossEntropyLoss()

    def _wrap_model(self) -> None:
        """``forward_model``: the model under DDP (several processes) and ``torch.compile`` (compile=true)."""
        self.forward_model, self.ddp = self.model, None
        if self.dist.enabled:
            ids = [self.device.index] if self.device.type == 'cuda' else None
            self.forward_model = self.ddp = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        if self.cfg.compile:
            self.forward_model = torch.compile(self.forward_model, mode=self.cfg.compile_mode)
        if self.ddp is not None:
            self._settle_gradient_buckets()

    def _reset_position(self) -> None:
        """Position and history of a fresh run (a resume then restores them from its checkpoint)."""
        self.epoch, self.epoch_step, self.global_step = 0, 0, 0
        self.best_top1, self.best_epoch = -1.0, -1
        self.elapsed_before = 0.0
        self._first_step = None  # the step fit() starts with (its log line says when it was done)
        self._last_loss = float('nan')
        self._window = (0.0, 0)  # (loss sum, steps) since the last metrics row
        self._saved_step = None  # the step last.pth holds (set by save and _restore)
        self._averaged_stats = None  # under DDP: the BatchNorm statistics of the last evaluation or save
        self._stop_vote = None  # under DDP: the sum over the ranks of the last step's stop flag, still in flight
        # a stop during an evaluation saves the state from before it: the evaluation (and, after a completed
        # epoch, the scheduler's epoch step, which plateau takes the evaluation's top-1 for) is then still owed
        self._evaluation_owed, self._scheduler_step_owed = False, False

    # --- setup helpers -----------------------------------------------------------------------------
    def _peek_classes(self) -> int:
        return open_train_split(self.cfg).num_classes

    def _make_run_dir(self, run_dir: Optional[Path], resume: Optional[Path], ckpt) -> Path:
        if resume is not None:
            path = Path(resume).parent if Path(resume).is_file() else Path(resume)
        elif run_dir is not None:
            path = Path(run_dir)
        else:
            path = Path(self.cfg.output) / (self.cfg.name or default_run_name(self.cfg))
        error = None
        if self.dist.is_main:
            error = new_run_folder_problem(path) if resume is None else None
            if error is None:
                try:
                    path.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise ConfigError(f'{path}: cannot create the run folder ({e.strerror or e})') from None
                self._notes += [f'removed {p.name}, left by a write that was killed' for p in
                                remove_stale_temporaries(path)]
                # on resume too: a longer budget or other logging settings are part of the run from now on
                save_config(self.cfg, path / 'config.yaml',
                            header=f'resolved config of run {path.name}\nresume: vitblocks train --resume {path}\n'
                                   f'or:     python -m vitblocks.experiments {path / "config.yaml"} --resume '
                                   f'--run-dir {path}')
        error = broadcast_object(error)  # every rank stops, none waits for the others forever
        if error:
            raise ConfigError(error)
        barrier()
        return path

    def _apply_changes(self, fresh) -> None:
        """Put the asked-for learning rate / weight decay into the restored optimizer (per parameter group, with
        its layer-decay scale as built). Warm-up and the lr floor shape the schedule, which is built from this
        run's config anyway; clipping is read every step."""
        lr, wd = {'lr', 'lr_base'} & set(self.changed), 'weight_decay' in self.changed
        for group, (lr_value, initial, wd_value) in zip(self.optimizer.param_groups, fresh):
            if lr:
                group['lr'] = lr_value
                if initial is not None:
                    group['initial_lr'] = initial
            if wd and wd_value is not None:
                group['weight_decay'] = wd_value

    def _check_global_batch(self, ckpt: Dict[str, Any], path: Path) -> None:
        """A resume must keep the global batch (batch_size x processes x grad_accum): another one would renumber
        the steps, train some samples twice or not at all, and keep a learning rate scaled for the old batch.
        Another number of processes with the same global batch (grad_accum or batch_size adjusted) resumes step
        for step: step b of an epoch covers positions [b*B, (b+1)*B) of its permutation whatever the world size."""
        new = self.cfg.batch_size * self.dist.world_size * self.cfg.grad_accum
        saved = ckpt.get('global_batch', new)
        if saved == new:
            return
        old = ckpt.get('config', {})
        world, saved_world = self.dist.world_size, len(ckpt.get('rng') or [None])
        per_rank = self.cfg.batch_size * world
        keep = f'grad_accum={saved // per_rank}' if saved % per_rank == 0 else f'{saved_world} process(es)'
        raise ConfigError(f'{path} was trained with a global batch of {saved} ({saved_world} process(es) x batch_size '
                          f'{old.get("batch_size", "?")} x grad_accum {old.get("grad_accum", 1)}); this resume has '
                          f'{new} ({world} x {self.cfg.batch_size} x {self.cfg.grad_accum}), which would '
                          f'renumber its steps and samples; resume with {keep} to keep it, or start a new run from '
                          f'its weights (initial_checkpoint={path})')

    def _restore(self, ckpt: Dict[str, Any], path: Path) -> None:
        # the optimizer's settings this run was built with: an explicit change (--change) keeps them over the saved
        fresh = [(g['lr'], g.get('initial_lr'), g.get('weight_decay')) for g in self.optimizer.param_groups]
        try:
            self.model.load_state_dict(ckpt['model'])
            self.optimizer.load_state_dict(ckpt['optimizer'])
            self._apply_changes(fresh)
            if self.ema is not None:
                self.ema.module.load_state_dict(ckpt['model_ema'])
            if self.scaler is not None and ckpt.get('scaler') is not None:
                self.scaler.load_state_dict(ckpt['scaler'])
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f'{path}: does not fit this model/config ({type(e).__name__}: '
                                  f'{str(e).splitlines()[0][:300]})') from None
        self.epoch, self.epoch_step, self.global_step = ckpt['epoch'], ckpt['epoch_step'], ckpt['global_step']
        self._saved_step = self.global_step
        self.best_top1, self.best_epoch = ckpt.get('best_top1', -1.0), ckpt.get('best_epoch', -1)
        self.elapsed_before = ckpt.get('elapsed_s', 0.0)
        self._window = tuple(ckpt.get('log_window', (0.0, 0)))
        # checkpoints written before these fields were saved after their evaluation: nothing is owed
        self._evaluation_owed = bool(ckpt.get('evaluation_owed', False))
        self._scheduler_step_owed = bool(ckpt.get('scheduler_step_owed', False))
        states = ckpt['rng']
        own_stats = ckpt.get('rank_batchnorm_stats')
        if own_stats is not None and len(own_stats) == self.dist.world_size:  # else: the averaged statistics
            self._load_batchnorm_stats(own_stats[self.dist.rank])
        if self.log is not None:  # rows a killed attempt wrote after this checkpoint are recomputed (saved steps)
            self.log.truncate_after(self.global_step)
        if self.dist.rank < len(states):
            set_rng_state(states[self.dist.rank])
        else:  # a process the saved run did not have: a fresh seed of its own
            seed_everything(derive_seed(self.cfg.seed, self.dist.rank, self.global_step), self.cfg.deterministic,
                            self.device)
        # the schedule's shape comes from this run's config (a changed epochs count lengthens it, instead of
        # the added epochs running at min_lr); its state (the step, plateau's counters) from the checkpoint
        restore_scheduler(self.scheduler, ckpt.get('scheduler'), self.global_step)
        if self.cfg.streaming and self.epoch_step:
            self._notes.append(f'streaming: resumed at step {self.epoch_step} of epoch {self.epoch}, which restarts '
                               f'from the beginning of its stream for its {self.steps_per_epoch - self.epoch_step} '
                               f'remaining steps (a stream cannot start in its middle)')

    # --- checkpoints -------------------------------------------------------------------------------
    def _state(self, own_batchnorm_stats: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        states, stats = [rng_state()], None
        if self.dist.enabled:
            states = [None] * self.dist.world_size
            dist.all_gather_object(states, rng_state())
        if own_batchnorm_stats is not None:
            stats = [None] * self.dist.world_size
            dist.all_gather_object(stats, own_batchnorm_stats)
        return {
            'model': self.model.state_dict(), 'optimizer': self.optimizer.state_dict(),
            'scheduler': scheduler_state(self.scheduler),
            'model_ema': self.ema.module.state_dict() if self.ema is not None else None,
            'scaler': self.scaler.state_dict() if self.scaler is not None else None,
            'rng': states, 'rank_batchnorm_stats': stats, 'global_batch': self.global_batch,
            'epoch': self.epoch, 'epoch_step': self.epoch_step, 'global_step': self.global_step,
            'best_top1': self.best_top1, 'best_epoch': self.best_epoch, 'elapsed_s': self._elapsed(),
            'log_window': list(self._window),
            'evaluation_owed': self._evaluation_owed, 'scheduler_step_owed': self._scheduler_step_owed,
            'config': self.cfg.to_dict(), 'num_classes': self.num_classes, 'classes': list(self.data.train.classes),
            'input_size': list(self.data.input_size), 'mean': list(self.data.mean), 'std': list(self.data.std),
            'dataset': dataset_manifest(self.data),
        }

    def save(self, name: str = 'last.pth', state: Optional[Dict[str, Any]] = None) -> None:
        with self._averaged_batchnorm_stats() if state is None else nullcontext() as own:
            state = state or self._state(own)  # every rank takes part (RNG gather); rank 0 writes
            if self.dist.is_main:
                save_checkpoint(state, self.run_dir / name)
                if name == 'last.pth' and self.cfg.checkpoint_hist:
                    keep_in_history(self.run_dir, self.global_step, self.cfg.checkpoint_hist)
        if name == 'last.pth':
            self._saved_step = self.global_step

    def _elapsed(self) -> float:
        return self.elapsed_before + (time.perf_counter() - self._t0 if hasattr(self, '_t0') else 0.0)

    # --- the loop ----------------------------------------------------------------------------------
    def _diverged(self, loss_value: float, where: str) -> TrainingDiverged:
        last = self.run_dir / 'last.pth'
        keep = f'the last good checkpoint is {last}' if last.exists() else 'no checkpoint was saved yet'
        again = (f' (to continue this run with one: vitblocks train --resume {self.run_dir} --change KEY=VALUE, '
                 f'e.g. --change lr={self.lr / 2:g})') if last.exists() else ''
        return TrainingDiverged(f'loss is {loss_value} at {where}; stopped; {keep}. Try: '
                                + '; '.join(self._divergence_remedies()) + again)

    def _divergence_remedies(self) -> list:
        """What may keep a run from diverging, naming only what is not in effect already."""
        cfg = self.cfg
        remedies = [f'a lower learning rate (now {self.lr:g})']
        if not cfg.warmup_epochs:  # sched=none has nothing to warm up to: a constant lr after the warm-up
            remedies.append('warm-up (warmup_epochs=5)' if cfg.sched != 'none' else
                            'warm-up (warmup_epochs=5 sched=step decay_rate=1: the same constant lr after it)')
        if cfg.clip_grad is None:
            remedies.append('gradient clipping (clip_grad=1.0)')
        if self.scaler is not None:  # float16 autocast
            remedies.append('amp_dtype=bfloat16 (the range of fp32)')
        elif self.use_amp:  # bfloat16 autocast
            remedies.append('amp=false (full fp32)')
        return remedies

    def _settle_gradient_buckets(self) -> None:
        """Give DDP its final gradient buckets before the first step of every start, fresh or resumed.

        DDP's first backward all-reduces all gradients as one bucket in parameter order, then re-buckets them
        in the order backward produced them. Over 3 or more processes an element's sum depends on its place
        in its bucket (a ring all-reduce adds in a rank order that varies with the place; (a + b) + c differs
        from a + (b + c) in floating point), so a resumed run, whose first step went through the one bucket
        again, drifted from an uninterrupted one (max weight difference 1.7e-5 after 24 steps on 3 gloo
        processes). One backward of a zero loss on a blank batch fixes the buckets; the parameters, buffers
        (BatchNorm statistics), gradients and random states are left as they were."""
        buffers = {name: b.clone() for name, b in self.model.named_buffers()}
        state = rng_state()
        x = torch.zeros((2, *model_input_size(self.model, self.cfg)), device=self.device)
        if self.cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with self.autocast():
            out = self.forward_model(x)
        outputs = out if isinstance(out, (tuple, list)) else (out,)  # a distilled model trains on two heads
        (sum(o.float().sum() for o in outputs) * 0).backward()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in self.model.named_buffers():
                b.copy_(buffers[name])
        set_rng_state(state)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on one batch; returns the (detached) loss."""
        return self.accumulate_step([(x, y)])

    def accumulate_step(self, batches) -> torch.Tensor:
        """One optimizer step on ``grad_accum`` micro-batches ``[(x, y), ...]``: their gradients are
        averaged, as for one batch that holds them all; under DDP only the last backward all-reduces
        (``no_sync`` before). Returns the mean (detached) loss."""
        cfg, n = self.cfg, len(batches)
        self.optimizer.zero_grad(set_to_none=True)
        total = None
        for i, (x, y) in enumerate(batches):
            last = i == n - 1
            with self.ddp.no_sync() if self.ddp is not None and not last else nullcontext():
                if self.mixup is not None:
                    x, y = self.mixup(x, y)
                if cfg.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                with self.autocast():
                    loss = self.criterion(self.forward_model(x), y)
                # free on CPU: check before the update (one process; under DDP all ranks decide together, later)
                if self.device.type == 'cpu' and not self.dist.enabled and not math.isfinite(loss.item()):
                    raise self._diverged(loss.item(), f'step {self.global_step + 1}')
                if self.scaler is not None:
                    self.scaler(loss / n, self.optimizer, clip_grad=cfg.clip_grad, clip_mode=cfg.clip_mode,
                                parameters=self.model.parameters(), need_update=last)
                else:
                    (loss / n).backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.scaler is None:
            if cfg.clip_grad is not None:
                dispatch_clip_grad(self.model.parameters(), cfg.clip_grad, mode=cfg.clip_mode)
            self.optimizer.step()
        self.global_step += 1
        self.epoch_step += 1
        if self.ema is not None:
            self.ema.update(self.model, step=self.global_step)
        if self.scheduler is not None:
            self.scheduler.step_update(num_updates=self.global_step)
        return total / n

    def fit(self) -> RunResult:
        cfg = self.cfg
        self._t0 = time.perf_counter()
        self._first_step = self.global_step + 1
        final = final_ema = None
        if self.dist.is_main:
            self.progress.message(f'run {self.run_dir}: {cfg.model} ({count_params(self.model) / 1e6:.2f} M params) on '
                                  f'{self.data.train.describe()}; {self.steps_per_epoch} steps/epoch x {cfg.epochs} '
                                  f'epochs, batch {self.global_batch}, {self.data.pipeline} pipeline, {self.device}'
                                  + (f', from step {self.global_step}' if self.global_step else '')
                                  + (f', set up {age:.0f} s after the process started'
                                     if (age := process_age_s()) is not None else ''))
            (self.run_dir / STOP_RECORD).unlink(missing_ok=True)  # this attempt replaces an earlier one's record
        try:
            with StopRequest() as self._stop:
                if self._evaluation_owed:  # saved by a stop during an evaluation: that evaluation comes first
                    final, final_ema = self._close_epoch(True, self._scheduler_step_owed)
                elif self._scheduler_step_owed:  # best.pth: saved by the evaluation that made it, the best top-1
                    self.scheduler.step(self.epoch, self.best_top1)
                    self._scheduler_step_owed = False
                while not self._budget_spent():
                    final, final_ema = self._run_epoch()
                if final is None:  # resumed at the very end: evaluated again for results.json
                    final, final_ema = self._evaluate_or_stop(epoch_done=False)
            if self._stop_vote is not None:  # every rank started it: let it finish before the group is torn down
                self._stop_vote.result()
                self._stop_vote = None
        except Exception as e:
            if self.dist.enabled and is_lost_peer(e):  # gloo's or NCCL's message names no run, step or checkpoint
                e = self._lost_process(e)
            if self.dist.is_main:
                self._record_stop(e)
            if isinstance(e, LostProcess):
                raise e from None
            raise
        if self._averaged_stats is not None:  # the trained model, as its last checkpoint has it
            self._load_batchnorm_stats(self._averaged_stats)
        barrier()
        if self.dist.is_main:
            self._write_results(final, final_ema)
            self.log.close()
        return RunResult(self.run_dir, final, final_ema, self.best_top1, self.global_step,
                         self.global_step / self.steps_per_epoch, self._elapsed())

    def _lost_process(self, error: Exception) -> LostProcess:
        last = self.run_dir / 'last.pth'
        step = f' (step {self._saved_step})' if self._saved_step is not None else ''
        saved = (f'{last}{step} is intact; resume with: vitblocks train --resume {self.run_dir} '
                 f'(resume=auto continues it under torchrun --max-restarts)' if last.exists() else
                 'no checkpoint was saved yet')
        detail = (str(error).splitlines() or [type(error).__name__])[0][:300]
        return LostProcess(f'rank {self.dist.rank} of {self.dist.world_size}: another process of this run went away '
                           f'(killed or crashed: its own log and torchrun\'s summary say why) during step '
                           f'{self.global_step + 1}; {saved} [{type(error).__name__}: {detail}]')

    def _record_stop(self, error: Exception) -> None:
        """Write ``stopped.json``: why this run stopped, where, and which checkpoint it can go on from."""
        reason = {TrainingDiverged: 'diverged', TrainingInterrupted: 'interrupted'}.get(type(error), 'error')
        last = self.run_dir / 'last.pth'
        fields = {'global_step': self.global_step, 'epoch': round(self._epoch_float(), 4),
                  'checkpoint': last.name if last.exists() else None}
        if reason == 'interrupted':
            fields['signal'] = error.signal_name
        elif reason == 'error':
            fields['error'] = type(error).__name__
        try:
            write_stop_record(self.run_dir, reason, (str(error).splitlines() or [''])[0][:2000], **fields)
        except OSError:  # a full disk must not hide the error that stopped the run
            pass

    def _run_epoch(self):
        cfg = self.cfg
        self.forward_model.train()
        self.progress.start_epoch(self.epoch, cfg.epochs, self.epoch_step, self.steps_per_epoch)
        # the loss average of the current log window survives a resume, so metric rows match too
        self._loss_sum = torch.tensor(self._window[0], device=self.device)
        self._loss_n = self._window[1]
        accum, micro = cfg.grad_accum, []
        for x, y in self.train_loader.epoch(self.epoch, self.epoch_step * accum):
            micro.append((x, y))
            if len(micro) < accum:
                continue
            self.after_step(self.accumulate_step(micro))
            micro = []
            if self.global_step >= self.total_steps or self.epoch_step == self.steps_per_epoch:
                break  # the batches left over by accumulation are dropped, like an incomplete last batch
        self.progress.end_epoch()
        self._sync_window()
        done_epoch = self.epoch_step == self.steps_per_epoch
        if done_epoch:
            self.epoch, self.epoch_step = self.epoch + 1, 0
        due = (done_epoch and self.epoch % cfg.eval_interval == 0) or self._budget_spent()
        return self._close_epoch(due, done_epoch)

    def _budget_spent(self) -> bool:
        return self.epoch >= self.cfg.epochs or self.global_step >= self.total_steps

    def _close_epoch(self, evaluation_due: bool, epoch_done: bool):
        """What follows the last step of an epoch or of the run: the evaluation if due, the scheduler's epoch
        step, ``last.pth``. A run resumed from a checkpoint saved during the evaluation starts here."""
        evaluated = self._evaluate_or_stop(epoch_done) if evaluation_due else (None, None)
        if epoch_done and self.scheduler is not None:
            # per-update schedules ignore this; plateau counts a completed epoch's top-1 (None: not evaluated)
            self.scheduler.step(self.epoch, evaluated[0].top1 if evaluated[0] is not None else None)
        self._scheduler_step_owed = False
        self.save()
        # a signal that came during the save (or the evaluation's last batches) stops here, not a step later (the
        # run, if not done)
        if not self._budget_spent() and self._stop_requested(now=True):
            raise self._interrupted()
        return evaluated

    def _evaluate_or_stop(self, epoch_done: bool):
        """``_evaluate()``, abandoned if a stop is requested during it: ``last.pth`` then holds the state from before
        the evaluation (RNG states included), which it records as owed, with the scheduler's step of a completed
        epoch, and TrainingInterrupted is raised. Nothing of the evaluation is logged or saved before it ends."""
        rng = rng_state()
        # best.pth, saved at the evaluation's end, is past it (as an uninterrupted run's) but before the scheduler's
        # step for a completed epoch, which it records as owed; last.pth on disk still owes the evaluation until the
        # save after it
        self._evaluation_owed, self._scheduler_step_owed = False, epoch_done and self.scheduler is not None
        evaluated = self._evaluate(stop=self._stop_requested)
        if evaluated is not None:
            return evaluated
        set_rng_state(rng)
        self._evaluation_owed, self._scheduler_step_owed = True, epoch_done
        self.save()
        raise self._interrupted()

    def after_step(self, loss: torch.Tensor) -> None:
        """Bookkeeping after each optimizer step: loss window, metrics row, progress, interval checkpoint."""
        cfg = self.cfg
        self._loss_sum += loss
        self._loss_n += 1
        lr = schedule_lr(self.optimizer)  # the head's lr under layer_decay (group 0 may be the stem's)
        last_in_epoch = self.epoch_step == self.steps_per_epoch
        if self.global_step % cfg.log_interval == 0 or last_in_epoch or self.global_step == self.total_steps:
            avg = (self._mean_over_ranks(self._loss_sum) / self._loss_n).item()  # the same on every rank
            if not math.isfinite(avg):
                raise self._diverged(avg, f'steps {self.global_step - self._loss_n + 1}..{self.global_step}')
            rate = self.progress.log_line(self.global_step, self._epoch_float(), avg, lr)
            if self.log is not None:
                self.log.write(self.global_step, self._epoch_float(), 'train', loss=avg, lr=lr, images_per_s=rate,
                               elapsed_s=self._elapsed())
            self._loss_sum.zero_()
            self._loss_n = 0
            self._last_loss = avg
        self.progress.update(self.global_step, self.epoch_step, self._running_loss, lr)
        if self.global_step == self._first_step and self.dist.is_main and (age := process_age_s()) is not None:
            self.progress.message(f'first step of this process (step {self.global_step}) done '
                                  f'{age:.0f} s after it started (compiling included)')
        if self._stop_requested():
            self.progress.end_epoch()
            self._sync_window()
            self.save()
            raise self._interrupted()
        if cfg.checkpoint_interval and self.global_step % cfg.checkpoint_interval == 0 and not last_in_epoch:
            self._sync_window()
            self.save()

    def _interrupted(self) -> TrainingInterrupted:
        return TrainingInterrupted(self._stop.signal_name or 'a signal to another process', self.global_step,
                                   self.run_dir, evaluation_owed=self._evaluation_owed)

    def _stop_requested(self, now: bool = False) -> bool:
        """A SIGINT/SIGTERM arrived, on any rank under DDP. Checked after every optimizer step and every evaluation
        batch: a cluster gives a preempted job a grace period (torchrun waits 30 s for its workers, SLURM's KillWait
        is 30 s by default) and the checkpoint must be written within it. Under DDP every rank must stop at the same
        step (or batch): each call's flag is summed over the ranks asynchronously and read at the next call, once
        the next step is queued (``now``: read the current one too, waiting for it); on a GPU reading it waits for
        the vote's own event, not for the step queued after it (``PendingSum``). One chain of votes runs through
        steps and evaluation batches alike; every rank makes the same calls in the same order."""
        stop = getattr(self, '_stop', None)
        if stop is None:
            return False
        flag = stop.signal_name is not None
        if not self.dist.enabled:
            return flag
        previous = self._stop_vote
        # torch.full fills on the device; torch.tensor([flag], device=cuda) would copy from pageable host memory,
        # which waits for the whole queued step (a device sync per step)
        self._stop_vote = all_reduce_sum_async(torch.full((1,), float(flag), device=self.device))
        requested = previous is not None and previous.result() > 0
        if now:
            requested = self._stop_vote.result() > 0 or requested
            self._stop_vote = None
        return requested

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any (so all processes stop together)."""
        if not self.dist.enabled:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        return bool(all_reduce_sum(t).item() > 0)

    def _running_loss(self) -> float:
        """Mean loss of the current log window (the last logged mean right after a row)."""
        return float(self._loss_sum) / self._loss_n if self._loss_n else self._last_loss

    def _mean_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` averaged over the processes (a new tensor; ``t`` itself in one process)."""
        return all_reduce_sum(t.clone()) / self.dist.world_size if self.dist.enabled else t

    def _sync_window(self) -> None:
        """Check the window's losses are finite (one device sync) and keep them for the checkpoint. Under DDP the
        window's loss sum becomes the mean of the ranks' sums on every rank (rows then log the mean loss of all
        ranks' images, and the checkpoint, which holds rank 0's window, holds everyone's)."""
        self._loss_sum = self._mean_over_ranks(self._loss_sum)
        if self._loss_n > 0 and not math.isfinite(float(self._loss_sum)):
            raise self._diverged(float(self._loss_sum),
                                 f'steps {self.global_step - self._loss_n + 1}..{self.global_step}')
        self._window = (float(self._loss_sum), self._loss_n)

    def _epoch_float(self) -> float:
        return self.global_step / self.steps_per_epoch

    @contextmanager
    def _averaged_batchnorm_stats(self):
        """Within: every rank's BatchNorm running statistics made equal (``dist_bn``), for an evaluation or a
        save. Yields this rank's own statistics from before (model and EMA), or None where there is nothing to
        average (one process, sync_bn, dist_bn=none, no BatchNorm). After: each rank's own again, so where a run
        evaluates or saves does not change its training, and a resumed run, which restores them from the
        checkpoint, goes on as an uninterrupted one (the averaging is not linear in them: DDP broadcasts rank
        0's buffers before every forward)."""
        own = None
        if self.dist.enabled and not self.cfg.sync_bn and self.cfg.dist_bn != 'none':
            own = self._batchnorm_stats()
            own = own if own['model'] or own['model_ema'] else None
        self._sync_batchnorm_stats()
        if own is not None:
            self._averaged_stats = self._batchnorm_stats()
        try:
            yield own
        finally:
            if own is not None:
                self._load_batchnorm_stats(own)

    def _batchnorm_stats(self) -> Dict[str, Any]:
        """CPU copies of the BatchNorm running statistics of the model and of its EMA."""
        return {'model': batchnorm_stats(self.model),
                'model_ema': batchnorm_stats(self.ema.module) if self.ema is not None else {}}

    def _load_batchnorm_stats(self, stats: Dict[str, Any]) -> None:
        load_batchnorm_stats(self.model, stats['model'])
        if self.ema is not None:
            load_batchnorm_stats(self.ema.module, stats['model_ema'])

    def _sync_batchnorm_stats(self) -> None:
        """Every rank's BatchNorm running statistics made equal (``dist_bn``) before an evaluation or a save: the
        model's, and the EMA's, which average each rank's own statistics between two syncs (timm's train.py
        distributes both)."""
        mode = 'none' if self.cfg.sync_bn else self.cfg.dist_bn
        sync_batchnorm_stats(self.model, mode)
        if self.ema is not None:
            sync_batchnorm_stats(self.ema.module, mode)

    def _evaluate(self, stop: Callable[[], bool]):
        """The model's and the EMA's evaluation, logged (best.pth on a new best top-1); None, with nothing logged or
        saved, if ``stop`` ended either early (only ``_evaluate_or_stop`` calls it)."""
        res_ema = None
        with self._averaged_batchnorm_stats():
            res = evaluate(self.model, self.val_loader, self.num_classes, self.device, autocast=self.autocast(),
                           progress=self.progress.mode, stop=stop)
            if res is not None and self.ema is not None:
                res_ema = evaluate(self.ema.module, self.val_loader, self.num_classes, self.device,
                                   autocast=self.autocast(), progress=self.progress.mode, stop=stop)
        if res is None or (self.ema is not None and res_ema is None):
            return None
        for which, r in (('', res), ('EMA ', res_ema)):
            # checked before anything is saved: NaN weights must not replace last.pth or best.pth
            if r is not None and self._any_rank(not math.isfinite(r.loss)):
                raise self._diverged(r.loss, f'the {which}evaluation after step {self.global_step} (evaluation loss)')
        if self.log is not None:
            for split, r in (('val', res), ('val_ema', res_ema)):
                if r is not None:
                    self.log.write(self.global_step, self._epoch_float(), split, loss=r.loss, top1=r.top1, top5=r.top5,
                                   images_per_s=r.images_per_s, elapsed_s=self._elapsed())
        self.progress.message(f'eval at step {self.global_step} (epoch {self._epoch_float():.2f}): '
                              f'top-1 {res.top1:.2f}% '
                              f'top-5 {res.top5:.2f}% loss {res.loss:.4f}'
                              + (f'; EMA top-1 {res_ema.top1:.2f}%' if res_ema else ''))
        if res.top1 > self.best_top1:
            self.best_top1, self.best_epoch = res.top1, self.epoch
            self.save('best.pth')
        return res, res_ema

    def _write_results(self, final: EvalResult, final_ema: Optional[EvalResult]) -> None:
        out = {'model': self.cfg.model, 'data': self.cfg.data, 'val_split': self.data.val_split,
               'recipe': self.cfg.recipe, 'params': count_params(self.model), 'global_step': self.global_step,
               'epochs': self.global_step / self.steps_per_epoch, 'seconds': self._elapsed(),
               'best_top1': self.best_top1, 'classes': list(self.data.train.classes),
               'final': final.to_dict() if final else None, 'final_ema': final_ema.to_dict() if final_ema else None}
        write_json(self.run_dir / 'results.json', out)


def _num_outputs(model: nn.Module, cfg: TrainConfig) -> int:
    head = model.get_classifier() if hasattr(model, 'get_classifier') else None
    n = getattr(head, 'out_features', None) or getattr(model, 'num_classes', None)
    if not n:
        raise ConfigError(f'{cfg.model}: cannot tell how many classes the model outputs (no get_classifier())')
    return int(n)


def train(cfg: TrainConfig, run_dir: Optional[Path] = None, resume: Optional[Path] = None,
          model: Optional[nn.Module] = None, changed: Sequence[str] = ()) -> RunResult:
    """Train ``cfg`` (optionally on a given ``model`` instance); see ``Trainer``. ``changed``: the optimisation
    settings (``RESUME_ON_REQUEST``) a resume was asked to take from ``cfg`` instead of the checkpoint's."""
    if resume is not None:
        resume = Path(resume)
        if resume.is_dir():
            resume = resume / 'last.pth'
    return Trainer(cfg, run_dir=run_dir, resume=resume, model=model, changed=changed).fit()
