"""Deployed and exported files on the command line: each unclear case is a one-line error or does the right thing."""
import pytest
import timm
import torch

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.cli import main
from vitblocks.deploy import reparameterize
from vitblocks.deploy.export import export_pt2
from vitblocks.deploy.io import save_deployed

TINY = ['deit_tiny_patch16_224', '--img-size', '32', '--num-classes', '10']


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, out, err, *fragments):
    assert code == 2, (code, err)
    assert out == ''
    assert len(err.strip().splitlines()) == 1, err
    assert 'Traceback' not in err
    for f in fragments:
        assert f in err, err


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    """A deployed safetensors file and a .pt2 export of a tiny IFFN-DeiT."""
    root = tmp_path_factory.mktemp('deployed')
    model = reparameterize(timm.create_model('iffn_deit_tiny_patch16_224', img_size=32, patch_size=8, embed_dim=32,
                                             depth=1, num_heads=2, num_classes=10))
    return {'safetensors': save_deployed(model, root / 'iffn.safetensors'),
            'pt2': export_pt2(timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, embed_dim=32,
                                                depth=1, num_heads=2, num_classes=10).eval(), root / 'deit.pt2')}


def test_export_refuses_an_empty_out(capsys):
    assert_one_line_error(*run(capsys, 'export', *TINY, '--format', 'pt2', '--out', ''), '--out is empty')


@pytest.mark.parametrize('tol', ['nan', '-1', 'inf'])
def test_export_refuses_a_check_tol_that_is_not_a_finite_non_negative_number(capsys, tol):
    assert_one_line_error(*run(capsys, 'export', *TINY, '--format', 'pt2', '--out', 'x.pt2', '--check', '--check-tol',
                               tol), 'expected a finite number >= 0')


def test_export_refuses_an_opset_the_dynamo_exporter_does_not_write_before_building(capsys, tmp_path):
    assert_one_line_error(*run(capsys, 'export', *TINY, '--format', 'onnx', '--opset', '11', '--out',
                               str(tmp_path / 'x.onnx')), '--opset 11', '--onnx-exporter legacy')
    assert not (tmp_path / 'x.onnx').exists()


@pytest.mark.parametrize('suffix', ['pt2', 'onnx'])
def test_eval_names_an_exported_file_for_what_it_is(capsys, files, tmp_path, suffix):
    path = files['pt2'] if suffix == 'pt2' else tmp_path / 'm.onnx'
    if suffix == 'onnx':
        path.write_bytes(b'not read')
    kind = 'torch.export program' if suffix == 'pt2' else 'ONNX model'
    assert_one_line_error(*run(capsys, 'eval', '--checkpoint', str(path), '--data', str(tmp_path)), kind,
                          'deployed safetensors file')


def test_train_refuses_a_deployed_file_as_initial_weights(capsys, files, tmp_path):
    assert_one_line_error(*run(capsys, 'train', '--model', 'iffn_deit_tiny_patch16_224', '--data', str(tmp_path),
                               '--initial-checkpoint', str(files['safetensors']), '--output', str(tmp_path / 'runs')),
                          'is a deployed file', 'training form')


def test_train_refuses_an_exported_file_as_initial_weights(capsys, files, tmp_path):
    assert_one_line_error(*run(capsys, 'train', '--model', 'deit_tiny_patch16_224', '--data', str(tmp_path),
                               '--initial-checkpoint', str(files['pt2']), '--output', str(tmp_path / 'runs')),
                          'torch.export program')


def test_analyze_gradcam_reads_a_deployed_file_and_other_analyses_refuse_it(capsys, files, tmp_path):
    out = tmp_path / 'cam.png'
    code, _, err = run(capsys, 'analyze', 'gradcam', 'iffn_deit_tiny_patch16_224', '--checkpoint',
                       str(files['safetensors']), '--num-images', '2', '--out', str(out))
    assert code == 0, err
    assert out.is_file()
    assert_one_line_error(*run(capsys, 'analyze', 'entropy', 'iffn_deit_tiny_patch16_224', '--checkpoint',
                               str(files['safetensors']), '--num-images', '2'), 'is a deployed file', 'gradcam')


def test_export_check_reports_a_failing_plain_call_as_a_failed_check(capsys, tmp_path, monkeypatch):
    """--check calls the loaded .pt2 the plain way too: a program that fails there exits 1 with one line."""
    from vitblocks.cli import export as export_cli
    from vitblocks.deploy.export import ExportCheckError

    def failing(path, *args, **kwargs):
        raise ExportCheckError(f'{path} loads but fails when its module is called the plain way, with autograd on')
    monkeypatch.setattr(export_cli, 'check_export', failing)
    code, out, err = run(capsys, 'export', *TINY, '--format', 'pt2', '--out', str(tmp_path / 'x.pt2'), '--check')
    assert code == 1
    assert 'check failed' in err and 'autograd on' in err and len(err.strip().splitlines()) == 1
    assert torch.export.load(str(tmp_path / 'x.pt2')) is not None  # written, and said to be wrong
