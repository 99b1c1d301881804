"""Print what the compiler says about every fused kernel at the launch configurations the deployed layers use.

    python -m vitblocks.kernels.report            # the table; exit code 1 if a configuration fails
    python -m vitblocks.kernels.report --json     # the rows as JSON (tests/test_kernel_compile.py reads them)

The configurations are recorded from the deployed IFFN and AFBO layers themselves (:mod:`.launches`: the
first FFN of each stage of DeiT-Ti/S/B, Swin-T and PoolFormer-S12, depthwise kernels k = 3, 5, 7, fp32
with TF32 matmuls, strict fp32 and bf16 autocast), compiled for sm_80 (A100) and sm_90 (H100/H200) and
checked by :mod:`.compile_check`. No GPU is needed; Triton and the ``ptxas`` in its wheel are.
"""
import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Dict, List, Sequence

__all__ = ['kernel_table', 'format_table', 'main']


def kernel_table(archs: Sequence[int] = (80, 90), workers=None, **selection) -> List[dict]:
    """One row per (kernel, configuration, architecture): the worst of its compilations (a configuration can
    compile more than once, for arguments Triton specializes on: alignment, a size of 1), where it is used,
    and whether it passes."""
    from .compile_check import compile_launches
    from .launches import deployed_launches
    cases = deployed_launches(**selection)
    used: Dict[str, set] = defaultdict(set)
    launches = []
    for (method, model, k, precision), recorded in cases.items():
        for launch in recorded:
            used[launch.key()].add(f'{method} {model.split("_patch")[0]} k={k} {precision}')
            launches.append(launch)
    stats = compile_launches(launches, archs, workers)
    rows: Dict[tuple, dict] = {}
    for (key, arch), s in stats.items():
        d = s.as_dict()
        row = rows.setdefault((s.kernel, s.config, arch), dict(d, compilations=0, used_by=set()))
        row['compilations'] += 1
        row['used_by'] |= used[key]
        if s.error or (d['registers'] or 0) > (row['registers'] or 0) or (d['spill_bytes'] or 0) > (row['spill_bytes']
                                                                                                   or 0):
            row.update({k: v for k, v in d.items()})  # the worst compilation speaks for the configuration
        row['problems'] = sorted(set(row['problems']) | set(d['problems']))
    out = []
    for key in sorted(rows):
        row = rows[key]
        row['used_by'] = sorted(row['used_by'])
        row['passes'] = not row['problems']
        out.append(row)
    return out


def format_table(rows: List[dict]) -> str:
    head = ('| kernel | configuration | arch | registers | spills (B) | shared (B) | blocks/SM | occupancy | '
            'verdict |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |')
    lines = [head]
    for r in rows:
        verdict = 'ok' if r['passes'] else '; '.join(r['problems'])
        lines.append(f"| {r['kernel']} | {r['config']} | sm_{r['arch']} | {r['registers']} | {r['spill_bytes']} | "
                     f"{r['shared_bytes']} | {r['blocks_per_sm']} | {r['occupancy']:.0%} | {verdict} |")
    passed = sum(r['passes'] for r in rows)
    lines.append(f'\n{passed} of {len(rows)} configurations pass (no spills, no ptxas performance warning, '
                 '<= 128 registers/thread outside the GEMM kernel).')
    return '\n'.join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--json', action='store_true', help='print the rows as JSON')
    p.add_argument('--archs', type=int, nargs='+', default=[80, 90], help='compute capabilities (default 80 90)')
    p.add_argument('--workers', type=int, default=None, help='compiler processes (default: CPUs, at most 8)')
    args = p.parse_args(argv)
    if os.environ.get('TRITON_INTERPRET', '0') not in ('', '0'):
        p.error('TRITON_INTERPRET is set: the interpreter has no compiled kernels to inspect; unset it')
    from .compile_check import ptxas_path
    if ptxas_path() is None:
        p.error('needs Triton with the ptxas of its NVIDIA backend (pip install triton)')
    rows = kernel_table(args.archs, args.workers)
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0 if all(r['passes'] for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
