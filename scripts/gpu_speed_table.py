"""The GPU speed sweep's results (scripts/gpu_speed_sweep.py) as markdown, the papers' claimed speed-ups beside ours.

    python scripts/gpu_speed_table.py runs/gpu_speed > table.md

Speed-up = images/s ratio to the group's vanilla backbone, measured in the same run (median
times). The papers' claims come from their tables (vitblocks/papers/*.yaml):
  RePa     Table 2: deployed vs vanilla (images/s, A6000, fp32, batch 128); Table 1: deployed vs
           training form; training form vs vanilla from Table 1's "before" over Table 2's vanilla.
  AFBO     latency ms (its Table 2 for vanilla and AFBO, Table 11 for GLU with M = 4): vanilla / variant.
  IFFN     publishes no speed; SwiGLU (M = 8/3) has no latency on these backbones: no claim.
"claim" compares our ratio with the paper's: holds (95-105% of it), ours faster (> 105%: a claimed
speed-up holds with room; where the paper reports a slow-down, the RePa training form or GLU, ours loses
less), close (85-95%), does not hold (< 85%).
A partial results folder (a sweep cut off by its time budget) gives a table of what is there: the
header says how many of the sweep's runs are present and which settings are missing.
"""
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from vitblocks.papers import load_paper

sys.path.insert(0, str(Path(__file__).parent))
from gpu_speed_sweep import BATCHES, GROUPS, MODES, PRECISIONS, settings  # noqa: E402  (what the runs measured)

# the setting names of the full sweep, in the order scripts/gpu_speed_sweep.py runs them
FULL_SWEEP = [s[0] for s in settings(SimpleNamespace(compile=MODES, precisions=PRECISIONS, batches=BATCHES))]

# AFBO Table 11's GLU (M = 4) latencies: afbo.yaml keeps latencies in row notes, and its three GLU rows share
# one note without them
AFBO_GLU4_MS = {'poolformer_s12': 13.3, 'poolformer_s24': 19.7, 'swin_tiny_patch4_window7_224': 19.8}
LABELS = {'vanilla': 'vanilla', 'repa': 'RePa (training form)', 'repa_deployed': 'RePa deployed',
          'iffn_deployed': 'IFFN deployed', 'afbo': 'AFBO', 'glu4': 'GLU (M=4)', 'swiglu': 'SwiGLU (M=8/3)'}


def _latency(note) -> float:
    m = re.search(r'latency ([\d.]+) ms', note or '')
    return float(m.group(1)) if m else None


def paper_claims() -> dict:
    """{(base, variant): (speed-up vs vanilla, source)} and {base: (deployed vs training form, source)}."""
    repa = load_paper('repa')
    t1 = {(r.model, bool(r.reparam)): r.throughput for r in repa.table('1').rows if not r.block_cfg}
    t2 = {(r.model, bool(r.reparam)): r.throughput for r in repa.table('2').rows if not r.block_cfg}
    afbo2 = {r.model: _latency(r.note) for r in load_paper('afbo').table('2').rows if not r.ffn}
    vs_vanilla, vs_training = {}, {}
    for base, _ in GROUPS.values():
        van = t2.get((base, False))
        after, before = t1.get((f'repa_{base}', True)), t1.get((f'repa_{base}', False))
        if van and after:
            vs_vanilla[base, 'repa_deployed'] = (after / van, 'RePa T2')
        if van and before:
            vs_vanilla[base, 'repa'] = (before / van, 'RePa T1/T2')
        if after and before:
            vs_training[base] = (after / before, 'RePa T1')
        if afbo2.get(base) and afbo2.get(f'afbo_{base}'):
            vs_vanilla[base, 'afbo'] = (afbo2[base] / afbo2[f'afbo_{base}'], 'AFBO T2')
        if afbo2.get(base) and base in AFBO_GLU4_MS:
            vs_vanilla[base, 'glu4'] = (afbo2[base] / AFBO_GLU4_MS[base], 'AFBO T2/T11')
    return vs_vanilla, vs_training


def verdict(ours: float, claim: float) -> str:
    share = ours / claim
    if share > 1.05:
        return 'ours faster'
    return 'holds' if share >= 0.95 else 'close' if share >= 0.85 else 'does not hold'


def setting_title(name: str) -> str:
    precision, mode, batch = name.split('-')
    title = f'{"fp32" if precision == "fp32" else "bf16 autocast"}, {mode}, batch {batch[1:]}'
    return title + (" (the papers' setting)" if name == 'fp32-eager-b128' else '')


def present_settings(folder: Path) -> list:
    """The setting folders present, in the sweep's order (others, e.g. from a custom --batches, after)."""
    present = {p.name for p in folder.iterdir() if p.is_dir() and re.fullmatch(r'\w+-\w+-b\d+', p.name)}
    return [s for s in FULL_SWEEP if s in present] + sorted(present - set(FULL_SWEEP))


def coverage(folder: Path) -> str:
    """How much of the full sweep the folder holds, and what is missing (the command resumes it)."""
    done = {s: sum((folder / s / f'{g}.json').is_file() for g in GROUPS) for s in FULL_SWEEP}
    missing = [s if not done[s] else f'{s} ({len(GROUPS) - done[s]} of {len(GROUPS)} groups)'
               for s in FULL_SWEEP if done[s] < len(GROUPS)]
    line = f'{sum(done.values())} of {len(FULL_SWEEP) * len(GROUPS)} runs of the full sweep present'
    return line + (f'; not yet run: {", ".join(missing)}.' if missing else '.')


def table(folder: Path, setting: str, claims) -> list:
    vs_vanilla, vs_training = claims
    rows = ['| backbone | model | median ms | images/s (timm) | speed-up vs vanilla | paper | claim | '
            'deployed vs training form | paper | claim |', '|' + ' --- |' * 2 + ' ---: |' * 8]
    for group, (base, variants) in GROUPS.items():
        path = folder / setting / f'{group}.json'
        if not path.is_file():
            rows.append(f'| {base} | not yet run | | | | | | | | |')
            continue
        records = json.loads(path.read_text())
        if 'error' in records[0]:
            rows.append(f'| {base} | {records[0]["error"][:80]} | | | | | | | | |')
            continue
        by_variant = {r['variant']: r for r in records}
        for v in ('vanilla',) + variants:
            r = by_variant[v]
            if 'error' in r:  # this model could not run in this setting
                rows.append(f'| {base} | {LABELS[v]}: fails: {r["error"][:100]} | | | | | | | | |')
                continue
            ours = r['speedup_vs_baseline']
            claim, source = vs_vanilla.get((base, v), (None, ''))
            cells = [base, LABELS[v], f'{r["infer_median_ms"]:.2f}', f'{r["infer_samples_per_sec"]:.1f}',
                     f'{ours:.2f}x', f'{claim:.2f}x ({source})' if claim else '', verdict(ours, claim) if claim else '']
            if v == 'repa_deployed' and 'error' not in by_variant['repa']:
                ours_t = by_variant['repa']['infer_median_ms'] / r['infer_median_ms']
                claim_t, source_t = vs_training.get(base, (None, ''))
                cells += [f'{ours_t:.2f}x', f'{claim_t:.2f}x ({source_t})' if claim_t else '',
                          verdict(ours_t, claim_t) if claim_t else '']
            else:
                cells += ['', '', '']
            rows.append('| ' + ' | '.join(cells) + ' |')
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(f'usage: gpu_speed_table.py RESULTS_FOLDER (runs/gpu_speed of scripts/gpu_job.sh); got {argv}',
              file=sys.stderr)
        return 2
    folder = Path(argv[0])
    env_path = folder / 'env.json'
    env = json.loads(env_path.read_text()) if env_path.is_file() else {}
    where = env.get('gpu') and f'{env["gpu"]}, driver {env.get("driver")}' or env.get('cpu', 'unknown device')
    px, timer = env.get('img_size', 224), 'CUDA events' if env.get('gpu') else 'wall clock'
    print(f'Measured on {where}; torch {env.get("torch")} (CUDA {env.get("cuda")}, cuDNN {env.get("cudnn")}), '
          f'timm {env.get("timm")}. Inference (eval, torch.inference_mode), random weights, 3x{px}x{px}, '
          f'{env.get("warmup")} warm-up + {env.get("repeats")} timed batches per model; speed-up = same-run '
          f'images/s ratio (median step times, {timer}).\n')
    print(coverage(folder) + '\n')
    claims = paper_claims()
    for setting in present_settings(folder):
        print(f'### {setting_title(setting)}\n')
        print('\n'.join(table(folder, setting, claims)) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
