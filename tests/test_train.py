"""Training loop, run folders, exact resume (also after SIGKILL, and after a SIGTERM mid-evaluation), NaN stop,
checkpoints, DDP, CLI.

Everything runs a one-block 16-wide ViT on 8x8 synthetic shards, one CPU thread: a few
milliseconds per step, so the whole file takes well under a minute of CPU.
"""
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch
import yaml
from torch import nn

import vitblocks.cli as cli
from vitblocks.cli import eval as eval_cmd
from vitblocks.cli import plot as plot_cmd
from vitblocks.cli import reproduce as reproduce_cmd
from vitblocks.cli import train as train_cmd
from vitblocks.data import DataError
from vitblocks.experiments import (CheckpointError, TrainingDiverged, TrainingInterrupted, list_recipes,
                                   load_checkpoint, load_model_weights, load_recipe, merge, save_checkpoint, train)
from vitblocks.experiments.config import ConfigError, parse_overrides
from vitblocks.experiments import engine
from vitblocks.experiments.engine import Trainer
from vitblocks.reproduce.common import run_or_reuse
from vitblocks.experiments.runlog import read_stop_record
from vitblocks.experiments.schedule import build_scheduler
from vitblocks.experiments.setup import set_cuda_matmul_precision
from vitblocks.profile import fixed_threads

from _train_helpers import TINY_VIT, signal_during_evaluation, tiny_dataset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope='module')
def _one_thread():
    with fixed_threads(1):
        yield


@pytest.fixture(autouse=True)
def _cli_commands(monkeypatch):
    """The train/eval/plot/reproduce commands, whether or not cli/__init__ lists them yet."""
    extra = tuple(c for c in (train_cmd, eval_cmd, plot_cmd, reproduce_cmd) if c not in cli.COMMANDS)
    monkeypatch.setattr(cli, 'COMMANDS', cli.COMMANDS + extra)


@pytest.fixture(scope='module')
def data(tmp_path_factory) -> Path:
    return tiny_dataset(tmp_path_factory.mktemp('data') / 'tiny')


def tiny_cfg(data: Path, out: Path, **kw):
    """Every RNG consumer on: dropout, drop path, mixup/cutmix (numpy/python RNG), flips and padded crops,
    label smoothing, cosine schedule with warm-up, EMA, gradient clipping."""
    base = dict(model='vit_tiny_patch16_224', data=str(data), model_kwargs=TINY_VIT, drop_rate=0.1,
                drop_path_rate=0.1, epochs=3, batch_size=8, opt='adamw', lr=3e-3, weight_decay=0.05, sched='cosine',
                warmup_epochs=1, mixup=0.2, cutmix=0.5, smoothing=0.1, crop_padding=1, hflip=0.5, model_ema=True,
                model_ema_decay=0.9, clip_grad=1.0, mean='dataset', std='dataset', progress='none', log_interval=4,
                output=str(out), name='run', tensorboard=False, threads=1)
    base.update(kw)
    return merge(base)


def weights(path: Path, ema: bool = False):
    return load_model_weights(path, ema=ema)


def assert_same_weights(a: Path, b: Path):
    for ema in (False, True):
        wa, wb = weights(a, ema), weights(b, ema)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f'{k} differs (ema={ema})'


def losses(run: Path):
    with open(run / 'metrics.csv') as f:
        return [(r['step'], r['split'], r['loss'], r['top1']) for r in csv.DictReader(f)]


# --- a run and its folder ------------------------------------------------------------------------------

def test_run_folder_contents_and_learning(data, tmp_path):
    cfg = tiny_cfg(data, tmp_path, epochs=4, mixup=0, cutmix=0, drop_rate=0, drop_path_rate=0, model_ema=False)
    result = train(cfg)
    run = tmp_path / 'run'
    assert {p.name for p in run.iterdir()} >= {'config.yaml', 'last.pth', 'best.pth', 'metrics.csv', 'results.json'}
    assert yaml.safe_load((run / 'config.yaml').read_text())['lr'] == 3e-3
    ckpt = load_checkpoint(run / 'last.pth')
    assert ckpt['global_step'] == result.global_step == 4 * (96 // 8) and ckpt['epoch'] == 4
    rows = losses(run)
    assert [r[0] for r in rows if r[1] == 'val'] == ['12', '24', '36', '48']  # one eval per epoch
    assert result.final.num_images == 40 and len(result.final.per_class_total) == 4
    assert sum(result.final.per_class_total) == 40
    first, last = float(rows[0][2]), float([r for r in rows if r[1] == 'train'][-1][2])
    assert last < first  # the blobs are learnable
    assert result.final.top1 > 40.0  # chance is 25%


def test_tensorboard_scalars_when_installed_and_a_note_when_not(data, tmp_path, monkeypatch):
    import types
    scalars = []

    class FakeWriter:  # torch's SummaryWriter needs the optional tensorboard package; record what it gets
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            scalars.append((tag, step))

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, 'torch.utils.tensorboard', types.SimpleNamespace(SummaryWriter=FakeWriter))
    train(tiny_cfg(data, tmp_path / 'tb', max_steps=4, tensorboard=True))
    assert ('train/loss', 4) in scalars and ('val/top1', 4) in scalars and ('val_ema/top1', 4) in scalars
    monkeypatch.setitem(sys.modules, 'torch.utils.tensorboard', None)  # import fails: the run goes on
    from vitblocks.experiments.runlog import MetricsLog
    assert 'pip install tensorboard' in MetricsLog(tmp_path, tensorboard=True).tb_note


def test_max_steps_is_a_budget(data, tmp_path):
    result = train(tiny_cfg(data, tmp_path, max_steps=5))
    assert result.global_step == 5
    ckpt = load_checkpoint(tmp_path / 'run' / 'last.pth')
    assert (ckpt['epoch'], ckpt['epoch_step']) == (0, 5)
    assert result.final is not None  # evaluated at the stop


def test_refuses_to_overwrite_a_run(data, tmp_path):
    train(tiny_cfg(data, tmp_path, max_steps=1))
    with pytest.raises(ConfigError, match='already holds a run'):
        train(tiny_cfg(data, tmp_path, max_steps=1))


# --- exact resume ----------------------------------------------------------------------------------------

@pytest.mark.parametrize('pipeline', ['tensor', 'pil'])
def test_resume_mid_epoch_is_exact(data, tmp_path, pipeline):
    """Stop after 7 steps (mid-epoch 0), resume, and land on the uninterrupted run's weights. Random erasing
    runs on the batch in the training process in both pipelines (pil: uint8 batches normalized there)."""
    full = tmp_path / 'full'
    train(tiny_cfg(data, full, epochs=2, pipeline=pipeline, reprob=0.5))
    part = tmp_path / 'part'
    train(tiny_cfg(data, part, epochs=2, pipeline=pipeline, reprob=0.5, max_steps=7))
    result = train(tiny_cfg(data, part, epochs=2, pipeline=pipeline, reprob=0.5), resume=part / 'run')
    assert result.global_step == 24
    assert_same_weights(full / 'run' / 'last.pth', part / 'run' / 'last.pth')
    # evaluations after the resume match (the stop at step 7 adds its own train and val rows)
    def val(run):
        return [r for r in losses(run) if r[1] == 'val' and r[0] != '7']
    assert val(part / 'run') == val(full / 'run')


def test_pil_pipeline_batches_do_not_depend_on_worker_count(data, tmp_path):
    for workers in (0, 2):
        train(tiny_cfg(data, tmp_path / str(workers), pipeline='pil', workers=workers, max_steps=4,
                       auto_augment='rand-m9'))
    assert_same_weights(tmp_path / '0' / 'run' / 'last.pth', tmp_path / '2' / 'run' / 'last.pth')


def test_sigkill_and_resume_matches_uninterrupted_run(data, tmp_path):
    """Kill a training subprocess with SIGKILL right after a mid-epoch checkpoint, resume it, compare."""
    kw = dict(epochs=3, checkpoint_interval=5)
    full = tmp_path / 'full'
    train(tiny_cfg(data, full, **kw))

    killed = tmp_path / 'killed'
    cfg_file = tmp_path / 'killed.yaml'
    cfg_file.write_text(yaml.safe_dump(tiny_cfg(data, killed, **kw).to_dict()))
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    cmd = [sys.executable, '-m', 'vitblocks.experiments', str(cfg_file)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    last = killed / 'run' / 'last.pth'
    deadline = time.monotonic() + 120
    while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0].decode(errors='replace')
    assert proc.returncode == -signal.SIGKILL, out
    ckpt = load_checkpoint(last)
    total = 3 * (96 // 8)
    assert 0 < ckpt['global_step'] < total, f'killed at step {ckpt["global_step"]} of {total}'
    assert not (killed / 'run' / 'results.json').exists()

    resumed = subprocess.run(cmd + ['--resume'], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert load_checkpoint(last)['global_step'] == total
    assert_same_weights(full / 'run' / 'last.pth', last)
    assert losses(killed / 'run') == losses(full / 'run')


def assert_same_state(a: dict, b: dict):
    """The same checkpoint but for its tensors of weights and its timings: position, schedule, RNG states."""
    keys = ('epoch', 'epoch_step', 'global_step', 'best_top1', 'best_epoch', 'log_window', 'scheduler',
            'evaluation_owed', 'scheduler_step_owed')
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert torch.equal(a['rng'][0]['torch'], b['rng'][0]['torch'])
    assert torch.equal(a['rng'][0]['numpy']['keys'], b['rng'][0]['numpy']['keys'])
    assert a['rng'][0]['python'] == b['rng'][0]['python']


def results_without_timings(run: Path) -> dict:
    drop = ('seconds', 'images_per_s')
    results = json.loads((run / 'results.json').read_text())
    return {k: {kk: vv for kk, vv in v.items() if kk not in drop} if isinstance(v, dict) else v
            for k, v in results.items() if k not in drop}


def test_sigterm_during_an_evaluation_stops_it_and_the_resumed_run_evaluates_first(data, tmp_path, monkeypatch):
    """A SIGTERM one batch into the evaluation after epoch 1 (step 12: 5 batches of the model, then 5 of its
    EMA) stops the run there, not once the evaluation is over (which on ImageNet may outlast a cluster's 30 s
    of grace); last.pth owes that evaluation, and the resumed run equals an uninterrupted one. Every evaluated
    batch draws from the RNG that dropout uses next: the checkpoint must hold the states from before it."""
    with pytest.MonkeyPatch.context() as patch:
        signal_during_evaluation(patch, evaluation=0, draws=True)  # never signals
        full = train(tiny_cfg(data, tmp_path / 'full'))
    evaluated = signal_during_evaluation(monkeypatch, evaluation=1, draws=True)
    part = tmp_path / 'part' / 'run'
    with pytest.raises(TrainingInterrupted, match=r'^SIGTERM at step 12 during its evaluation: saved \S*last\.pth '
                                                  r'\(the resumed run evaluates first\); resume with: vitblocks train'):
        train(tiny_cfg(data, tmp_path / 'part'))
    assert evaluated == [1]  # 1 of the model's 5 batches; the EMA's evaluation never started
    ckpt = load_checkpoint(part / 'last.pth')
    assert (ckpt['global_step'], ckpt['epoch'], ckpt['epoch_step']) == (12, 1, 0)
    assert ckpt['evaluation_owed'] is True and ckpt['scheduler_step_owed'] is True
    stop = read_stop_record(part)
    assert (stop['reason'], stop['signal'], stop['global_step'], stop['checkpoint']) == \
        ('interrupted', 'SIGTERM', 12, 'last.pth')
    assert [(r[0], r[1]) for r in losses(part)] == [('4', 'train'), ('8', 'train'), ('12', 'train')]  # no val row
    assert not (part / 'best.pth').exists()

    result = train(tiny_cfg(data, tmp_path / 'part'), resume=part)
    assert evaluated == [1] + [5] * 6  # the owed evaluation (model, EMA) once, then epochs 2 and 3
    assert losses(part) == losses(full.run_dir)  # every row, the evaluations' at step 12 included
    for name in ('last.pth', 'best.pth'):  # weights, position, schedule, owed nothing, every RNG state
        assert_same_weights(full.run_dir / name, part / name)
        assert_same_state(load_checkpoint(full.run_dir / name), load_checkpoint(part / name))
    assert results_without_timings(part) == results_without_timings(full.run_dir)
    assert (result.global_step, result.best_top1, result.final.top1, result.final.loss) == \
        (full.global_step, full.best_top1, full.final.top1, full.final.loss)
    assert read_stop_record(part) is None and load_checkpoint(part / 'last.pth')['evaluation_owed'] is False


def test_a_checkpoint_without_the_owed_evaluation_fields_resumes_owing_none(data, tmp_path, monkeypatch):
    train(tiny_cfg(data, tmp_path, epochs=1, max_steps=5))  # evaluated at step 5, then saved
    last = tmp_path / 'run' / 'last.pth'
    ckpt = load_checkpoint(last)
    del ckpt['evaluation_owed'], ckpt['scheduler_step_owed']  # as vitblocks wrote them before
    save_checkpoint(ckpt, last)
    evaluated = signal_during_evaluation(monkeypatch, evaluation=0)  # counts, never signals
    result = train(tiny_cfg(data, tmp_path, epochs=1), resume=tmp_path / 'run')
    assert result.global_step == 12 and evaluated == [5, 5]  # step 12's evaluation only (model, EMA)


# --- faults ----------------------------------------------------------------------------------------------

class NaNAfter(nn.Module):
    """A tiny ViT whose output turns NaN at the ``bad``-th training forward."""

    def __init__(self, bad: int):
        super().__init__()
        self.net = timm.create_model('vit_tiny_patch16_224', num_classes=4, **TINY_VIT)
        self.bad, self.calls = bad, 0
        self.patch_embed = self.net.patch_embed

    def get_classifier(self):
        return self.net.get_classifier()

    def forward(self, x):
        if self.training:
            self.calls += 1
        y = self.net(x)
        return y * float('nan') if self.training and self.calls == self.bad else y


def test_nan_loss_stops_and_keeps_last_good_checkpoint(data, tmp_path):
    cfg = tiny_cfg(data, tmp_path, checkpoint_interval=2, mixup=0, cutmix=0)
    with pytest.raises(TrainingDiverged, match=r'loss is nan at step 5.*last good checkpoint is .*last\.pth') as err:
        train(cfg, model=NaNAfter(bad=5))
    # warm-up and clipping are on, amp is off on a CPU: the hint names only the learning rate, and how this run
    # continues with one (the advice a resume could not take before --change)
    assert (f'Try: a lower learning rate (now 0.003) (to continue this run with one: vitblocks train --resume '
            f'{tmp_path / "run"} --change KEY=VALUE, e.g. --change lr=0.0015)') == str(err.value).split('. ', 1)[1]
    ckpt = load_checkpoint(tmp_path / 'run' / 'last.pth')
    assert ckpt['global_step'] == 4
    assert all(torch.isfinite(v).all() for v in ckpt['model'].values() if v.is_floating_point())
    # the run folder says why it stopped (what the GPU job's rechecks read), and a new attempt clears it
    stop = read_stop_record(tmp_path / 'run')
    assert (stop['reason'], stop['global_step'], stop['checkpoint']) == ('diverged', 4, 'last.pth')
    assert stop['message'] == str(err.value) and not (tmp_path / 'run' / 'results.json').exists()
    train(cfg, resume=tmp_path / 'run', model=NaNAfter(bad=0))  # resumed: finishes
    assert read_stop_record(tmp_path / 'run') is None and (tmp_path / 'run' / 'results.json').exists()


class NaNInEval(NaNAfter):
    """Finite while training, NaN in evaluation (as after a last optimizer step that broke the weights)."""

    def forward(self, x):
        y = self.net(x)
        return y if self.training else y * float('nan')


def test_nan_evaluation_loss_stops_before_saving(data, tmp_path):
    cfg = tiny_cfg(data, tmp_path, checkpoint_interval=2, mixup=0, cutmix=0, model_ema=False)
    with pytest.raises(TrainingDiverged, match=r'loss is nan at the evaluation after step (\d+) \(evaluation loss\); '
                       r'stopped; the last good checkpoint is .*last\.pth') as err:
        train(cfg, model=NaNInEval(bad=0))
    ckpt = load_checkpoint(tmp_path / 'run' / 'last.pth')  # the interval checkpoint, not the end of the epoch
    assert 0 < ckpt['global_step'] < int(re.search(r'after step (\d+)', str(err.value)).group(1))
    assert not (tmp_path / 'run' / 'best.pth').exists() and not (tmp_path / 'run' / 'results.json').exists()
    assert read_stop_record(tmp_path / 'run')['reason'] == 'diverged'


def test_agelu_shifts_stay_out_of_weight_decay_as_in_the_authors_training(data, tmp_path):
    """The IFFN authors' AGeLU keeps (1, 1, C) scale/bias tensors, and timm's factory decays only the scales;
    ours are stacked (2, C), which timm would decay all four of."""
    trainer = Trainer(tiny_cfg(data, tmp_path, model='iffn_deit_tiny_patch16_224', weight_decay=0.05))
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    decay = {names[id(p)]: g['weight_decay'] for g in trainer.optimizer.param_groups for p in g['params']}
    act = 'blocks.0.mlp.act'
    assert {k: decay[f'{act}.{k}'] for k in ('alpha', 'beta', 'gamma', 'theta')} == {
        'alpha': 0.05, 'beta': 0.05, 'gamma': 0.0, 'theta': 0.0}
    assert decay['blocks.0.mlp.fc1.weight'] == 0.05 and decay['blocks.0.mlp.fc1.bias'] == 0.0
    assert decay['pos_embed'] == 0.0 and len(decay) == len(names)  # timm's own list still applies; none left out


def test_any_other_error_is_recorded_with_its_type(data, tmp_path, monkeypatch):
    def out_of_memory(self, batches):
        raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB\nmore details')
    monkeypatch.setattr(Trainer, 'accumulate_step', out_of_memory)
    with pytest.raises(RuntimeError, match='out of memory'):
        train(tiny_cfg(data, tmp_path))
    stop = read_stop_record(tmp_path / 'run')
    assert {k: stop[k] for k in ('reason', 'error', 'message', 'global_step', 'checkpoint')} == {
        'reason': 'error', 'error': 'RuntimeError', 'message': 'CUDA out of memory. Tried to allocate 2.00 GiB',
        'global_step': 0, 'checkpoint': None}


def test_nan_hint_names_only_remedies_not_in_effect(data, tmp_path):
    cfg = tiny_cfg(data, tmp_path, warmup_epochs=0, clip_grad=None, sched='none', mixup=0, cutmix=0)
    # sched=none has no warm-up (warmup_epochs alone is refused): the hint names the schedule that has one
    with pytest.raises(TrainingDiverged, match=r'loss is nan at step 2; stopped; no checkpoint was saved yet\. '
                       r'Try: a lower learning rate \(now 0\.003\); warm-up \(warmup_epochs=5 sched=step '
                       r'decay_rate=1: the same constant lr after it\); gradient clipping \(clip_grad=1\.0\)$'):
        train(cfg, model=NaNAfter(bad=2))
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = build_scheduler(merge(dict(epochs=100, warmup_epochs=5, sched='step', decay_rate=1)), optimizer, 10)
    lrs = []
    for step in range(1, 1001):
        scheduler.step_update(num_updates=step)
        lrs.append(optimizer.param_groups[0]['lr'])
    assert lrs[0] < lrs[24] < 0.1 and set(lrs[50:]) == {0.1}  # warm-up over 50 steps, then constant
    cfg = tiny_cfg(data, tmp_path / 'warm', warmup_epochs=0, clip_grad=1.0, sched='cosine', mixup=0, cutmix=0)
    with pytest.raises(TrainingDiverged, match=r'Try: a lower learning rate \(now 0\.003\); warm-up '
                       r'\(warmup_epochs=5\)$'):
        train(cfg, model=NaNAfter(bad=2))


@pytest.mark.parametrize('amp_dtype, has_scaler, last', [
    ('bfloat16', False, 'amp=false (full fp32)'),  # what the H100 ViT run should have been told
    ('float16', True, 'amp_dtype=bfloat16 (the range of fp32)'),
])
def test_nan_hint_under_cuda_autocast(amp_dtype, has_scaler, last):
    trainer = SimpleNamespace(cfg=merge(dict(amp=True, amp_dtype=amp_dtype, warmup_epochs=5, clip_grad=1.0)),
                              scaler=object() if has_scaler else None, use_amp=True, lr=1e-3)
    assert Trainer._divergence_remedies(trainer) == ['a lower learning rate (now 0.001)', last]


def test_truncated_and_foreign_checkpoints_are_refused(data, tmp_path):
    train(tiny_cfg(data, tmp_path, max_steps=2))
    good = tmp_path / 'run' / 'last.pth'
    truncated = tmp_path / 'truncated.pth'
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r'truncated\.pth: not a readable PyTorch checkpoint; truncated'):
        load_checkpoint(truncated)
    foreign = tmp_path / 'foreign.pth'
    torch.save({'weights': torch.zeros(2)}, foreign)
    with pytest.raises(CheckpointError, match='not a vitblocks training checkpoint'):
        load_checkpoint(foreign)
    code = tmp_path / 'code.pth'
    torch.save({'format': 'x', 'obj': ConfigError('runs code on load')}, code)
    with pytest.raises(CheckpointError, match='refused to load'):
        load_checkpoint(code)
    with pytest.raises(CheckpointError, match='empty file'):
        (tmp_path / 'empty.pth').write_bytes(b'')
        load_checkpoint(tmp_path / 'empty.pth')


def test_a_changed_optimizer_setting_is_refused_like_a_changed_weight(data, tmp_path):
    """The digest covers every value of the checkpoint, not only its tensors: AdamW's beta2 flipped from 0.999 to
    0.99888 on disk is refused on load (it resumed silently when only tensors were covered); saving a loaded
    checkpoint again gives a valid one, and a checkpoint written before (tensors-only digest) still loads."""
    train(tiny_cfg(data, tmp_path, max_steps=2))
    good = tmp_path / 'run' / 'last.pth'
    state = torch.load(good, weights_only=True)
    assert 'state_digest' in state and 'tensor_digest' not in state
    group = state['optimizer']['param_groups'][0]
    assert group['betas'][1] == 0.999
    group['betas'] = (group['betas'][0], 0.99888)
    flipped = tmp_path / 'flipped.pth'
    torch.save(state, flipped)  # the old digest kept, as a flipped byte would
    with pytest.raises(CheckpointError, match='do not match the digest'):
        load_checkpoint(flipped)
    save_checkpoint(load_checkpoint(good), tmp_path / 'again.pth')
    assert load_checkpoint(tmp_path / 'again.pth')['global_step'] == 2
    from vitblocks.experiments.checkpoint import tensor_digest
    older = {k: v for k, v in torch.load(good, weights_only=True).items() if k != 'state_digest'}
    older['tensor_digest'] = tensor_digest(older)
    torch.save(older, tmp_path / 'older.pth')
    assert load_checkpoint(tmp_path / 'older.pth')['global_step'] == 2


def test_atomic_save_keeps_old_checkpoint_on_failure(tmp_path):
    path = tmp_path / 'last.pth'
    save_checkpoint({'x': torch.ones(1)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError('boom')

    with pytest.raises(RuntimeError, match='boom'):
        save_checkpoint({'x': Unpicklable()}, path)
    assert torch.equal(torch.load(path, weights_only=True)['x'], torch.ones(1))
    assert [p.name for p in tmp_path.iterdir()] == ['last.pth']  # no temp file left


# --- config ----------------------------------------------------------------------------------------------

def test_recipes_state_source_and_launch_and_load():
    assert set(list_recipes()) >= {'deit', 'repa', 'augreg', 'ninformer'}
    for name in list_recipes():
        lines = (ROOT / 'src/vitblocks/experiments/recipes' / f'{name}.yaml').read_text().splitlines()
        head = '\n'.join(line for line in lines[:next(i for i, ln in enumerate(lines) if not ln.startswith('#'))])
        assert '# Source:' in head and '# Launch:' in head and ' train --model ' in head, name
        merge(load_recipe(name))
    nin = merge(load_recipe('ninformer'))
    assert (nin.opt, nin.lr, nin.batch_size, nin.epochs, nin.weight_decay) == ('adam', 1e-3, 128, 100, 0.0)
    repa = merge(load_recipe('repa'))
    assert (repa.opt, repa.lr_base, repa.warmup_epochs) == ('lamb', 5e-3, 20)


def test_config_errors_say_what_to_fix():
    with pytest.raises(ConfigError, match="unknown config key 'lrr'. Did you mean: lr"):
        parse_overrides(['lrr=1'])
    with pytest.raises(ConfigError, match='KEY=VALUE'):
        parse_overrides(['lr'])
    with pytest.raises(ConfigError, match='epochs=0: expected a positive integer'):
        merge({'epochs': 0})
    with pytest.raises(ConfigError, match="unknown recipe 'dei'. Did you mean: deit"):
        load_recipe('dei')
    with pytest.raises(ConfigError, match="matmul_precision='medium': expected one of highest, high"):
        merge({'matmul_precision': 'medium'})


@pytest.mark.parametrize('layer, message', [
    ({'ratio': [0.75, 1.33]}, r'ratio=\[0.75, 1.33\] is the aspect-ratio range of RandomResizedCrop, which only '
                              r'scale=\[lo, hi\] turns on'),
    ({'scale': [0.5, 1.0], 'crop_padding': 4}, 'crop_padding=4 .* and scale=.* are two different crops'),
    ({'mixup': 0.8, 'batch_size': 7}, 'the batch per process must be even; batch_size=7'),
    ({'cutmix': 1.0, 'batch_size': 5}, 'batch_size=5'),
    ({'sched': 'none', 'warmup_epochs': 5}, 'warmup_epochs=5 warms up to a schedule, and sched=none keeps the learning '
                                            'rate constant'),
    ({'opt': 'sgd', 'opt_eps': 1e-6}, r'opt_eps=1e-06: opt=sgd has no epsilon \(timm would drop it silently\)'),
    ({'opt': 'sgd', 'opt_betas': [0.9, 0.99]}, r'opt_betas=\[0.9, 0.99\]: opt=sgd has no betas'),
    ({'opt': 'adan', 'opt_betas': [0.9, 0.99]}, r'opt=adan takes 3 betas; give 3 values'),  # IndexError at step 1
    ({'opt': 'adamw', 'opt_betas': [0.9, 0.99, 0.9]}, r'opt=adamw takes 2 betas'),
])
def test_options_that_would_be_ignored_or_crash_later_are_config_errors(layer, message):
    with pytest.raises(ConfigError, match=message):
        merge(layer)


def test_a_later_optimizer_resets_the_recipes_options_it_cannot_take():
    deit = load_recipe('deit')
    assert deit['opt'] == 'adamw' and deit['opt_eps'] == 1e-8
    # the recipe's epsilon was AdamW's: SGD has none, so it goes, as timm's factory drops it
    assert merge(deit, {'opt': 'sgd'}).opt_eps is None
    # LAMB has an epsilon: the recipe's stays
    assert merge(deit, {'opt': 'lamb'}).opt_eps == 1e-8
    # betas: reset where the new optimizer takes none or another number of them
    adamw_betas = {'opt': 'adamw', 'opt_betas': [0.9, 0.95]}
    assert merge(adamw_betas, {'opt': 'sgd'}).opt_betas is None
    assert merge(adamw_betas, {'opt': 'adan'}).opt_betas is None
    assert merge(adamw_betas, {'opt': 'lamb'}).opt_betas == [0.9, 0.95]
    # given with the optimizer, or after it, they are the user's: a mismatch is still an error
    with pytest.raises(ConfigError, match='opt=sgd has no epsilon'):
        merge(deit, {'opt': 'sgd', 'opt_eps': 1e-8})
    with pytest.raises(ConfigError, match='opt=sgd has no epsilon'):
        merge(deit, {'opt': 'sgd'}, {'opt_eps': 1e-6})
    with pytest.raises(ConfigError, match='opt=sgd has no betas'):
        merge({'opt_betas': [0.9, 0.99]}, {'opt': 'sgd'}, {'opt_betas': [0.9, 0.99]})
    # an earlier layer's options without a later opt are checked as given
    with pytest.raises(ConfigError, match='opt=sgd has no epsilon'):
        merge({'opt': 'sgd'}, {'opt_eps': 1e-8})


def test_optimizer_options_reach_the_optimizers_that_take_them(data, tmp_path):
    for opt, betas in (('adamw', (0.8, 0.95)), ('adan', (0.9, 0.92, 0.98))):  # Adan has three betas
        trainer = Trainer(tiny_cfg(data, tmp_path, name=opt, opt=opt, opt_eps=1e-6, opt_betas=list(betas)))
        assert trainer.optimizer.defaults['betas'] == betas and trainer.optimizer.defaults['eps'] == 1e-6


def test_training_refuses_to_evaluate_on_its_training_images(data, tmp_path):
    for pattern in ('tiny-train-{0000..0001}.tar.gz', 'tiny-train-0000.tar.gz'):  # no other split to hold out
        with pytest.raises(DataError, match=r'no held-out split: evaluation \(\'val\'\) would read the training'):
            train(tiny_cfg(str(data / pattern), tmp_path, max_steps=1))
    assert not (tmp_path / 'run' / 'last.pth').exists()


def test_a_finished_run_without_checkpoints_is_not_overwritten(data, tmp_path):
    run = tmp_path / 'run'
    train(tiny_cfg(data, tmp_path, max_steps=1))
    (run / 'last.pth').unlink()  # results copied without their checkpoints
    before = (run / 'results.json').read_bytes(), (run / 'metrics.csv').read_bytes()
    with pytest.raises(ConfigError, match='already holds a finished run'):
        train(tiny_cfg(data, tmp_path, max_steps=1, lr=1e-3))
    assert ((run / 'results.json').read_bytes(), (run / 'metrics.csv').read_bytes()) == before
    with pytest.raises(DataError, match=r'holds the results of a run with another config \(lr differ\) and no '
                                        r'last.pth'):
        run_or_reuse(tiny_cfg(data, tmp_path, max_steps=1, lr=1e-3), run)
    assert ((run / 'results.json').read_bytes(), (run / 'metrics.csv').read_bytes()) == before
    # grad_accum changes the global batch of a run on as many processes: its results are not reused
    with pytest.raises(DataError, match=r'\(grad_accum differ\)'):
        run_or_reuse(tiny_cfg(data, tmp_path, max_steps=1, grad_accum=2), run)
    assert run_or_reuse(tiny_cfg(data, tmp_path, max_steps=1, threads=2), run)['global_step'] == 1  # reused


def test_config_yaml_is_written_atomically(data, tmp_path):
    run = tmp_path / 'run'
    train(tiny_cfg(data, tmp_path, max_steps=1))
    (run / 'config.yaml.tmp').write_text('batch_size: 8\nlr')  # what a kill mid-write leaves
    train(tiny_cfg(data, tmp_path, max_steps=2), resume=run)
    assert not (run / 'config.yaml.tmp').exists()
    assert yaml.safe_load((run / 'config.yaml').read_text())['max_steps'] == 2


def test_matmul_precision_sets_tf32_for_matmuls_and_convolutions():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        set_cuda_matmul_precision('high')
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        set_cuda_matmul_precision('highest')  # full fp32: cuDNN's TF32 default (on) is turned off too
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize('sched', ['step', 'plateau'])
def test_a_run_resumed_from_best_pth_goes_on_as_from_the_last_pth_of_that_epoch(data, tmp_path, sched):
    # best.pth is written by the evaluation, before the scheduler's step for the epoch: it records that step as owed
    kw = dict(sched=sched, decay_epochs=1, decay_rate=0.5, patience_epochs=0, warmup_epochs=0, epochs=3,
              model_ema=False)
    first = train(tiny_cfg(data, tmp_path / 'a', max_steps=12, **kw))
    assert first.epochs_done == 1.0
    shutil.copytree(tmp_path / 'a', tmp_path / 'b')
    from_last = train(tiny_cfg(data, tmp_path / 'a', **kw), resume=tmp_path / 'a' / 'run' / 'last.pth')
    from_best = train(tiny_cfg(data, tmp_path / 'b', **kw), resume=tmp_path / 'b' / 'run' / 'best.pth')
    assert from_last.global_step == from_best.global_step == 36
    lrs = [[r['lr'] for r in csv.DictReader(open(run / 'run' / 'metrics.csv')) if r['split'] == 'train']
           for run in (tmp_path / 'a', tmp_path / 'b')]
    assert lrs[0] == lrs[1]
    if sched == 'step':
        assert len(set(lrs[0])) >= 3  # the first epoch's decay was taken from best.pth too
    wa, wb = weights(tmp_path / 'a' / 'run' / 'last.pth'), weights(tmp_path / 'b' / 'run' / 'last.pth')
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # the schedulers counted the same epochs (plateau: the same best top-1 and bad epochs)
    a, b = (torch.load(run / 'run' / 'last.pth', weights_only=False)['scheduler'] for run in (tmp_path / 'a',
                                                                                             tmp_path / 'b'))
    assert a == b


# --- CLI ---------------------------------------------------------------------------------------------------

def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


TINY_CLI = ['model_kwargs={img_size: 8, patch_size: 4, embed_dim: 16, depth: 1, num_heads: 2}', 'progress=none',
            'tensorboard=false']


def train_tiny_run(capsys, data, out, max_steps, *extra):
    """``vitblocks train`` of a tiny ViT (the ninformer recipe, batch 8, one thread) into ``out/r``; asserts it ran."""
    code, stdout, err = run_cli(capsys, 'train', '--model', 'vit_tiny_patch16_224', '--data', data, '--config',
                                'ninformer', '--max-steps', max_steps, '--batch-size', 8, '--output', out, '--name',
                                'r', '--threads', 1, *TINY_CLI, *extra)
    assert code == 0, err
    return stdout


def test_cli_train_eval_and_resume(data, tmp_path, capsys):
    kw = ['model_kwargs={img_size: 8, patch_size: 4, embed_dim: 16, depth: 1, num_heads: 2}', 'progress=none',
          'tensorboard=false']
    code, out, err = run_cli(capsys, 'train', '--model', 'vit_tiny_patch16_224', '--data', data, '--config',
                             'ninformer', '--epochs', 2, '--max-steps', 3, '--batch-size', 8, '--output', tmp_path,
                             '--name', 'r', '--threads', 1, *kw)
    assert code == 0, err
    assert 'trained  3 steps' in out and 'final    top-1' in out
    code, out, err = run_cli(capsys, 'train', '--resume', tmp_path / 'r', '--lr', 0.5)
    assert code == 2 and 'cannot change lr' in err
    code, out, err = run_cli(capsys, 'train', '--resume', tmp_path / 'r', 'max_steps=null')  # lift the budget
    assert code == 0 and 'trained  24 steps' in out, err

    code, out, err = run_cli(capsys, 'eval', '--checkpoint', tmp_path / 'r' / 'last.pth', '--data', data,
                             '--threads', 1, '--json', tmp_path / 'eval.json')
    assert code == 0, err
    ckpt_top1 = load_checkpoint(tmp_path / 'r' / 'last.pth')
    assert 'top-1' in out and 'images/s' in out and 'GMACs' in out
    assert 'class0' in out  # per-class table for small class counts
    import json
    res = json.loads((tmp_path / 'eval.json').read_text())
    (result,) = res['results'].values()
    assert result['num_images'] == 40
    final = json.loads((tmp_path / 'r' / 'results.json').read_text())['final']
    assert result['top1'] == pytest.approx(final['top1'])  # same model, same un-augmented test split
    assert ckpt_top1['global_step'] == 24

    code, out, err = run_cli(capsys, 'eval', '--checkpoint', tmp_path / 'r' / 'last.pth', '--data', data,
                             '--reparam', '--threads', 1)
    assert code == 0 and 'reparameterized' in out, err


def test_eval_through_the_training_augmentation(data, tmp_path, capsys):
    """--train-augment N: the test split through the run's training transform (as the NiNformer authors' script
    evaluates), N passes of their own random draws; with no augmentation in the run it is the clean evaluation."""
    import json
    kw = ['model_kwargs={img_size: 8, patch_size: 4, embed_dim: 16, depth: 1, num_heads: 2}', 'progress=none',
          'tensorboard=false']
    for name, aug in (('plain', ['hflip=0', 'crop_padding=0']), ('aug', ['hflip=0.5', 'crop_padding=2'])):
        code, out, err = run_cli(capsys, 'train', '--model', 'vit_tiny_patch16_224', '--data', data, '--config',
                                 'ninformer', '--max-steps', 3, '--batch-size', 8, '--output', tmp_path, '--name',
                                 name, '--threads', 1, *kw, *aug)
        assert code == 0, err

    def augmented(run, passes, json_name):
        code, out, err = run_cli(capsys, 'eval', '--checkpoint', tmp_path / run / 'last.pth', '--data', data,
                                 '--threads', 1, '--progress', 'none', '--train-augment', passes, '--json',
                                 tmp_path / json_name)
        assert code == 0, err
        assert f'top-1 through the training augmentation, {passes} pass(es): ' in out
        res = json.loads((tmp_path / json_name).read_text())
        (clean,) = res['results'].values()
        return clean, res['train_augment']

    clean, aug = augmented('plain', 2, 'plain.json')
    for p in aug['passes']:  # no random crop or flip in this run: the training transform is the evaluation's
        assert p['num_images'] == 40
        assert (p['top1'], p['loss']) == pytest.approx((clean['top1'], clean['loss']), rel=1e-6)
    clean, aug = augmented('aug', 3, 'aug.json')
    losses = [p['loss'] for p in aug['passes']]
    assert all(p['num_images'] == 40 for p in aug['passes'])  # every image once per pass
    assert len(set(losses)) == 3 and clean['loss'] not in losses  # each pass its own crops and flips
    assert aug['top1_mean'] == pytest.approx(sum(p['top1'] for p in aug['passes']) / 3)
    _, again = augmented('aug', 3, 'again.json')
    assert [p['loss'] for p in again['passes']] == losses  # seeded: the same draws again

    # RandAugment is timm's PIL pipeline: the passes go through it too (the only random draws of this run)
    code, out, err = run_cli(capsys, 'train', '--model', 'vit_tiny_patch16_224', '--data', data, '--config',
                             'ninformer', '--max-steps', 1, '--batch-size', 8, '--output', tmp_path, '--name', 'ra',
                             '--threads', 1, *kw, 'hflip=0', 'crop_padding=0', 'auto_augment=rand-m9-mstd0.5')
    assert code == 0, err
    clean, aug = augmented('ra', 2, 'ra.json')
    assert len({p['loss'] for p in aug['passes']} | {clean['loss']}) == 3

    code, out, err = run_cli(capsys, 'eval', '--checkpoint', tmp_path / 'aug' / 'last.pth', '--data', data,
                             '--robustness', 'imagenet-r', '--train-augment', 1)
    assert code == 2 and 'which --robustness does not go with' in err, err
    code, out, err = run_cli(capsys, 'eval', '--checkpoint', tmp_path / 'aug' / 'last.pth', '--data', data,
                             '--train-augment', 0)
    assert code == 2 and "argument --train-augment: expected an integer >= 1, got '0'" in err, err
    from safetensors.torch import save_file
    save_file(load_checkpoint(tmp_path / 'aug' / 'last.pth')['model'], tmp_path / 'w.safetensors')
    code, out, err = run_cli(capsys, 'eval', '--model', 'vit_tiny_patch16_224', '--checkpoint',
                             tmp_path / 'w.safetensors', '--data', data, '--train-augment', 1, kw[0])
    assert code == 2 and 'is not a vitblocks run checkpoint, so no training augmentation is known' in err, err


def test_the_log_says_how_long_setup_and_the_first_step_took(data, tmp_path, capsys, monkeypatch):
    # a GPU job's eight runs spent minutes before training (decoding, compiling): each log now says how many
    kw = ['model_kwargs={img_size: 8, patch_size: 4, embed_dim: 16, depth: 1, num_heads: 2}', 'progress=log',
          'tensorboard=false', 'log_interval=1']
    code, out, err = run_cli(capsys, 'train', '--model', 'vit_tiny_patch16_224', '--data', data, '--config',
                             'ninformer', '--max-steps', 2, '--batch-size', 8, '--output', tmp_path, '--name', 'r',
                             '--threads', 1, *kw)
    assert code == 0, err
    lines = err.splitlines()
    (run_line,) = [i for i, line in enumerate(lines) if line.startswith(f'run {tmp_path / "r"}:')]
    assert re.search(r', set up \d+ s after the process started$', lines[run_line])
    assert re.fullmatch(r'first step of this process \(step 1\) done \d+ s after it started \(compiling included\)',
                        lines[run_line + 1])
    assert lines[run_line + 2].startswith('step 2/2 ')  # (step 1 has no rate to print yet)
    assert len([line for line in lines if line.startswith('first step')]) == 1
    monkeypatch.setattr(engine, 'process_age_s', lambda: None)  # no /proc: no figures, no error
    code, out, err = run_cli(capsys, 'train', '--resume', tmp_path / 'r', 'max_steps=3')
    assert code == 0 and 'from step 2' in err and 'after the process started' not in err, err
    assert 'first step' not in err


@pytest.mark.parametrize('argv, fragment', [
    (['train', '--model', 'vit_tiny_patch16_224'], '--model and --data are required'),
    (['train', '--model', 'vit_tiny_patch16', '--data', '{data}'], 'Did you mean'),
    (['train', '--model', 'vit_tiny_patch16_224', '--data', '/no/such/dir'], '/no/such/dir: no such file'),
    (['train', '--model', 'vit_tiny_patch16_224', '--data', '{data}', '--config', 'dei'], 'Did you mean: deit'),
    (['train', '--model', 'vit_tiny_patch16_224', '--data', '{data}', 'epochz=3'], 'Did you mean: epochs'),
    (['eval', '--checkpoint', '/no/such.pth', '--data', '{data}'], '/no/such.pth: no such checkpoint file'),
    (['eval', '--checkpoint', '{run}', '--data', '{data}'], 'a folder, not a checkpoint file; give one of its '
                                                            'files (best.pth, last.pth)'),
    (['eval', '--checkpoint', '{foreign}', '--data', '{data}'], 'say which model it holds with --model'),
])
def test_cli_user_errors_are_one_line(data, tmp_path, capsys, argv, fragment):
    foreign = tmp_path / 'w.pth'
    torch.save({'w': torch.zeros(1)}, foreign)
    run = tmp_path / 'run'  # a run folder given where its checkpoint is meant
    run.mkdir()
    for name in ('last.pth', 'best.pth', 'metrics.csv'):
        (run / name).write_text('')
    argv = [a.format(data=data, foreign=foreign, run=run) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and 'Traceback' not in err
    assert fragment in err


# --- DDP ---------------------------------------------------------------------------------------------------

def test_torchrun_two_cpu_processes_train_and_evaluate(data, tmp_path):
    cfg = tiny_cfg(data, tmp_path, epochs=1, batch_size=4, checkpoint_interval=5)
    cfg_file = tmp_path / 'ddp.yaml'
    cfg_file.write_text(yaml.safe_dump(cfg.to_dict()))
    torchrun = shutil.which('torchrun', path=str(Path(sys.executable).parent)) or 'torchrun'
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    cmd = [torchrun, '--standalone', '--nproc_per_node', '2', '-m', 'vitblocks.experiments', str(cfg_file)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode and re.search(r'(?i)address already in use|rendezvous', proc.stderr):
        shutil.rmtree(tmp_path / 'run', ignore_errors=True)  # a port taken by another process: launch once more
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(': top-1 ') == 1, proc.stdout  # one summary for the run, not one per process
    import json
    res = json.loads((tmp_path / 'run' / 'results.json').read_text())
    # each process takes 96 / 2 = 48 images per epoch: 12 steps of 4, global batch 8
    assert res['global_step'] == 12
    assert res['final']['num_images'] == 40  # the two ranks' halves of the test split, each counted once
    ckpt = load_checkpoint(tmp_path / 'run' / 'last.pth')
    assert len(ckpt['rng']) == 2  # both processes' RNG states, for exact resume
    assert not any(k.startswith('module.') for k in ckpt['model'])


# --- reproduce, plot, robustness ----------------------------------------------------------------------------

def test_reproduce_ninformer_table1_with_a_budget(tmp_path, capsys):
    from _train_helpers import write_shards
    root = tmp_path / 'data'
    write_shards(root / 'mnist', 'train', n=128, per_shard=128, size=28, channels=1, num_classes=10)
    write_shards(root / 'mnist', 'test', n=32, per_shard=32, size=28, channels=1, num_classes=10, seed=1)
    argv = ['reproduce', 'ninformer-table1', '--datasets', 'mnist,cifar100', '--models', 'NiNformer (ours)',
            '--max-steps', 1, '--threads', 1, '--data-root', root, '--output', tmp_path / 'out', '--set',
            'progress=none', 'tensorboard=false']
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith('NiNformer (ours)'))
    cells = line.split()[2:]  # after the two words of the label: ours, best, paper, delta, epochs per dataset
    assert cells[1] == cells[0]  # one evaluation: the best is the last
    assert cells[2:4] == ['98.61', f'{float(cells[0]) - 98.61:+.2f}'] and cells[5:8] == ['-', '-', '53.78']
    assert 'CIFAR-100 is not available here' in out
    run_dir = tmp_path / 'out' / 'mnist' / 'ninformer_vit_patch4_28'
    cfg = yaml.safe_load((run_dir / 'config.yaml').read_text())
    assert (cfg['opt'], cfg['lr'], cfg['batch_size'], cfg['mlp_drop'], cfg['max_steps']) == ('adam', 1e-3, 128, 0.5, 1)
    assert cfg['hflip'] == 0.0  # no mirrored digits
    stamp = (run_dir / 'results.json').stat().st_mtime_ns
    code, out2, _ = run_cli(capsys, *argv, '--archive', tmp_path / 'runs.tgz')  # a finished run is reused
    assert code == 0 and (run_dir / 'results.json').stat().st_mtime_ns == stamp and line in out2
    import tarfile
    packed = tarfile.open(tmp_path / 'runs.tgz').getnames()  # the runs, without checkpoints, to carry to another job
    assert 'out/mnist/ninformer_vit_patch4_28/results.json' in packed and 'out/table.txt' in packed
    assert not any(n.endswith('.pth') for n in packed) and 'archive: ' in out2
    argv[argv.index('--max-steps') + 1] = 2  # a larger budget continues the run from step 1
    code, out3, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert load_checkpoint(run_dir / 'last.pth')['global_step'] == 2
    assert yaml.safe_load((run_dir / 'config.yaml').read_text())['max_steps'] == 2
    # --no-train prints the runs as they are: this one finished, the ViT row not run, nothing trains
    def row(out, label='NiNformer (ours)'):
        return next(line for line in out.splitlines() if line.startswith(label))

    line3 = row(out3)
    code, out4, err = run_cli(capsys, *argv, '--no-train')
    assert code == 0 and line3 in out4, err
    stamp = (run_dir / 'results.json').stat().st_mtime_ns
    argv[argv.index('--max-steps') + 1] = 5  # a larger budget: the run holds 2 of its 5 steps
    code, out5, err = run_cli(capsys, *argv, '--no-train')
    assert code == 0, err
    assert line3.split()[2:4] == row(out5).split()[2:4]
    assert 'mnist: ninformer_vit_patch4_28: unfinished, its last test evaluation (epoch ' in out5
    assert (run_dir / 'results.json').stat().st_mtime_ns == stamp
    assert load_checkpoint(run_dir / 'last.pth')['global_step'] == 2
    models = argv.index('--models') + 1
    code, out6, _ = run_cli(capsys, *argv[:models], 'ViT', *argv[models + 1:], '--no-train')
    assert code == 0 and 'mnist: ninformer_baseline_vit_patch4_28: not run yet' in out6
    assert row(out6, 'ViT').split()[1:3] == ['-', '-']
    code, _, err = run_cli(capsys, *argv, 'lr=0.01', '--no-train')  # (after --set: another config)
    assert code == 2 and 'another config (lr, max_steps differ)' in err
    for flags in (['--jobs', 2], ['--time-limit', 60], ['--train-only']):
        code, _, err = run_cli(capsys, *argv, '--no-train', *flags)
        assert code == 2 and f'--no-train prints the runs as they are; {flags[0]} would train them' in err


def test_reproduce_jobs_runs_each_model_in_its_own_process(tmp_path, capsys):
    from _train_helpers import write_shards
    root = tmp_path / 'data'
    write_shards(root / 'mnist', 'train', n=128, per_shard=128, size=28, channels=1, num_classes=10)
    write_shards(root / 'mnist', 'test', n=32, per_shard=32, size=28, channels=1, num_classes=10, seed=1)
    argv = ['reproduce', 'ninformer-table1', '--datasets', 'mnist', '--models', 'ViT,MlpMixer', '--max-steps', 1,
            '--jobs', 2, '--threads', 1, '--data-root', root, '--output', tmp_path / 'out', '--set', 'progress=none',
            'tensorboard=false']
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    for model in ('ninformer_baseline_vit_patch4_28', 'ninformer_baseline_mixer_patch4_28'):
        assert f'finished mnist/{model}: exit 0' in out
        child = (tmp_path / 'out' / 'mnist' / f'{model}.log').read_text()  # the child trains only: no table
        assert 'top-1 ' in child and 'mnist ours %' not in child
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (['ViT'], ['MlpMixer'])]
    assert [r[0] for r in rows] == ['ViT', 'MlpMixer'] and all(r[3] in ('97.12', '97.73') for r in rows)
    # the results alone are reused (checkpoints deleted, another thread count): nothing is retrained
    run_dir = tmp_path / 'out' / 'mnist' / 'ninformer_baseline_vit_patch4_28'
    (run_dir / 'last.pth').unlink()
    stamp = (run_dir / 'results.json').stat().st_mtime_ns
    argv[argv.index('--jobs'):argv.index('--jobs') + 4] = ['--threads', 2]
    code, out2, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert (run_dir / 'results.json').stat().st_mtime_ns == stamp and not (run_dir / 'last.pth').exists()
    assert 'started' not in out2  # no process for a finished run
    assert [ln for ln in out2.splitlines() if ln.startswith('ViT')] == \
        [ln for ln in out.splitlines() if ln.startswith('ViT')]
    # ... but not when the model that name builds has changed since (the config holds the name only)
    res = json.loads((run_dir / 'results.json').read_text())
    (run_dir / 'results.json').write_text(json.dumps(dict(res, params=res['params'] - 16384)))  # another model
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and 'definition changed' in err and '2,111,498-parameter' in err


def test_reproduce_ablations_share_the_pool_paused_first_and_print_their_own_tables(tmp_path, capsys,
                                                                                     monkeypatch):
    from _train_helpers import write_shards
    root = tmp_path / 'data'
    write_shards(root / 'mnist', 'train', n=128, per_shard=128, size=28, channels=1, num_classes=10)
    write_shards(root / 'mnist', 'test', n=32, per_shard=32, size=28, channels=1, num_classes=10, seed=1)
    pools = []
    real = reproduce_cmd.run_children
    monkeypatch.setattr(reproduce_cmd, 'run_children',
                        lambda args, children: pools.append([(j.name, j.priority) for j in children]) or
                        real(args, children))
    argv = ['reproduce', 'ninformer-table1', '--datasets', 'mnist', '--models', 'ViT,NiNformer', '--max-steps', 1,
            '--jobs', 4, '--threads', 1, '--data-root', root, '--output', tmp_path / 'out', '--set', 'progress=none',
            'tensorboard=false', '--ablation', 'seed1', 'mnist/ViT', 'seed=1',
            '--ablation', 'drop', 'mnist/NiNformer,mnist/ViT', 'mlp_drop=0.1', 'lr=0.002']
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    vit, nin = 'mnist/ninformer_baseline_vit_patch4_28', 'mnist/ninformer_vit_patch4_28'
    # one pool: the table's rows (NiNformer's own paused last), then the ablations, paused first
    assert pools == [[(vit, 0), (nin, 1), (f'seed1:{vit}', -1), (f'drop:{nin}', -1), (f'drop:{vit}', -1)]]
    for folder, run, seed, drop, lr in (('out', vit, 0, 0.5, 0.001), ('out-seed1', vit, 1, 0.5, 0.001),
                                        ('out-drop', nin, 0, 0.1, 0.002), ('out-drop', vit, 0, 0.1, 0.002)):
        cfg = yaml.safe_load((tmp_path / folder / run / 'config.yaml').read_text())
        assert (cfg['seed'], cfg['mlp_drop'], cfg['lr'], cfg['max_steps']) == (seed, drop, lr, 1)
        assert (tmp_path / folder / run / 'results.json').is_file()
    # the table, then one table per ablation, each also saved in its folder
    titles = [line for line in out.splitlines() if line.startswith('NiNformer Table 1')]
    assert titles == ['NiNformer Table 1: test top-1 % (ours: un-augmented test split)',
                      'NiNformer Table 1, ablation seed1 (seed=1): test top-1 %',
                      'NiNformer Table 1, ablation drop (mlp_drop=0.1 lr=0.002): test top-1 %']
    drop_table = (tmp_path / 'out-drop' / 'table.txt').read_text()
    assert 'dropout 0.1' in drop_table and 'runs in ' + str(tmp_path / 'out-drop') in drop_table
    assert [line.split()[0] for line in drop_table.splitlines()[3:5]] == ['ViT', 'NiNformer']
    # a re-run reuses everything: no pool at all; --no-train prints the same tables
    code, out2, err = run_cli(capsys, *argv)
    assert code == 0 and len(pools) == 1 and 'started' not in out2, err
    code, out3, err = run_cli(capsys, *argv[:argv.index('--jobs')], *argv[argv.index('--data-root'):], '--no-train')
    assert code == 0, err
    assert [line for line in out3.splitlines() if line.startswith('ViT')] == \
        [line for line in out.splitlines() if line.startswith('ViT')]


@pytest.mark.parametrize('ablation, message', [
    (['x', 'mnist/ViT'], 'expected NAME ROWS KEY=VALUE [KEY=VALUE ...]'),
    (['a/b', 'mnist/ViT', 'seed=1'], 'a name of letters, digits'),
    (['a', 'ViT', 'seed=1'], "'ViT' is not DATASET/ROW"),
    (['a', 'svhn/ViT', 'seed=1'], "'svhn/ViT' is not DATASET/ROW"),
    (['a', 'mnist/Foo', 'seed=1'], '--models: unknown Foo'),
    (['a', 'mnist/ViT', 'sed=1'], 'Did you mean: seed'),
    (['a', 'mnist/ViT', 'mlp_drop=0.5'], "mlp_drop=0.5 is what the table's mnist ninformer_baseline_vit_patch4_28 "
                                         "run has already"),
    (['a', 'mnist/ViT', 'threads=3'], 'would train the same run'),
])
def test_reproduce_bad_ablations_are_one_line_errors_before_anything_trains(tmp_path, capsys, ablation, message):
    from _train_helpers import write_shards
    write_shards(tmp_path / 'data' / 'mnist', 'train', n=16, per_shard=16, size=28, channels=1, num_classes=10)
    code, out, err = run_cli(capsys, 'reproduce', 'ninformer-table1', '--datasets', 'mnist', '--data-root',
                             tmp_path / 'data', '--output', tmp_path / 'out', '--ablation', *ablation)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and out == '', err
    assert not (tmp_path / 'out').exists()
    code, _, err = run_cli(capsys, 'reproduce', 'ninformer-table1', '--datasets', 'mnist', '--data-root',
                           tmp_path / 'data', '--output', tmp_path / 'out', '--ablation', 'a', 'mnist/ViT', 'seed=1',
                           '--ablation', 'a', 'mnist/ViT', 'seed=2')
    assert code == 2 and '--ablation a: given twice' in err


class _PoolSeen(Exception):
    pass


def test_reproduce_ablations_first_start_first_and_are_paused_last(tmp_path, capsys, monkeypatch):
    """Where an ablation is what a short GPU job is for, --ablations-first puts it before the table's rows in the
    pool: started first, and paused only after every Table 1 run (priority 2 against 0 and 1)."""
    from _train_helpers import write_shards
    write_shards(tmp_path / 'data' / 'mnist', 'train', n=16, per_shard=16, size=28, channels=1, num_classes=10)
    pools = []

    def seen(args, children):
        pools.append([(j.name, j.priority) for j in children])
        raise _PoolSeen

    monkeypatch.setattr(reproduce_cmd, 'run_children', seen)
    argv = ['reproduce', 'ninformer-table1', '--datasets', 'mnist', '--models', 'ViT,NiNformer', '--data-root',
            tmp_path / 'data', '--output', tmp_path / 'out', '--ablation', 'torchinit', 'mnist/NiNformer',
            'model_kwargs={block_cfg: {init: torch}}']
    vit, nin = 'mnist/ninformer_baseline_vit_patch4_28', 'mnist/ninformer_vit_patch4_28'
    for order, expected in ((['--ablations-first'], [(f'torchinit:{nin}', 2), (vit, 0), (nin, 1)]),
                            ([], [(vit, 0), (nin, 1), (f'torchinit:{nin}', -1)])):
        with pytest.raises(_PoolSeen):
            run_cli(capsys, *argv, '--time-limit', 600, *order)
        assert pools.pop() == expected
    # where nothing orders a pool, the flag would do nothing: a one-line error, nothing trains
    for extra, message in ((['--ablations-first'], 'give --jobs N or --time-limit S'),
                           (['--ablations-first', '--no-train'], '--no-train prints the runs as they are; '
                                                                 '--ablations-first would train them')):
        code, out, err = run_cli(capsys, *argv, *extra)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and out == '', err
    code, out, err = run_cli(capsys, *argv[:argv.index('--ablation')], '--jobs', 2, '--ablations-first')
    assert code == 2 and 'give --ablation' in err and not pools and not (tmp_path / 'out').exists(), err


def test_reproduce_jobs_reports_a_failed_run(tmp_path, capsys):
    from _train_helpers import write_shards
    write_shards(tmp_path / 'mnist', 'train', n=16, per_shard=16, size=28, channels=1, num_classes=10)
    argv = ['reproduce', 'ninformer-table1', '--datasets', 'mnist', '--models', 'ViT', '--jobs', 2, '--data-root',
            tmp_path, '--output', tmp_path / 'out']
    code, out, err = run_cli(capsys, *argv)  # no test split: the child finds out when it loads the data
    assert code == 1 and 'run failed, see' in err and 'ninformer_baseline_vit_patch4_28.log' in err
    log = (tmp_path / 'out' / 'mnist' / 'ninformer_baseline_vit_patch4_28.log').read_text()
    assert "no shard of split 'test'" in log
    # a config no run can take is the parent's one-line error: no child starts
    code, out, err = run_cli(capsys, *argv, '--set', 'progress=sometimes')
    assert code == 2 and 'progress' in err and len(err.strip().splitlines()) == 1 and 'started' not in out, err


def test_plot_curves_and_tradeoff(data, tmp_path, capsys):
    for name, width in (('a', 16), ('b', 32)):
        kw = dict(TINY_VIT, embed_dim=width)
        train(tiny_cfg(data, tmp_path, name=name, epochs=2, model_kwargs=kw, model_ema=False))
    code, out, err = run_cli(capsys, 'plot', tmp_path / 'a', tmp_path / 'b', '--output', tmp_path / 'figs',
                             '--threads', 1, '--repeats', 2, '--latency-batch', 4)
    assert code == 0, err
    for png in (tmp_path / 'a' / 'curves.png', tmp_path / 'b' / 'curves.png', tmp_path / 'figs' / 'tradeoff.png'):
        assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    gmacs = [float(ln.split(',')[1].split()[0]) for ln in out.splitlines() if 'GMACs' in ln]
    assert len(gmacs) == 2 and gmacs[1] > gmacs[0]  # the wider model costs more
    assert 'ms/batch' in out
    code, _, err = run_cli(capsys, 'plot', tmp_path)
    assert code == 2 and 'not a run folder' in err
    code, _, err = run_cli(capsys, 'plot', tmp_path / 'a', '--no-latency', '--repeats', 3, '--device', 'cpu')
    assert code == 2 and '--repeats, --device: options of the latency measurement, which --no-latency skips' in err


def test_a_plot_that_fails_to_save_keeps_the_previous_curves(data, tmp_path, capsys, monkeypatch):
    import matplotlib.image
    train(tiny_cfg(data, tmp_path, max_steps=1, model_ema=False))
    code, _, err = run_cli(capsys, 'plot', tmp_path / 'run', '--no-latency')
    curves = tmp_path / 'run' / 'curves.png'
    assert code == 0 and curves.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n', err
    good = curves.read_bytes()

    def disk_full(fname, *args, **kwargs):  # the PNG writer stops half-way into the file
        with open(fname, 'wb') as f:
            f.write(good[:100])
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(matplotlib.image, 'imsave', disk_full)
    code, _, err = run_cli(capsys, 'plot', tmp_path / 'run', '--no-latency')
    assert code == 2 and 'cannot write curves.png there (No space left on device)' in err, err
    assert curves.read_bytes() == good and not list((tmp_path / 'run').glob('.*.tmp'))


def test_eval_imagenet_r_restricts_logits_to_its_200_classes(tmp_path, capsys):
    from safetensors.torch import save_file
    from vitblocks.experiments.robustness import _imagenet_synsets, _subset_classes, mean_corruption_error
    from PIL import Image
    import numpy as np
    wnids = _subset_classes('imagenet-r')
    for w in wnids[:2]:
        (tmp_path / 'r' / w).mkdir(parents=True)
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / 'r' / w / 'x.png')
    model = timm.create_model('vit_tiny_patch16_224', num_classes=1000, **TINY_VIT)
    with torch.no_grad():  # a head that always answers the second ImageNet-R class
        model.head.weight.zero_()
        model.head.bias.zero_()
        model.head.bias[_imagenet_synsets().index(wnids[1])] = 10.0
        model.head.bias[0] = 20.0  # a class outside ImageNet-R: ignored by the 200-class protocol
    save_file(model.state_dict(), str(tmp_path / 'w.safetensors'))
    code, out, err = run_cli(capsys, 'eval', '--model', 'vit_tiny_patch16_224', '--checkpoint',
                             tmp_path / 'w.safetensors', '--data', tmp_path / 'r', '--robustness', 'imagenet-r',
                             '--threads', 1, 'model_kwargs={img_size: 8, patch_size: 4, embed_dim: 16, depth: 1, '
                             'num_heads: 2}', 'mean=[0.5, 0.5, 0.5]', 'std=[0.5, 0.5, 0.5]')
    assert code == 0, err
    assert 'top-1    50.00%' in out  # one of the two images is of the class the head answers
    mce = mean_corruption_error({'fog': {1: 10.0, 2: 30.0}, 'snow': {1: 40.0}}, {'fog': 40.0, 'snow': 80.0})
    assert mce == {'fog': 50.0, 'snow': 50.0, 'mean': 50.0}


def test_train_step_ops_benchmark_names_the_dropout_masks():
    """benchmarks/train_step_ops.py (docs/training.md): with the recipe's dropout the masks are a share of the
    step; without it there are none, and the GEMMs remain."""
    script = Path(__file__).resolve().parents[1] / 'benchmarks' / 'train_step_ops.py'
    env = dict(os.environ, PYTHONPATH=str(script.parents[1] / 'src'))
    shares = {}
    for drop in ('0.5', '0'):
        out = subprocess.run([sys.executable, str(script), '--batch-size', '2', '--steps', '1', '--threads', '1',
                              '--mlp-drop', drop], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        m = re.search(r'^step 1: [\d.]+ s; dropout masks \(bernoulli_\) ([\d.]+)%, GEMMs \(mm \+ addmm\) ([\d.]+)%',
                      out.stdout, re.M)
        assert m, out.stdout
        shares[drop] = float(m[1]), float(m[2])
    assert shares['0.5'][0] > 0 and shares['0'][0] == 0
    assert shares['0.5'][1] > 0 and shares['0'][1] > 0


def _reordered_copy(src: Path, dst: Path, order) -> None:
    """The shards of ``src`` with their class list in another order (``order``: old index -> new position) and each
    ``.cls`` renumbered to match: the same images under the same class names."""
    import io
    import json
    import tarfile
    dst.mkdir(parents=True)
    manifest = json.loads((src / 'MANIFEST.json').read_text())
    names = manifest['classes']
    new_names = [None] * len(names)
    for old, new in enumerate(order):
        new_names[new] = names[old]
    manifest['classes'] = new_names
    (dst / 'MANIFEST.json').write_text(json.dumps(manifest))
    for shard in src.glob('*.tar.gz'):
        with tarfile.open(shard) as tin, tarfile.open(dst / shard.name, 'w:gz') as tout:
            for member in tin.getmembers():
                data = tin.extractfile(member).read()
                if member.name.endswith('.cls'):
                    data = str(order[int(data)]).encode()
                member.size = len(data)
                tout.addfile(member, io.BytesIO(data))


def test_eval_renumbers_a_dataset_whose_classes_are_in_another_order(data, tmp_path, capsys):
    """A test split listing the checkpoint's classes in another order, its labels following that order: the
    evaluation matches images to the checkpoint's classes by name, so top-1 and the per-class counts are those
    of the split in the checkpoint's own order (before, the labels kept their indices under the new names)."""
    import json
    train_tiny_run(capsys, data, tmp_path, 6)
    _reordered_copy(data, tmp_path / 'reordered', order=[2, 0, 3, 1])
    results = []
    for folder in (data, tmp_path / 'reordered'):
        code, out, err = run_cli(capsys, 'eval', '--checkpoint', tmp_path / 'r' / 'last.pth', '--data', folder,
                                 '--threads', 1, '--per-class', '--json', tmp_path / 'e.json')
        assert code == 0, err
        (res,) = json.loads((tmp_path / 'e.json').read_text())['results'].values()
        results.append(res)
    assert results[1]['top1'] == results[0]['top1'] and results[1]['num_images'] == results[0]['num_images'] == 40
    assert results[1]['loss'] == pytest.approx(results[0]['loss'], rel=1e-6)
    assert len(results[0]['per_class_top1']) == 4
    assert results[1]['per_class_top1'] == results[0]['per_class_top1']  # the checkpoint's class order in both


@pytest.mark.parametrize('argv, message', [
    (['--name', '../../escape'], "name='../../escape' must be one folder name inside output"),
    (['--name', '..'], "name='..' must be one folder name"),
    (['std=[0, 0.2, 0.2]'], "std=[0.0, 0.2, 0.2]: every channel's std must be > 0"),
    (['opt=sgd', 'momentum=0'], 'opt=sgd is timm\'s SGD with Nesterov momentum, which needs momentum > 0'),
    (['lr=0.1', 'lr=0.2'], 'lr given more than once (lr=0.1, lr=0.2); give each key once'),
    (['model_kwargs={embed_dim: -1}'], 'cannot build vit_tiny_patch16_224 with'),
])
def test_config_values_found_wrong_before_training_are_one_line_errors(data, tmp_path, capsys, argv, message):
    code, out, err = run_cli(capsys, 'train', '--model', 'vit_tiny_patch16_224', '--data', data, '--output',
                             tmp_path / 'runs', '--max-steps', 1, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / 'escape').exists() and not any(tmp_path.parent.glob('escape'))


def test_the_collective_timeout_is_a_config_key(data, tmp_path, monkeypatch):
    """dist_timeout_min reaches the process group (it was fixed at 30 minutes); 0 is an error; resume may change it."""
    from vitblocks.experiments import engine
    from vitblocks.experiments.config import RESUME_CHANGEABLE
    seen = []
    real = engine.init_distributed
    monkeypatch.setattr(engine, 'init_distributed', lambda device, timeout: seen.append(timeout) or real(device))
    train(tiny_cfg(data, tmp_path, max_steps=1, dist_timeout_min=5))
    from datetime import timedelta
    assert seen == [timedelta(minutes=5)]
    with pytest.raises(ConfigError, match='dist_timeout_min'):
        tiny_cfg(data, tmp_path, dist_timeout_min=0)
    assert 'dist_timeout_min' in RESUME_CHANGEABLE


def test_checkpoint_history_keeps_the_newest_and_resume_falls_back_to_it(data, tmp_path, capsys):
    """checkpoint_hist=2 keeps copies of the two newest last.pth; with last.pth corrupt, a resume continues from the
    newest good copy (saying so) instead of refusing, and ends where an uninterrupted run ends."""
    cfg = tiny_cfg(data, tmp_path, epochs=3, checkpoint_hist=2)
    first = train(merge(cfg.to_dict(), {'max_steps': 36}))  # 3 epochs of 12 steps: a copy at 12, 24, 36
    assert first.global_step == 36
    history = sorted(p.name for p in (tmp_path / 'run' / 'history').iterdir())
    assert history == ['step000000024.pth', 'step000000036.pth']
    last = tmp_path / 'run' / 'last.pth'
    data_bytes = bytearray(last.read_bytes())
    data_bytes[len(data_bytes) // 2] ^= 0xFF
    last.write_bytes(bytes(data_bytes))
    (tmp_path / 'run' / 'history' / 'step000000036.pth').write_bytes(b'cut short')  # the newest copy is bad too
    capsys.readouterr()
    with pytest.raises(CheckpointError):
        load_checkpoint(last)
    resumed = train(cfg, run_dir=tmp_path / 'run', resume=last)
    printed = capsys.readouterr().out
    assert 'resuming from' in printed and 'step000000024.pth instead' in printed
    assert resumed.global_step == 36 and load_checkpoint(last)['global_step'] == 36


def test_a_disk_that_fills_during_a_checkpoint_is_one_line_and_keeps_the_previous(data, tmp_path, capsys, monkeypatch):
    """A checkpoint write that stops part-way (the disk fills: torch's zip writer says 'unexpected pos ...', which
    was a 43-line traceback): one line, exit 2, the previous last.pth intact and loadable, no temporary left."""
    import errno
    train_tiny_run(capsys, data, tmp_path, 2)
    from vitblocks.experiments import checkpoint
    real_fdopen = checkpoint.os.fdopen

    class FillsUp:  # the real file, until 4 KiB have gone in
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            if self.n + len(b) > 4096:
                raise OSError(errno.ENOSPC, 'No space left on device')
            self.n += len(b)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)
    monkeypatch.setattr(checkpoint.os, 'fdopen', lambda fd, mode: FillsUp(real_fdopen(fd, mode)))
    code, out, err = run_cli(capsys, 'train', '--resume', tmp_path / 'r', 'max_steps=4')
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert 'cannot write the checkpoint: the write stopped part-way' in err and 'previous checkpoint is intact' in err
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / 'r' / 'last.pth')['global_step'] == 2
    assert not [p for p in (tmp_path / 'r').iterdir() if p.name.endswith('.tmp')]


def test_the_run_folder_is_checked_before_the_data_is_decoded(data, tmp_path, capsys, monkeypatch):
    """A --name that is a file, or a folder holding a run, is one line before any data is read (it was a traceback
    for a file, and the folder was checked only after the whole training split had been decoded)."""
    from vitblocks.cli import train as train_cmd
    (tmp_path / 'afile').write_text('x')
    (tmp_path / 'done').mkdir()
    (tmp_path / 'done' / 'last.pth').write_bytes(b'x')
    monkeypatch.setattr(train_cmd, 'train', lambda *a, **k: pytest.fail('the data was read before the check'))
    for name, message in (('afile', 'is a file, not a run folder'), ('done', 'already holds a run (last.pth)')):
        code, out, err = run_cli(capsys, 'train', '--model', 'vit_tiny_patch16_224', '--data', data, '--output',
                                 tmp_path, '--name', name, '--max-steps', 1)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_unreadable_and_corrupt_files_are_named_for_what_they_are(data, tmp_path, monkeypatch):
    """A checkpoint this user may not read is a permission problem, not 'corrupt'; a data.pkl with a byte that is no
    pickle opcode is corrupt, not 'would run code'; an unreadable classes.txt is one DataError, not a traceback."""
    import zipfile
    train(tiny_cfg(data, tmp_path, max_steps=1))
    good = tmp_path / 'run' / 'last.pth'
    from vitblocks.experiments import checkpoint
    with monkeypatch.context() as m:  # what torch.load raises for a file this user may not read (root reads any)
        m.setattr(checkpoint.torch, 'load', lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, 'Permission '
                                                                                                    'denied')))
        with pytest.raises(CheckpointError, match=r'cannot read it \(Permission denied\); check its permissions'):
            load_checkpoint(good)
    bad = tmp_path / 'bad.pth'
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, 'w', zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            body = zin.read(item.filename)
            if item.filename.endswith('data.pkl'):
                body = body[:2] + b'\xfa' + body[3:]  # 0xfa is no pickle opcode
            zout.writestr(item, body)
    with pytest.raises(CheckpointError, match=r'corrupt: its pickled data does not read \(Unsupported operand 250\)'):
        load_checkpoint(bad)
    from vitblocks.data import ShardDataset
    from _train_helpers import write_shards
    write_shards(tmp_path / 'd', 'test', n=8, per_shard=8, num_classes=2, manifest=False)
    (tmp_path / 'd' / 'classes.txt').write_bytes(b'\xff\xfecat\n')
    with pytest.raises(DataError, match=r'classes.txt: not UTF-8 text'):
        ShardDataset(str(tmp_path / 'd'), 'test')


def test_resume_with_changed_optimisation_settings_is_explicit_and_recorded(data, tmp_path, capsys):
    """A run that needs another learning rate continues with --change (a plain lr=... on --resume is refused with
    the --change that does it); the new lr is what the optimizer uses from the next step, clipping applies, the
    config says so, and changes.jsonl records the step and both values."""
    import json
    train_tiny_run(capsys, data, tmp_path, 3, '--lr', 0.01, 'sched=none', 'log_interval=1')
    code, out, err = run_cli(capsys, 'train', '--resume', tmp_path / 'r', 'lr=0.002', 'max_steps=6')
    assert code == 2 and '--change lr=0.002' in err and len(err.strip().splitlines()) == 1, err
    code, out, err = run_cli(capsys, 'train', '--resume', tmp_path / 'r', 'max_steps=6', '--change', 'lr=0.002',
                             'clip_grad=1.0')
    assert code == 0 and 'trained  6 steps' in out, err
    ckpt = load_checkpoint(tmp_path / 'r' / 'last.pth')
    assert {g['lr'] for g in ckpt['optimizer']['param_groups']} == {0.002}
    assert ckpt['config']['lr'] == 0.002 and ckpt['config']['clip_grad'] == 1.0
    with open(tmp_path / 'r' / 'metrics.csv') as f:
        lrs = {int(r['step']): float(r['lr']) for r in csv.DictReader(f) if r['split'] == 'train'}
    assert lrs[3] == pytest.approx(0.01) and lrs[4] == pytest.approx(0.002) and lrs[6] == pytest.approx(0.002)
    (record,) = [json.loads(line) for line in (tmp_path / 'r' / 'changes.jsonl').read_text().splitlines()]
    assert record['step'] == 3 and record['changes'] == {'clip_grad': [None, 1.0], 'lr': [0.01, 0.002]}
    for argv, message in ((['--resume', tmp_path / 'r', '--change', 'batch_size=4'], '--change batch_size: a resume '
                           'can be asked to change'),
                          (['--model', 'vit_tiny_patch16_224', '--data', data, '--change', 'lr=0.1'],
                           '--change changes the settings of a run being resumed')):
        code, out, err = run_cli(capsys, 'train', *argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
