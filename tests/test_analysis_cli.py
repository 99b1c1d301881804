"""`vitblocks analyze lipschitz|entropy|gradcam|breakdown`: tables, plots and errors on tiny models."""
import os

import pytest
import torch

from vitblocks.cli import analyze
from vitblocks.cli.common import ArgumentParser, CliError

from _train_helpers import SHARED_DATA

TINY = '{img_size: 32, patch_size: 8, depth: 2, embed_dim: 16, num_heads: 2, num_classes: 10}'


def _cli(*argv):
    parser = ArgumentParser(prog='vitblocks')
    analyze.add_parser(parser.add_subparsers(dest='command', required=True))
    args = parser.parse_args(['analyze', *argv])
    return args.run(args)


def _rows(text, first):
    return [line.split() for line in text.splitlines() if line.startswith(first)]


def test_entropy_two_models_side_by_side(tmp_path, capsys):
    out = tmp_path / 'e.png'
    assert _cli('entropy', 'deit_tiny_patch16_224', 'iffn_deit_tiny_patch16_224', '--model-kwargs', TINY,
                '--num-images', '4', '--out', str(out)) == 0
    text = capsys.readouterr().out
    rows = [r for r in (line.split() for line in text.splitlines()) if r and r[0] in ('0', '1', 'mean')]
    assert [r[0] for r in rows] == ['0', '1', 'mean'] and all(len(r) == 3 for r in rows)
    assert all(0 < float(v) <= 8 for r in rows for v in r[1:])
    assert out.read_bytes()[:4] == b'\x89PNG'


def test_lipschitz_table_per_block(capsys):
    assert _cli('lipschitz', 'iffn_deit_tiny_patch16_224', '--model-kwargs', TINY, '--num-images', '2',
                '--blocks', '1', '--no-plot') == 0
    rows = _rows(capsys.readouterr().out, 'blocks.')
    assert len(rows) == 1 and rows[0][:2] == ['blocks.1.mlp', 'IFFN']
    naive, sdp, low = (float(v) for v in rows[0][2:5])
    assert low <= sdp <= naive


def test_breakdown_puts_the_deployed_repa_model_beside_it(capsys):
    assert _cli('breakdown', 'repa_deit_tiny_patch16_224', '--model-kwargs', TINY, '--deploy', '--repeats', '2',
                '--warmup', '1', '--no-plot') == 0
    rows = _rows(capsys.readouterr().out, 'repa_')
    assert [r[0] for r in rows] == ['repa_deit_tiny_patch16_224'] * 2 and rows[1][1] == '(deployed)'


@pytest.mark.slow  # decodes the 10,000 CIFAR-10 test images (~15 s here)
@pytest.mark.skipif(not (SHARED_DATA / 'cifar10').is_dir(), reason='needs the shared CIFAR-10 shards')
def test_gradcam_on_real_images(tmp_path, capsys):
    out = tmp_path / 'g.png'
    assert _cli('gradcam', 'deit_tiny_patch16_224', '--model-kwargs', TINY, '--data', str(SHARED_DATA / 'cifar10'),
                '--num-images', '2', '--out', str(out)) == 0
    rows = _rows(capsys.readouterr().out, 'deit_tiny')
    assert len(rows) == 2 and all(r[-3:-1] == ['32', '32'] for r in rows)
    assert out.is_file()


def test_errors_are_clear(tmp_path):
    with pytest.raises(CliError, match='2 models but 1 checkpoints'):
        _cli('entropy', 'deit_tiny_patch16_224', 'deit_small_patch16_224', '--checkpoint', 'a.pth', '--no-plot')
    with pytest.raises(CliError, match='no such file'):
        _cli('entropy', 'deit_tiny_patch16_224', '--checkpoint', str(tmp_path / 'x.pth'), '--no-plot')
    bad = tmp_path / 'w.pth'
    torch.save({'weight': torch.zeros(2)}, bad)
    with pytest.raises(CliError, match='cannot load'):
        _cli('entropy', 'deit_tiny_patch16_224', '--checkpoint', str(bad), '--no-plot')
    with pytest.raises(CliError, match=r'a folder, not a checkpoint file; give one of its files \(w.pth\)'):
        _cli('entropy', 'deit_tiny_patch16_224', '--checkpoint', str(tmp_path), '--no-plot')
    with pytest.raises(CliError, match='no such file'):
        _cli('entropy', 'deit_tiny_patch16_224', '--model-kwargs', TINY, '--data', str(tmp_path / 'none'), '--no-plot')
    with pytest.raises(SystemExit):  # argparse: not a YAML mapping
        _cli('entropy', 'deit_tiny_patch16_224', '--model-kwargs', '[1, 2]')


def test_breakdown_refuses_data_it_would_not_time(tmp_path, capsys):
    from PIL import Image
    for cls in ('cat', 'dog'):  # a valid ImageFolder: the images would load, then go unused
        (tmp_path / 'val' / cls).mkdir(parents=True)
        Image.new('RGB', (32, 32), (200, 10, 10)).save(tmp_path / 'val' / cls / '0.png')
    with pytest.raises(CliError, match='--data .*: breakdown times each model on random inputs'):
        _cli('breakdown', 'deit_tiny_patch16_224', '--model-kwargs', TINY, '--data', str(tmp_path),
             '--num-images', '2', '--repeats', '1', '--warmup', '1', '--no-plot')
    assert capsys.readouterr().out == ''  # not "input 2 images of DIR" above a timing of random tensors


def test_plot_path_is_checked_before_any_model_runs(tmp_path, capsys):
    run = ('entropy', 'deit_tiny_patch16_224', '--model-kwargs', TINY, '--num-images', '2')
    with pytest.raises(CliError, match='no folder .*missing; create it first'):
        _cli(*run, '--out', str(tmp_path / 'missing' / 'e.png'))
    with pytest.raises(CliError, match=r'cannot write a \.txt figure; give a name ending in \.png'):
        _cli(*run, '--out', str(tmp_path / 'e.txt'))
    with pytest.raises(CliError, match='no file suffix'):  # matplotlib would write e.png and we would print e
        _cli(*run, '--out', str(tmp_path / 'e'))
    with pytest.raises(CliError, match='--out .* and --no-plot contradict'):
        _cli(*run, '--out', str(tmp_path / 'e.png'), '--no-plot')
    assert capsys.readouterr().out == ''  # refused before the analysis ran and printed its table
    assert list(tmp_path.iterdir()) == []


def test_a_failed_save_leaves_the_previous_figure_in_place(tmp_path, monkeypatch):
    import matplotlib.image

    from vitblocks.analysis.figures import png_figure
    path = tmp_path / 'f.png'
    with png_figure(path) as (_, ax):
        ax.plot([0, 1])
    good = path.read_bytes()
    imsave = matplotlib.image.imsave

    def disk_full(fname, *args, **kwargs):  # a write to a file that stops half-way
        if not isinstance(fname, (str, os.PathLike)):  # into memory: not the file
            return imsave(fname, *args, **kwargs)
        with open(fname, 'wb') as f:
            f.write(good[:100])
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(matplotlib.image, 'imsave', disk_full)
    with pytest.raises(OSError, match='No space left'):
        with png_figure(path) as (_, ax):
            ax.plot([1, 0])
    assert path.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ['f.png']


def test_lipschitz_plot_puts_each_bound_at_its_block(tmp_path, monkeypatch):
    import contextlib

    from vitblocks.cli import analyze_run
    drawn, real = {}, analyze_run.png_figure

    @contextlib.contextmanager
    def keep_lines(path, **kwargs):
        with real(path, **kwargs) as (fig, ax):
            yield fig, ax
            drawn['x'] = [list(line.get_xdata()) for line in ax.get_lines()]
    monkeypatch.setattr(analyze_run, 'png_figure', keep_lines)
    assert _cli('lipschitz', 'deit_tiny_patch16_224', '--model-kwargs', TINY, '--num-images', '1', '--blocks', '1',
                '--out', str(tmp_path / 'l.png')) == 0
    assert drawn['x'] == [[1], [1], [1]]  # naive, SDP and empirical of blocks.1.mlp at block 1, not block 0
