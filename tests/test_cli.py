"""The ``vitblocks`` command line, run in-process through ``vitblocks.cli.main``."""
import csv
import io
import re

import pytest
import timm

import vitblocks
from vitblocks.cli import COMMANDS, main
from vitblocks.cli.profile_model import breakdown, component_of
from vitblocks.papers import load_paper
from vitblocks.profile import count_macs, count_params, fixed_threads


@pytest.fixture(autouse=True, scope='module')
def _one_thread():
    """Batch-1 counting forwards gain nothing from threads; on a shared CPU extra threads spin."""
    with fixed_threads(1):
        yield


SUMMARY = re.compile(r'^(\d+) of (\d+) published rows within 1%$')


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, out, err, *fragments):
    assert code == 2
    assert out == ''
    assert len(err.strip().splitlines()) == 1, err
    assert 'Traceback' not in err
    for f in fragments:
        assert f in err


# --- help ------------------------------------------------------------------------------------------

def test_top_level_help(capsys):
    code, out, _ = run(capsys, '--help')
    assert code == 0
    for cmd in ('compare', 'profile', 'bench', 'list'):
        assert cmd in out


@pytest.mark.parametrize('command', [c.NAME for c in COMMANDS])
def test_every_command_has_help_with_examples(capsys, command):
    code, out, _ = run(capsys, command, '--help')
    assert code == 0
    assert 'examples:' in out
    assert f'vitblocks {command} ' in out.split('examples:')[1]  # a real command line, not a placeholder


def test_no_command_is_a_usage_error(capsys):
    code, out, err = run(capsys)
    assert_one_line_error(code, out, err, 'required')


# --- list ----------------------------------------------------------------------------------------

def test_list_shows_every_registered_model(capsys):
    code, out, _ = run(capsys, 'list')
    assert code == 0
    names = vitblocks.list_models()
    assert names and all(n in out for n in names)
    assert out.strip().endswith(f'{len(names)} models')
    line = next(ln for ln in out.splitlines() if ln.startswith('iffn_deit_tiny_patch16_224 '))
    assert line.split()[1:3] == ['iffn', 'deit_tiny_patch16_224']


def test_list_params_are_the_real_counts(capsys):
    code, out, _ = run(capsys, 'list', '--method', 'iffn', '--filter', 'deit_tiny', '--params')
    assert code == 0
    line = next(ln for ln in out.splitlines() if ln.startswith('iffn_deit_tiny_patch16_224 '))
    assert line.split()[3] == '5.00'  # 4,998,184 parameters (IFFN Table 1: 5.0 M)


# --- profile ---------------------------------------------------------------------------------------

def test_profile_prints_params_and_both_gmacs(capsys):
    """DeiT-T, counted by hand: 5,717,416 parameters (timm: 5.72 M). MACs without norms: the patch embedding
    196 * 768 * 192, per block (x12, 197 tokens) qkv 197 * 192 * 576, proj 197 * 192^2, the two attention
    matmuls 2 * 3 * 197^2 * 64 and the MLP 2 * 197 * 192 * 768, and the head 192 * 1000: 1,253,683,200. The 25
    LayerNorms add 2 MACs per element of 197 x 192: 1,255,574,400."""
    code, out, _ = run(capsys, 'profile', 'deit_tiny_patch16_224')
    assert code == 0
    assert re.search(r'^params\s+5,717,416\b', out, re.M)
    assert re.search(r'GMACs\s+1\.256\s+with norms', out)
    assert re.search(r'^\s+1\.254\s+without norms', out, re.M)
    for component in ('stem / patch embed', 'token mixer', 'FFN', 'head', 'total'):
        assert re.search(rf'^\s+{re.escape(component)}\s', out, re.M)
    assert 'blocks.0' in out  # top modules at depth 2


@pytest.mark.parametrize('name', ['deit_tiny_patch16_224', 'iffn_poolformer_s12'])
def test_profile_breakdown_adds_up(name):
    """Every MAC and parameter lands in exactly one component (also PoolFormer, whose head's
    own forward is bypassed)."""
    model = timm.create_model(name)
    report = count_macs(model, include_norms=True)
    parts = breakdown(model, report.by_module)
    assert sum(m for _, m in parts.values()) == report.total
    assert sum(p for p, _ in parts.values()) == count_params(model)
    assert parts['head'][1] > 0 and parts['FFN'][1] > parts['stem / patch embed'][1] > 0


def test_component_names():
    assert component_of('blocks.3.mlp.norm') == 'FFN'
    assert component_of('blocks.3.norm1') == 'block norms'
    assert component_of('norm') == 'head'
    assert component_of('layers.1.downsample.norm') == 'downsample'
    assert component_of('stages.0.blocks.1.token_mixer') == 'token mixer'
    assert component_of('pos_drop') == 'other'


def test_profile_block_cfg(capsys):
    code, out, _ = run(capsys, 'profile', 'iffn_deit_tiny_patch16_224', '--block-cfg', 'kernel_size=7', '--top', '1')
    assert code == 0
    # 4,998,184 at kernel 3; the 768-channel depthwise conv of each of the 12 blocks grows by 768 * (49 - 9)
    assert re.search(r'^params\s+5,366,824\b', out, re.M) and 'kernel_size=7' in out


# --- user errors: one line on stderr, exit code 2 ---------------------------------------------------

@pytest.mark.parametrize('argv, fragments', [
    (['profile', 'deit_tiny_patch16'], ['Did you mean', 'deit_tiny_patch16_224']),
    (['bench', 'iffn_deit_tiny_patch16'], ['Did you mean', 'iffn_deit_tiny_patch16_224']),
    (['bench', 'deit_tiny_patch16_224', '--baseline', 'deit_tiny_patch16'], ['Did you mean']),
    (['compare', '--paper', 'ifn'], ['unknown paper', 'Did you mean: iffn']),
    (['compare', '--tables', '1,99'], ['no table 99', 'available: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13']),
    (['compare', '--models', 'no_such_model'], ['no table row matches']),
    (['compare', '--tables', ','], ["--tables ',' names no table"]),  # was every table of every paper
    (['list', '--method', 'ifn'], ['Did you mean: iffn']),
    (['profile', 'deit_tiny_patch16_224', '--depth', 'x'], ['--depth', "'x'"]),
    (['bench', 'deit_tiny_patch16_224', '--batch-size', '0'], ['--batch-size']),
    (['profile', 'deit_tiny_patch16_224', '--block-cfg', 'kernel_size=5'], ['vitblocks models only']),
    (['profile', 'iffn_deit_tiny_patch16_224', '--block-cfg', 'kernel_size=4'], ['kernel_size']),
    (['profile', 'iffn_deit_tiny_patch16_224', '--block-cfg', 'kernel_size'], ['KEY=VALUE']),
    (['bench', 'deit_tiny_patch16_224', '--reparam', '--train'], ['--reparam']),
    (['compare', '--format', 'xls'], ['invalid choice']),
])
def test_user_errors_are_one_line(capsys, argv, fragments):
    assert_one_line_error(*run(capsys, *argv), *fragments)


# --- compare ---------------------------------------------------------------------------------------

def _expected_counted(substr):
    rows = [r for t in load_paper('iffn').tables for r in t.rows
            if r.buildable and not r.accuracy_only and substr in r.model]
    return len(rows)


def test_compare_deit_tiny_ends_with_summary(capsys):
    code, out, _ = run(capsys, 'compare', '--paper', 'iffn', '--models', 'deit_tiny')
    assert code == 0
    m = SUMMARY.match(out.rstrip('\n').splitlines()[-1])
    assert m, out[-300:]
    within, total = map(int, m.groups())
    assert total == _expected_counted('deit_tiny') > 0
    assert within == total
    assert 'IFFN Table 1' in out and 'IFFN Table 6' in out
    assert 'acc. only' in out  # Table 3 rows are listed but not counted


def test_compare_shows_progress_on_a_redirected_stderr(capsys, monkeypatch):
    """With stderr not a terminal (a job log), compare says how far its counting is (a line at most every 10 s;
    every model here), the report on stdout unchanged."""
    from functools import partial
    from vitblocks.cli import compare
    from vitblocks.ticker import Ticker
    monkeypatch.setattr(compare, 'Ticker', partial(Ticker, interval_s=0.0))
    code, out, err = run(capsys, 'compare', '--paper', 'iffn', '--models', 'deit_tiny')
    assert code == 0 and SUMMARY.match(out.rstrip('\n').splitlines()[-1])
    lines = [ln for ln in err.splitlines() if ln.startswith('compare: counting: ')]
    assert lines and lines[-1].startswith(f'compare: counting: {len(lines)}/{len(lines)} models in ')


def test_compare_lists_unbuildable_rows_without_counting_them(capsys, tmp_path):
    paper = tmp_path / 'unbuilt.yaml'  # the shipped tables' unbuilt rows get built over time
    paper.write_text('key: unbuilt\ntitle: t\nauthors: a\nvenue: v\nmethod: afbo\ntables:\n'
                     '  - {number: "1", caption: c, rows: [{label: X-Net, model: null, params_m: 1.0,'
                     ' note: X-Net is not in timm}, {label: Y-Net, model: null, params_m: 2.0,'
                     ' note: X-Net is not in timm}]}\n')
    code, out, _ = run(capsys, 'compare', '--paper', str(paper))
    assert code == 0
    assert 'Not counted: 2 rows that timm cannot build (X-Net is not in timm)' in out
    assert out.rstrip().splitlines()[-1] == '0 of 0 published rows within 1%'


def test_compare_counts_a_repeated_paper_once(capsys):
    # `--paper iffn --paper iffn` printed every table twice and counted each row twice ('4 of 4' for 2 rows)
    code, out, _ = run(capsys, 'compare', '--paper', 'iffn', '--paper', 'iffn', '--tables', '1', '--models',
                       'deit_tiny')
    assert code == 0
    assert out.count('IFFN Table 1:') == 1 and out.count('IFFN: "') == 1
    assert out.rstrip().splitlines()[-1] == f'{_expected_counted_in("1", "deit_tiny")} of ' \
        f'{_expected_counted_in("1", "deit_tiny")} published rows within 1%'


def _expected_counted_in(table, substr):
    return sum(r.buildable and not r.accuracy_only and substr in r.model for r in load_paper('iffn').table(table).rows)


def test_compare_csv(capsys):
    code, out, err = run(capsys, 'compare', '--paper', 'iffn', '--tables', '2', '--format', 'csv')
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    table = load_paper('iffn').table('2')
    assert [r['row'] for r in rows] == [r.label for r in table.rows]
    for r, paper in zip(rows, table.rows):
        assert float(r['gmacs_paper']) == paper.gmacs
        assert abs(float(r['gmacs_delta_pct'])) <= 1.0
    assert SUMMARY.match(err.strip().splitlines()[-1])


def test_compare_repa_counts_before_and_after_reparam(capsys):
    """RePa rows: a rep. column, each row's own convention, and one-decimal rows marked "rounding"."""
    code, out, _ = run(capsys, 'compare', '--paper', 'repa', '--tables', '1', '--models', 'deit_tiny')
    assert code == 0
    lines = out.rstrip('\n').splitlines()
    assert SUMMARY.match(lines[-1]) and lines[-1].startswith('0 of 2 ')  # 1.089 for 1.1, 0.642 for 0.6
    assert '2 of the others are off by more than 1% but round to the published numbers' in lines[-2]
    assert 'rep.' in out and 'no-attn+norms*5' in out
    after = next(ln for ln in lines if ln.strip().startswith('RePa-DeiT-Tiny (rep.)'))
    assert ' yes ' in after and '3.494' in after and '0.642' in after and after.split()[-2] == 'rounding'


# --- bench -----------------------------------------------------------------------------------------

def test_bench_with_baseline_and_reparam(capsys):
    code, out, _ = run(capsys, 'bench', 'iffn_deit_tiny_patch16_224', '--baseline', 'deit_tiny_patch16_224',
                       '--batch-size', '1', '--warmup', '0', '--repeats', '1', '--threads', '1', '--reparam')
    assert code == 0
    assert 'reparameterized' in out and '1 threads' in out and '3x224x224' in out
    lines = out.splitlines()
    base = next(ln for ln in lines if ln.startswith('deit_tiny_patch16_224 (baseline)'))
    assert lines[lines.index(base) - 2].split()[-4:] == ['vs', 'baseline', 'fresh', 'pages']
    assert base.split()[-2] == '1.00x' and re.fullmatch(r'[\d,]+', base.split()[-1])  # CPU: page faults per batch
    model = next(ln for ln in lines if ln.startswith('iffn_deit_tiny_patch16_224 '))
    assert re.fullmatch(r'\d+\.\d\dx', model.split()[-2])


def test_bench_wrong_input_size_is_a_user_error(capsys):
    assert_one_line_error(*run(capsys, 'bench', 'deit_tiny_patch16_224', '--batch-size', '1', '--repeats', '1',
                               '--input-size', '3', '64', '64'), 'input')


def test_python_dash_m_runs_the_command_line():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, '-m', 'vitblocks', '--version'], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f'vitblocks {vitblocks.__version__}'
