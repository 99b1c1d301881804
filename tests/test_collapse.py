"""The residual-growth (collapse) probe and `vitblocks analyze collapse`."""
import math

import pytest
import timm
import torch

from vitblocks.analysis import plot_divergence, plot_residual_growth, residual_growth, sequential_vs_parallel
from vitblocks.cli import analyze
from vitblocks.cli.common import ArgumentParser


def _manual_norms(model, x):
    """The probe's numbers computed by running the blocks by hand (eval mode, no hooks): per block the mean
    token norms of X_in, attn branch, X_mid, MLP branch, X_out, and the mean per-token cos(X_in, X_out)."""
    def tok(t):
        return t.norm(dim=-1).mean().item()
    def cos(u, v):
        return ((u * v).sum(-1) / (u.norm(dim=-1) * v.norm(dim=-1))).mean().item()
    rows = []
    with torch.no_grad():
        h = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        for blk in model.blocks:
            a = blk.ls1(blk.attn(blk.norm1(h)))
            mid = h + a
            m = blk.ls2(blk.mlp(blk.norm2(mid if type(blk).__name__ == 'Block' else h)))
            out = blk(h)
            rows.append((tok(h), tok(a), tok(mid), tok(m), tok(out), cos(h, out)))
            h = out
    return rows


def test_probe_on_deit_tiny_matches_manual_computation():
    model = timm.create_model('deit_tiny_patch16_224', img_size=64).eval()  # 16 patches + class token
    x = torch.randn(2, 3, 64, 64)
    report = residual_growth(model, x, name='deit_tiny')
    assert report.model == 'deit_tiny' and report.input_shape == (2, 3, 64, 64)
    assert [b.index for b in report.blocks] == list(range(12))
    for b, (s_in, a, mid, m, out, cos) in zip(report.blocks, _manual_norms(model, x)):
        assert b.stream_in == pytest.approx(s_in, rel=1e-5) and b.attn == pytest.approx(a, rel=1e-5)
        assert b.stream_mid == pytest.approx(mid, rel=1e-5) and b.mlp == pytest.approx(m, rel=1e-5)
        assert b.stream_out == pytest.approx(out, rel=1e-5)
        assert b.attn_ratio == pytest.approx(a / s_in) and b.mlp_ratio == pytest.approx(m / mid)
        assert 0 < b.attn_ratio < math.inf and b.cosine == pytest.approx(cos, rel=1e-5)
    # the stream leaving block i is the stream entering block i + 1
    for prev, nxt in zip(report.blocks, report.blocks[1:]):
        assert prev.stream_out == pytest.approx(nxt.stream_in, rel=1e-6)
    assert set(report.as_dicts()[0]) >= {'stream_in', 'attn', 'mlp', 'attn_ratio', 'mlp_ratio', 'cosine'}


def test_probe_leaves_the_model_as_it_was():
    model = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8).train()
    residual_growth(model, torch.randn(1, 3, 32, 32))
    assert model.training
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


@pytest.mark.parametrize('name, kwargs, size', [
    ('mabvit_glu_parallel_vit_tiny_patch16_224', dict(img_size=32), (3, 32, 32)),  # parallel blocks
    ('ninformer_vit_patch4_28', {}, (1, 28, 28)),  # gating unit, one shared LayerNorm per block
])
def test_probe_on_vitblocks_models(name, kwargs, size):
    model = timm.create_model(name, **kwargs).eval()
    x = torch.randn(2, *size)
    report = residual_growth(model, x)
    assert len(report.blocks) == len(model.blocks)
    for b, (s_in, a, mid, m, out, cos) in zip(report.blocks, _manual_norms(model, x)):
        got = (b.stream_in, b.attn, b.mlp, b.stream_out, b.cosine)
        assert got == pytest.approx((s_in, a, m, out, cos), rel=1e-5)


def test_probe_rejects_models_without_vit_blocks():
    with pytest.raises(ValueError, match='blocks.0 is a MixerBlock'):
        residual_growth(timm.create_model('mixer_s16_224', img_size=32), torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match='needs a timm ViT-style model with a .blocks'):
        residual_growth(timm.create_model('resnet18'), torch.randn(1, 3, 32, 32))


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip('matplotlib')
    model = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8)
    path = plot_residual_growth(residual_growth(model, torch.randn(2, 3, 32, 32), 'deit'), tmp_path / 'c.png')
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_sequential_vs_parallel_matches_the_definition_and_vanishes_without_mlp():
    torch.manual_seed(0)
    model = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, depth=3, embed_dim=16,
                              num_heads=2).eval()
    x = torch.randn(2, 3, 32, 32)
    rows = sequential_vs_parallel(model, x)
    def tok(t):
        return t.norm(dim=-1).mean().item()
    with torch.no_grad():  # by hand, with each block's input from the model's own (sequential) forward
        h = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        for r, blk in zip(rows, model.blocks):
            mid = h + blk.attn(blk.norm1(h))
            seq, par = mid + blk.mlp(blk.norm2(mid)), mid + blk.mlp(blk.norm2(h))
            assert (r.stream_in, r.distance, r.update) == \
                pytest.approx((tok(h), tok(seq - par), tok(seq - h)), rel=1e-5)
            assert r.relative == pytest.approx(r.distance / r.stream_in) and r.distance > 0
            h = blk(h)
    for blk in model.blocks:  # MLP branch outputs zero: sequential == parallel exactly
        torch.nn.init.zeros_(blk.mlp.fc2.weight)
        torch.nn.init.zeros_(blk.mlp.fc2.bias)
    assert [r.distance for r in sequential_vs_parallel(model, x)] == [0.0, 0.0, 0.0]


def test_sequential_vs_parallel_on_parallel_and_value_glu_blocks(tmp_path):
    pytest.importorskip('matplotlib')
    curves = {}
    for name in ('mabvit_glu_parallel_vit_tiny_patch16_224', 'mabvit_glu_vit_tiny_patch16_224'):
        torch.manual_seed(0)
        model = timm.create_model(name, img_size=32, depth=2)
        curves[name] = sequential_vs_parallel(model, torch.randn(2, 3, 32, 32))
        assert len(curves[name]) == 2 and all(r.stream_in > 0 for r in curves[name])
    assert plot_divergence(curves, tmp_path / 'd.png').read_bytes()[:4] == b'\x89PNG'


def test_sequential_vs_parallel_uses_the_shared_norm_of_a_parallel_block():
    """A parallel block with one LayerNorm (``shared_norm``, its norm2 an identity) feeds LN1 to the MLP: X_par
    is then the block's own output, and X_seq normalizes X_i + A before its MLP."""
    torch.manual_seed(0)
    model = timm.create_model('mabvit_glu_parallel_vit_tiny_patch16_224', img_size=32, depth=2,
                              block_cfg={'shared_norm': True}).eval()
    assert isinstance(model.blocks[0].norm2, torch.nn.Identity)
    x = torch.randn(2, 3, 32, 32)
    rows = sequential_vs_parallel(model, x)

    def tok(t):
        return t.norm(dim=-1).mean().item()
    with torch.no_grad():
        h = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        for r, blk in zip(rows, model.blocks):
            mid = h + blk.ls1(blk.attn(blk.norm1(h)))
            seq, par = mid + blk.ls2(blk.mlp(blk.norm1(mid))), blk(h)
            assert (r.distance, r.update) == pytest.approx((tok(seq - par), tok(seq - h)), rel=1e-5)
            h = par


def _cli(*argv):
    parser = ArgumentParser(prog='vitblocks')
    analyze.add_parser(parser.add_subparsers(dest='command', required=True))
    args = parser.parse_args(['analyze', *argv])
    return args.run(args)


def test_cli_prints_per_block_ratios_and_plots(tmp_path, capsys):
    pytest.importorskip('matplotlib')
    out = tmp_path / 'collapse.png'
    assert _cli('collapse', 'ninformer_vit_patch4_28', '--num-images', '2', '--out', str(out)) == 0
    text = capsys.readouterr().out
    assert 'attn/X' in text and 'mlp/X' in text and 'seq-par/X' in text and f'plot    {out}' in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 8]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    assert all(0 < float(r[6]) for r in rows)  # seq-par/X
    assert out.is_file()


def test_cli_errors_are_clear(tmp_path):
    from vitblocks.cli.common import CliError
    with pytest.raises(CliError, match='blocks.0 is a MixerBlock'):
        _cli('collapse', 'ninformer_baseline_mixer_patch4_28', '--no-plot')
    with pytest.raises(CliError, match='no such file'):
        _cli('collapse', 'ninformer_vit_patch4_28', '--checkpoint', str(tmp_path / 'missing.pth'))
    with pytest.raises(CliError, match='Did you mean'):
        _cli('collapse', 'deit_tiny_patch16', '--no-plot')
