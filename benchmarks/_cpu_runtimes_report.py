"""The tables, target verdicts, per-op profile listing and output files of benchmarks/cpu_runtimes.py."""
import json
from pathlib import Path
from typing import Dict, List, Sequence

from _ratio_runs import target_line

RUNTIME_LABELS = {'eager': 'PyTorch eager', 'compile': 'torch.compile', 'onnxruntime': 'ONNX Runtime',
                  'openvino': 'OpenVINO'}


def _cell(record: dict, targets: bool) -> str:
    if record is None:
        return ''
    if record['status'] != 'ok':
        return record['status']
    cell = f'{record["ratio"]:.2f}x'
    if len(record['ratios']) > 1:
        cell += f' ({record["ratio_min"]:.2f}-{record["ratio_max"]:.2f})'
    if targets and 'target' in record:
        cell += ' met' if record['target']['met'] else ' MISSED'
    return cell


def _find(records: List[dict], pair: str, batch: int, runtime: str):
    return next((r for r in records if r['pair'] == pair and r['batch'] == batch and r['runtime'] == runtime), None)


def markdown(records: List[dict], runtimes: Sequence, pairs: Sequence, batch_sizes: Sequence[int],
             targets: bool) -> str:
    """The ratio table (deployed / vanilla latency, median over runs with min-max, a verdict with ``targets``)
    and the table of times and output errors behind it."""
    names = [r.name for r in runtimes]
    head = ['deployed / vanilla, latency', 'batch', 'MACs', *(r.label for r in runtimes)]
    rule = '| --- | ---: | ---: |' + ' ---: |' * len(names)
    if targets:
        head, rule = head + ['target'], rule + ' --- |'
    lines = ['| ' + ' | '.join(head) + ' |', rule]
    for pair in pairs:
        for b in batch_sizes:
            row = [_find(records, pair.label, b, n) for n in names]
            mac = next((r['mac_ratio'] for r in row if r is not None), None)
            cells = [pair.label, str(b), f'{mac:.2f}x' if mac is not None else '', *(_cell(r, targets) for r in row)]
            if targets:
                cells.append(pair.target.describe(mac) if pair.target is not None and mac is not None else '')
            lines.append('| ' + ' | '.join(cells) + ' |')
    lines += ['', '| deployed / vanilla | batch | runtime | deployed ms | vanilla ms | deployed img/s | vanilla img/s '
                  '| max abs error vs eager (deployed / vanilla) |',
              '| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |']
    for r in records:
        if r['status'] != 'ok':
            lines.append(f'| {r["pair"]} | {r["batch"]} | {RUNTIME_LABELS[r["runtime"]]} | {r["status"]}: '
                         f'{r["error"].splitlines()[0][:200]} | | | | |')
            continue
        lines.append(f'| {r["pair"]} | {r["batch"]} | {RUNTIME_LABELS[r["runtime"]]} | {r["deployed_ms"]:.2f} | '
                     f'{r["vanilla_ms"]:.2f} | {r["batch"] / r["deployed_ms"] * 1e3:.1f} | '
                     f'{r["batch"] / r["vanilla_ms"] * 1e3:.1f} | {r["deployed_check"]["max_abs_error"]:.2g} / '
                     f'{r["vanilla_check"]["max_abs_error"]:.2g} |')
    return '\n'.join(lines)


def verdict_lines(records: List[dict]) -> List[str]:
    """One target line per measured ratio that has a target (median over runs, with min / median / max)."""
    lines = []
    for r in records:
        if 'target' in r:
            t = r['target']
            label = f'{r["pair"]}, {RUNTIME_LABELS[r["runtime"]]}, batch {r["batch"]}, ' \
                    f'{"throughput" if t["at_least"] else "latency"}'
            lines.append(target_line(label, t['judged'], t['threshold'], t['at_least']))
        elif r['status'] != 'ok':
            lines.append(f'{r["pair"]}, {RUNTIME_LABELS[r["runtime"]]}, batch {r["batch"]}: not measured '
                         f'({r["status"]})')
    return lines


def print_profile(title: str, summary: Dict[str, object], path: Path, top: int) -> None:
    print(f'  ONNX Runtime profile, {title}: {summary["ms_per_run"]:.2f} ms of kernel time per run over '
          f'{summary["runs"]} runs ({path})')
    print(f'    {"op":<28} {"calls/run":>9} {"ms/run":>9} {"share":>7}')
    for op, calls, ms, share in summary['ops'][:top]:
        print(f'    {op:<28} {calls:>9.0f} {ms:>9.3f} {share:>7.1%}')
    print(f'    {"node":<44} {"op":<20} {"ms/run":>8} {"share":>6} {"MiB":>7}  output')
    for n in summary['nodes'][:top]:
        name = n['name'] if len(n['name']) <= 44 else '...' + n['name'][-41:]
        print(f'    {name:<44} {n["op"]:<20} {n["ms_per_run"]:>8.3f} {n["share"]:>6.1%} {n["bytes"] / 2 ** 20:>7.2f}  '
              f'{" ".join("x".join(map(str, s)) for s in n["outputs"])}')


def write_outputs(out: Path, info: Dict[str, object], records: List[dict], table: str) -> List[Path]:
    """``out`` with suffix .md (the machine, then the tables) and .json (the machine and every record)."""
    md, js = out.with_suffix('.md'), out.with_suffix('.json')
    md.parent.mkdir(parents=True, exist_ok=True)
    versions = ', '.join(f'{k} {v}' for k, v in info['versions'].items() if v)
    options = [f'torch.compile mode {info["compile_mode"]}' + (' with inductor freezing' * info['inductor_freezing']),
               f'ONNX Runtime spinning {info["ort_spinning"]}']
    if info['model_kwargs']:
        options.append(f'models built with {info["model_kwargs"]}')
    options = '; '.join(options)
    md.write_text(f'{info["cpu"]} ({info["cpu_id"]}); ISA {" ".join(info["isa"])}; torch CPU capability '
                  f'{info["torch_cpu_capability"]}; {info["threads"]} intra-op thread(s); {versions}; {options}; '
                  f'batch sizes {info["batch_sizes"]}, {info["runs"]} run(s) of {info["warmup"]} warm-up + '
                  f'{info["rounds"]} timed rounds; load average {info["load_average"]}\n\n{table}\n')
    js.write_text(json.dumps(dict(machine=info, records=records), indent=1) + '\n')
    return [md, js]
