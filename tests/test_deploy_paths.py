"""Deploy paths of every block family: exports that fail keep what was there, files that load by name alone,
`vitblocks bench --weights` against a baseline, and damaged metadata."""
import importlib.util
import os
from types import SimpleNamespace

import pytest
import timm
import torch

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.cli import bench as bench_cmd
from vitblocks.cli import main
from vitblocks.deploy import reparameterize
from vitblocks.deploy.export import check_export, export_onnx, export_pt2
from vitblocks.deploy.io import DeployedCheckpointError, load_deployed, save_deployed, write_safetensors
from vitblocks.profile import count_params, input_size_of


def _has(*packages):
    return all(importlib.util.find_spec(p) is not None for p in packages)


def _tiny(name='bench_repa_vit_tiny_patch4_32'):
    torch.manual_seed(0)
    return timm.create_model(name).eval()


# --- exports are written in place at the end ------------------------------------------------------------------

def test_a_failed_export_keeps_the_previous_file_and_leaves_no_partial_one(tmp_path, monkeypatch):
    model = reparameterize(_tiny())
    path = export_pt2(model, tmp_path / 'm.pt2')
    good = path.read_bytes()

    def save_half_then_fail(program, f):  # f: the in-memory buffer export_pt2 serializes into
        f.write(good[:100])
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(torch.export, 'save', save_half_then_fail)
    with pytest.raises(OSError, match='No space left'):
        export_pt2(model, path)
    assert path.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ['m.pt2']
    assert check_export(path, model) < 1e-5

    code = main(['export', 'bench_repa_vit_tiny_patch4_32', '--reparam', '--format', 'pt2', '--out', str(path)])
    assert code == 2 and path.read_bytes() == good  # the command line: one line, the file unchanged


def test_cli_write_error_is_one_line_and_names_what_was_kept(tmp_path, monkeypatch, capsys):
    out = tmp_path / 'm.pt2'
    out.write_bytes(b'previous')
    monkeypatch.setattr(torch.export, 'save', lambda program, f: (_ for _ in ()).throw(OSError(28, 'No space left')))
    code = main(['export', 'bench_repa_vit_tiny_patch4_32', '--reparam', '--format', 'pt2', '--out', str(out)])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f'cannot write {out}: No space left; the existing file is unchanged' in err
    assert out.read_bytes() == b'previous'


@pytest.mark.skipif(not _has('onnx', 'onnxscript'), reason='needs onnx and onnxscript')
def test_an_opset_the_dynamo_exporter_did_not_write_is_an_error(tmp_path):
    model = reparameterize(_tiny())
    with pytest.raises(ValueError, match='opset 13: torch.s dynamo exporter writes opset 18 and later'):
        export_onnx(model, tmp_path / 'm.onnx', opset=13)
    assert list(tmp_path.iterdir()) == []
    import onnx
    path = export_onnx(model, tmp_path / 'm.onnx', opset=18)
    assert [i.version for i in onnx.load(str(path)).opset_import if i.domain == ''] == [18]


def test_deployed_files_get_the_usual_file_mode(tmp_path):
    path = tmp_path / 'm.safetensors'
    path.write_bytes(b'')
    os.chmod(path, 0o644)
    save_deployed(_tiny(), path)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


# --- every family exports with a free batch and deploys by name ------------------------------------------------

def test_afbo_exports_with_a_free_batch_dimension(tmp_path):
    """Exported under no_grad, AFBO's eager inference path (a Python loop over batch slices) would fix the batch."""
    model = reparameterize(_tiny('bench_afbo_vit_tiny_patch4_32'))
    path = export_pt2(model, tmp_path / 'afbo.pt2')
    assert check_export(path, model, batch_size=3) < 1e-4
    assert check_export(path, model, batch_size=1) < 1e-4


def test_iffn_lvt_runs_deployed_its_class_attention_iffns_have_no_grid():
    torch.manual_seed(0)
    model = timm.create_model('iffn_lvt', num_classes=10).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        want = model(x)
        got = reparameterize(model)(x)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gcvit_records_the_image_size_it_was_built_for(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model('afbo_gcvit_xxtiny', img_size=128, num_classes=10).eval()
    assert input_size_of(model) == (3, 128, 128)  # the size bench, export and profile feed it
    path = save_deployed(model, tmp_path / 'gc.safetensors')
    loaded = load_deployed(None, path)  # by the file alone
    x = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        assert torch.allclose(loaded(x), reparameterize(model)(x), rtol=1e-4, atol=1e-5)


def test_damaged_metadata_is_a_deployed_checkpoint_error(tmp_path):
    path = save_deployed(_tiny(), tmp_path / 'm.safetensors')
    from safetensors import safe_open
    with safe_open(str(path), framework='pt') as f:
        metadata = f.metadata()
    bad = write_safetensors(load_deployed(None, path), tmp_path / 'bad.safetensors', {**metadata, 'num_classes': 'x0'})
    with pytest.raises(DeployedCheckpointError, match=r"its metadata num_classes='x0' is not JSON"):
        load_deployed(None, bad)


# --- vitblocks bench --weights ---------------------------------------------------------------------------------

def _bench_args(**kw):
    base = dict(num_classes=None, img_size=None, block_cfg=None, weights=None, reparam=False)
    return SimpleNamespace(**{**base, **kw})


def test_bench_weights_deploys_the_baseline_too(tmp_path):
    weights = save_deployed(_tiny(), tmp_path / 'repa.safetensors')
    base = 'bench_iffn_vit_tiny_patch4_32'
    models = bench_cmd._models(_bench_args(weights=str(weights)), 'bench_repa_vit_tiny_patch4_32', base)
    deployed_iffn = count_params(reparameterize(timm.create_model(base)))
    assert deployed_iffn < count_params(timm.create_model(base))
    assert count_params(models[f'{base} (baseline)']) == deployed_iffn


def test_bench_weights_builds_an_any_size_baseline_without_the_files_img_size(tmp_path):
    weights = save_deployed(_tiny(), tmp_path / 'repa.safetensors')  # records img_size=[32, 32]
    models = bench_cmd._models(_bench_args(weights=str(weights)), 'bench_repa_vit_tiny_patch4_32', 'poolformer_s12')
    baseline = models['poolformer_s12 (baseline)']
    assert baseline.num_classes == 10
    with torch.no_grad():
        assert baseline(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    with pytest.raises(bench_cmd.CliError, match="cannot build poolformer_s12: .*img_size"):  # asked for: an error
        bench_cmd._models(_bench_args(img_size=[32]), 'bench_repa_vit_tiny_patch4_32', 'poolformer_s12')


def test_bench_weights_times_an_any_size_model_at_the_input_size_its_file_records(tmp_path):
    pool = timm.create_model('poolformer_s12', num_classes=10).eval()
    weights = save_deployed(pool, tmp_path / 'pool.safetensors',
                            preprocessing=dict(input_size=[3, 32, 32], mean=[0.5] * 3, std=[0.25] * 3))
    args = _bench_args(weights=str(weights), input_size=None)
    models = bench_cmd._models(args, 'poolformer_s12', None)
    assert bench_cmd._input_size(args, models['poolformer_s12']) == (3, 32, 32)  # was the config's (3, 224, 224)
    given = _bench_args(weights=str(weights), input_size=None, img_size=[64])
    assert bench_cmd._input_size(given, models['poolformer_s12']) == (3, 224, 224)  # --img-size: the model's own
    assert bench_cmd._input_size(_bench_args(weights=str(weights), input_size=[3, 48, 48]), pool) == (3, 48, 48)
    plain = save_deployed(pool, tmp_path / 'plain.safetensors')  # no preprocessing recorded
    assert bench_cmd._input_size(_bench_args(weights=str(plain), input_size=None), pool) == (3, 224, 224)


# --- vitblocks export: --check fails, a deployed file is --weights, stale external data ------------------------

@pytest.mark.parametrize('missing, purpose', [('onnxruntime', 'checking an ONNX export'), ('onnx', 'ONNX export'),
                                              ('onnxscript', 'ONNX export')])
def test_a_missing_onnx_package_is_named_before_anything_is_built_or_written(tmp_path, monkeypatch, capsys,
                                                                             missing, purpose):
    from vitblocks.cli import export as export_cmd
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == missing else find_spec(name, *a))
    monkeypatch.setattr(export_cmd, '_model', lambda args: pytest.fail('built the model before naming ' + missing))
    out = tmp_path / 'm.onnx'
    code = main(['export', 'bench_repa_vit_tiny_patch4_32', '--format', 'onnx', '--out', str(out), '--check'])
    _, err = capsys.readouterr()
    assert code == 2 and err.strip() == (f'vitblocks export: error: {purpose} needs {missing}: pip install {missing} '
                                         f'(or pip install "vitblocks[export]")')
    assert not out.exists()


def test_export_check_fails_above_its_tolerance(tmp_path, monkeypatch, capsys):
    out = tmp_path / 'm.pt2'
    argv = ['export', 'bench_repa_vit_tiny_patch4_32', '--reparam', '--format', 'pt2', '--out', str(out), '--check']
    assert main(argv) == 0
    text, _ = capsys.readouterr()
    assert float(text.split('max abs error ')[1].split()[0]) <= 1e-3
    from vitblocks.cli import export as export_cmd
    monkeypatch.setattr(export_cmd, 'check_export', lambda *a, **k: 0.25)  # a file that computes something else
    assert main(argv) == 1
    _, err = capsys.readouterr()
    assert 'check failed: max abs error 0.25 > --check-tol 0.001' in err
    assert main([*argv, '--check-tol', '0.5']) == 0
    capsys.readouterr()
    assert main(argv[:-1] + ['--check-tol', '0.5']) == 2  # a tolerance without the check it tunes
    assert '--check-tol is the tolerance of --check' in capsys.readouterr()[1]


def test_export_checkpoint_that_is_a_deployed_file_says_use_weights(tmp_path, capsys):
    weights = save_deployed(_tiny(), tmp_path / 'd.safetensors')
    code = main(['export', 'bench_repa_vit_tiny_patch4_32', '--checkpoint', str(weights), '--format', 'pt2',
                 '--out', str(tmp_path / 'm.pt2')])
    _, err = capsys.readouterr()
    assert code == 2 and f'--checkpoint {weights} is a deployed file (save_deployed); pass it as --weights' in err


@pytest.mark.skipif(not _has('onnx', 'onnxscript'), reason='needs onnx and onnxscript')
def test_a_self_contained_onnx_export_removes_the_external_data_of_the_file_it_replaces(tmp_path):
    model = reparameterize(_tiny())
    path = export_onnx(model, tmp_path / 'm.onnx', external_data=True)
    assert (tmp_path / 'm.onnx.data').is_file()
    export_onnx(model, path)  # small: one self-contained file
    assert sorted(p.name for p in tmp_path.iterdir()) == ['m.onnx']


@pytest.mark.parametrize('name, block_cfg, built', [
    ('bench_mabvit_glu_vit_tiny_patch4_32', {'value_act': 'geglu'}, lambda m: m.blocks[0].attn.value_act == 'geglu'),
    ('bench_afbo_vit_tiny_patch4_32', {'act_layer': 'gelu'}, lambda m: isinstance(m.blocks[0].mlp.act, torch.nn.GELU)),
])
def test_a_model_is_rebuilt_with_the_recorded_block_cfg(tmp_path, name, block_cfg, built):
    """MABViT has no deploy form to build: load_deployed builds the training form and re-parameterizes it; AFBO
    builds its deployed form directly. Either path once dropped the recorded block config, so a file saved with
    GeGLU on V (or AFBO's act_layer=gelu) loaded silently into the default SwiGLU (SiLU): same shapes, a strict
    load passed, the outputs differed."""
    torch.manual_seed(0)
    model = timm.create_model(name, block_cfg=block_cfg, depth=1).eval()
    path = save_deployed(model, tmp_path / 'model.safetensors', block_cfg=block_cfg)
    loaded = load_deployed(None, path, depth=1)
    assert built(loaded)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_a_full_disk_while_writing_bench_json_leaves_the_old_file_and_no_litter(tmp_path, monkeypatch, capsys):
    """A disk that fills while the JSON is written (here: a writer that stops after half the text): one line,
    exit 2, the previous file as it was and no 0-byte or half-written .tmp beside it."""
    import pathlib
    out = tmp_path / 'bench.json'
    out.write_text('previous')
    real = pathlib.Path.write_text

    def half_then_full(self, text, *args, **kwargs):
        if self.name.endswith('.tmp'):
            real(self, text[:len(text) // 2], *args, **kwargs)
            raise OSError(28, 'No space left on device')
        return real(self, text, *args, **kwargs)
    monkeypatch.setattr(pathlib.Path, 'write_text', half_then_full)
    code = main(['bench', 'deit_tiny_patch16_224', '--img-size', '32', '--num-classes', '10', '--batch-size', '1',
                 '--warmup', '0', '--repeats', '1', '--json', str(out)])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and 'No space left on device' in err
    assert out.read_text() == 'previous' and sorted(p.name for p in tmp_path.iterdir()) == ['bench.json']


def test_a_full_disk_during_a_pt2_export_is_one_line_not_an_abort(tmp_path, monkeypatch, capsys):
    """torch's C++ writer aborted the process (exit 134) when the disk filled under torch.export.save; the program
    is now serialized in memory and written by Python, whose failure is one line with the old file kept."""
    import pathlib
    out = tmp_path / 'm.pt2'
    out.write_bytes(b'previous')
    real = pathlib.Path.write_bytes

    def half_then_full(self, data):
        real(self, bytes(data)[:len(data) // 2])
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(pathlib.Path, 'write_bytes', half_then_full)
    code = main(['export', 'bench_repa_vit_tiny_patch4_32', '--reparam', '--format', 'pt2', '--out', str(out)])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and 'No space left on device' in err
    assert out.read_bytes() == b'previous' and sorted(p.name for p in tmp_path.iterdir()) == ['m.pt2']


def test_a_full_disk_while_saving_a_deployed_file_is_an_oserror_that_keeps_the_old_file(tmp_path, monkeypatch):
    """safetensors reports a full disk as a SafetensorError (seen on a 200 KiB tmpfs: 'Error while serializing: I/O
    error: No space left on device (os error 28)'), which convert and export did not catch: it is an OSError now,
    with the previous file kept and nothing left beside it."""
    from safetensors import SafetensorError
    from vitblocks.deploy import io as deploy_io
    from vitblocks.deploy.io import save_deployed
    model = timm.create_model('bench_repa_vit_tiny_patch4_32')
    out = tmp_path / 'm.safetensors'
    out.write_bytes(b'previous')

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')
    monkeypatch.setattr(deploy_io, 'save_model', full)
    with pytest.raises(OSError, match='No space left on device'):
        save_deployed(model, out)
    assert out.read_bytes() == b'previous' and sorted(p.name for p in tmp_path.iterdir()) == ['m.safetensors']
