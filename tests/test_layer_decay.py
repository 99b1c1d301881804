"""Layer-wise learning-rate decay (``layer_decay``): a ``group_matcher`` for timm's MetaFormer (PoolFormer),
one lr scale per unit for timm and vitblocks models, a run's groups at the schedule's lr x their scale
(cosine, none, plateau), weight decay unchanged, and the errors.

A training step here is a 16-wide ViT (or PoolFormer-S12) on 8x8 synthetic images, one CPU thread.
"""
import csv
import re
from pathlib import Path

import pytest
import timm
import torch
from timm.models import group_parameters
from timm.optim import param_groups_layer_decay
from torch import nn

from vitblocks.experiments import merge
from vitblocks.experiments.config import ConfigError, parse_overrides
from vitblocks.experiments.engine import Trainer
from vitblocks.experiments.optim import param_groups, schedule_lr
from vitblocks.experiments.schedule import build_scheduler
from vitblocks.models import expose_group_matcher, has_group_matcher
from vitblocks.models.surgery import SWAPPED_ATTR
from vitblocks.profile import fixed_threads

from _train_helpers import TINY_VIT, tiny_dataset


@pytest.fixture(autouse=True, scope='module')
def _one_thread():
    with fixed_threads(1):
        yield


def _scales(model: nn.Module, decay: float):
    """{parameter name: lr_scale} of timm's layer-decay groups."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g['lr_scale'] for g in param_groups_layer_decay(model, layer_decay=decay)
            for p in g['params']}


def _metaformer_unit(name: str):
    """Where a MetaFormer parameter sits from the input up: stem, a stage's downsampling, a block, the head."""
    parts = name.split('.')
    if parts[0] == 'stem':
        return (0,)
    if parts[0] == 'stages':
        return (1, int(parts[1]), -1 if parts[2] == 'downsample' else int(parts[3]))
    assert parts[0] == 'head', name  # head.norm (after the pooling) and head.fc
    return (2,)


def _vit_unit(name: str, depth: int):
    """The same for a ViT: the embedding, a block (the final norm with the last one), the head."""
    parts = name.split('.')
    if parts[0] in ('cls_token', 'reg_token', 'pos_embed', 'patch_embed'):
        return (0,)
    if parts[0] == 'blocks':
        return (1, int(parts[1]))
    if parts[0] == 'norm':
        return (1, depth - 1)
    assert parts[0] in ('fc_norm', 'head'), name
    return (2,)


def _check_one_scale_per_unit(model: nn.Module, unit, decay: float) -> int:
    """Each unit gets one scale, ``decay ** (units above it)``; returns the number of units."""
    scale = _scales(model, decay)
    assert scale.keys() == {n for n, _ in model.named_parameters()}
    units = {n: unit(n) for n in scale}
    order = sorted(set(units.values()))
    expected = {u: decay ** (len(order) - 1 - k) for k, u in enumerate(order)}
    wrong = {n: (s, expected[units[n]]) for n, s in scale.items() if abs(s - expected[units[n]]) > 1e-12}
    assert not wrong, f'{len(wrong)} parameters with another lr_scale than their unit, e.g. {list(wrong.items())[:3]}'
    # a block vitblocks swapped in trains at its block's lr
    for path, module in model.named_modules():
        if getattr(module, SWAPPED_ATTR, None):
            assert {scale[f'{path}.{n}'] for n, _ in module.named_parameters()} == {
                expected[unit(f'{path}.x')]}, path
    return len(order)


# PoolFormer-S12: stem, 3 downsamplings (stage 0 keeps its width), 2+2+6+2 blocks, head = 17 units;
# CAFormer-S18: attention stages, a norm in its stem and downsamplings, an MLP head: 1 + 3 + 18 + 1
@pytest.mark.parametrize('name, units', [('poolformer_s12', 17), ('caformer_s18', 23), ('iffn_poolformer_s12', 17),
                                         ('repa_poolformer_s12', 17)])
def test_metaformer_group_matcher_gives_one_scale_per_unit(name, units):
    model = timm.create_model(name, num_classes=5)
    assert has_group_matcher(model) == name.startswith(('iffn_', 'repa_'))  # vitblocks' models get it when built
    expose_group_matcher(model)  # timm's own: the trainer gives it (no-op for vitblocks' models)
    assert has_group_matcher(model)
    assert _check_one_scale_per_unit(model, _metaformer_unit, decay=0.65) == units


def test_metaformer_group_matcher_coarse_is_one_group_per_stage():
    model = timm.create_model('afbo_poolformer_s12', num_classes=5)  # built with its group_matcher
    groups = list(group_parameters(model, model.group_matcher(coarse=True)).values())  # in depth order
    where = [{'.'.join(n.split('.')[:2]) if n.startswith('stages.') else n.split('.')[0] for n in g} for g in groups]
    assert where == [{'stem'}, {'stages.0'}, {'stages.1'}, {'stages.2'}, {'stages.3'}, {'head'}]


def test_expose_group_matcher_leaves_other_models_alone():
    vit = timm.create_model('vit_tiny_patch16_224', **TINY_VIT)
    matcher = vit.group_matcher
    assert expose_group_matcher(vit).group_matcher == matcher  # timm's own method stays
    plain = expose_group_matcher(nn.Linear(2, 2))
    assert not has_group_matcher(plain)


@pytest.mark.parametrize('name', ['iffn_deit_tiny_patch16_224', 'repa_deit_tiny_patch16_224'])
def test_surgery_on_deit_keeps_one_scale_per_block(name):
    model = timm.create_model(name, img_size=32, depth=3, num_classes=5)
    assert _check_one_scale_per_unit(model, lambda n: _vit_unit(n, 3), decay=0.75) == 5  # embedding, 3 blocks, head
    assert sum(bool(getattr(m, SWAPPED_ATTR, None)) for m in model.modules()) == 3


# --- the trainer ------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def data(tmp_path_factory) -> Path:
    return tiny_dataset(tmp_path_factory.mktemp('data') / 'tiny')


def _cfg(data: Path, out: Path, **kw):
    base = dict(model='vit_tiny_patch16_224', data=str(data), model_kwargs={**TINY_VIT, 'depth': 2}, epochs=3,
                batch_size=8, opt='adamw', lr=3e-3, weight_decay=0.05, sched='cosine', warmup_epochs=1,
                mean='dataset', std='dataset', progress='none', log_interval=1, output=str(out), name='run',
                tensorboard=False, threads=1, layer_decay=0.5)
    base.update(kw)
    return merge(base)


def _reference_lr(cfg, steps_per_epoch: int, step: int) -> float:
    """The schedule's lr after ``step`` updates, on a one-group optimizer."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch)
    if scheduler is not None:
        scheduler.step_update(num_updates=step)
    return optimizer.param_groups[0]['lr']


@pytest.mark.parametrize('sched, warmup', [('cosine', 1), ('none', 0)])
def test_run_sets_each_group_to_the_schedule_lr_times_its_scale(data, tmp_path, sched, warmup):
    trainer = Trainer(_cfg(data, tmp_path, sched=sched, warmup_epochs=warmup, max_steps=5))
    result = trainer.fit()
    assert result.global_step == 5
    ref = _reference_lr(trainer.cfg, trainer.steps_per_epoch, 5)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    lr = {names[id(p)]: g['lr'] for g in trainer.optimizer.param_groups for p in g['params']}
    scale = {names[id(p)]: g['lr_scale'] for g in trainer.optimizer.param_groups for p in g['params']}
    assert len(lr) == len(names)
    for n in lr:
        assert lr[n] == pytest.approx(ref * scale[n], rel=1e-12), n
    # units: embedding, blocks 0 and 1, head; the head trains at the schedule's lr, block 0 at lr x 0.5^depth
    assert lr['head.weight'] == pytest.approx(ref, rel=1e-12)
    assert lr['blocks.0.mlp.fc1.weight'] == pytest.approx(ref * 0.5 ** 2, rel=1e-12)
    assert lr['patch_embed.proj.weight'] == pytest.approx(ref * 0.5 ** 3, rel=1e-12)
    assert schedule_lr(trainer.optimizer) == pytest.approx(ref, rel=1e-12)
    with open(result.run_dir / 'metrics.csv') as f:  # the logged lr is the schedule's (the head's), not the stem's
        rows = [r for r in csv.DictReader(f) if r['split'] == 'train']
    assert float(rows[-1]['lr']) == pytest.approx(ref, rel=1e-5) and int(rows[-1]['step']) == 5
    if sched == 'cosine':
        assert ref < trainer.cfg.lr  # mid-schedule, so the test tells the scaled lr from the base one


@pytest.mark.parametrize('sched', ['cosine', 'none'])
def test_resumed_layer_decay_run_retraces_the_uninterrupted_one(data, tmp_path, sched):
    """The groups' lrs and scales come back with the optimizer state (sched=none: scaled once at build, then loaded)."""
    from vitblocks.experiments import load_model_weights, train
    kw = dict(sched=sched, warmup_epochs=1 if sched == 'cosine' else 0)
    train(_cfg(data, tmp_path / 'straight', max_steps=4, **kw))
    train(_cfg(data, tmp_path / 'parts', max_steps=2, **kw))
    resumed = Trainer(_cfg(data, tmp_path / 'parts', max_steps=4, **kw), resume=tmp_path / 'parts' / 'run' / 'last.pth')
    assert resumed.global_step == 2
    resumed.fit()
    a, b = (load_model_weights(tmp_path / d / 'run' / 'last.pth') for d in ('straight', 'parts'))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_plateau_keeps_the_scales_through_decays_and_at_the_floor():
    """torch's ReduceLROnPlateau multiplies the groups' lrs (ratios kept) but floors every group at min_lr and skips
    a decay smaller than eps = 1e-8: left so, the lowest group (1e-6 here) stops decaying after two decays and all
    groups end at one floor."""
    model = timm.create_model('vit_tiny_patch16_224', **{**TINY_VIT, 'depth': 2})  # 4 units: scales 1 .. 1e-3
    cfg = merge(dict(sched='plateau', lr=1e-3, min_lr=1e-9, decay_rate=0.1, patience_epochs=0, layer_decay=0.1))
    optimizer = torch.optim.SGD(param_groups(cfg, model), lr=cfg.lr)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch=10)
    scales = [g['lr_scale'] for g in optimizer.param_groups]
    assert min(scales) == pytest.approx(1e-3)
    for epoch in range(1, 10):
        scheduler.step(epoch, 50.0)  # never better: a decay per epoch after the first
        head = max(cfg.lr * 0.1 ** (epoch - 1), cfg.min_lr)  # the floor from epoch 7 on
        for g in optimizer.param_groups:
            assert g['lr'] == pytest.approx(head * g['lr_scale'], rel=1e-9), (epoch, g['lr_scale'])


def test_plain_poolformer_trains_with_layer_decay(data, tmp_path):
    """``vitblocks train --model poolformer_s12 layer_decay=...``: timm's MetaFormer gets the group_matcher from the
    trainer (17 units), not timm's runs of 12 tensors."""
    trainer = Trainer(_cfg(data, tmp_path, model='poolformer_s12', model_kwargs={}, input_size=[3, 8, 8],
                           layer_decay=0.65, max_steps=2, warmup_epochs=0))
    assert has_group_matcher(trainer.model)
    trainer.fit()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    scale = {names[id(p)]: g['lr_scale'] for g in trainer.optimizer.param_groups for p in g['params']}
    assert scale['head.fc.weight'] == 1.0 and scale['head.norm.weight'] == 1.0
    assert scale['stages.3.blocks.1.mlp.fc2.weight'] == pytest.approx(0.65)
    assert scale['stages.3.downsample.conv.weight'] == pytest.approx(0.65 ** 3)
    assert scale['stem.conv.weight'] == pytest.approx(0.65 ** 16)
    assert len({scale[n] for n in scale}) == 17


# --- weight decay, errors -----------------------------------------------------------------------------
class TwoDimBias(nn.Module):
    """A block whose shift is a (2, C) tensor named ``.bias``: timm's weight-decay groups skip it by its name, timm's
    layer-decay groups only 1-D tensors."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.shift = nn.Module()
        self.shift.bias = nn.Parameter(torch.zeros(2, 4))
        self.head = nn.Linear(4, 3)

    def group_matcher(self, coarse: bool = False):
        return dict(stem=r'^stem', blocks=r'^blocks\.(\d+)')


@pytest.mark.parametrize('build', [lambda: timm.create_model('iffn_deit_tiny_patch16_224', img_size=32, depth=2),
                                   TwoDimBias], ids=['iffn_deit', 'two_dim_bias'])
def test_layer_decay_keeps_the_weight_decay_exclusions(build):
    """The groups decay exactly the tensors the plain weight-decay groups decay (IFFN's (2, C) AGeLU shifts named by
    its no_weight_decay(), timm's pos_embed, 1-D tensors, names ending in .bias)."""
    model = build()
    names = {id(p): n for n, p in model.named_parameters()}

    def decay(**kw):
        groups = param_groups(merge(dict(weight_decay=0.05, **kw)), model)
        return {names[id(p)]: g['weight_decay'] for g in groups for p in g['params']}
    plain, layered = decay(), decay(layer_decay=0.75)
    assert layered == plain and len(plain) == len(names)
    skipped = {n for n, wd in plain.items() if wd == 0}
    if 'shift.bias' in names.values():
        assert 'shift.bias' in skipped
    else:
        assert {'pos_embed', 'blocks.0.mlp.act.gamma', 'blocks.0.mlp.act.theta'} <= skipped  # IFFN's DeiT: no cls_token
        assert plain['blocks.0.mlp.act.alpha'] == 0.05


def test_a_model_without_group_matcher_is_an_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    cfg = merge(dict(model='my_net', layer_decay=0.75))
    with pytest.raises(ConfigError, match=re.escape('layer_decay=0.75: my_net (Sequential) has no group_matcher()')
                       + '.*runs of 12 tensors.*Drop layer_decay'):
        param_groups(cfg, model)
    assert len(param_groups(merge(dict(model='my_net')), model)) == 2  # fine without layer_decay


@pytest.mark.parametrize('value', ['0', '1.5', '-0.5'])
def test_layer_decay_outside_0_1_is_refused(value):
    with pytest.raises(ConfigError, match=rf'layer_decay={float(value)!r}: expected a number in \(0, 1\]'):
        parse_overrides([f'layer_decay={value}'])
    with pytest.raises(ConfigError, match='layer_decay'):
        merge(dict(layer_decay=float(value)))


def test_layer_decay_in_range_is_accepted():
    assert parse_overrides(['layer_decay=1'])['layer_decay'] == 1.0
    assert parse_overrides(['layer_decay=0.65'])['layer_decay'] == 0.65
    assert merge(dict(layer_decay=None)).layer_decay is None
