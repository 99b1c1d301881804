"""What exporters record from the deployed layers: plain functional graphs (no in-place or out= op, no batch loop),
equal to the eager layer at any batch size, shaped for ONNX Runtime."""
import contextlib
import io
import tempfile

import pytest
import torch

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.layers import AFBO, IFFN, RePaFFN
from vitblocks.layers.channel_maps import create_channel_map
from vitblocks.layers.layout import building_graph, exporting, plain_eager_inference
from _helpers import perturb_

LAYERS = {
    'iffn_tokens_prefix': (lambda: IFFN(12, 48, grid_size=(3, 5), num_prefix_tokens=1), (16, 12)),
    'iffn_channels_first': (lambda: IFFN(12, 48, channels_first=True), (12, 3, 5)),
    'afbo_tokens_prefix': (lambda: AFBO(12, 48, grid_size=(3, 5), num_prefix_tokens=1), (16, 12)),
    'afbo_tokens': (lambda: AFBO(12, 48, grid_size=(3, 5)), (15, 12)),
    'afbo_channels_first': (lambda: AFBO(12, 48, channels_first=True), (12, 3, 5)),
    'afbo_channels_last_map': (lambda: AFBO(12, 48, act_position='post'), (3, 5, 12)),
    'afbo_no_spatial': (lambda: AFBO(12, 48, order='cm'), (7, 12)),
    'repa': (lambda: RePaFFN(12, 48), (16, 12)),
}


def _deployed(name):
    build, shape = LAYERS[name]
    layer = perturb_(build(), std=0.2, batchnorm=True).eval()
    return layer.fuse(), shape


def _mutating_ops(program) -> list:
    """Names of the ops in an exported program that write into an argument (in-place or out=)."""
    found = []
    for node in program.graph.nodes:
        schema = getattr(node.target, '_schema', None)
        if node.op == 'call_function' and schema is not None and schema.is_mutable:
            found.append(str(node.target))
    return found


@pytest.mark.parametrize('name', sorted(LAYERS))
def test_torch_export_records_a_functional_graph_that_runs_any_batch_with_autograd_on(name):
    layer, shape = _deployed(name)
    with torch.no_grad():
        program = torch.export.export(layer, (torch.randn(3, *shape),), dynamic_shapes=({0: torch.export.Dim('b')},))
    assert _mutating_ops(program) == []
    x = torch.randn(5, *shape)
    with torch.no_grad():
        expected = layer(x)  # the eager fast path
    out = program.module()(x)  # called the plain way: autograd on
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('name', ['iffn_tokens_prefix', 'afbo_tokens_prefix', 'afbo_channels_first'])
def test_legacy_trace_and_vmap_take_plain_ops(name):
    layer, shape = _deployed(name)
    x = torch.randn(4, *shape)
    with torch.no_grad():
        expected = layer(x)
        traced = torch.jit.trace(layer, torch.randn(2, *shape), check_trace=False)
        batched = torch.func.vmap(lambda t: layer(t.unsqueeze(0)).squeeze(0))(x)
    torch.testing.assert_close(traced(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched, expected, rtol=1e-5, atol=1e-5)


def test_what_counts_as_building_a_graph():
    x = torch.randn(2, 3)
    with torch.no_grad():
        assert plain_eager_inference(x, training=False) and not building_graph() and not exporting()
        assert not plain_eager_inference(x, training=True)
        seen = []
        torch.func.vmap(lambda t: seen.append((building_graph(), exporting(), plain_eager_inference(t, False))) or t)(x)
        assert seen == [(True, False, False)]
    assert not plain_eager_inference(x, training=False)  # autograd on
    with torch.autocast('cpu', dtype=torch.bfloat16), torch.no_grad():
        assert not plain_eager_inference(x, training=False)


@pytest.mark.parametrize('kind,groups', [('occm', 2), ('occm', 3), ('occm', 4), ('gccm', 2), ('gccm', 4),
                                         ('grouped', 3), ('dense', 1)])
def test_a_channel_maps_export_weight_is_its_dense_matrix(kind, groups):
    m = create_channel_map(kind, 24, 48, groups)
    torch.nn.init.normal_(m.bias)
    torch.testing.assert_close(m.export_weight(), m.dense_weight(), rtol=0, atol=0)
    rows = torch.randn(5, 24)
    with torch.no_grad():
        torch.testing.assert_close(torch.nn.functional.linear(rows, m.export_weight(), m.bias), m(rows),
                                   rtol=1e-5, atol=1e-5)


def _onnx_ops(module, x, optimize: bool):
    onnx = pytest.importorskip('onnx')
    ort = pytest.importorskip('onnxruntime')
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        program = torch.onnx.export(module, (x,), dynamo=True, input_names=['input'], output_names=['output'])
    data = program.model_proto.SerializeToString()
    if optimize:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # no hardware layouts
        with tempfile.TemporaryDirectory() as tmp:
            options.optimized_model_filepath = f'{tmp}/opt.onnx'
            ort.InferenceSession(data, options, providers=['CPUExecutionProvider'])
            model = onnx.load(options.optimized_model_filepath)
    else:
        model = onnx.load_from_string(data)
    return [n.op_type for n in model.graph.node]


def test_afbo_exports_its_maps_as_dense_matmuls_of_constant_weights():
    layer, shape = _deployed('afbo_tokens_prefix')
    ops = _onnx_ops(layer, torch.randn(2, *shape), optimize=True)
    # the maps' dense weights are folded into constants: no gather, scatter or loop runs per call
    assert not {'Gather', 'GatherElements', 'ScatterElements', 'ScatterND', 'Loop', 'Unfold'} & set(ops), ops
    assert ops.count('Conv') == 2  # the two depthwise convs
    # maps, fc2 and the prefix tokens' maps and fc2: matmuls (fused with their bias where ONNX Runtime can)
    assert sum(op in ('MatMul', 'Gemm', 'FusedMatMul') for op in ops) == 6


def test_iffn_exports_its_conv_with_layout_changes_only_around_it():
    layer, shape = _deployed('iffn_tokens_prefix')
    ops = _onnx_ops(layer, torch.randn(2, *shape), optimize=False)
    assert ops.count('Transpose') == 2 and ops.count('Conv') == 1  # into and out of the depthwise conv only
