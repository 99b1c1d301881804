"""Every bad input is one line (exit 2), nothing corrupt passes unnoticed, runs survive
being moved, killed and resumed. A one-block 8x8 ViT on tiny synthetic shards, one CPU thread."""
import csv
import errno
import json
import os
import signal
import shutil
import time
from pathlib import Path

import pytest
import timm
import torch
import yaml

import vitblocks.cli as cli
from vitblocks.cli import list_models as list_cmd
from vitblocks.experiments import CheckpointError, Trainer, load_checkpoint, merge, save_checkpoint
from vitblocks.experiments.config import ConfigError, load_recipe, parse_overrides
from vitblocks.experiments.runlog import read_stop_record
from vitblocks.experiments.setup import load_initial_weights
from vitblocks.profile import count_macs, fixed_threads, input_size_of

from _train_helpers import TINY_VIT, tiny_dataset

TINY = 'model_kwargs={img_size: 8, patch_size: 4, embed_dim: 16, depth: 1, num_heads: 2}'
QUIET = ['progress=none', 'tensorboard=false', '--threads', '1']


@pytest.fixture(autouse=True, scope='module')
def _one_thread():
    with fixed_threads(1):
        yield


@pytest.fixture(scope='module')
def data(tmp_path_factory) -> Path:
    return tiny_dataset(tmp_path_factory.mktemp('data') / 'tiny')


@pytest.fixture(scope='module')
def run_dir(data, tmp_path_factory) -> Path:
    """A finished 2-step run (4 classes)."""
    out = tmp_path_factory.mktemp('runs')
    code = cli.main(['train', '--model', 'vit_tiny_patch16_224', '--data', str(data), '--max-steps', '2',
                     '--epochs', '1', '--batch-size', '8', '--output', str(out), '--name', 'r', TINY, *QUIET])
    assert code == 0
    return out / 'r'


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code, err, fragment):
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and 'Traceback' not in err, err
    assert fragment in err, err


def tiny_train(data, out, *extra):
    """``vitblocks train`` argv of a tiny run; a key in ``extra`` replaces QUIET's (a key given twice is an error)."""
    given = {str(e).partition('=')[0] for e in extra if '=' in str(e)}
    quiet = [q for q in QUIET if q.partition('=')[0] not in given]
    return ['train', '--model', 'vit_tiny_patch16_224', '--data', data, '--epochs', 1, '--batch-size', 8,
            '--output', out, TINY, *quiet, *extra]


# --- 1: typed config values ----------------------------------------------------------------------------

def test_numbers_and_booleans_are_typed(tmp_path):
    assert parse_overrides(['lr=5e-4', 'warmup_lr=1e-6', 'max_steps=1e3'])['lr'] == 5e-4
    recipe = tmp_path / 'r.yaml'
    recipe.write_text('lr: 1e-3\nmodel_ema: "false"\namp: "no"\ncompile: "yes"\n')
    cfg = merge(load_recipe(str(recipe)))
    assert (cfg.lr, cfg.model_ema, cfg.amp, cfg.compile) == (1e-3, False, False, True)
    assert type(merge({'max_steps': 1e3}).max_steps) is int


@pytest.mark.parametrize('override, message', [
    ('opt=adamx', "opt='adamx': expected one of"), ('sched=cosin', 'did you mean cosine'),
    ('seed=abc', "seed='abc': expected an integer"), ('smoothing=1.5', 'smoothing=1.5: expected a number in [0, 1)'),
    ('device=tpu', "device='tpu': expected 'auto', 'cpu'"), ('hflip=2.0', 'hflip=2.0: expected a number in [0, 1]'),
    ('interpolation=bicubik', 'did you mean bicubic'), ('auto_augment=rand-xyz', "'xyz' is not one"),
    ('model_ema=maybe', 'expected true/false'),
    # nan passed every range rule (nan < 0 is False): lr=nan was a torch traceback, weight_decay=nan or
    # clip_grad=nan trained a step and stopped as 'diverged', warmup_epochs=inf trained at warmup_lr forever
    ('lr=nan', 'lr=nan: expected a finite number'), ('lr=.inf', 'lr=inf: expected a finite number'),
    ('weight_decay=nan', 'weight_decay=nan: expected a finite number'),
    ('clip_grad=.inf', 'clip_grad=inf: expected a finite number'),
    ('warmup_epochs=inf', 'warmup_epochs=inf: expected a finite number'),
    ('mean=[.nan, 0.5, 0.5]', 'mean=[nan, 0.5, 0.5]: expected finite numbers'),
])
def test_bad_values_are_refused_at_load_time(override, message):
    with pytest.raises(ConfigError) as e:
        merge(parse_overrides([override]))
    assert message in str(e.value)


# --- 7/10: the command line ------------------------------------------------------------------------------

@pytest.mark.parametrize('extra, fragment', [
    (['opt=adamx'], 'did you mean adamax'), (['seed=abc'], "seed='abc'"),
    (['--device', 'tpu'], "device='tpu'"), (['input_size=[3, 16, 16]'], 'is built for 8x8 images only'),
    (['--train-subset', '1000'], 'train_subset=1000'), (['--lr', 'nan'], 'lr=nan: expected a finite number'),
    # a flag and its KEY=VALUE: the flag won silently (tiny_train's --epochs 1 over epochs=5)
    (['epochs=5'], '--epochs 1 and epochs=5 disagree; give one of them'),
    (['--no-amp', 'amp=yes', '--seed', '3', 'seed=4'], '--no-amp and amp=True disagree; --seed 3 and seed=4 disagree'),
])
def test_train_bad_inputs_are_one_line(data, tmp_path, capsys, extra, fragment):
    assert_one_line(*run_cli(capsys, *tiny_train(data, tmp_path, *extra))[::2], fragment)


def test_train_unknown_model_fails_before_the_data_is_decoded(data, tmp_path, capsys, monkeypatch):
    # the class count was read from the training split first (30 s of decoding for CIFAR-10, minutes for
    # ImageNet) and only then was the model name looked up
    import vitblocks.experiments.engine as engine

    def decode(cfg):
        raise AssertionError(f'decoded {cfg.data} for a model that does not exist')
    monkeypatch.setattr(engine, 'open_train_split', decode)
    code, _, err = run_cli(capsys, 'train', '--model', 'vit_tiny_patch16', '--data', data, '--output', tmp_path,
                           *QUIET)
    assert_one_line(code, err, "unknown model 'vit_tiny_patch16'. Did you mean")


def test_unwritable_outputs_fail_before_any_work(data, run_dir, tmp_path, capsys):
    blocker = tmp_path / 'file'
    blocker.write_text('x')
    code, _, err = run_cli(capsys, *tiny_train(data, blocker / 'runs'))
    assert_one_line(code, err, 'is a file, not a folder')
    code, out, err = run_cli(capsys, 'eval', '--checkpoint', run_dir / 'last.pth', '--data', data, '--json',
                             blocker / 'x.json', '--threads', 1)
    assert_one_line(code, err, '--json')
    assert 'top-1' not in out  # refused before evaluating
    code, out, err = run_cli(capsys, 'plot', run_dir, '--output', blocker / 'figs', '--no-latency')
    assert_one_line(code, err, 'is a file, not a folder')


def test_key_value_overrides_anywhere(data, tmp_path, capsys):
    code, out, err = run_cli(capsys, 'train', '--model', 'vit_tiny_patch16_224', 'lr=5e-4', '--data', data,
                             '--epochs', 1, 'max_steps=1', '--batch-size', 8, '--output', tmp_path, TINY, *QUIET)
    assert code == 0, err
    assert yaml.safe_load(next(tmp_path.glob('*/config.yaml')).read_text())['lr'] == 5e-4


def test_block_cfg_values_are_checked(capsys):
    assert_one_line(*run_cli(capsys, 'profile', 'iffn_deit_tiny_patch16_224', '--block-cfg', 'num_functions=0')[::2],
                    'num_functions must be a positive integer')
    assert_one_line(*run_cli(capsys, 'profile', 'iffn_deit_tiny_patch16_224', '--block-cfg', 'kernel_size=true')[::2],
                    'kernel_size must be a positive odd integer')
    assert_one_line(*run_cli(capsys, 'profile', 'ninformer_vit_patch4_28', '--block-cfg', 'token_mlp_dim=0')[::2],
                    'token_mlp_dim must be a positive integer')


def test_empty_metrics_and_malformed_config(run_dir, tmp_path, capsys):
    bad = tmp_path / 'bad'
    shutil.copytree(run_dir, bad)
    (bad / 'metrics.csv').write_text('')
    assert_one_line(*run_cli(capsys, 'plot', bad, '--no-latency')[::2], 'no rows yet')
    (bad / 'config.yaml').write_text('model: [unclosed\n')
    assert_one_line(*run_cli(capsys, 'train', '--resume', bad)[::2], 'not valid YAML')


def test_broken_pipe_is_quiet(monkeypatch, capsys):
    def run(args):
        raise BrokenPipeError(errno.EPIPE, 'Broken pipe')
    monkeypatch.setattr(list_cmd, 'run', run)
    code, out, err = run_cli(capsys, 'list')
    assert code == 141 and err == ''


def test_profile_bench_export_take_num_classes_and_img_size(tmp_path, capsys):
    code, out, err = run_cli(capsys, 'profile', 'deit_tiny_patch16_224', '--img-size', 32, '--num-classes', 10)
    assert code == 0, err
    assert 'input   1 x 3 x 32 x 32' in out and 'params  5,489,482' in out  # 5,717,416 - 192 x 990 - 990 - pos
    code, out, err = run_cli(capsys, 'bench', 'deit_tiny_patch16_224', '--img-size', 32, '--repeats', 1, '--warmup',
                             0, '--batch-size', 1)
    assert code == 0 and '1 x 3x32x32' in out, err
    assert_one_line(*run_cli(capsys, 'profile', 'deit_tiny_patch16_224', '--img-size', 1, 2, 3)[::2], '--img-size')


# --- 4: MACs at the size the model was built for --------------------------------------------------------

def test_count_macs_uses_the_built_img_size():
    model = timm.create_model('vit_tiny_patch16_224', img_size=(48, 32), patch_size=16, depth=1)
    assert input_size_of(model) == (3, 48, 32)
    assert count_macs(model).total == count_macs(model, input_size=(3, 48, 32)).total
    gray = timm.create_model('vit_tiny_patch16_224', img_size=28, patch_size=4, in_chans=1, depth=1)
    assert input_size_of(gray) == (1, 28, 28)


# --- 5: corruption is named as corruption --------------------------------------------------------------

def test_flipped_tensor_byte_is_detected(run_dir, data, tmp_path, capsys):
    raw = bytearray((run_dir / 'last.pth').read_bytes())
    weight = load_checkpoint(run_dir / 'last.pth')['model']['head.weight']
    at = bytes(raw).find(weight.numpy().tobytes())
    assert at > 0
    raw[at + 3] ^= 0x40
    bad = tmp_path / 'flipped.pth'
    bad.write_bytes(bytes(raw))
    torch.load(bad, weights_only=True)  # torch itself does not notice
    with pytest.raises(CheckpointError, match='corrupt: its tensors do not match the digest'):
        load_checkpoint(bad)
    assert_one_line(*run_cli(capsys, 'eval', '--checkpoint', bad, '--data', data)[::2], 'corrupt')


def test_full_disk_is_one_error_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / 'last.pth'
    save_checkpoint({'x': torch.ones(1)}, path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(torch, 'save', full)
    with pytest.raises(CheckpointError, match=r'No space left on device\); the previous checkpoint is intact'):
        save_checkpoint({'x': torch.zeros(1)}, path)
    monkeypatch.undo()
    assert torch.equal(load_checkpoint(path)['x'], torch.ones(1))
    assert [p.name for p in tmp_path.iterdir()] == ['last.pth']


# --- 3 and 8: moved data, edited configs, wrong data ----------------------------------------------------

def test_absolute_data_and_resume_from_elsewhere_with_moved_data(data, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(data.parent)
    code, _, err = run_cli(capsys, *tiny_train(data.name, tmp_path, '--max-steps', 2, '--name', 'r'))
    assert code == 0, err
    cfg = yaml.safe_load((tmp_path / 'r' / 'config.yaml').read_text())
    assert cfg['data'] == str(data.resolve())
    moved = tmp_path / 'moved'
    shutil.copytree(data, moved)
    monkeypatch.chdir(tmp_path / 'r')
    code, out, err = run_cli(capsys, 'train', '--resume', tmp_path / 'r', '--data', moved, 'max_steps=4')
    assert code == 0 and 'trained  4 steps' in out, err
    other = tiny_dataset(tmp_path / 'other', n_train=64)
    code, _, err = run_cli(capsys, 'train', '--resume', tmp_path / 'r', '--data', other, 'max_steps=6')
    assert_one_line(code, err, 'is not the dataset this run was trained on')


def test_edited_config_yaml_cannot_resume_with_other_settings(run_dir, tmp_path, capsys):
    run = tmp_path / 'r'
    shutil.copytree(run_dir, run)
    cfg = yaml.safe_load((run / 'config.yaml').read_text())
    truncated = {k: cfg[k] for k in ('model', 'data', 'model_kwargs', 'progress', 'tensorboard')}  # lr etc. gone
    (run / 'config.yaml').write_text(yaml.safe_dump(truncated))
    code, _, err = run_cli(capsys, 'train', '--resume', run, 'max_steps=3')
    assert_one_line(code, err, 'was trained with another config')


def test_eval_refuses_foreign_classes_and_missing_splits_and_honours_val_subset(run_dir, data, tmp_path, capsys):
    other = tiny_dataset(tmp_path / 'other', classes=['cat', 'dog', 'cow', 'ant'])
    assert_one_line(*run_cli(capsys, 'eval', '--checkpoint', run_dir / 'last.pth', '--data', other)[::2],
                    'are not among the 4 the checkpoint was trained on')
    assert_one_line(*run_cli(capsys, 'eval', '--checkpoint', run_dir / 'last.pth', '--data', data, '--split',
                             'val')[::2], "has no 'val' split")
    code, out, err = run_cli(capsys, 'eval', '--checkpoint', run_dir / 'last.pth', '--data', data, 'val_subset=10',
                             '--json', tmp_path / 'e.json', '--threads', 1, '--progress', 'log')
    assert code == 0, err
    (res,) = json.loads((tmp_path / 'e.json').read_text())['results'].values()
    assert res['num_images'] == 10


def test_eval_reads_the_whole_split_whatever_val_subset_the_run_was_trained_with(run_dir, data, tmp_path, capsys):
    quick = load_checkpoint(run_dir / 'last.pth')  # as if trained with val_subset=8 (quick checks while training)
    quick['config']['val_subset'] = 8
    save_checkpoint({k: v for k, v in quick.items() if k not in ('format', 'tensor_digest', 'state_digest')},
                    tmp_path / 'quick.pth')
    for extra, images in (((), 40), (('val_subset=10',), 10)):  # the run's 8 was used unless one was given
        code, out, err = run_cli(capsys, 'eval', '--checkpoint', tmp_path / 'quick.pth', '--data', data, *extra,
                                 '--threads', 1, '--progress', 'none')
        assert code == 0, err
        assert f': {images} images, 4 classes' in out


def test_eval_honours_the_overrides_of_keys_it_has_flags_for(run_dir, data, capsys, monkeypatch):
    # batch_size= / workers= / device= were replaced by the flags' defaults (256, 0, auto) and val_split= was
    # ignored (the default split was evaluated), all without a word
    import vitblocks.cli.eval as eval_cmd
    seen = {}

    def make_loader(cfg, setup, *args, **kwargs):
        seen.update(batch_size=cfg.batch_size, device=cfg.device, split=setup.val.source)
        return real(cfg, setup, *args, **kwargs)
    real = eval_cmd.make_loader
    monkeypatch.setattr(eval_cmd, 'make_loader', make_loader)
    ckpt = run_dir / 'last.pth'
    code, _, err = run_cli(capsys, 'eval', '--checkpoint', ckpt, '--data', data, 'batch_size=7', 'device=cpu',
                           'val_split=train', '--threads', 1, '--progress', 'none')
    assert code == 0, err
    assert seen == {'batch_size': 7, 'device': 'cpu', 'split': f'{data} [train]'}
    code, _, err = run_cli(capsys, 'eval', '--checkpoint', ckpt, '--data', data, '--threads', 1, '--progress', 'none')
    assert code == 0 and seen == {'batch_size': 256, 'device': 'auto', 'split': f'{data} [test]'}, err
    assert_one_line(*run_cli(capsys, 'eval', '--checkpoint', ckpt, '--data', data, '--batch-size', 8,
                             'batch_size=7')[::2], '--batch-size 8 and batch_size=7 disagree')


def test_eval_refuses_overrides_only_training_reads(run_dir, data, capsys):
    ckpt = run_dir / 'last.pth'
    assert_one_line(*run_cli(capsys, 'eval', '--checkpoint', ckpt, '--data', data, 'lr=3', 'epochs=7')[::2],
                    'epochs=7, lr=3: only training reads these keys; evaluation would ignore them (drop them)')
    assert_one_line(*run_cli(capsys, 'eval', '--checkpoint', ckpt, '--data', data, 'threads=1', 'amp=true')[::2],
                    'amp=true, threads=1: only training reads these keys; evaluation would ignore them '
                    '(--threads instead of threads=)')
    assert_one_line(*run_cli(capsys, 'eval', '--checkpoint', ckpt, '--data', data, 'lrr=3')[::2], 'lrr')  # unknown
    code, out, err = run_cli(capsys, 'eval', '--checkpoint', ckpt, '--data', data, 'val_subset=4', 'crop_pct=1.0',
                             'interpolation=bicubic', '--threads', 1, '--progress', 'none')
    assert code == 0 and '4 images' in out, err


def test_every_config_key_is_either_read_by_evaluation_or_refused_by_it():
    """A new TrainConfig key must be classified: EVAL_READS lists those evaluation reads; the others are refused.
    The keys evaluation reads (from cli/eval.py and the experiments.setup functions it calls) are pinned here."""
    import dataclasses
    from vitblocks.cli.eval import EVAL_FLAG_FOR, EVAL_READS
    from vitblocks.experiments import TrainConfig
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert EVAL_READS <= fields and set(EVAL_FLAG_FOR) <= fields - EVAL_READS
    assert len(fields) == 89 and len(EVAL_READS) == 17  # a new key: decide whether eval reads it, then update


# --- 9: run bookkeeping ----------------------------------------------------------------------------------

def rows(run: Path):
    with open(run / 'metrics.csv') as f:
        return [(r['step'], r['split']) for r in csv.DictReader(f)]


def test_stale_files_and_rows_are_cleaned_and_evaluations_not_repeated(data, run_dir, tmp_path, capsys):
    run = tmp_path / 'r'
    run.mkdir()
    (run / '.last.pth.abc123.tmp').write_bytes(b'half a checkpoint')
    (run / 'metrics.csv').write_text('step,epoch,split,loss,top1,top5,lr,images_per_s,elapsed_s\n'
                                     '9,0.5,train,1.0,,,0.1,1,1\n')  # a killed attempt, no checkpoint
    code, _, err = run_cli(capsys, *tiny_train(data, tmp_path, '--max-steps', 2, '--name', 'r'))
    assert code == 0, err
    assert not list(run.glob('*.tmp')) and ('9', 'train') not in rows(run)
    before = rows(run)
    code, _, err = run_cli(capsys, 'train', '--resume', run)  # already finished: evaluates again
    assert code == 0, err
    assert rows(run) == before and before.count(('2', 'val')) == 1


def test_sigterm_saves_and_prints_the_resume_command(data, tmp_path, capsys, monkeypatch):
    step = Trainer.accumulate_step  # the loop's optimizer step (train_step wraps it for one batch)

    def step_then_signal(self, batches):
        loss = step(self, batches)
        if self.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss
    monkeypatch.setattr(Trainer, 'accumulate_step', step_then_signal)
    code, _, err = run_cli(capsys, *tiny_train(data, tmp_path, '--name', 'r'))
    assert code == 130
    assert f'SIGTERM at step 3: saved {tmp_path / "r" / "last.pth"}; resume with: vitblocks train --resume' in err
    assert load_checkpoint(tmp_path / 'r' / 'last.pth')['global_step'] == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    stop = read_stop_record(tmp_path / 'r')
    assert (stop['reason'], stop['signal'], stop['global_step'], stop['checkpoint']) == \
        ('interrupted', 'SIGTERM', 3, 'last.pth')


def test_a_repeated_sigterm_does_not_stop_the_save_the_first_asked_for(data, tmp_path, capsys, monkeypatch):
    # SLURM signals every process of the job step and torchrun forwards its own SIGTERM: a worker gets two.
    # Before, the second ran the previous handler (the default: death, no checkpoint, no stopped.json)
    step = Trainer.accumulate_step

    def step_then_signal_twice(self, batches):
        loss = step(self, batches)
        if self.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the first one handled before the second arrives
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    def previous(signum, frame):  # stands in for SIG_DFL, which would kill the test process
        raise AssertionError('the repeated SIGTERM reached the handler vitblocks replaced')
    monkeypatch.setattr(Trainer, 'accumulate_step', step_then_signal_twice)
    old = signal.signal(signal.SIGTERM, previous)
    try:
        code, _, err = run_cli(capsys, *tiny_train(data, tmp_path, '--name', 'r'))
        assert signal.getsignal(signal.SIGTERM) is previous  # handlers restored
    finally:
        signal.signal(signal.SIGTERM, old)
    assert code == 130, err
    assert 'SIGTERM at step 3: saved' in err
    assert load_checkpoint(tmp_path / 'r' / 'last.pth')['global_step'] == 3


# --- 10: fine-tuning from weights, exporting a trained checkpoint -----------------------------------------

def test_initial_checkpoint_loads_weights_and_reinitializes_another_head(run_dir):
    state = load_checkpoint(run_dir / 'last.pth')['model']
    same = timm.create_model('vit_tiny_patch16_224', num_classes=4, **TINY_VIT)
    assert 're-initialized' not in load_initial_weights(same, str(run_dir / 'last.pth'))
    assert all(torch.equal(v, state[k]) for k, v in same.state_dict().items())
    wider = timm.create_model('vit_tiny_patch16_224', num_classes=7, **TINY_VIT)
    note = load_initial_weights(wider, str(run_dir / 'last.pth'))
    assert 'head.weight, head.bias re-initialized' in note
    assert torch.equal(wider.blocks[0].mlp.fc1.weight, state['blocks.0.mlp.fc1.weight'])
    deeper = timm.create_model('vit_tiny_patch16_224', num_classes=4, **{**TINY_VIT, 'depth': 2})
    with pytest.raises(CheckpointError, match='missing'):
        load_initial_weights(deeper, str(run_dir / 'last.pth'))


def test_train_from_initial_checkpoint_and_export_it(data, run_dir, tmp_path, capsys):
    code, _, err = run_cli(capsys, *tiny_train(data, tmp_path, '--max-steps', 1, '--name', 'ft', '--num-classes', 6,
                                               '--initial-checkpoint', run_dir / 'last.pth', 'progress=log'))
    assert code == 0, err
    assert 'initial weights:' in err and 're-initialized' in err
    code, out, err = run_cli(capsys, 'export', 'vit_tiny_patch16_224', '--checkpoint', tmp_path / 'ft' / 'last.pth',
                             '--format', 'torchscript', '--out', tmp_path / 'ft.pt')
    assert code == 0, err
    assert 'input 2x3x8x8' in out and f'weights {tmp_path / "ft" / "last.pth"}' in out
    traced = torch.jit.load(str(tmp_path / 'ft.pt'))
    assert traced(torch.zeros(1, 3, 8, 8)).shape == (1, 6)


def test_analyze_reads_checkpoints_through_the_checked_loader(tmp_path, capsys):
    """Point 7: an empty checkpoint to `analyze` is one line (it loads with weights_only via read_checkpoint)."""
    empty = tmp_path / 'empty.pth'
    empty.write_bytes(b'')
    code, _, err = run_cli(capsys, 'analyze', 'collapse', 'deit_tiny_patch16_224', '--checkpoint', empty)
    assert_one_line(code, err, 'empty file')
