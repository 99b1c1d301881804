"""Training at scale, rehearsed on this CPU: SyncBatchNorm conversion of vitblocks' BatchNorms,
gradient accumulation, uint8 batches from the PIL pipeline, resume=auto, a longer schedule and a plateau
schedule's counters on resume (also after a SIGTERM mid-evaluation), and (slow) 2-process gloo runs:
BatchNorm statistics averaged across ranks, a 2 -> 1 process resume, a SIGTERM to one rank during an
evaluation, a checkpoint missing on one rank, a SIGKILLed rank restarted by torchrun, and streamed
shards split between ranks."""
import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from torch import nn

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.data import EpochOrder, PILLoader, ShardDataset, build_dataset, build_pil_transform
from vitblocks.experiments import TrainingInterrupted, merge, train
from vitblocks.experiments.checkpoint import load_checkpoint
from vitblocks.experiments.config import ConfigError

from _train_helpers import TINY_VIT, signal_during_evaluation, tiny_dataset

TINY_REPA = dict(img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=2)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp('scale_data'), n_train=64, n_test=16)


def _cfg(data, out, **kw):
    base = dict(model='vit_tiny_patch16_224', data=str(data), model_kwargs=TINY_VIT, batch_size=8, epochs=1,
                lr=1e-3, sched='none', hflip=0.0, threads=1, progress='none', tensorboard=False, output=str(out),
                name='run', log_interval=1)
    return merge({**base, **kw})


def _randomize_bn(model):
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g))
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            m.weight.data.copy_(torch.randn(m.weight.shape, generator=g))


@pytest.mark.parametrize('convert', [nn.SyncBatchNorm.convert_sync_batchnorm, timm.layers.convert_sync_batchnorm],
                         ids=['torch', 'timm'])
@pytest.mark.parametrize('name,kwargs,shape', [
    ('repa_deit_tiny_patch16_224', TINY_REPA, (4, 3, 8, 8)),            # TokenBatchNorm on (B, N, C) tokens
    ('vit_tiny_patch16_224', TINY_VIT, (4, 3, 8, 8)),                  # + swap_ffn 'localvit': channel BatchNorm
])
def test_sync_batchnorm_converters_keep_every_vitblocks_batchnorm_right(convert, name, kwargs, shape):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=4, **kwargs)
    if name.startswith('vit_'):
        assert vitblocks.swap_ffn(model, 'localvit') == 1
    _randomize_bn(model)
    n_bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    synced = convert(copy.deepcopy(model))
    assert n_bn > 0 and sum(isinstance(m, nn.SyncBatchNorm) for m in synced.modules()) == n_bn
    x = torch.randn(shape)
    for training in (True, False):  # in one process a SyncBatchNorm is a BatchNorm: outputs and stats agree
        model.train(training)
        synced.train(training)
        torch.testing.assert_close(synced(x), model(x))
    for (k, a), (k2, b) in zip(model.state_dict().items(), synced.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(a, b)


def test_checkpoints_of_the_old_token_batchnorm_layout_load():
    model = timm.create_model('repa_deit_tiny_patch16_224', num_classes=4, **TINY_REPA)
    _randomize_bn(model)
    old = {k.replace('.bn.', '.'): v for k, v in model.state_dict().items()}  # <name>.weight, not <name>.bn.weight
    assert 'blocks.0.mlp.norm_in.running_var' in old
    fresh = timm.create_model('repa_deit_tiny_patch16_224', num_classes=4, **TINY_REPA)
    fresh.load_state_dict(old)
    torch.testing.assert_close(fresh.blocks[0].mlp.norm_in.running_var, model.blocks[0].mlp.norm_in.running_var)


def test_grad_accumulation_equals_the_large_batch(data, tmp_path):
    # SGD: the update is the gradient itself (Adam would divide float rounding by tiny second moments)
    large = train(_cfg(data, tmp_path / 'a', batch_size=8, opt='sgd', lr=0.1))
    accum = train(_cfg(data, tmp_path / 'b', batch_size=4, grad_accum=2, opt='sgd', lr=0.1))
    assert large.global_step == accum.global_step == 8
    a, b = (load_checkpoint(r.run_dir / 'last.pth')['model'] for r in (large, accum))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match='grad_accum=9 is more than the 8 batches'):
        train(_cfg(data, tmp_path / 'c', grad_accum=9))


def _lrs(run_dir):
    with open(run_dir / 'metrics.csv') as f:
        return {int(r['step']): float(r['lr']) for r in csv.DictReader(f) if r['split'] == 'train'}


def test_resume_drops_the_rows_of_the_killed_attempt(data, tmp_path):
    import shutil
    run, cfg = tmp_path / 'run', dict(batch_size=4, eval_interval=1)
    train(_cfg(data, tmp_path, max_steps=4, **cfg))
    shutil.copy(run / 'last.pth', tmp_path / 'step4.pth')
    train(_cfg(data, tmp_path, max_steps=6, **cfg), resume=run)  # writes rows 5, 6 and a val row at 6 ...
    shutil.copy(tmp_path / 'step4.pth', run / 'last.pth')  # ... and is killed: its last checkpoint is step 4's
    train(_cfg(data, tmp_path, max_steps=5, **cfg), resume=run)
    with open(run / 'metrics.csv') as f:
        rows = [(int(r['step']), r['split']) for r in csv.DictReader(f)]
    assert rows == [(1, 'train'), (2, 'train'), (3, 'train'), (4, 'train'), (4, 'val'), (5, 'train'), (5, 'val')]


def test_resume_with_another_global_batch_is_refused_with_the_way_to_keep_it(data, tmp_path):
    """Global batch 4 saved, 8 asked (grad_accum=2): one error that names the grad_accum keeping it; the metrics
    and the checkpoint are as they were (before, the steps were renumbered: two different rows of one step)."""
    run, cfg = tmp_path / 'run', dict(batch_size=4, eval_interval=1)
    train(_cfg(data, tmp_path, max_steps=4, **cfg))
    rows_before, config_before = (run / 'metrics.csv').read_text(), (run / 'config.yaml').read_text()
    with pytest.raises(ConfigError, match=r'global batch of 4 \(1 process\(es\) x batch_size 4 x grad_accum 1\); '
                                          r'this resume has 8 \(1 x 4 x 2\).* resume with grad_accum=1 to keep it'):
        train(_cfg(data, tmp_path, max_steps=6, grad_accum=2, **cfg), resume=run)
    assert (run / 'metrics.csv').read_text() == rows_before and load_checkpoint(run / 'last.pth')['global_step'] == 4
    assert (run / 'config.yaml').read_text() == config_before


def test_resume_with_a_budget_that_ended_before_the_checkpoint_is_refused(data, tmp_path):
    """epochs=1 (16 steps) for a run at step 30, in epoch 2, cannot be trained back: one error, its config.yaml as it
    was (it was silently rewritten to epochs=1)."""
    run = tmp_path / 'run'
    train(_cfg(data, tmp_path, epochs=2, max_steps=30, batch_size=4))
    config_before = (run / 'config.yaml').read_text()
    with pytest.raises(ConfigError, match=r'is at step 30, past the 16 steps of epochs=1; a resume cannot go back'):
        train(_cfg(data, tmp_path, epochs=1, batch_size=4), resume=run)
    assert (run / 'config.yaml').read_text() == config_before


def test_resume_with_more_epochs_follows_the_longer_schedule(data, tmp_path):
    kw = dict(sched='cosine', min_lr=0.0, warmup_epochs=0)
    first = train(_cfg(data, tmp_path, epochs=1, **kw))
    resumed = train(_cfg(data, tmp_path, epochs=3, **kw), resume=first.run_dir)
    straight = train(_cfg(data, tmp_path, epochs=3, name='straight', **kw))
    assert resumed.global_step == straight.global_step == 24
    got, want = _lrs(resumed.run_dir), _lrs(straight.run_dir)
    assert want[12] > 1e-4  # mid-schedule: well above min_lr
    for step in range(9, 25):
        assert got[step] == pytest.approx(want[step], rel=1e-9)


def test_plateau_resumed_mid_run_keeps_its_counters(data, tmp_path):
    # lr 1e-6 leaves the test top-1 flat: epoch 1 sets the best, then every second epoch (num_bad_epochs >
    # patience) halves the lr: after epochs 3 and 5 uninterrupted. Killed in epoch 5 (step 36), the resumed run
    # must remember that epoch 4 was already a bad one (num_bad_epochs=1, best); with fresh counters epoch 5
    # would count as an improvement.
    kw = dict(sched='plateau', patience_epochs=1, decay_rate=0.5, lr=1e-6, epochs=6)
    straight = train(_cfg(data, tmp_path, name='straight', **kw))
    first = train(_cfg(data, tmp_path, max_steps=36, **kw))
    assert load_checkpoint(first.run_dir / 'last.pth')['scheduler']['plateau']['num_bad_epochs'] == 1
    resumed = train(_cfg(data, tmp_path, **kw), resume=first.run_dir)
    want, got = _lrs(straight.run_dir), _lrs(resumed.run_dir)
    assert [want[s] for s in (24, 25, 40, 41, 48)] == pytest.approx([1e-6, 5e-7, 5e-7, 2.5e-7, 2.5e-7], rel=1e-9)
    assert got == want  # every step, the part before the resume included


def test_plateau_stopped_during_an_evaluation_takes_its_step_after_it_on_resume(data, tmp_path, monkeypatch):
    # the flat run above: epoch 3's evaluation (step 24) makes its second bad epoch in a row, after which the lr
    # halves. A SIGTERM during it saves the state from before the plateau's step (the step needs that evaluation's
    # top-1): the resumed run evaluates, then steps, once. Without the owed step the lr stays 1e-6 at step 25.
    kw = dict(sched='plateau', patience_epochs=1, decay_rate=0.5, lr=1e-6, epochs=6)
    straight = train(_cfg(data, tmp_path, name='straight', **kw))
    evaluated = signal_during_evaluation(monkeypatch, evaluation=3)
    with pytest.raises(TrainingInterrupted, match='SIGTERM at step 24 during its evaluation'):
        train(_cfg(data, tmp_path, **kw))
    saved = load_checkpoint(tmp_path / 'run' / 'last.pth')
    assert evaluated == [2, 2, 1] and saved['global_step'] == 24  # 2 batches of 8 test images each
    assert saved['scheduler']['plateau']['num_bad_epochs'] == 1 and saved['scheduler_step_owed'] is True
    train(_cfg(data, tmp_path, **kw), resume=tmp_path / 'run')
    assert evaluated[3:] == [2] * 4  # the owed evaluation once, then epochs 4 to 6
    want, got = _lrs(straight.run_dir), _lrs(tmp_path / 'run')
    assert want[24] == 1e-6 and want[25] == pytest.approx(5e-7, rel=1e-9)
    assert got == want


def test_every_rank_asks_for_a_stop_after_the_evaluation_batches_they_all_have():
    # 33 test images on 2 ranks in batches of 4: rank 0 holds 17 (5 batches), rank 1 16 (4); a per-batch vote
    # (a collective) after rank 0's fifth batch would wait for rank 1 forever
    orders = [EpochOrder(33, 4, shuffle=False, rank=r, world_size=2) for r in (0, 1)]
    assert [o.batches_per_epoch for o in orders] == [5, 4]
    assert [o.batches_on_every_rank for o in orders] == [4, 4]
    assert EpochOrder(64, 4, rank=1, world_size=2).batches_on_every_rank == 8  # training: the same on every rank


def _worker_batch(loader: PILLoader) -> torch.Tensor:
    """The first images batch of epoch 0 as the DataLoader's workers hand it over."""
    loader.set_epoch(0)
    return next(iter(loader.dataloader))[0]


@pytest.mark.parametrize('kw', [dict(crop_padding=2, hflip=0.5, auto_augment='rand-m9'),        # our resize path
                                dict(scale=[0.5, 1.0], ratio=[0.75, 1.33], color_jitter=0.4),  # timm create_transform
                                dict(training=False)], ids=['resize', 'timm', 'eval'])
def test_uint8_pil_batches_equal_the_float_pipeline_in_a_quarter_of_the_bytes(data, kw):
    ds = build_dataset(str(data), 'train')
    kw = {'training': True, **kw}
    mean, std = (0.3, 0.4, 0.5), (0.2, 0.25, 0.3)
    order = EpochOrder(len(ds), 16, seed=3, shuffle=kw['training'])
    floats = PILLoader(ds, order, build_pil_transform((3, 8, 8), mean, std, **kw))
    uint8 = PILLoader(ds, order, build_pil_transform((3, 8, 8), mean, std, uint8=True, **kw), normalize=(mean, std))
    for epoch in (0, 1):
        for (xf, yf), (xu, yu) in zip(floats.epoch(epoch), uint8.epoch(epoch), strict=True):
            assert xu.dtype == torch.float32 and torch.equal(yf, yu)
            torch.testing.assert_close(xu, xf)  # float32 rounding: (x - 255 m) / (255 s) vs (x / 255 - m) / s
    # what the workers hand over (shared memory, pinned memory, the host-to-device copy): uint8, 4x fewer bytes
    raw = [_worker_batch(loader) for loader in (floats, uint8)]
    assert raw[0].dtype == torch.float32 and raw[1].dtype == torch.uint8 and raw[1].shape == raw[0].shape
    assert raw[0].nbytes == 4 * raw[1].nbytes == 4 * 16 * 3 * 8 * 8


def test_uint8_batches_in_training_runs_and_their_option_errors(data):
    from vitblocks.experiments.setup import make_loader, setup_data
    model = timm.create_model('vit_tiny_patch16_224', num_classes=4, **TINY_VIT)
    cfg = _cfg(data, '/nonexistent', pipeline='pil', reprob=1.0, remode='const')
    loader = make_loader(cfg, setup_data(cfg, model), True, torch.device('cpu'))
    assert len(loader) == 8 and _worker_batch(loader).dtype == torch.uint8
    x, _ = next(loader.epoch(0))
    # reprob=1: timm's RandomErasing erased (zeroed, remode=const) a box of every image, on the device, after
    # normalization (a normalized image of class-brightness pixels has no exact zeros otherwise)
    assert all((img == 0).all(0).any() for img in x)
    cfg = _cfg(data, '/nonexistent', pipeline='pil', uint8_batches=False)
    assert _worker_batch(make_loader(cfg, setup_data(cfg, model), True, torch.device('cpu'))).dtype == torch.float32
    with pytest.raises(ConfigError, match='uint8_batches=false: the tensor pipeline always moves uint8'):
        setup_data(_cfg(data, '/nonexistent', pipeline='tensor', uint8_batches=False), model)
    with pytest.raises(ValueError, match='erase acts on batches normalized on the device'):
        PILLoader(build_dataset(str(data), 'train'), EpochOrder(64, 8), lambda img: img, erase=lambda x: x)


def test_resume_auto_starts_then_resumes_and_checks_the_config(data, tmp_path):
    first = train(_cfg(data, tmp_path, resume='auto', max_steps=3, epochs=2))
    assert first.global_step == 3
    again = train(_cfg(data, tmp_path, resume='auto', max_steps=10, epochs=2))  # the same command, continued
    assert again.global_step == 10
    with pytest.raises(ConfigError, match=r'lr \(0.001 -> 0.002\)'):
        train(_cfg(data, tmp_path, resume='auto', epochs=2, lr=2e-3))
    with pytest.raises(ConfigError, match="resume='always': expected 'auto'"):
        _cfg(data, tmp_path, resume='always')


def test_sync_bn_on_cpu_processes_is_refused_clearly(data, tmp_path, monkeypatch):
    from vitblocks.experiments import engine
    monkeypatch.setattr(engine, 'init_distributed', lambda device_type, timeout=None: engine.DistInfo(0, 2, 0))
    with pytest.raises(ConfigError, match="SyncBatchNorm runs on CUDA devices only"):
        train(_cfg(data, tmp_path, sync_bn=True, model='repa_deit_tiny_patch16_224', model_kwargs=TINY_REPA))


def test_restarted_ranks_agree_on_a_namespace_no_earlier_attempt_used():
    import threading
    from datetime import timedelta
    import torch.distributed as dist
    from vitblocks.experiments.distributed import agree_on_attempt
    store = dist.HashStore()  # stands in for torchrun's agent store, which outlives a restart with its keys
    store.set_timeout(timedelta(seconds=20))
    stale = 'f' * 32
    store.queue_push('vitblocks/attempt/queue/1', stale)  # pushed by an earlier rank 0 for a rank 1 that died first

    def attempt():
        tokens = {}
        def run(rank):
            tokens[rank] = agree_on_attempt(store, rank, 2, timedelta(seconds=20))
        threads = [threading.Thread(target=run, args=(rank,)) for rank in (1, 0)]
        for t in threads:  # rank 1 first: it pops the stale token, then must switch to rank 0's
            t.start()
        for t in threads:
            t.join(30)
        return tokens

    first, second = attempt(), attempt()
    assert first[0] == first[1] != stale and second[0] == second[1] != first[0]
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError):  # rank 1 never comes: rank 0 stops waiting for it
        agree_on_attempt(store, 0, 2, timedelta(seconds=0.3))


# --- several processes (torchrun, gloo on the CPU) ----------------------------------------------------------

WORKER = '''
import json, os, signal, sys, time
sys.path[:0] = [{tests!r}]
import torch
from vitblocks.experiments import engine, merge
spec = json.loads(sys.argv[1])
restarted = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') != '0'
if restarted and os.environ['RANK'] == '1':  # comes up late, as on a loaded node: rank 0 reaches the store first
    time.sleep(spec.get('restarted_rank1_delay', 0))
if spec.get('output_per_rank'):  # a node that does not share the run folder
    spec['cfg']['output'] += '/rank' + os.environ['RANK']
trainer = engine.Trainer(merge(spec['cfg']), resume=spec.get('resume'))
kill = spec.get('kill_rank_at_step')
if kill and os.environ['RANK'] == '1' and not restarted:
    step = trainer.after_step
    def after_step(loss):
        step(loss)
        if trainer.global_step == kill:
            os.kill(os.getpid(), signal.SIGKILL)
    trainer.after_step = after_step
signal_at = spec.get('signal_at_step')
if signal_at:  # SIGTERM to every rank after that step's update, as a cluster preempting the job sends it
    inner = trainer.after_step
    def signal_then_step(loss):
        if trainer.global_step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        inner(loss)
    trainer.after_step = signal_then_step
in_evaluation = spec.get('signal_rank1_in_evaluation')
if in_evaluation:  # SIGTERM to rank 1 alone after its first batch of that evaluation; count every rank's batches
    evaluated, evaluate = [], engine.evaluate
    def counted_evaluate(model, *args, **kwargs):
        evaluated.append(0)
        def count(module, inputs, output):
            evaluated[-1] += 1
            if os.environ['RANK'] == '1' and len(evaluated) == in_evaluation and evaluated[-1] == 1:
                os.kill(os.getpid(), signal.SIGTERM)
        hook = model.register_forward_hook(count)
        try:
            return evaluate(model, *args, **kwargs)
        finally:
            hook.remove()
            with open(spec['dump'] + '.evaluated' + os.environ['RANK'], 'w') as f:
                json.dump(evaluated, f)
    engine.evaluate = counted_evaluate
result = trainer.fit()
bn = {{k: v for k, v in trainer.model.state_dict().items() if 'running' in k}}
torch.save(bn, spec['dump'] + '.rank' + os.environ['RANK'])
if trainer.ema is not None:
    ema = {{k: v for k, v in trainer.ema.module.state_dict().items() if 'running' in k}}
    torch.save(ema, spec['dump'] + '.ema' + os.environ['RANK'])
if spec.get('dump_stream'):  # the images this rank streams in epoch 0
    images = torch.cat([x for x, _ in trainer.train_loader.epoch(0)])
    torch.save(images, spec['dump'] + '.stream' + os.environ['RANK'])
from vitblocks.experiments.distributed import shutdown
shutdown()
'''


def _torchrun(tmp_path, spec, nproc=2, restarts=0):
    script = tmp_path / 'worker.py'
    script.write_text(WORKER.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(REPO / 'src'), os.environ.get('PYTHONPATH', '')]),
           'OMP_NUM_THREADS': '1'}
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', str(nproc),
           '--max-restarts', str(restarts), str(script), json.dumps(spec)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _bn_cfg(data, out, **kw):
    return {**dict(model='repa_deit_tiny_patch16_224', data=str(data), model_kwargs=TINY_REPA, batch_size=4,
                   epochs=1, lr=1e-3, sched='none', hflip=0.0, threads=1, progress='log', tensorboard=False,
                   output=str(out), name='run', log_interval=2), **kw}


@pytest.mark.slow
def test_two_processes_average_bn_stats_then_resume_on_one(data, tmp_path):
    cfg = _bn_cfg(data, tmp_path, model_ema=True, model_ema_decay=0.5)
    out = _torchrun(tmp_path, {'cfg': cfg, 'dump': str(tmp_path / 'bn')})
    assert out.returncode == 0, out.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f'bn.rank{r}') for r in (0, 1))
    saved = load_checkpoint(tmp_path / 'run' / 'last.pth')
    assert saved['global_step'] == 8 and saved['global_batch'] == 8
    for k in r0:  # every rank ends with the same statistics, and the checkpoint has them
        torch.testing.assert_close(r0[k], r1[k])
        torch.testing.assert_close(saved['model'][k], r0[k])
    # the EMA's statistics average each rank's own between evaluations: they are averaged too (as timm's train.py)
    e0, e1 = (torch.load(tmp_path / f'bn.ema{r}') for r in (0, 1))
    assert e0.keys() == r0.keys()
    for k in e0:
        torch.testing.assert_close(e0[k], e1[k])
        torch.testing.assert_close(saved['model_ema'][k], e0[k])
    # 2 -> 1 process: the global batch is kept by accumulating 2 micro-batches; a longer budget continues it
    result = train(merge({**cfg, 'epochs': 2, 'grad_accum': 2, 'progress': 'none'}),
                   resume=tmp_path / 'run')
    assert result.global_step == 16 and result.epochs_done == 2


def _saved_state(path):
    saved = load_checkpoint(path)
    return {f'{part}.{k}': v for part in ('model', 'model_ema') for k, v in saved[part].items()}


@pytest.mark.slow
@pytest.mark.parametrize('nproc', [2, 3])
def test_resume_on_several_processes_is_exact(data, tmp_path, nproc):
    # stopped mid-epoch (by its budget, which evaluates and saves there), then resumed: bit-identical to an
    # uninterrupted run, weights, EMA and every rank's BatchNorm statistics (RePa: BatchNorm in the FFN), with drop
    # path, accumulation and EMA on. On 3 processes this failed twice over: the first step after a resume went
    # through DDP's one first-iteration gradient bucket (another summation order), and the evaluation and save of
    # the stop averaged the BatchNorm statistics the ranks trained on
    cfg = _bn_cfg(data, tmp_path, batch_size=2, grad_accum=2, epochs=2, model_ema=True, drop_path_rate=0.1,
                  progress='none')
    dump = str(tmp_path / 'bn')
    for spec in ({'cfg': {**cfg, 'name': 'full'}, 'dump': dump}, {'cfg': {**cfg, 'name': 'part', 'max_steps': 3},
                 'dump': dump}, {'cfg': {**cfg, 'name': 'part'}, 'resume': str(tmp_path / 'part' / 'last.pth'),
                                 'dump': dump}):
        out = _torchrun(tmp_path, spec, nproc=nproc)
        assert out.returncode == 0, out.stderr[-3000:]
    full, part = _saved_state(tmp_path / 'full' / 'last.pth'), _saved_state(tmp_path / 'part' / 'last.pth')
    assert load_checkpoint(tmp_path / 'part' / 'last.pth')['global_step'] == 2 * (64 // (2 * 2 * nproc))  # 2 epochs
    assert full.keys() == part.keys()
    for k in full:
        assert torch.equal(full[k], part[k]), k


def _train_losses(run):
    with open(run / 'metrics.csv') as f:
        return [(int(r['step']), float(r['loss'])) for r in csv.DictReader(f) if r['split'] == 'train']


@pytest.mark.slow
def test_logged_training_loss_is_the_mean_over_every_ranks_images(data, tmp_path):
    # 2 ranks x 4 images and 1 process x 4 x grad_accum=2 see the same 8 images per step (EpochOrder): the same
    # loss rows, not rank 0's half (1.4886 against 1.4512 at step 1 before)
    cfg = _cfg(data, tmp_path, name='ddp', batch_size=4, max_steps=6, checkpoint_interval=3).to_dict()
    out = _torchrun(tmp_path, {'cfg': cfg, 'dump': str(tmp_path / 'bn')})
    assert out.returncode == 0, out.stderr[-3000:]
    train(merge({**cfg, 'name': 'one', 'grad_accum': 2}))
    ddp, one = _train_losses(tmp_path / 'ddp'), _train_losses(tmp_path / 'one')
    assert [s for s, _ in ddp] == [s for s, _ in one] == list(range(1, 7))
    torch.testing.assert_close([v for _, v in ddp], [v for _, v in one], rtol=1e-4, atol=0)


@pytest.mark.slow
def test_sigterm_to_every_rank_stops_at_the_next_step_and_resumes_on_one_process(data, tmp_path):
    # log_interval 1000: before, ranks agreed on a stop only at log intervals, so this run trained on to its end
    # (a real run: up to log_interval steps, past torchrun's 30 s and SLURM's grace period, then SIGKILL)
    cfg = _cfg(data, tmp_path, name='ddp', batch_size=4, epochs=2, log_interval=1000).to_dict()
    out = _torchrun(tmp_path, {'cfg': cfg, 'dump': str(tmp_path / 'bn'), 'signal_at_step': 3})
    assert out.returncode != 0
    assert out.stderr.count('TrainingInterrupted: SIGTERM at step 4: saved') == 2, out.stderr[-3000:]  # both ranks
    assert load_checkpoint(tmp_path / 'ddp' / 'last.pth')['global_step'] == 4
    # resumed on one process with the global batch kept: the rows of an uninterrupted one-process run
    resumed = train(merge({**cfg, 'grad_accum': 2}), resume=tmp_path / 'ddp')
    train(merge({**cfg, 'name': 'one', 'grad_accum': 2}))
    assert resumed.global_step == 16
    ddp, one = _train_losses(tmp_path / 'ddp'), _train_losses(tmp_path / 'one')
    assert [s for s, _ in ddp] == [s for s, _ in one] == [8, 16]
    torch.testing.assert_close([v for _, v in ddp], [v for _, v in one], rtol=1e-4, atol=0)


@pytest.mark.slow
def test_sigterm_to_one_rank_during_an_evaluation_stops_every_rank_at_the_same_batch(tmp_path):
    # 33 test images: rank 0 evaluates 5 batches of 4, rank 1 only 4 (both vote after 4: epoch 1's evaluation
    # ends). Rank 1 alone gets the signal after its first batch of epoch 2's evaluation (step 16); the vote is
    # read a batch later: both stop after their second batch, save last.pth owing the evaluation, and the run
    # resumes on one process like an uninterrupted one-process run
    data = tiny_dataset(tmp_path / 'data', n_train=64, n_test=33)
    cfg = _cfg(data, tmp_path, name='ddp', batch_size=4, epochs=3, log_interval=4).to_dict()
    out = _torchrun(tmp_path, {'cfg': cfg, 'dump': str(tmp_path / 'bn'), 'signal_rank1_in_evaluation': 2})
    assert out.returncode != 0
    for who in ('SIGTERM', 'a signal to another process'):  # rank 1's own, rank 0 by the vote
        assert out.stderr.count(f'TrainingInterrupted: {who} at step 16 during its evaluation: saved') == 1, \
            out.stderr[-3000:]
    evaluated = [json.loads((tmp_path / f'bn.evaluated{rank}').read_text()) for rank in (0, 1)]
    assert evaluated == [[5, 2], [4, 2]]
    saved = load_checkpoint(tmp_path / 'ddp' / 'last.pth')
    assert (saved['global_step'], saved['evaluation_owed']) == (16, True)
    with open(tmp_path / 'ddp' / 'metrics.csv') as f:  # no row of the half evaluation
        assert [(r['step'], r['split']) for r in csv.DictReader(f)][-2:] == [('12', 'train'), ('16', 'train')]
    resumed = train(merge({**cfg, 'grad_accum': 2}), resume=tmp_path / 'ddp')
    train(merge({**cfg, 'name': 'one', 'grad_accum': 2}))
    assert resumed.global_step == 24
    rows = {}
    for name in ('ddp', 'one'):
        with open(tmp_path / name / 'metrics.csv') as f:
            rows[name] = [(int(r['step']), r['split'], float(r['loss'])) for r in csv.DictReader(f)]
    assert [r[:2] for r in rows['ddp']] == [r[:2] for r in rows['one']] == \
        [(4, 'train'), (8, 'train'), (8, 'val'), (12, 'train'), (16, 'train'), (16, 'val'), (20, 'train'),
         (24, 'train'), (24, 'val')]
    torch.testing.assert_close([r[2] for r in rows['ddp']], [r[2] for r in rows['one']], rtol=1e-4, atol=0)


def test_under_ddp_a_stop_is_agreed_one_step_after_the_signal_whatever_the_log_interval():
    # the DDP path without a process group (the sum over ranks is then this rank's flag)
    from types import SimpleNamespace
    from vitblocks.experiments.distributed import DistInfo
    from vitblocks.experiments.engine import Trainer
    fake = SimpleNamespace(dist=DistInfo(0, 2), device=torch.device('cpu'), cfg=SimpleNamespace(log_interval=50),
                           global_step=7, _stop=SimpleNamespace(signal_name=None), _stop_vote=None)
    assert not Trainer._stop_requested(fake)
    fake._stop.signal_name = 'SIGTERM'
    assert not Trainer._stop_requested(fake)  # this step's votes are in flight: read at the next step
    fake.global_step += 1
    assert Trainer._stop_requested(fake)  # step 8 (before: only at step 50, the next log interval)
    fake._stop_vote = None
    assert Trainer._stop_requested(fake, now=True) and fake._stop_vote is None  # after an evaluation: at once


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device (run by scripts/gpu_job.sh)')
def test_a_cuda_vote_is_read_without_waiting_for_the_kernels_queued_after_it():
    """The stop vote of step i is read at step i+1, with that step already queued: reading it must wait for the
    vote only (an event recorded behind its copy to pinned memory), not for the step queued after it, as
    float() of the device tensor would. A one-rank NCCL group; a sleeping kernel stands in for the next step."""
    import time
    import torch.distributed as dist
    from vitblocks.experiments.distributed import all_reduce_sum_async
    dist.init_process_group('nccl', store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(2):  # the first vote also warms NCCL and the pinned-memory cache up
            vote = all_reduce_sum_async(torch.full((1,), 1., device='cuda'))
            torch.cuda._sleep(2 ** 31)  # about a second of one SM busy
            t0 = time.perf_counter()
            assert vote.result() == 1.0
            read = time.perf_counter() - t0
            torch.cuda.synchronize()
            queued = time.perf_counter() - t0
        assert read < 0.2 * queued, (read, queued)
        old_style = torch.full((1,), 1., device='cuda')
        torch.cuda._sleep(2 ** 31)
        t0 = time.perf_counter()
        float(old_style.sum())  # what the vote did before: waits for the sleeping kernel
        assert time.perf_counter() - t0 > 0.5 * queued
    finally:
        dist.destroy_process_group()


def test_failed_collectives_of_a_lost_process_are_told_from_other_errors():
    from vitblocks.experiments.distributed import is_lost_peer
    gloo = ('[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:52115. '
            'This is typically caused by a remote worker crashing.')
    assert is_lost_peer(RuntimeError(gloo)) and is_lost_peer(torch.distributed.DistBackendError('NCCL error'))
    assert not is_lost_peer(RuntimeError('mat1 and mat2 shapes cannot be multiplied')) and not is_lost_peer(KeyError())


@pytest.mark.slow
def test_a_killed_rank_stops_the_others_with_a_message_naming_the_intact_checkpoint(data, tmp_path):
    # before: gloo's "Connection reset by peer ... GLHF!" traceback, no step, checkpoint or resume command
    cfg = _cfg(data, tmp_path, batch_size=4, checkpoint_interval=2, log_interval=2).to_dict()
    out = _torchrun(tmp_path, {'cfg': cfg, 'kill_rank_at_step': 5, 'dump': str(tmp_path / 'bn')})
    assert out.returncode != 0
    assert ('LostProcess: rank 0 of 2: another process of this run went away (killed or crashed: its own log and '
            f"torchrun's summary say why) during step 6; {tmp_path / 'run' / 'last.pth'} (step 4) is intact; "
            f'resume with: vitblocks train --resume {tmp_path / "run"}') in out.stderr, out.stderr[-3000:]
    stop = json.loads((tmp_path / 'run' / 'stopped.json').read_text())
    assert (stop['error'], stop['checkpoint'], stop['global_step']) == ('LostProcess', 'last.pth', 5)
    # resumed on one process with the global batch kept (4 x grad_accum 2 = the 2 ranks' 8): the epoch's 8 steps
    assert train(merge({**cfg, 'grad_accum': 2}), resume=tmp_path / 'run').global_step == 8


@pytest.mark.slow
def test_checkpoint_missing_on_one_rank_stops_every_rank(data, tmp_path):
    first = train(merge(_bn_cfg(data, tmp_path / 'rank0', max_steps=2, progress='none')))
    assert (first.run_dir / 'last.pth').is_file()  # rank 1's folder (tmp/rank1/run) has none
    spec = {'cfg': _bn_cfg(data, tmp_path, resume='auto'), 'output_per_rank': True, 'dump': str(tmp_path / 'bn')}
    out = _torchrun(tmp_path, spec)
    assert out.returncode != 0
    assert out.stderr.count('exists for rank(s) [0] but not here') >= 2  # raised on both ranks, no hang


@pytest.mark.slow
def test_sigkilled_rank_is_restarted_by_torchrun_with_the_same_command(data, tmp_path):
    cfg = _bn_cfg(data, tmp_path, resume='auto', checkpoint_interval=2, epochs=2)
    # torchrun keeps its store, and the killed group's gloo addresses in it, across the restart: the restarted
    # rank 0 reads rank 1's old address unless rank 1 rewrites it first. Rank 1 comes up 2 s late, so without
    # a fresh namespace per attempt (distributed.attempt_store) rank 0 dials a dead port ("Connection refused").
    spec = {'cfg': cfg, 'kill_rank_at_step': 5, 'restarted_rank1_delay': 2, 'dump': str(tmp_path / 'bn')}
    out = _torchrun(tmp_path, spec, restarts=1)
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'from step 4' in out.stdout + out.stderr  # the restarted workers resumed from the step-4 checkpoint
    assert load_checkpoint(tmp_path / 'run' / 'last.pth')['global_step'] == 16


@pytest.mark.slow
def test_two_processes_stream_disjoint_halves_of_the_shards(tmp_path):
    data = tiny_dataset(tmp_path / 'data', n_train=64, n_test=16, per_shard=16)  # 4 shards: 2 per rank
    cfg = dict(model='vit_tiny_patch16_224', data=str(data), model_kwargs=TINY_VIT, batch_size=4, epochs=1,
               lr=1e-3, hflip=0.0, mean=[0.5] * 3, std=[0.5] * 3, threads=1, progress='log', tensorboard=False,
               output=str(tmp_path), name='run', streaming=True)
    out = _torchrun(tmp_path, {'cfg': cfg, 'dump': str(tmp_path / 'd'), 'dump_stream': True})
    assert out.returncode == 0, out.stderr[-3000:]
    assert load_checkpoint(tmp_path / 'run' / 'last.pth')['global_step'] == 8  # 64 samples / (2 x 4)
    def key(images):
        return {bytes(img.contiguous().view(-1).numpy()) for img in images}  # (B, C, H, W): one per image
    # back from mean = std = 0.5 to the uint8 pixels
    rows = [key(torch.load(tmp_path / f'd.stream{r}').mul(127.5).add(127.5).round().to(torch.uint8)) for r in (0, 1)]
    assert len(rows[0]) == len(rows[1]) == 32 and not rows[0] & rows[1]  # each rank its own 2 shards, once
    assert rows[0] | rows[1] == key(ShardDataset(str(data), 'train').images)
