"""The evidence plan of the CIFAR-10 blocks benchmark: controls at matched parameters, verdicts against each
paper's sign, the plan order, and the whole command rehearsed at a tiny budget (a small plan, in-process)."""
import json
import tarfile

import pytest
import timm

import vitblocks.cli as cli
from vitblocks.reproduce import blocks_evidence
from vitblocks.reproduce.blocks_evidence import CLAIMS, EVIDENCE_PLAN, Claim, Tier, verdicts
from vitblocks.reproduce.common import archive_runs
from vitblocks.models.blocks_bench import ABLATION_CONFIGS, CONTROL_CONFIGS, MAIN_CONFIGS, bench_model_name
from vitblocks.profile import count_params
from test_reproduce import TINY, cifar_root  # noqa: F401  (the stand-in for CIFAR-10)


def _params(config):
    return count_params(timm.create_model(bench_model_name(config)))


@pytest.mark.parametrize('control,block', [('local_ffn', 'iffn'), ('local_ffn_afbo', 'afbo'),
                                           ('vanilla_wide', 'ninformer')])
def test_controls_match_the_parameters_of_the_block_they_control_for(control, block):
    assert abs(_params(control) - _params(block)) / _params(block) < 0.001


def test_the_plan_covers_every_configuration_once_per_tier_and_every_claim():
    every = set(MAIN_CONFIGS) - {'swiglu', 'mabvit_parallel', 'mabvit_glu_parallel'}
    planned = {c for tier in EVIDENCE_PLAN[:2] for c in tier.configs}
    assert set(CONTROL_CONFIGS) | set(ABLATION_CONFIGS) | every <= planned
    assert all(len(set(t.configs)) == len(t.configs) for t in EVIDENCE_PLAN)
    assert EVIDENCE_PLAN[0].configs[:4] == ('vanilla', 'local_ffn', 'iffn', 'afbo')  # the locality question first
    assert EVIDENCE_PLAN[-1].epochs == 100 and EVIDENCE_PLAN[-1].seeds == (0,)
    assert all({c.config, c.reference} <= planned for c in CLAIMS)


def test_verdicts_pair_by_seed_and_compare_the_sign_with_the_spread():
    claims = [Claim('a', 'ref', +1, 'a above'), Claim('b', 'ref', +1, 'b above', locality=True),
              Claim('c', 'ref', -1, 'c below'), Claim('d', 'ref', 0, 'd equal'), Claim('e', 'ref', +1, 'one seed'),
              Claim('x', 'missing', +1, 'no runs')]
    top1 = {'ref': {0: 50.0, 1: 60.0, 2: 55.0},
            'a': {0: 52.0, 1: 62.5, 2: 56.5},  # +2.0, +2.5, +1.5: mean 2.0, spread 0.5
            'b': {0: 51.0, 1: 59.0, 2: 55.5},  # +1.0, -1.0, +0.5: within the spread
            'c': {0: 53.0, 1: 63.0, 2: 58.0},  # +3 each: opposite to the paper's sign, spread 0
            'd': {0: 50.1, 1: 59.8, 2: 55.2},
            'e': {1: 70.0}}
    rows = {r['config']: r for r in verdicts(top1, claims)}
    assert set(rows) == {'a', 'b', 'c', 'd', 'e'}
    assert rows['a']['mean'] == pytest.approx(2.0) and rows['a']['spread'] == pytest.approx(0.5)
    assert rows['a']['verdict'] == 'holds'
    assert rows['b']['verdict'] == 'not separable from locality'
    assert rows['c']['verdict'] == 'does not hold'
    assert rows['d']['verdict'].startswith('holds (no difference')
    assert rows['e']['seeds'] == [1] and rows['e']['verdict'] == 'one seed: no spread known'


def test_archive_packs_the_runs_without_checkpoints(tmp_path):
    run = tmp_path / 'out' / 'iffn' / 'seed0'
    run.mkdir(parents=True)
    for name in ('config.yaml', 'metrics.csv', 'results.json', 'last.pth'):
        (run / name).write_text('x')
    (tmp_path / 'out' / 'afbo' / 'seed0').mkdir(parents=True)
    (tmp_path / 'out' / 'afbo' / 'seed0' / 'metrics.csv').write_text('x')  # unfinished: no results.json
    assert archive_runs([tmp_path / 'out', tmp_path / 'absent'], tmp_path / 'e.tgz') == 1
    names = tarfile.open(tmp_path / 'e.tgz').getnames()
    assert 'out/iffn/seed0/results.json' in names and 'out/afbo/seed0/metrics.csv' in names
    assert not any(n.endswith('.pth') for n in names) and not (tmp_path / 'e.tgz.tmp').exists()


def test_the_plan_runs_most_telling_first_and_resumes(cifar_root, tmp_path, capsys, monkeypatch):  # noqa: F811
    """A two-tier plan at one step a run, in child processes: the first tier's runs start first and are paused
    last, the verdicts are printed, evidence.json and the archive written; a re-run trains nothing."""
    plan = (Tier('', ('vanilla', 'local_ffn', 'iffn'), (0, 1)), Tier('long', ('vanilla', 'iffn'), (0,), 3))
    claims = (Claim('iffn', 'local_ffn', +1, 'IFFN above its locality control', True),)
    monkeypatch.setattr(blocks_evidence, 'EVIDENCE_PLAN', plan)
    monkeypatch.setattr(blocks_evidence, 'CLAIMS', claims)
    from vitblocks.cli import reproduce_evidence
    monkeypatch.setattr(reproduce_evidence, 'EVIDENCE_PLAN', plan)
    started = []
    real = reproduce_evidence.run_children

    def record(args, children):
        started.extend((j.name, j.priority) for j in children)
        return real(args, children)
    monkeypatch.setattr(reproduce_evidence, 'run_children', record)
    out = tmp_path / 'evidence'
    argv = ['reproduce', 'cifar10-blocks', '--plan', 'evidence', '--max-steps', 1, '--threads', 1, '--jobs', 2,
            '--repeats', 1, '--latency-batch', 2,
            '--data-root', cifar_root, '--output', out, '--archive', tmp_path / 'evidence.tgz',
            '--set', 'progress=none', 'tensorboard=false', 'batch_size=16', TINY]
    code = cli.main([str(a) for a in argv])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert started == [('vanilla/seed0', 2), ('vanilla/seed1', 2), ('local_ffn/seed0', 2), ('local_ffn/seed1', 2),
                       ('iffn/seed0', 2), ('iffn/seed1', 2), ('long/vanilla/seed0', 1), ('long/iffn/seed0', 1)]
    assert 'iffn vs local_ffn' in printed and 'evidence plan: 8 run(s) to train of 8' in printed
    assert (out / 'table.txt').is_file() and (out / 'tradeoff.png').is_file()  # the table of every finished config
    summary = {s['config']: s for s in json.loads((out / 'summary.json').read_text())}
    assert set(summary) == {'vanilla', 'local_ffn', 'iffn'} and len(summary['iffn']['top1']) == 2
    report = json.loads((out / 'evidence.json').read_text())
    assert set(report['top1']['']) == {'vanilla', 'local_ffn', 'iffn'} and set(report['top1']['long']) == {
        'vanilla', 'iffn'}
    assert report['verdicts'][0]['seeds'] == [0, 1]
    names = tarfile.open(tmp_path / 'evidence.tgz').getnames()
    assert 'evidence/long/iffn/seed0/results.json' in names and not any(n.endswith('.pth') for n in names)
    started.clear()
    assert cli.main([str(a) for a in argv]) == 0  # everything finished: nothing trains again
    assert started == [] and 'evidence plan: 0 run(s) to train of 8' in capsys.readouterr().out


def test_plan_options_that_contradict_are_one_line_errors(tmp_path, capsys):
    for argv, message in ((['--plan', 'evidence', '--configs', 'iffn'], 'chooses the configurations and seeds'),
                          (['--archive', 'x.tgz'], '--archive packs the runs of --plan evidence')):
        code = cli.main(['reproduce', 'cifar10-blocks', '--output', str(tmp_path), *argv])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
