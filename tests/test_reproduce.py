"""`vitblocks reproduce`: NiNformer Table 1 as the authors' script trains it, and the CIFAR-10 blocks benchmark
through the whole harness on tiny budgets (every configuration; kill and resume), so CI needs no GPU."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch
import yaml
from torch import nn

import vitblocks.cli as cli
from vitblocks.cli import reproduce as reproduce_cmd
from vitblocks.data import BatchTransform
from vitblocks.experiments import engine, load_checkpoint
from vitblocks.reproduce.blocks_benchmark import BENCH_CONFIGS, check_fold
from vitblocks.reproduce.common import budget_line, child_command
from vitblocks.reproduce.ninformer_table1 import ninformer_config, ninformer_jobs, ninformer_rechecks, select_rows
from vitblocks.experiments.runlog import read_stop_record, write_stop_record
from vitblocks.experiments.setup import create_model
from vitblocks.models.blocks_bench import bench_model_name
from vitblocks.papers import load_paper
from vitblocks.profile import count_params

from _train_helpers import write_shards

ROOT = Path(__file__).resolve().parents[1]
TINY = "model_kwargs={embed_dim: 48, depth: 1}"  # every benchmark block at width 48, one block: milliseconds a step


@pytest.fixture(autouse=True)
def _reproduce_command(monkeypatch):
    if reproduce_cmd not in cli.COMMANDS:
        monkeypatch.setattr(cli, 'COMMANDS', cli.COMMANDS + (reproduce_cmd,))


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_child_run_gets_the_commands_budget_and_settings():
    """The command line of a run in its own process parses back to the parent's budget, with an ablation's
    settings after --set (the later value wins), and the report's budget line names what was given."""
    parser = cli.build_parser()
    args = parser.parse_args(['reproduce', 'ninformer-table1', '--max-steps', '3', '--test-subset', '50',
                              '--data-root', 'data', '--device', 'cpu', '--set', 'lr=0.002', 'seed=0'])
    argv = child_command(args, 'ninformer-table1', ['--datasets', 'mnist', '--models', 'ViT'], Path('out-x'),
                         settings=['seed=1'])
    assert argv[:5] == [sys.executable, '-m', 'vitblocks', 'reproduce', 'ninformer-table1']
    child = parser.parse_args(argv[3:])
    assert (child.datasets, child.models, child.train_only, child.device, child.output) == \
        ('mnist', 'ViT', True, 'cpu', 'out-x')
    assert (child.epochs, child.max_steps, child.test_subset, child.train_subset, child.data_root) == \
        (None, 3, 50, None, 'data')
    assert child.overrides == ['lr=0.002', 'seed=0', 'seed=1']
    assert budget_line(args, 100) == 'epochs=100 (recipe), max_steps=3, test_subset=50'
    assert budget_line(child, 100) == budget_line(args, 100)


@pytest.fixture(scope='module')
def cifar_root(tmp_path_factory) -> Path:
    """A 10-class 32x32 stand-in for CIFAR-10: 48 training and 16 test images."""
    root = tmp_path_factory.mktemp('data')
    write_shards(root / 'cifar10', 'train', n=48, per_shard=48, size=32, num_classes=10)
    write_shards(root / 'cifar10', 'test', n=16, per_shard=16, size=32, num_classes=10, seed=1)
    return root


# --- NiNformer Table 1, as the authors' script trains it ------------------------------------------------

def _row(table: str, label: str):
    return next(r for r in load_paper('ninformer').table(table).rows if r.label.startswith(label))


def test_ninformer_dropout_is_in_every_feed_forward_net():
    """The authors' NiNBlock: dropout 0.5 in the Mixer's token and channel MLPs and in the outer FFN (after the
    activation and after the second linear); dropout has no parameters, so the counts stay the paper's."""
    cfg = ninformer_config('cifar10', _row('1-CIFAR10', 'NiNformer'), Path('unused'))
    model = create_model(cfg, 10)
    assert count_params(model) == 2_652_170
    for blk in model.blocks:
        mixer = blk.attn.mixer
        for mlp in (blk.mlp, mixer.mlp_tokens, mixer.mlp_channels):
            assert (mlp.drop1.p, mlp.drop2.p) == (0.5, 0.5)
    plain = timm.create_model('ninformer_vit_patch4_32')
    assert all(m.p == 0 for m in plain.modules() if isinstance(m, nn.Dropout))
    # the outer FFN's dropout acts: in train mode the output of one block's FFN is random
    x = torch.randn(2, 64, 256)
    mlp = model.blocks[0].mlp.train()
    assert not torch.equal(mlp(x), mlp(x))
    with pytest.raises(ValueError, match='proj_drop_rate.*give one of the two'):
        timm.create_model('ninformer_vit_patch4_32', proj_drop_rate=0.3, block_cfg=dict(drop=0.5))


def test_ninformer_recipe_follows_the_authors_script():
    cifar = ninformer_config('cifar10', _row('1-CIFAR10', 'NiNformer'), Path('cifar10'))
    assert (cifar.opt, cifar.lr, cifar.batch_size, cifar.epochs, cifar.sched) == ('adam', 1e-3, 128, 100, 'none')
    assert cifar.amp is False  # the script trains in fp32 (bf16 autocast let the ViT baseline diverge on a GPU)
    assert (cifar.crop_padding, cifar.hflip, cifar.mlp_drop, cifar.mean, cifar.std) == (4, 0.5, 0.5, 'model', 'model')
    assert timm.create_model(cifar.model).pretrained_cfg['mean'] == (0.5, 0.5, 0.5)  # Normalize(0.5, 0.5)
    mnist = ninformer_config('mnist', _row('1-MNIST', 'ViT'), Path('mnist'))
    assert (mnist.crop_padding, mnist.hflip, mnist.mlp_drop) == (0, 0.0, 0.5)  # no crops or mirrored digits


def test_crop_padding_4_shifts_the_training_images_only():
    """RandomCrop(32, padding=4): each training image is shifted by up to 4 pixels with zeros coming in;
    the test transform leaves the image alone."""
    images = torch.randint(1, 256, (64, 3, 32, 32), dtype=torch.uint8)  # no zero pixel of its own
    unit = dict(input_size=(3, 32, 32), mean=(0.0,) * 3, std=(1 / 255,) * 3, crop_padding=4)
    out = BatchTransform(training=True, **unit)(images, torch.Generator().manual_seed(0))
    zero_rows = (out == 0).all(dim=(1, 3)).sum(1)  # (B,) rows of zeros padded in
    zero_cols = (out == 0).all(dim=(1, 2)).sum(1)
    assert zero_rows.max() <= 4 and zero_cols.max() <= 4 and (zero_rows + zero_cols > 0).float().mean() > 0.5
    assert torch.equal(BatchTransform(training=False, **unit)(images), images.float())


def test_models_are_matched_by_label_or_name_in_any_case():
    def jobs(*names):
        return ninformer_jobs(['mnist'], list(names))
    assert jobs('NiNformer') == jobs('ninformer (ours)') == jobs('ninformer_vit_patch4_28') == \
        [('mnist', 'ninformer_vit_patch4_28')]
    assert jobs('ViT', 'NiNformer') == [('mnist', 'ninformer_baseline_vit_patch4_28'),
                                        ('mnist', 'ninformer_vit_patch4_28')]
    assert [r.label for r in select_rows(load_paper('ninformer').table('1-CIFAR10').rows, ['mlpmixer', 'LOCALVIT'])] \
        == ['MlpMixer', 'LocalViT']


def test_rechecks_list_diverged_runs_and_rows_more_than_the_margin_below_the_paper(tmp_path):
    """The paper's CIFAR-10 column: ViT 65.74, MlpMixer 70.12, LocalViT 77.71, NiNformer 81.59."""
    def finished(model, top1):
        (tmp_path / 'cifar10' / model).mkdir(parents=True)
        (tmp_path / 'cifar10' / model / 'results.json').write_text(json.dumps({'final': {'top1': top1}}))

    finished('ninformer_baseline_mixer_patch4_32', 69.13)  # 0.99 below: within the margin
    finished('ninformer_vit_patch4_32', 80.58)  # 1.01 below
    log = tmp_path / 'cifar10' / 'ninformer_baseline_vit_patch4_32.log'
    log.write_text('step 3200/39000 epoch 8.21 loss 1.3178\nvitblocks reproduce: stopped: loss is nan at steps '
                   '3201..3400; stopped; the last good checkpoint is ...\n')
    (tmp_path / 'cifar10' / 'ninformer_baseline_localvit_patch4_32.log').write_text('step 200/39000\n')  # running
    assert ninformer_rechecks(tmp_path, ['mnist', 'cifar10']) == [
        ('cifar10', 'ninformer_baseline_vit_patch4_32', 'diverged'),
        ('cifar10', 'ninformer_vit_patch4_32', 'below the paper: 80.58 vs 81.59')]
    assert ninformer_rechecks(tmp_path, ['cifar10'], margin=0.5)[1:] == [
        ('cifar10', 'ninformer_baseline_mixer_patch4_32', 'below the paper: 69.13 vs 70.12'),
        ('cifar10', 'ninformer_vit_patch4_32', 'below the paper: 80.58 vs 81.59')]
    finished('ninformer_baseline_vit_patch4_32', 66.0)  # resumed and finished: its old log line no longer counts
    assert [m for _, m, _ in ninformer_rechecks(tmp_path, ['cifar10'])] == ['ninformer_vit_patch4_32']


def test_rechecks_trust_the_run_folders_stop_record_over_the_log(tmp_path):
    """``stopped.json`` (written by the trainer) decides; the log text counts only for runs without one."""
    def stopped(model, reason, log_text='vitblocks reproduce: stopped: loss is nan at steps 1..2\n'):
        (tmp_path / 'mnist' / model).mkdir(parents=True)
        (tmp_path / 'mnist' / f'{model}.log').write_text(log_text)
        if reason:
            write_stop_record(tmp_path / 'mnist' / model, reason, 'why', global_step=2)

    stopped('ninformer_baseline_vit_patch4_28', 'diverged', log_text='')  # the record alone is enough
    stopped('ninformer_baseline_mixer_patch4_28', 'interrupted')  # a later attempt was interrupted: not diverged
    stopped('ninformer_baseline_localvit_patch4_28', 'error')  # e.g. out of memory: not an accuracy question
    stopped('ninformer_vit_patch4_28', None)  # a run from before the record: its log decides
    assert ninformer_rechecks(tmp_path, ['mnist']) == [('mnist', 'ninformer_baseline_vit_patch4_28', 'diverged'),
                                                       ('mnist', 'ninformer_vit_patch4_28', 'diverged')]
    (tmp_path / 'mnist' / 'ninformer_baseline_vit_patch4_28' / 'stopped.json').write_text('{not json')
    assert read_stop_record(tmp_path / 'mnist' / 'ninformer_baseline_vit_patch4_28') is None  # log (empty) decides
    assert [m for _, m, _ in ninformer_rechecks(tmp_path, ['mnist'])] == ['ninformer_vit_patch4_28']


@pytest.mark.parametrize('argv, message', [
    (['--models', 'Foo'], "--models: unknown Foo; Table 1 has ViT, MlpMixer, LocalViT, NiNformer"),
    (['--models', 'ViT,Foo', '--jobs', '2'], '--models: unknown Foo'),
    (['--data-root', '/nonexistent'], '--data-root /nonexistent: no such folder'),
    (['--configs', 'iffn'], '--configs: an option of `reproduce cifar10-blocks` only'),
])
def test_ninformer_bad_options_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    code, out, err = run_cli(capsys, 'reproduce', 'ninformer-table1', '--output', tmp_path, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and out == ''
    assert not any(tmp_path.iterdir())  # nothing trained


def test_ninformer_missing_dataset_is_an_error(tmp_path, capsys):
    (tmp_path / 'empty').mkdir()
    code, _, err = run_cli(capsys, 'reproduce', 'ninformer-table1', '--datasets', 'mnist', '--data-root',
                           tmp_path / 'empty', '--output', tmp_path / 'out')
    assert code == 2 and 'mnist/ not found under' in err and not (tmp_path / 'out').exists()


# --- the CIFAR-10 blocks benchmark ---------------------------------------------------------------------

def test_benchmark_models_are_one_backbone_with_one_swap():
    with torch.device('meta'):  # structure and counts only
        models = {c: timm.create_model(bench_model_name(c)) for c in BENCH_CONFIGS}
    base = models['vanilla']
    assert (base.embed_dim, len(base.blocks), base.patch_embed.grid_size, base.num_prefix_tokens) == (192, 6, (8, 8), 0)
    # 6 blocks of 12 D^2 + 13 D (D = 192), patch embedding 48 D + D, position embedding 64 D, norm, head
    assert count_params(base) == 6 * (12 * 192 ** 2 + 13 * 192) + 49 * 192 + 64 * 192 + 2 * 192 + 1930 == 2_693_194
    assert {c: type(models[c].blocks[0].mlp).__name__ for c in ('iffn', 'afbo', 'swiglu', 'repa')} == \
        {'iffn': 'IFFN', 'afbo': 'AFBO', 'swiglu': 'SwiGLU', 'repa': 'RePaFFN'}
    assert [type(models[c].blocks[0]).__name__ for c in ('mabvit_glu', 'mabvit_parallel', 'mabvit_glu_parallel')] == \
        ['Block', 'ParallelBlock', 'ParallelBlock']
    assert type(models['mabvit_glu'].blocks[0].attn).__name__ == 'ValueActivationAttention'
    nin = models['ninformer'].blocks[0]
    assert type(nin.attn).__name__ == 'MixerGatingUnit' and nin.norm2 is not nin.norm1
    # the same embedding, position embedding, norms and head in all nine
    assert all(count_params(m.patch_embed) + m.pos_embed.numel() + count_params(m.head) ==
               count_params(base.patch_embed) + base.pos_embed.numel() + count_params(base.head)
               for m in models.values())


@pytest.mark.parametrize('argv, message', [
    (['--configs', 'vanila'], '--configs: unknown vanila; the benchmark has vanilla, iffn'),
    (['--seeds', 'a'], '--seeds a: expected comma-separated integers'),
    (['--seeds', '1,1'], 'expected distinct integers'),
    (['--models', 'ViT'], '--models: an option of `reproduce ninformer-table1` only'),
    (['--data-root', '/nonexistent'], '--data-root /nonexistent: no such folder'),
])
def test_benchmark_bad_options_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    code, out, err = run_cli(capsys, 'reproduce', 'cifar10-blocks', '--output', tmp_path, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and out == ''


def test_benchmark_every_configuration_through_the_harness(cifar_root, tmp_path, capsys):
    """All nine configurations, one step each on a tiny stand-in for CIFAR-10: table, RePa's fold check,
    summary.json, plots, and each run's config is the fixed recipe with its own model and seed."""
    out_dir = tmp_path / 'bench'
    code, out, err = run_cli(capsys, 'reproduce', 'cifar10-blocks', '--seeds', '0', '--max-steps', 1, '--threads', 1,
                             '--data-root', cifar_root, '--output', out_dir, '--repeats', 1, '--latency-batch', 2,
                             '--set', 'progress=none', 'tensorboard=false', 'batch_size=16', TINY)
    assert code == 0, err
    lines = out.splitlines()
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.split()[:1] and ln.split()[0] in BENCH_CONFIGS}
    assert list(rows) == list(BENCH_CONFIGS) and rows['vanilla'][-1] == '1.00x'
    summary = {s['config']: s for s in json.loads((out_dir / 'summary.json').read_text())}
    for config in BENCH_CONFIGS:
        run_dir = out_dir / config / 'seed0'
        cfg = yaml.safe_load((run_dir / 'config.yaml').read_text())
        assert (cfg['model'], cfg['seed'], cfg['recipe'], cfg['opt'], cfg['mixup'], cfg['crop_padding']) == \
            (bench_model_name(config), 0, 'cifar10_blocks', 'adamw', 0.2, 4)
        assert (run_dir / 'curves.png').is_file()
        model = timm.create_model(bench_model_name(config), embed_dim=48, depth=1)
        assert summary[config]['params'] == count_params(model)
    fold = json.loads((out_dir / 'repa' / 'seed0' / 'fold.json').read_text())
    assert fold['folded_top1'] == fold['trained_top1'] and fold['predictions_differ'] == 0
    assert fold['max_logit_diff'] < 1e-4 and fold['folded_params'] < fold['trained_params']
    assert summary['repa']['folded_top1'] == [fold['folded_top1']]
    assert any(ln.startswith('note: repa: fp32 top-1 before folding') for ln in lines)
    assert (out_dir / 'tradeoff.png').is_file() and (out_dir / 'table.txt').read_text().strip() in out
    # again with --jobs: every run is finished, so no process starts, and the runs are the same
    code, out2, err = run_cli(capsys, 'reproduce', 'cifar10-blocks', '--seeds', '0', '--configs', 'vanilla,repa',
                              '--max-steps', 1, '--threads', 1, '--jobs', 2, '--data-root', cifar_root, '--output',
                              out_dir, '--no-latency', '--set', 'progress=none', 'tensorboard=false', 'batch_size=16',
                              TINY)
    assert code == 0 and 'started' not in out2, out2 + err
    again = {ln.split()[0]: ln.split()[:2] for ln in out2.splitlines() if ln.split()[:1] in (['vanilla'], ['repa'])}
    assert again == {c: rows[c][:2] for c in ('vanilla', 'repa')}


def test_fold_check_reuses_a_whole_record_and_rechecks_a_torn_one(tmp_path):
    """fold.json of the run's final step is reused; one cut short by a kill (not JSON) is not read as a result
    and is checked again (here: None, as the run kept no weights), instead of stopping the benchmark."""
    record = {'global_step': 7, 'trained_top1': 50.0, 'folded_top1': 50.0, 'predictions_differ': 0}
    (tmp_path / 'fold.json').write_text(json.dumps(record))
    assert check_fold(None, tmp_path, {'global_step': 7}) == record
    assert check_fold(None, tmp_path, {'global_step': 8}) is None  # of an earlier step: stale
    (tmp_path / 'fold.json').write_text(json.dumps(record)[:20])
    assert check_fold(None, tmp_path, {'global_step': 7}) is None


@pytest.mark.slow  # races a run with a poller: 40 steps, so that a loaded CPU does not let the run finish first
def test_benchmark_run_killed_mid_training_resumes_from_last_pth(cifar_root, tmp_path, capsys, monkeypatch):
    """A run killed (SIGKILL, as at the end of a GPU slice) resumes from its last.pth when the command is
    re-run; killed after its last checkpoint but before results.json, it only evaluates."""
    out_dir = tmp_path / 'bench'
    steps = 40  # (6 steps were seen to finish between two polls on a loaded CPU)
    argv = ['reproduce', 'cifar10-blocks', '--configs', 'vanilla', '--seeds', '0', '--max-steps', steps, '--threads', 1,
            '--data-root', cifar_root, '--output', out_dir, '--train-only', '--set', 'progress=none',
            'tensorboard=false', 'batch_size=8', 'checkpoint_interval=1', 'log_interval=1', TINY]
    env = dict(os.environ, PYTHONPATH=str(ROOT / 'src'))
    proc = subprocess.Popen([sys.executable, '-m', 'vitblocks', *map(str, argv)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = out_dir / 'vanilla' / 'seed0' / 'last.pth'
    deadline = time.time() + 120
    while not (last.exists() and load_checkpoint(last)['global_step'] >= 2) and proc.poll() is None:
        assert time.time() < deadline, 'no checkpoint within 2 minutes'
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = load_checkpoint(last)['global_step']
    assert 2 <= killed_at < steps and not (last.parent / 'results.json').exists()

    restored = []
    original = engine.Trainer._restore
    monkeypatch.setattr(engine.Trainer, '_restore', lambda self, ckpt, path: (restored.append(ckpt['global_step']),
                                                                              original(self, ckpt, path))[1])
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert restored == [killed_at] and 'vanilla seed 0: top-1' in out
    results = json.loads((last.parent / 'results.json').read_text())
    assert results['global_step'] == steps
    def train_rows():
        return [ln for ln in (last.parent / 'metrics.csv').read_text().splitlines() if ',train,' in ln]
    rows = train_rows()
    # killed after the last checkpoint, before results.json: the re-run evaluates and trains nothing
    (last.parent / 'results.json').unlink()
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert restored == [killed_at, steps] and train_rows() == rows
    again = json.loads((last.parent / 'results.json').read_text())['final']
    assert (again['top1'], again['loss']) == (results['final']['top1'], results['final']['loss'])
