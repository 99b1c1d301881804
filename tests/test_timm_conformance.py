"""timm's model API contract (the checks of timm's ``test_model_default_cfgs``), and the command that runs
timm's own ``tests/test_models.py`` over the registered models (``scripts/timm_conformance.py``).

The contract runs by default on the meta device (no memory, no compute), on the models whose configs
and builders it once failed on; the whole timm suite runs on a small subset under ``slow``, given a
timm checkout in ``VITBLOCKS_TIMM_TESTS`` (tests never fetch one).
"""
import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from timm.layers import get_channel_dim, get_spatial_dim
from timm.models._manipulate import group_parameters

import vitblocks
from vitblocks.models import get_variant

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'scripts' / 'timm_conformance.py'
sys.path.insert(0, str(ROOT / 'scripts'))
import timm_conformance  # noqa: E402
import timm_conformance_plugin as routing  # noqa: E402

# LVT and LV-ViT (added backbones and swapped variants), the NiNformer paper's LocalViT baseline, one
# model of each other added backbone family (their builders took no device and their heads lost it), and
# a RePa PoolFormer (the surgery read MetaFormer's layer scale, which a meta model has no value for)
CONTRACT = ['afbo_lvt', 'iffn_lvt', 'lvvit_s', 'repa_lvvit_s', 'ninformer_baseline_localvit_patch4_28',
            'cyclemlp_b1', 'hiremlp_tiny', 'edgevit_xxs', 'pyramid_visionllama_s', 'repa_poolformer_s12']
META = dict(device='meta', dtype=torch.float32)


def _head_params(model):
    heads = model.get_classifier()
    return [p for h in (heads if isinstance(heads, (tuple, list)) else (heads,)) for p in h.parameters()]


@pytest.mark.parametrize('name', CONTRACT)
def test_builds_on_the_factory_device_and_rejects_unknown_args(name):
    model = timm.create_model(name, **META)  # no device context: the builder places every tensor
    misplaced = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != 'meta']
    assert not misplaced
    assert timm.create_model(name, device='meta', dtype=torch.bfloat16).get_classifier().weight.dtype == torch.bfloat16
    with pytest.raises(TypeError, match='not_a_model_arg'):
        timm.create_model(name, not_a_model_arg=1, **META)


@pytest.mark.parametrize('name', CONTRACT)
def test_config_and_shapes(name):
    """timm's test_model_default_cfgs(_non_std) on the meta device: the config's in_chans and grid, the
    unpooled features, pre-logits and headless outputs, and the classifier / first conv names."""
    model = timm.create_model(name, **META).eval()
    cfg = model.pretrained_cfg
    assert model.in_chans == cfg['input_size'][0] and model.num_features > 0 and model.head_hidden_size > 0
    x = torch.randn(1, *cfg['input_size'], device='meta')
    feats = model.forward_features(x)
    pre = model.forward_head(feats, pre_logits=True)
    assert pre.shape == (1, model.head_hidden_size)
    if cfg['pool_size'] is None:  # token features (B, N, C): timm's non-standard models
        assert feats.ndim == 3 and feats.shape[-1] == model.num_features
    else:
        fmt = getattr(model, 'output_fmt', 'NCHW')
        assert [feats.shape[a] for a in get_spatial_dim(fmt)] == list(cfg['pool_size'])
        assert feats.shape[get_channel_dim(fmt)] == model.num_features
    state = model.state_dict()
    classifiers = cfg['classifier'] if isinstance(cfg['classifier'], (tuple, list)) else (cfg['classifier'],)
    assert all(f'{c}.weight' in state for c in classifiers) and f"{cfg['first_conv']}.weight" in state
    model.reset_classifier(0)
    assert model.num_classes == 0 and model(x).shape == pre.shape
    assert timm.create_model(name, num_classes=0, **META)(x).shape == pre.shape


@pytest.mark.parametrize('name', CONTRACT)
@pytest.mark.parametrize('train', [False, True])
def test_new_head_keeps_device_dtype_and_mode(name, train):
    model = timm.create_model(name, **META).train(train).to(device='meta', dtype=torch.float64)
    model.reset_classifier(0)
    model.reset_classifier(2)  # after reset(0) the head has no parameter to take the device from
    params = _head_params(model)
    assert params and all(p.device.type == 'meta' and p.dtype == torch.float64 for p in params)
    assert all(m.training == train for m in model.modules())


@pytest.mark.parametrize('name', CONTRACT)
def test_optimizer_groups_and_frozen_parameters(name):
    model = timm.create_model(name, **META)
    groups = group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    assert len(set(groups.values())) > 1
    names = [n for n, _ in model.named_parameters()]
    for pattern in getattr(model, 'no_weight_decay', set)():  # a parameter, or an optional one left out (None)
        assert any(fnmatch.fnmatch(n, pattern) for n in names) or getattr(model, pattern, None) is None, pattern
    model.requires_grad_(False)
    model.reset_classifier(0)
    assert not [n for n, p in model.named_parameters() if p.requires_grad]


def test_variant_config_names_its_timm_family():
    cfg = timm.get_pretrained_cfg('ninformer_baseline_localvit_patch4_28')
    assert get_variant('ninformer_baseline_localvit_patch4_28').base == 'vit_tiny_patch16_224'
    assert 'Local-ViT' in cfg.description and 'timm vit_tiny_patch16_224' in cfg.description


NON_STD = ['vit_*', 'deit*', '*mixer_*', 'volo_*', 'cait_*', 'poolformer_*', 'gcvit*']  # part of timm's list


def test_routing_follows_the_timm_family():
    """The plugin lists a model where timm lists its base: a Swin or PVTv2 variant and the map backbones in the
    standard kinds (LVT, hierarchical like PVTv2, too), ViT-based models whatever their name and the token
    backbone LV-ViT in the non-std kind; timm's name filters still apply to our names."""
    std = set(routing.list_models(exclude_filters=['*enormous*'] + NON_STD))
    non_std = set(routing.list_models(filter=NON_STD, exclude_filters=['*enormous*']))
    assert {'iffn_swin_tiny_patch4_window7_224', 'afbo_pvt_v2_b1', 'cyclemlp_b1', 'edgevit_xxs',
            'pyramid_visionllama_s', 'lvt', 'afbo_lvt', 'iffn_lvt'} <= std
    assert {'ninformer_baseline_localvit_patch4_28', 'lvvit_s', 'repa_lvvit_s'} <= non_std
    assert not std & non_std
    assert std | non_std == set(vitblocks.list_models() + vitblocks.models.list_backbones())
    assert not [n for n in routing.list_models(exclude_filters=['afbo_*']) if n.startswith('afbo_')]
    # the feature-API kinds: timm lists them by module, ours join through their base's family or as added backbones
    features = set(routing.list_models(module=['vision_transformer', 'swin_transformer', 'pvt_v2']))
    assert {'lvt', 'afbo_lvt', 'lvvit_s', 'repa_lvvit_s', 'cyclemlp_b1', 'iffn_swin_tiny_patch4_window7_224',
            'afbo_pvt_v2_b1', 'ninformer_baseline_localvit_patch4_28'} <= features
    assert not {n for n in features if routing.base_of(n).startswith('poolformer')}  # timm's metaformer: not listed
    assert not set(routing.list_models(module=['swin_transformer'])) & {'lvt', 'cyclemlp_b1'}
    assert routing.list_models(pretrained=True) == []


def _run(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), cwd=ROOT)


def _main(*args):
    """The command's exit status (or error message) and what it printed, run in this process."""
    try:
        return timm_conformance.main([str(a) for a in args])
    except SystemExit as e:
        return e.code


def test_command_names_what_is_wrong(tmp_path, capsys):
    assert 'no test_models.py there' in _main('--timm-tests', tmp_path)
    (tmp_path / 'test_models.py').write_text('')
    assert 'matches no registered model' in _main('--timm-tests', tmp_path, '--models', 'no_such_model_*')
    assert _main('--summarize', tmp_path) == 2 and 'no collected-*.jsonl' in capsys.readouterr().err
    assert _main('--timm-tests', tmp_path, '--jobs', 0) == 2 and 'must be positive' in capsys.readouterr().err


def test_table_of_a_stopped_run(tmp_path, capsys):
    """The table counts each case once (its worst report), and a collected case with no result as not run."""
    case = 'test_models.py::test_model_{}[1-{}]'
    collected = [dict(nodeid=case.format(k, m), model=m, kind=f'test_model_{k}')
                 for m in ('a_model', 'b_model') for k in ('forward', 'backward')]
    results = [dict(nodeid=case.format('forward', 'a_model'), outcome='passed', message=''),
               dict(nodeid=case.format('backward', 'a_model'), outcome='passed', message=''),
               dict(nodeid=case.format('backward', 'a_model'), outcome='failed', message='E teardown broke'),
               dict(nodeid=case.format('forward', 'b_model'), outcome='skipped', message='Fixed input size')]
    (tmp_path / 'collected-0.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in collected))
    (tmp_path / 'results-0.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in results))
    assert _main('--summarize', tmp_path) == 1
    table = capsys.readouterr().out
    assert '| `backward` | 2 | 0 | 1 | 0 | 1 |' in table and '| `forward` | 2 | 1 | 0 | 1 | 0 |' in table
    assert '| all | 4 | 1 | 1 | 1 | 1 |' in table
    assert '| `a_model` | FAIL | pass |' in table and '| `b_model` | not run | skip |' in table
    assert 'E teardown broke' in table and (tmp_path / 'table.md').read_text() == table


def _write_run(out, kinds, cases):
    """A run folder: ``cases`` as (kind, model, outcome or None for collected, not run)."""
    out.mkdir()
    nodeid = 'test_models.py::test_model_{}[1-{}]'.format
    (out / 'run.json').write_text(json.dumps(dict(
        timm_version='1.0.31', test_file='t/test_models.py', test_file_sha256='ab' * 32, vitblocks_commit=out.name,
        started='today', models=2, kinds=kinds, jobs=1, threads=1, time_limit_s=60.)))
    (out / 'collected-0.jsonl').write_text(''.join(
        json.dumps(dict(nodeid=nodeid(k, m), model=m, kind=f'test_model_{k}')) + '\n' for k, m, _ in cases))
    (out / 'results-0.jsonl').write_text(''.join(
        json.dumps(dict(nodeid=nodeid(k, m), outcome=o, message='E broke' if o == 'failed' else '')) + '\n'
        for k, m, o in cases if o))


def test_merged_runs_replace_the_cases_they_ran(tmp_path, capsys):
    """A later run replaces the cases of the kinds it ran for its models; one over every kind replaces all of
    its models' cases, including kinds the model no longer joins."""
    _write_run(tmp_path / 'full', ['*'], [('forward', 'a', 'failed'), ('backward', 'a', 'passed'),
                                          ('forward', 'b', 'passed'), ('non_std', 'b', 'failed')])
    _write_run(tmp_path / 'fix_a', ['forward'], [('forward', 'a', 'passed')])
    _write_run(tmp_path / 'fix_b', ['*'], [('forward', 'b', 'passed'), ('std', 'b', None)])
    assert _main('--summarize', tmp_path / 'full') == 1
    capsys.readouterr()
    assert _main('--summarize', tmp_path / 'full', tmp_path / 'fix_a') == 1  # b's non_std still fails
    assert '| `a` | pass | pass | - |' in capsys.readouterr().out
    assert _main('--summarize', tmp_path / 'full', tmp_path / 'fix_a', tmp_path / 'fix_b') == 1  # b's std: not run
    table = capsys.readouterr().out
    assert '| `a` | pass | pass | - |' in table and '| `b` | - | pass | not run |' in table and 'non_std' not in table
    assert 'run 2 of 3, 1 cases (1 of the earlier replaced)' in table and 'vitblocks fix_b' in table
    assert 'run 3 of 3, 2 cases (2 of the earlier replaced)' in table
    assert (tmp_path / 'fix_b' / 'table-merged.md').read_text() == table


# the LVT models (hierarchical: timm's standard and feature kinds), the LV-ViT models and the LocalViT
# baseline (token features: the non-std kinds), an added map backbone (EdgeViT: the feature-API kinds timm
# selects by module) and a Swin variant
SUBSET = CONTRACT[:5] + ['edgevit_xxs', 'iffn_swin_tiny_patch4_window7_224']


@pytest.mark.slow
def test_timm_suite_on_a_subset(tmp_path):
    """timm's own tests/test_models.py, every kind, over SUBSET: no case fails."""
    tests = os.environ.get('VITBLOCKS_TIMM_TESTS')
    if not tests:
        pytest.skip('set VITBLOCKS_TIMM_TESTS to a timm checkout (or its tests/ folder) at the installed timm '
                    'version to run timm\'s own model tests; nothing is fetched')
    out = _run('--timm-tests', tests, '--models', *SUBSET, '--jobs', 2, '--out', tmp_path,
               env=dict(PYTHONPATH=str(ROOT / 'src')))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]  # 0: every collected case ran, none failed
    cases, passed, failed, skipped, not_run = out.stdout.split('\n| all |')[1].split('\n')[0].split('|')[:5]
    assert int(passed) > 0 and int(failed) == int(not_run) == 0 and int(passed) + int(skipped) == int(cases)
    assert all(f'| `{name}` |' in out.stdout for name in SUBSET)
