"""The fused kernels as the compiler sees them, without a GPU: every launch configuration the deployed IFFN and
AFBO layers choose (recorded from the layers: DeiT-Ti/S/B, Swin-T, PoolFormer-S12; k = 3, 5, 7; fp32 with and
without TF32, bf16), and every candidate configuration, compiled by Triton for sm_80 and sm_90 and read by the
wheel's ptxas: no spills, no performance warning, at most 128 registers per thread outside the GEMM kernel.

The compilations run in a child process without ``TRITON_INTERPRET`` (the interpreter has no compiled kernels)
and are cached by Triton, so a rerun takes seconds; the first run on a machine compiles about a hundred kernels.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip('triton')

from vitblocks.kernels.compile_check import KernelStats, parse_ptxas, ptxas_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NEEDS_PTXAS = pytest.mark.skipif(ptxas_path() is None, reason="Triton's wheel has no ptxas for its NVIDIA backend here")

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_window_maps_kernel' for 'sm_90a'
ptxas info    : Function properties for _window_maps_kernel
    0 bytes stack frame, 16 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 504 bytes cmem[0]
ptxas warning : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to the presence \
of Extern calls in the function '_window_maps_kernel'.
"""


def _compiled_python(code: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    env['PYTHONPATH'] = os.pathsep.join([str(ROOT / 'src'), env.get('PYTHONPATH', '')])
    return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


def test_ptxas_log_is_read_into_registers_spills_and_warnings():
    stats = KernelStats('window_maps', 'x', 90, warps=4, shared_bytes=0, **parse_ptxas(LOG))
    assert (stats.registers, stats.spill_bytes) == (168, 40)
    assert len(stats.warnings) == 1 and 'C7515' in stats.warnings[0]
    assert stats.problems() == [f'ptxas: {stats.warnings[0]}', '40 bytes of spills']  # GEMM: registers allowed


@pytest.mark.parametrize('registers,warps,shared,arch,blocks', [
    (128, 4, 0, 90, 4),  # 128 x 32 x 4 = 16384 registers a block: 4 blocks, 16 warps, 25%
    (64, 4, 0, 90, 8),
    (255, 4, 0, 80, 2),  # 256 per thread after rounding: 2 blocks (12%), the depthwise kernels before their tap loop
    (32, 4, 0, 90, 16),  # 64 warps per SM at most
    (96, 4, 98304, 90, 2),  # shared memory: 228 KB / (96 KB + 1 KB)
    (96, 4, 98304, 80, 1),  # 164 KB on an A100
])
def test_blocks_per_sm_follow_the_occupancy_calculator(registers, warps, shared, arch, blocks):
    stats = KernelStats('dwconv_act_residual', 'x', arch, registers=registers, spill_bytes=0, shared_bytes=shared,
                        warps=warps)
    assert stats.blocks_per_sm == blocks
    assert stats.occupancy == blocks * warps / 64
    assert (stats.problems() == []) == (registers <= 128)


@NEEDS_PTXAS
def test_every_configuration_the_layers_choose_compiles_without_spills_or_warnings():
    run = _compiled_python('from vitblocks.kernels.report import main; main(["--json"])')
    assert run.stdout.strip(), run.stderr[-3000:]
    rows = json.loads(run.stdout)
    failing = [f"{r['kernel']} {r['config']} sm_{r['arch']}: {'; '.join(r['problems'])}"
               for r in rows if not r['passes']]
    assert not failing, '\n'.join(failing)
    # the recording covers every kernel, kernel size, architecture, storage dtype and GEMM precision
    assert {r['kernel'] for r in rows} == {'agelu_concat_layernorm', 'dwconv_act_residual', 'dwconv_pair_product',
                                           'window_maps'}
    assert {r['arch'] for r in rows} == {80, 90}
    for kernel in ('dwconv_act_residual', 'dwconv_pair_product'):
        assert {k for k in (3, 5, 7) for r in rows if r['kernel'] == kernel and f'K={k} ' in r['config']} == {3, 5, 7}
        assert any('bf16' in r['config'] for r in rows if r['kernel'] == kernel)
    gemm = [r['config'] for r in rows if r['kernel'] == 'window_maps']
    assert any('PRECISION=tf32' in c for c in gemm) and any('PRECISION=ieee' in c for c in gemm)
    assert all(r['registers'] <= 128 for r in rows if r['kernel'] != 'window_maps')
    assert all(r['occupancy'] >= 0.25 for r in rows if r['kernel'] != 'window_maps')
    assert any('afbo poolformer_s12 k=7 bf16' in u for r in rows for u in r['used_by'])


@NEEDS_PTXAS
def test_the_check_fails_a_tile_that_spills():
    """The depthwise kernel at k = 7 with 128 outputs per thread (64 pixels x 256 channels, 4 warps) must be
    caught: it spills."""
    code = '''
import json, torch
from vitblocks.kernels import iffn
from vitblocks.kernels.compile_check import compile_launch
from vitblocks.kernels.launches import record_launches
iffn.DWCONV_TUNER.candidates = [dict(W_BLOCK=64, C_BLOCK=256, num_warps=4)]
iffn._dwconv_fits = lambda k: None  # let it through: the check is what must refuse it
with record_launches() as launches:
    iffn.dwconv_act_residual(torch.zeros(1, 56 * 56, 384), torch.zeros(384, 1, 7, 7), None, (56, 56))
print(json.dumps(compile_launch(launches[0], 90).as_dict()))
'''
    run = _compiled_python(code)
    assert run.returncode == 0, run.stderr[-3000:]
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert stats['spill_bytes'] > 1000, stats  # ptxas gives up on registers: 32 of them and 40 KB of spills on sm_90
    assert any('bytes of spills' in p for p in stats['problems'])
