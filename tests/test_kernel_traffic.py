"""The traffic and time model of one FFN (vitblocks.kernels.traffic): bytes, FLOPs and roofline times by hand."""
import pytest

from vitblocks.kernels.traffic import GPUS, Op, afbo_ops, ffn_time_ms, iffn_ops, mlp_ops, model_table


def test_mlp_bytes_and_flops_by_hand():
    tokens, dim = 1000, 64
    ops = mlp_ops(tokens, dim, 4 * dim, 'tf32')
    assert [o.name for o in ops] == ['fc1', 'GELU', 'fc2']
    # fc1 reads x (1000 x 64) and W1 (64 x 256), writes 1000 x 256; GELU reads and writes it; fc2 the reverse
    assert sum(o.read + o.write for o in ops) == 4 * ((64_000 + 16_384 + 256_000) * 2 + 2 * 256_000)
    assert sum(o.flops for o in ops if o.tensor_cores) == 2 * 2 * 1000 * 64 * 256
    bf16 = mlp_ops(tokens, dim, 4 * dim, 'bf16')  # autocast casts each fp32 weight first: read 4 B, write 2 B
    assert [o.name for o in bf16] == ['fc1 weight cast', 'fc1', 'GELU', 'fc2 weight cast', 'fc2']
    assert bf16[0].read + bf16[0].write == 6 * 64 * 256


def test_roofline_time_is_the_slower_of_memory_and_compute():
    h100 = GPUS['H100']
    memory_bound = Op('x', 3.35e9, 0, 1e9)
    assert memory_bound.time_s(h100, 'tf32') == pytest.approx(1e-3)
    gemm = Op('y', 0, 0, 494.7e9, tensor_cores=True)
    assert gemm.time_s(h100, 'tf32') == pytest.approx(1e-3) and gemm.time_s(h100, 'bf16') == pytest.approx(0.5e-3)
    assert ffn_time_ms([memory_bound, gemm], 'H100', 'tf32') == pytest.approx(2.0)


def test_depthwise_halo_is_counted_and_dram_halo_only_on_request():
    hidden, tokens = 768, 196
    ops = iffn_ops(tokens, 14, 192, hidden, 2, 3, 'tf32', w_block=8)
    conv = next(o for o in ops if o.name == 'dwconv_act_residual')
    tensor = 4 * tokens * hidden
    assert conv.halo == pytest.approx(tensor * 2 / 8)  # tiles of 8 columns read 10
    assert conv.rows_halo == pytest.approx((tensor + conv.halo) * 2)  # and 3 rows each
    assert conv.bytes_moved == pytest.approx(2 * tensor + conv.halo + conv.rows_halo)
    h200 = GPUS['H200']
    assert conv.time_s(h200, 'tf32', halo_from_dram=True) > conv.time_s(h200, 'tf32')
    no_conv = afbo_ops(tokens, 14, 192, hidden, 128, 96, 0, 'tf32')
    assert no_conv[1].halo == 0 and no_conv[1].rows_halo == 0


def test_model_table_says_where_a_target_is_out_of_reach():
    text = model_table(['iffn_deit_tiny_patch16_224'], 128, {'iffn_deit_tiny_patch16_224': 1.00})
    assert 'not a measurement' in text and 'Assumptions:' in text
    row = next(line for line in text.splitlines() if line.startswith('| iffn_deit_tiny_patch16_224 | tf32'))
    ratio = float(row.split('|')[7].strip().rstrip('x'))
    assert 0.5 < ratio < 1.0  # more bytes than the Mlp (the 4D-wide hidden tensor is written twice), memory-bound
    assert 'iffn_deit_tiny_patch16_224: cannot reach its whole-model target 1.00x' in text
