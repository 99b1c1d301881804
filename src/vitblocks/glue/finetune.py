"""Fine-tune a Hugging Face sequence classifier on a GLUE task's TSV files, resumable like ``vitblocks train``.

A run folder holds ``config.yaml``, ``tokenizer/`` (the tokenizer the run uses, so a resume never needs the
original), ``last.pth`` / ``best.pth`` (atomic writes, a digest of their contents checked on load), ``metrics.csv``
(a train row every ``log_interval`` steps, a row per dev file and evaluation), ``results.json`` and, at the end,
``model/`` (the final weights and tokenizer, loadable with ``from_pretrained``).

Exact resume: the checkpoint holds the model, AdamW, the schedule, the RNG state (dropout) and the position. The
batches of an epoch are a permutation seeded by (seed, epoch) (``vitblocks.data.loader.EpochOrder``; the last
incomplete batch is dropped), so a run stopped at any step and resumed lands on the weights of an uninterrupted
one on the CPU. SIGINT / SIGTERM save ``last.pth`` at the next step (or abandon an evaluation, which the resumed
run does first) and raise ``TrainingInterrupted`` naming the command that resumes.
"""
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from ..data.loader import EpochOrder
from ..experiments.checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from ..experiments.config import ConfigError
from ..experiments.engine import TrainingDiverged, new_run_folder_problem, seed_everything
from ..experiments.interrupt import StopRequest, TrainingInterrupted
from ..experiments.runlog import (STOP_RECORD, MetricsLog, Progress, remove_stale_temporaries, write_json,
                                  write_stop_record)
from ..experiments.setup import resolve_device
from .config import GlueConfig, check_glue_config, save_glue_config
from .metrics import METRIC_NAMES, task_metrics
from .swap import apply_swap, save_model
from .tasks import GlueDataError, GlueSplit, file_digest, get_task, read_task
from .text_models import build_model, check_model_source, has_weights, load_tokenizer, model_config, train_wordpiece

__all__ = ['GlueRun', 'GlueResult', 'fine_tune', 'GLUE_COLUMNS']

GLUE_COLUMNS = ['step', 'epoch', 'split', 'loss', 'accuracy', 'matthews', 'lr', 'examples_per_s', 'elapsed_s']
COMMAND = 'vitblocks glue'


@dataclass
class GlueResult:
    run_dir: Path
    metric: str  # 'matthews' or 'accuracy'
    final: Dict[str, Dict[str, float]]  # dev file stem -> {'loss', 'accuracy', 'matthews'}
    best: float  # the best metric on the first dev file
    best_step: int
    global_step: int
    epochs_done: float
    seconds: float


@dataclass
class Encoded:
    """A split's token ids (and segment ids where the model takes them), one list per example."""
    input_ids: List[List[int]]
    token_type_ids: Optional[List[List[int]]]
    labels: torch.Tensor


class GlueRun:
    """One fine-tuning run in ``run_dir``: ``GlueRun(cfg, run_dir).fit()``; ``resume=True`` continues it."""

    def __init__(self, cfg: GlueConfig, run_dir: Path, resume: bool = False):
        check_glue_config(cfg)
        self.cfg, self.run_dir, self.task = cfg, Path(run_dir), get_task(cfg.task)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        try:
            self.device = resolve_device(cfg.device)
        except RuntimeError as e:  # torch.device('tpu')
            raise ConfigError(f'device={cfg.device!r}: {e}') from None
        check_model_source(cfg.model)
        ckpt = load_checkpoint(self.run_dir / 'last.pth') if resume else None
        if ckpt is None:
            problem = new_run_folder_problem(self.run_dir)
            if problem:
                raise ConfigError(problem)
        self.train_split, self.dev_splits = read_task(self.task, Path(cfg.data), cfg.max_examples)
        if len(self.train_split) < cfg.batch_size:  # an epoch drops its last incomplete batch
            raise ConfigError(f'{self.train_split.path}: {len(self.train_split)} examples are fewer than one batch of '
                              f'{cfg.batch_size}; lower --batch-size')
        self.digests = {s.path.name: file_digest(s.path) for s in (self.train_split, *self.dev_splits.values())}
        if ckpt is not None:
            self._check_same_files(ckpt)
        self.notes = []
        seed_everything(cfg.seed, True, self.device)
        self.tokenizer = self._tokenizer(ckpt)
        self.model = self._model(ckpt)
        self.model.to(self.device)
        self.use_segments = getattr(self.model.config, 'type_vocab_size', 0) > 1  # BERT's segment embedding
        self.train_data = self._encode(self.train_split)
        self.dev_data = {name: self._encode(split) for name, split in self.dev_splits.items()}
        self.order = EpochOrder(len(self.train_split), cfg.batch_size, seed=cfg.seed)
        self.steps_per_epoch = self.order.batches_per_epoch
        self.schedule_steps = cfg.epochs * self.steps_per_epoch
        self.total_steps = min(self.schedule_steps, cfg.max_steps) if cfg.max_steps else self.schedule_steps
        self._build_optimization()
        self.epoch = self.epoch_step = self.global_step = 0
        self.best, self.best_step = -math.inf, -1
        self.elapsed_before, self.window = 0.0, [0.0, 0]  # window: (loss sum, steps) since the last train row
        self.evaluation_owed = False
        # the folder is written once everything above has been checked and built
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.notes += [f'removed {p.name}, left by a write that was killed' for p in
                       remove_stale_temporaries(self.run_dir)]
        if ckpt is None:
            self.tokenizer.save_pretrained(str(self.run_dir / 'tokenizer'))
        save_glue_config(cfg, self.run_dir / 'config.yaml')
        self.log = MetricsLog(self.run_dir, tensorboard=False, fresh=ckpt is None, columns=GLUE_COLUMNS)
        if ckpt is not None:
            self._restore(ckpt)
        self.progress = Progress(cfg.progress, True, self.total_steps, cfg.batch_size, unit='ex')

    # --- setup -------------------------------------------------------------------------------------
    def _check_same_files(self, ckpt: Dict[str, Any]) -> None:
        saved = ckpt.get('data_digests', {})
        for name, digest in self.digests.items():
            if name in saved and saved[name] != digest:
                raise GlueDataError(f'{Path(self.cfg.data) / name} is not the file this run was trained on (its '
                                    f'SHA-256 differs from the one in {self.run_dir / "last.pth"}); resume with the '
                                    f'original files, or start a new run')

    def _tokenizer(self, ckpt):
        """The run's tokenizer (saved in the run folder, which a resume reads)."""
        cfg = self.cfg
        if ckpt is not None:
            return load_tokenizer(self.run_dir / 'tokenizer', flag='the run\'s tokenizer')
        if cfg.tokenizer:
            tokenizer = load_tokenizer(Path(cfg.tokenizer))
        elif cfg.train_tokenizer:
            if Path(cfg.model).is_dir() and has_weights(Path(cfg.model)):
                raise ConfigError(f'--model {cfg.model} holds pretrained weights, whose embedding belongs to its own '
                                  f'tokenizer; drop --train-tokenizer (the folder\'s tokenizer is used) or give '
                                  f'--tokenizer')
            texts = (text for example in self.train_split.texts for text in example)
            tokenizer = train_wordpiece(texts, cfg.train_tokenizer)
            self.notes.append(f'trained a WordPiece tokenizer of {len(tokenizer)} tokens on '
                              f'{self.train_split.path.name}')
        elif Path(cfg.model).is_dir() and (Path(cfg.model) / 'tokenizer_config.json').is_file():
            tokenizer = load_tokenizer(Path(cfg.model), flag='--model')
        else:
            raise ConfigError(f'--model {cfg.model} brings no tokenizer; give --tokenizer PATH (a local tokenizer '
                              f'folder or tokenizer.json) or --train-tokenizer VOCAB_SIZE (trained on the task\'s '
                              f'text)')
        return tokenizer

    def _model(self, ckpt):
        cfg = self.cfg
        if ckpt is None:
            config, pretrained = model_config(cfg.model, self.task.num_labels, self.task.labels, cfg.model_args,
                                              self.tokenizer)
            self._check_length(config)
            if cfg.warm_start and not pretrained:
                raise ConfigError(f'--warm-start copies pretrained FFN weights, but --model {cfg.model} is randomly '
                                  f'initialized (no weights there); give a pretrained model folder or drop '
                                  f'--warm-start')
            model = build_model(config, Path(cfg.model) if pretrained else None)
            self.pretrained = pretrained
            self.model_config = config.to_json_string()
        else:
            from transformers import AutoConfig
            saved = json.loads(ckpt['model_config'])
            config = AutoConfig.for_model(saved.pop('model_type'), **saved)
            model = build_model(config)
            self.pretrained, self.model_config = ckpt.get('pretrained', False), ckpt['model_config']
        # a resumed run's weights come from its checkpoint: no warm start to redo
        self.swapped = apply_swap(model, cfg.ffn, cfg.block_cfg, cfg.warm_start and ckpt is None) if cfg.ffn else 0
        if ckpt is not None:
            try:
                model.load_state_dict(ckpt['model'])
            except RuntimeError as e:
                raise CheckpointError(f'{self.run_dir / "last.pth"}: does not fit the model of config.yaml '
                                      f'({" ".join(str(e).split())[:300]})') from None
        return model

    def _check_length(self, config) -> None:
        limit = getattr(config, 'max_position_embeddings', None) or getattr(config, 'n_positions', None)
        if limit is not None and self.cfg.max_length > limit:
            raise ConfigError(f'--max-length {self.cfg.max_length}: the model has {limit} positions; use at most '
                              f'{limit}')

    def _encode(self, split: GlueSplit) -> Encoded:
        first = [t[0] for t in split.texts]
        second = [t[1] for t in split.texts] if len(split.texts[0]) > 1 else None
        enc = self.tokenizer(first, second, truncation=True, max_length=self.cfg.max_length)
        types = enc.get('token_type_ids') if self.use_segments else None
        return Encoded(enc['input_ids'], types, torch.tensor(split.labels))

    def _build_optimization(self) -> None:
        from transformers import get_linear_schedule_with_warmup
        cfg = self.cfg
        decay = [p for p in self.model.parameters() if p.ndim > 1]  # biases and norm weights are not decayed
        no_decay = [p for p in self.model.parameters() if p.ndim <= 1]
        self.optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': cfg.weight_decay},
                                            {'params': no_decay, 'weight_decay': 0.0}], lr=cfg.lr)
        warmup = round(cfg.warmup_ratio * self.schedule_steps)
        self.scheduler = get_linear_schedule_with_warmup(self.optimizer, warmup, self.schedule_steps)

    def _restore(self, ckpt: Dict[str, Any]) -> None:
        path = self.run_dir / 'last.pth'
        if ckpt['global_step'] > self.total_steps:
            raise ConfigError(f'{path} is at step {ckpt["global_step"]}, past the {self.total_steps} steps of '
                              f'this budget; a resume cannot go back: give more --epochs or --max-steps')
        try:
            self.optimizer.load_state_dict(ckpt['optimizer'])
            self.scheduler.load_state_dict(ckpt['scheduler'])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f'{path}: does not fit this run ({type(e).__name__}: {str(e)[:200]})') from None
        self.epoch, self.epoch_step, self.global_step = ckpt['epoch'], ckpt['epoch_step'], ckpt['global_step']
        self.best, self.best_step = ckpt['best'], ckpt['best_step']
        self.elapsed_before, self.window = ckpt['elapsed_s'], list(ckpt['log_window'])
        self.evaluation_owed = ckpt['evaluation_owed']
        self.log.truncate_after(self.global_step)  # rows a killed attempt wrote after the checkpoint
        set_rng_state(ckpt['rng'])

    # --- checkpoints -------------------------------------------------------------------------------
    def _state(self) -> Dict[str, Any]:
        return {'model': self.model.state_dict(), 'optimizer': self.optimizer.state_dict(),
                'scheduler': self.scheduler.state_dict(), 'rng': rng_state(), 'epoch': self.epoch,
                'epoch_step': self.epoch_step, 'global_step': self.global_step, 'best': self.best,
                'best_step': self.best_step, 'elapsed_s': self._elapsed(), 'log_window': list(self.window),
                'evaluation_owed': self.evaluation_owed, 'config': self.cfg.to_dict(),
                'model_config': self.model_config, 'pretrained': self.pretrained, 'data_digests': self.digests,
                'task': self.task.name, 'labels': list(self.task.labels)}

    def save(self, name: str = 'last.pth') -> None:
        save_checkpoint(self._state(), self.run_dir / name)

    def _elapsed(self) -> float:
        return self.elapsed_before + (time.perf_counter() - self._t0 if hasattr(self, '_t0') else 0.0)

    # --- batches -----------------------------------------------------------------------------------
    def _batch(self, data: Encoded, idx: List[int]):
        """(model inputs, labels) for the examples ``idx``, right-padded to the longest of them."""
        lengths = [len(data.input_ids[i]) for i in idx]
        ids = torch.full((len(idx), max(lengths)), self.tokenizer.pad_token_id, dtype=torch.long)  # (B, L)
        mask = torch.zeros_like(ids)
        types = torch.zeros_like(ids) if data.token_type_ids is not None else None
        for row, (i, n) in enumerate(zip(idx, lengths)):
            ids[row, :n] = torch.tensor(data.input_ids[i])
            mask[row, :n] = 1
            if types is not None:
                types[row, :n] = torch.tensor(data.token_type_ids[i])
        inputs = {'input_ids': ids, 'attention_mask': mask}
        if types is not None:
            inputs['token_type_ids'] = types
        return {k: v.to(self.device) for k, v in inputs.items()}, data.labels[idx].to(self.device)

    # --- the loop ----------------------------------------------------------------------------------
    def fit(self) -> GlueResult:
        cfg = self.cfg
        self._t0 = time.perf_counter()
        params = sum(p.numel() for p in self.model.parameters())
        swap = f', {self.swapped} FFNs swapped for {cfg.ffn}' if cfg.ffn else ''
        self.progress.message(
            f'run {self.run_dir}: {type(self.model).__name__} ({params / 1e6:.2f} M params, '
            f'{"pretrained" if self.pretrained else "random init"}{swap}) on {self.task.name.upper()} '
            f'({len(self.train_split)} train examples); {self.steps_per_epoch} steps/epoch x {cfg.epochs} epochs, '
            f'batch {cfg.batch_size}, {self.device}' + (f', from step {self.global_step}' if self.global_step else ''))
        for note in self.notes:
            self.progress.message(note)
        (self.run_dir / STOP_RECORD).unlink(missing_ok=True)
        final = None
        try:
            with StopRequest() as self._stop:
                if self.evaluation_owed:  # a stop during an evaluation saved the state from before it
                    final = self._evaluate_and_save()
                while not self._budget_spent():
                    final = self._run_epoch()
                if final is None:  # resumed at the very end: evaluated again for results.json
                    final = self._evaluate_and_save()
        except Exception as e:
            self._record_stop(e)
            raise
        self._write_results(final)
        save_model(self.model, self.tokenizer, self.run_dir / 'model', bool(cfg.ffn))
        return GlueResult(self.run_dir, self.task.metric, final, self.best, self.best_step, self.global_step,
                          self.global_step / self.steps_per_epoch, self._elapsed())

    def _budget_spent(self) -> bool:
        return self.global_step >= self.total_steps

    def _run_epoch(self):
        self.model.train()
        self.progress.start_epoch(self.epoch, self.cfg.epochs, self.epoch_step, self.steps_per_epoch)
        for idx in self.order.batches(self.epoch, self.epoch_step):
            self._after_step(self._step(idx.tolist()))
            if self._budget_spent():
                break
        self.progress.end_epoch()
        if self.epoch_step == self.steps_per_epoch:
            self.epoch, self.epoch_step = self.epoch + 1, 0
        return self._evaluate_and_save()

    def _step(self, idx: List[int]) -> float:
        inputs, labels = self._batch(self.train_data, idx)
        loss = self.model(**inputs, labels=labels).loss
        if not math.isfinite(loss.item()):
            raise self._diverged(loss.item())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.clip_grad:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
        self.optimizer.step()
        self.scheduler.step()
        self.global_step += 1
        self.epoch_step += 1
        return loss.item()

    def _after_step(self, loss: float) -> None:
        cfg = self.cfg
        self.window = [self.window[0] + loss, self.window[1] + 1]
        lr = self.scheduler.get_last_lr()[0]
        if self.global_step % cfg.log_interval == 0 or self._budget_spent() or \
                self.epoch_step == self.steps_per_epoch:
            mean = self.window[0] / self.window[1]
            rate = self.progress.log_line(self.global_step, self._epoch_float(), mean, lr)
            self.log.write(self.global_step, self._epoch_float(), 'train', loss=mean, lr=lr, examples_per_s=rate,
                           elapsed_s=self._elapsed())
            self.window = [0.0, 0]
        self.progress.update(self.global_step, self.epoch_step, lambda: loss, lr)
        if self._stop.signal_name:
            self.progress.end_epoch()
            self.save()
            raise self._interrupted()
        if cfg.checkpoint_interval and self.global_step % cfg.checkpoint_interval == 0:
            self.save()

    def _evaluate_and_save(self) -> Dict[str, Dict[str, float]]:
        """Evaluate every dev file, log it, keep best.pth, save last.pth. A stop during the evaluation abandons it:
        last.pth then records it as owed, and the resumed run evaluates first."""
        results = {}
        for name, data in self.dev_data.items():
            result = self._evaluate(data)
            if result is None:
                self.evaluation_owed = True
                self.save()
                raise self._interrupted()
            results[name] = result
        self.evaluation_owed = False
        for name, r in results.items():
            self.log.write(self.global_step, self._epoch_float(), name, loss=r['loss'], accuracy=r['accuracy'],
                           matthews=r['matthews'], elapsed_s=self._elapsed())
        metric = self.task.metric
        self.progress.message(f'eval at step {self.global_step} (epoch {self._epoch_float():.2f}): ' + '; '.join(
            f'{name} {METRIC_NAMES[metric]} {r[metric]:.4f} loss {r["loss"]:.4f}' for name, r in results.items()))
        first = next(iter(results.values()))[metric]
        if first > self.best:
            self.best, self.best_step = first, self.global_step
            self.save('best.pth')
        self.save()
        if not self._budget_spent() and self._stop.signal_name:
            raise self._interrupted()
        return results

    @torch.no_grad()
    def _evaluate(self, data: Encoded) -> Optional[Dict[str, float]]:
        """Loss, accuracy and Matthews correlation on one dev file; None if a stop came during it."""
        was_training = self.model.training
        self.model.eval()
        predictions, loss_sum = [], 0.0
        n, size = len(data.labels), self.cfg.eval_batch_size
        for start in range(0, n, size):
            if self._stop.signal_name:
                self.model.train(was_training)
                return None
            inputs, labels = self._batch(data, list(range(start, min(start + size, n))))
            out = self.model(**inputs, labels=labels)
            loss_sum += out.loss.item() * len(labels)
            predictions.append(out.logits.argmax(-1).cpu())
        self.model.train(was_training)
        metrics = task_metrics(torch.cat(predictions), data.labels)
        return {'loss': loss_sum / n, **metrics}

    # --- endings -----------------------------------------------------------------------------------
    def _epoch_float(self) -> float:
        return self.global_step / self.steps_per_epoch

    def _interrupted(self) -> TrainingInterrupted:
        return TrainingInterrupted(self._stop.signal_name, self.global_step, self.run_dir,
                                   evaluation_owed=self.evaluation_owed, command=COMMAND)

    def _diverged(self, value: float) -> TrainingDiverged:
        last = self.run_dir / 'last.pth'
        keep = f'the last good checkpoint is {last}' if last.exists() else 'no checkpoint was saved yet'
        return TrainingDiverged(f'loss is {value} at step {self.global_step + 1}; stopped; {keep}. Try a lower '
                                f'--lr (now {self.cfg.lr:g})')

    def _record_stop(self, error: Exception) -> None:
        reason = {TrainingDiverged: 'diverged', TrainingInterrupted: 'interrupted'}.get(type(error), 'error')
        last = self.run_dir / 'last.pth'
        fields = {'global_step': self.global_step, 'checkpoint': last.name if last.exists() else None}
        if reason == 'interrupted':
            fields['signal'] = error.signal_name
        try:
            write_stop_record(self.run_dir, reason, (str(error).splitlines() or [''])[0][:2000], **fields)
        except OSError:
            pass

    def _write_results(self, final: Dict[str, Dict[str, float]]) -> None:
        cfg = self.cfg
        write_json(self.run_dir / 'results.json', {
            'task': self.task.name, 'metric': self.task.metric, 'data': cfg.data, 'model': cfg.model,
            'pretrained': self.pretrained, 'ffn': cfg.ffn, 'block_cfg': cfg.block_cfg, 'ffns_swapped': self.swapped,
            'params': sum(p.numel() for p in self.model.parameters()), 'global_step': self.global_step,
            'epochs': self.global_step / self.steps_per_epoch, 'seconds': self._elapsed(),
            'best': self.best, 'best_step': self.best_step, 'final': final})


def fine_tune(cfg: GlueConfig, run_dir: Path, resume: bool = False) -> GlueResult:
    """Fine-tune (or, with ``resume``, continue fine-tuning) ``cfg`` in ``run_dir``; see ``GlueRun``."""
    return GlueRun(cfg, run_dir, resume=resume).fit()
