"""IFFN deploy form: fuse() / reparameterize() equivalence, deploy-form checkpoints, timm protocol."""
import copy
from contextlib import nullcontext
from pathlib import Path

import pytest
import timm
import torch
from timm.utils import reparameterize_model
from torch import nn

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.deploy import reparameterize
from vitblocks.layers import IFFN, ConcatArbitraryActivations, IFFNDeployed
from vitblocks.layers.iffn import DepthwiseBlock
from _helpers import assert_autocast_runs_the_reference_path, perturb_

RTOL = 1e-5  # relative error allowed between training form (eval) and deploy form, fp32


def _reset_bn_and_agelu(module: nn.Module):
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.reset_parameters()  # running stats and affine back to identity
            if isinstance(m, ConcatArbitraryActivations):
                m.init_weights()  # alpha = beta = 1, gamma = theta = 0


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _check_deploy(module: nn.Module, x: torch.Tensor, deploy=lambda m: m.fuse()):
    """Randomize, check the randomization matters, deploy and compare in inference mode."""
    module = perturb_(module, std=0.2, batchnorm=True).eval()
    plain = copy.deepcopy(module)
    _reset_bn_and_agelu(plain)
    with torch.inference_mode():
        ref = module(x)
        assert _rel_err(plain(x), ref) > 1e-2, 'randomized BN/AGeLU did not change the output'
        deployed = deploy(module)
        x_before = x.clone()
        out = deployed(x)
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)  # in-place work never touches the input
    assert out.shape == ref.shape and out.stride() == ref.stride()
    assert _rel_err(out, ref) <= RTOL
    return deployed, ref


@pytest.mark.parametrize('cfg', [dict(), dict(num_functions=4), dict(act_layer='softplus'), dict(bias=False),
                                 dict(channel_part=False), dict(spatial_part=False), dict(kernel_size=5)])
def test_fuse_matches_training_form_tokens_with_prefix(cfg):
    ffn = IFFN(16, 64, grid_size=(3, 4), num_prefix_tokens=2, **cfg)
    deployed, _ = _check_deploy(ffn, torch.randn(3, 2 + 12, 16))
    assert deployed is not ffn and deployed.deploy and not ffn.deploy
    assert deployed.layout is ffn.layout  # grid tracking keeps working
    assert not any(isinstance(m, nn.BatchNorm2d) for m in deployed.modules())


def test_fuse_matches_training_form_channels_first_and_channels_last_maps():
    _check_deploy(IFFN(16, 64, channels_first=True), torch.randn(3, 16, 4, 5))  # (B, C, H, W), PoolFormer
    _check_deploy(IFFN(16, 64, grid_size=(4, 5)), torch.randn(3, 4, 5, 16))  # (B, H, W, C) maps


def test_batch_slice_size():
    from vitblocks.layers.layout import batch_slice_size
    assert batch_slice_size(10, 100, 250) == 2  # two samples fit the budget
    assert batch_slice_size(10, 100, 50) == 1  # at least one sample per slice
    assert batch_slice_size(2, 100, 250) is None and batch_slice_size(10, 100, 0) is None  # fits / no budget
    seen = []

    def traced(x):
        seen.append(batch_slice_size(10, 100, 250))
        return x * 2
    torch.jit.trace(traced, torch.ones(1), check_trace=False)
    assert seen == [None]  # a traced graph must not bake in a batch size


def _trace(module: nn.Module, x: torch.Tensor):
    """Output and FX graph of ``torch.compile(module)`` with a backend that runs the traced graph as is
    (what inductor would compile, without the minutes of C++ compilation)."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    with torch.inference_mode():
        out = torch.compile(module, backend=backend)(x)
    torch._dynamo.reset()
    assert len(graphs) == 1  # no graph break
    return out, graphs[0]


def _called(gm, name: str) -> int:
    """How many torch functions or tensor methods in the graph have ``name`` in their name."""
    return sum(n.op in ('call_function', 'call_method') and name in getattr(n.target, '__name__', str(n.target))
               for n in gm.graph.nodes)


def test_benchmark_can_keep_slices_while_compiling(monkeypatch):
    """benchmarks/iffn_latency.py --compile-chunk-bytes: with the compile check lifted, dynamo traces one
    fc2 matmul per batch slice into one graph (equal numbers); by default the layer compiles unsliced."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / 'benchmarks'))
    from iffn_latency import parse_args, slices_while_compiling
    ffn = perturb_(IFFN(16, 64, grid_size=(3, 4), num_prefix_tokens=1), std=0.2, batchnorm=True).eval().fuse()
    ffn.inference_chunk_bytes = 2 * 13 * 64 * 4  # two samples per slice: 3 slices of a batch of 5
    x = torch.randn(5, 13, 16)

    def fc2_matmuls(keep_slices: bool):
        with slices_while_compiling() if keep_slices else nullcontext():
            out, gm = _trace(ffn, x)  # one graph, no break
            with torch.inference_mode():
                torch.testing.assert_close(out, ffn(x), rtol=1e-6, atol=1e-6)
        return [n.target for n in gm.graph.nodes if n.op == 'call_function' and n.target is torch.addmm]
    assert fc2_matmuls(False) == []  # fc2 is one F.linear on the whole batch
    assert fc2_matmuls(True) == [torch.addmm] * 3

    with pytest.raises(SystemExit):
        parse_args(['--compile-chunk-bytes', '8388608'])  # without --compile
    with pytest.raises(SystemExit):
        parse_args(['--compile', '--compile-chunk-bytes', '0'])  # 0 = the plain compiled row
    assert parse_args(['--compile', '--compile-chunk-bytes', '1', '2']).compile_chunk_bytes == [1, 2]


def test_benchmark_gelu_variants(monkeypatch):
    """benchmarks/iffn_latency.py --compile rows: the deployed model with torch's GELU, and the baseline with
    the same rational GELU (every exact nn.GELU swapped, same function)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / 'benchmarks'))
    from iffn_latency import baseline_with_rational_gelu, iffn_copy
    from vitblocks.layers.rational_gelu import RationalGELU
    base = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, depth=3).eval()
    swapped = baseline_with_rational_gelu(base)
    assert sum(isinstance(m, nn.GELU) for m in base.modules()) == 3
    assert not any(isinstance(m, nn.GELU) for m in swapped.modules())
    assert sum(isinstance(m, RationalGELU) for m in swapped.modules()) == 3
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(swapped(x), base(x), rtol=1e-5, atol=1e-5)
    assert baseline_with_rational_gelu(nn.Sequential(nn.Linear(2, 2), nn.GELU(approximate='tanh'))) is None
    model = nn.Sequential(IFFN(16, 64, grid_size=(3, 4)).fuse())
    torch_gelu = iffn_copy(model, compile_rational_gelu=False)
    assert not torch_gelu[0].compile_rational_gelu and model[0].compile_rational_gelu  # a copy, class default kept
    with pytest.raises(ValueError, match='IFFN has no setting compile_rational'):
        iffn_copy(model, compile_rational=False)  # a misspelt setting would change nothing


@pytest.mark.parametrize('cfg,x,gelus', [
    (dict(grid_size=(3, 4), num_prefix_tokens=2), torch.randn(3, 14, 16), 2),  # tokens with prefix
    (dict(grid_size=(3, 4), num_functions=4), torch.randn(3, 12, 16), 2),
    (dict(channels_first=True), torch.randn(3, 16, 4, 5), 2),  # PoolFormer maps
    (dict(grid_size=(4, 5)), torch.randn(3, 4, 5, 16), 2),  # (B, H, W, C) maps
    (dict(grid_size=(3, 4), channel_part=False), torch.randn(3, 12, 16), 2),
    (dict(grid_size=(3, 4), act_layer='softplus'), torch.randn(3, 12, 16), 0),
    (dict(grid_size=(3, 4), spatial_act_layer='softplus'), torch.randn(3, 12, 16), 1),
])
def test_compiled_inference_path_matches_training_form(cfg, x, gelus):
    """Under torch.compile the deploy form's CPU path is functional, with the N activations as one flat
    (..., C') tensor and exact GELUs as gelu_rational (compile_rational_gelu, default) or torch's GELU."""
    ffn = perturb_(IFFN(16, 64, **cfg), std=0.2, batchnorm=True).eval()
    deployed = ffn.fuse()
    with torch.inference_mode():
        ref = ffn(x)
    for rational in (True, False):
        deployed.compile_rational_gelu = rational
        out, gm = _trace(deployed, x)
        assert out.shape == ref.shape and _rel_err(out, ref) <= RTOL
        assert _called(gm, 'gelu') == (0 if rational else gelus)
        assert _called(gm, 'clamp') == (gelus if rational else 0)  # one rational erf per exact GELU
        assert _called(gm, 'repeat') == (cfg.get('channel_part', True) is not False)
    with torch.inference_mode():
        eager = deployed(x)
    assert _rel_err(eager, ref) <= RTOL


def test_exported_program_keeps_torch_gelu():
    """torch.export traces the inference path too, but an exported program keeps the GELU op (ONNX Gelu, a
    runtime's own kernel): the rational form is for torch.compile only."""
    deployed = perturb_(IFFN(16, 64, grid_size=(3, 4)), std=0.2, batchnorm=True).eval().fuse()
    x = torch.randn(2, 12, 16)
    with torch.no_grad():
        program = torch.export.export(deployed, (x,))
        torch.testing.assert_close(program.module()(x), deployed(x), rtol=1e-6, atol=1e-6)
    gelus = [n for n in program.graph.nodes if n.op == 'call_function' and 'gelu' in str(n.target)]
    assert len(gelus) == 2 and not any('clamp' in str(n.target) for n in program.graph.nodes)


def test_inductor_compiles_the_inference_path():
    ffn = perturb_(IFFN(16, 64, grid_size=(3, 4), num_prefix_tokens=1), std=0.2, batchnorm=True).eval()
    deployed, x = ffn.fuse(), torch.randn(2, 13, 16)
    torch._dynamo.reset()
    with torch.inference_mode():
        out = torch.compile(deployed)(x)
        assert _rel_err(out, ffn(x)) <= RTOL
    torch._dynamo.reset()


def test_batch_slices_give_the_same_numbers():
    ffn = perturb_(IFFN(16, 64, grid_size=(3, 4), num_prefix_tokens=1), std=0.2, batchnorm=True).eval()
    deployed = ffn.fuse()
    x = torch.randn(5, 13, 16)
    with torch.inference_mode():
        deployed.inference_chunk_bytes = 0  # the whole batch at once
        whole = deployed(x)
        deployed.inference_chunk_bytes = 2 * 13 * 64 * 4  # two samples per slice: 3 slices
        sliced = deployed(x)
        torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)
        assert _rel_err(sliced, ffn(x)) <= RTOL


@pytest.mark.parametrize('spatial_act', ['gelu', 'softplus'])  # softplus: no in-place kernel, result used
def test_inference_path_matches_training_form_for_any_spatial_activation(spatial_act):
    ffn = perturb_(IFFN(16, 64, spatial_act_layer=spatial_act, grid_size=(3, 4), num_prefix_tokens=1),
                   std=0.2, batchnorm=True).eval()
    deployed = ffn.fuse()
    x = torch.randn(3, 13, 16)
    with torch.inference_mode():
        for chunk in (0, 13 * 64 * 4):  # whole batch, then one sample per slice
            deployed.inference_chunk_bytes = chunk
            assert _rel_err(deployed(x), ffn(x)) <= RTOL


def test_deploy_form_uses_reference_path_under_autograd():
    ffn = perturb_(IFFN(16, 64, grid_size=(3, 4)), std=0.2, batchnorm=True).eval()
    deployed = ffn.fuse()
    x = torch.randn(2, 12, 16, requires_grad=True)
    out = deployed(x)  # autograd on: readable path, no in-place ops on saved tensors
    out.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with torch.inference_mode():
        torch.testing.assert_close(out.detach(), deployed(x.detach()), rtol=RTOL, atol=RTOL)


def test_inference_path_is_cpu_only(monkeypatch):
    """The sliced, in-place inference path is for the CPU; a device without fused kernels (here 'meta')
    runs the reference path under inference_mode."""
    deployed = perturb_(IFFN(16, 64, grid_size=(3, 4)), std=0.2, batchnorm=True).eval().fuse()
    on_meta = copy.deepcopy(deployed).to('meta')
    calls = []
    for m in (deployed, on_meta):
        monkeypatch.setattr(m, '_forward_cpu', lambda x: calls.append(x.device.type) or x)
    with torch.inference_mode():
        out = on_meta(torch.randn(2, 12, 16, device='meta'))
        assert out.shape == (2, 12, 16) and out.device.type == 'meta' and calls == []
        deployed(torch.randn(2, 12, 16))
    assert calls == ['cpu']



def test_cpu_autocast_runs_the_reference_path():
    """Under CPU autocast the deployed layer runs its reference path, whose F.linear / conv2d autocast casts.
    The inference path's fc2 is an addmm with out= into an fp32 buffer, which autocast does not cast: a sliced
    batch under bf16 autocast ran fc2 in fp32 and returned fp32 (vitblocks bench --amp bf16 timed fp32 there)."""
    deployed = perturb_(IFFN(16, 64, grid_size=(3, 4), num_prefix_tokens=1), std=0.2, batchnorm=True).eval().fuse()
    deployed.inference_chunk_bytes = 1  # one image per slice, as a large batch is sliced
    assert_autocast_runs_the_reference_path(deployed, torch.randn(3, 13, 16))

def test_deploy_form_errors_like_training_form():
    deployed = IFFNDeployed(16, 64, grid_size=(3, 4), num_prefix_tokens=1).eval()
    with torch.inference_mode(), pytest.raises(ValueError, match='1 prefix tokens \\+ a 3x4 grid = 13'):
        deployed(torch.randn(2, 12, 16))


def test_fuse_is_idempotent_and_keeps_mode():
    ffn = perturb_(IFFN(16, 64, grid_size=(3, 4)), std=0.2, batchnorm=True)
    fused = ffn.fuse()
    assert fused.training == ffn.training and fused.fuse() is fused
    assert isinstance(ffn.spatial.bn, nn.BatchNorm2d)  # the training form is left as it was


def test_deploy_form_constructs_directly_and_loads_fused_state_dict():
    ffn = perturb_(IFFN(16, 64, grid_size=(3, 4), num_prefix_tokens=2), std=0.2, batchnorm=True).eval()
    fused = ffn.fuse()
    built = IFFNDeployed(16, 64, grid_size=(3, 4), num_prefix_tokens=2).eval()
    built.load_state_dict(fused.state_dict())  # strict: same keys, same shapes
    x = torch.randn(2, 14, 16)
    with torch.inference_mode():
        torch.testing.assert_close(built(x), fused(x), rtol=0, atol=0)
    n_train, n_deploy = (sum(p.numel() for p in m.parameters()) for m in (ffn, built))
    assert n_train - n_deploy == 2 * 64  # only the BatchNorm affine is gone


def _tiny_model(**kwargs):
    return timm.create_model('iffn_deit_tiny_patch16_224', img_size=64, **kwargs)


def test_full_model_reparameterize_matches_and_copies():
    model = _tiny_model()
    x = torch.randn(2, 3, 64, 64)
    deployed, ref = _check_deploy(model, x, deploy=reparameterize)
    assert isinstance(model.blocks[0].mlp.spatial.bn, nn.BatchNorm2d)  # copied: the original is untouched
    assert not deployed.training
    assert all(m.deploy for m in deployed.modules() if isinstance(m, IFFN))
    assert deployed.blocks[0].mlp.layout is deployed.patch_embed._vitblocks_layout
    # idempotent
    again = reparameterize(deployed)
    with torch.inference_mode():
        torch.testing.assert_close(again(x), deployed(x), rtol=0, atol=0)
    # timm's reparameterize_model walks the same fuse() protocol and gives the same model
    via_timm = reparameterize_model(copy.deepcopy(model).eval())
    assert via_timm.state_dict().keys() == deployed.state_dict().keys()
    with torch.inference_mode():
        torch.testing.assert_close(via_timm(x), deployed(x), rtol=0, atol=0)


def test_parameter_counts_training_and_deploy_forms():
    with torch.device('meta'):  # shapes only: no memory, no init cost
        trained = timm.create_model('iffn_deit_tiny_patch16_224')
        deployed = timm.create_model('iffn_deit_tiny_patch16_224', block_cfg={'deploy': True})
    assert sum(p.numel() for p in trained.parameters()) == 4_998_184
    assert sum(p.numel() for p in deployed.parameters()) == 4_998_184 - 12 * 2 * 768  # 12 BN affines


def test_deploy_form_model_loads_fused_checkpoint_and_tracks_grid():
    model = perturb_(_tiny_model(dynamic_img_size=True), std=0.2, batchnorm=True).eval()
    deployed = reparameterize(model)
    built = _tiny_model(dynamic_img_size=True, block_cfg={'deploy': True}).eval()
    built.load_state_dict(deployed.state_dict())
    x = torch.randn(2, 3, 48, 80)  # another resolution: a 3x5 grid, tracked by the patch-embed hook
    with torch.inference_mode():
        ref = model(x)
        assert _rel_err(built(x), ref) <= RTOL
        assert _rel_err(deployed(x), ref) <= RTOL


def test_channels_first_model_deploys():
    model = timm.create_model('iffn_poolformer_s12', num_classes=10)
    _check_deploy(model, torch.randn(2, 3, 64, 64), deploy=reparameterize)


def test_folding_keeps_the_batchnorm_eps():
    """BN(z) = w (z - mean) / sqrt(var + eps) + b: with small running variances eps is a large part of
    the denominator, so a fold that drops it is off by far more than float64 rounding."""
    block = DepthwiseBlock(4, 3).double().eval()
    with torch.no_grad():
        block.bn.running_var.fill_(1e-4)
        block.bn.eps = 1e-3
        block.bn.running_mean.normal_()
        block.bn.weight.normal_()
        block.bn.bias.normal_()
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    fused = block.fuse()
    assert isinstance(fused.bn, nn.Identity)
    scale = block.bn.weight / torch.sqrt(block.bn.running_var + 1e-3)
    expected_w = block.conv.weight * scale.view(-1, 1, 1, 1)
    torch.testing.assert_close(fused.conv.weight, expected_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused(x), block(x), rtol=1e-10, atol=1e-10)


def test_reparameterize_returns_an_eval_mode_copy_of_a_training_model():
    """The deployed model folds BatchNorm running statistics, so it is returned in eval mode (every module),
    computes the eval-mode function, and the training model it came from stays in training mode."""
    model = timm.create_model('iffn_deit_tiny_patch16_224', img_size=32, patch_size=8, depth=1, embed_dim=16,
                              num_heads=2, num_classes=3).train()
    perturb_(model, std=0.1, batchnorm=True)
    deployed = reparameterize(model)
    assert not any(m.training for m in deployed.modules()) and model.training
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        out = deployed(x)
        torch.testing.assert_close(out, deployed(x), rtol=0, atol=0)  # no dropout / batch statistics
        torch.testing.assert_close(out, model.eval()(x), rtol=1e-5, atol=1e-5)
