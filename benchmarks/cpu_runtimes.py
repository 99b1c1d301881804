"""Deployed models against their vanilla timm models in the CPU runtimes people deploy with, side by side in one run.

Command (2 intra-op threads in every runtime; all pairs, all runtimes installed, batch 1 and 16):

    .venv/bin/python benchmarks/cpu_runtimes.py --targets                       # the table and the verdicts
    .venv/bin/python benchmarks/cpu_runtimes.py --targets --out cpu_runtimes.md # also cpu_runtimes.md / .json
    .venv/bin/python benchmarks/cpu_runtimes.py --models afbo-deit-t --runtimes onnxruntime --ort-profile prof/
    .venv/bin/python benchmarks/cpu_runtimes.py --models iffn-deit-s --runtimes eager onnxruntime \\
        --batch-sizes 1 32 --runs 5 --ort-spinning off
    .venv/bin/python benchmarks/cpu_runtimes.py --pair iffn_swin_tiny_patch4_window7_224 swin_tiny_patch4_window7_224

Targets (``--targets``; judged on the median ratio over ``--runs`` at every batch size; set for ONNX Runtime
and PyTorch eager, the other runtimes' verdicts are for information):
RePa-DeiT-B throughput >= 1.55x of DeiT-B; IFFN-DeiT-S latency <= 0.95x of DeiT-S; AFBO-EdgeViT-XXS <= 1.12x of
EdgeViT-XXS (AFBO Table 16's Xeon figure); AFBO-DeiT-T <= 1.25x of DeiT-T; AFBO-PoolFormer-S12 within 10% of
its MAC ratio (latency at most 1.10x the MAC ratio; faster than its MACs is no miss).

What is measured, per pair (``--models``, ``--pair``): the deployed model (``vitblocks.deploy.reparameterize``
of the registered model) against its vanilla timm model, both with random weights from the same seed (the
latency of these fp32 models does not depend on the weights' values), in inference mode, on one random batch:

* ``eager``: PyTorch eager (``torch.set_num_threads(--threads)``);
* ``compile``: ``torch.compile`` (inductor's CPU backend, static shapes; the first call compiles, its seconds
  are printed);
* ``onnxruntime``: the ONNX file ``vitblocks.deploy.export.export_onnx`` writes (torch's dynamo exporter,
  dynamic batch) in ``onnxruntime.InferenceSession``, CPU provider, all graph optimisations, ``--threads``
  intra-op threads;
* ``openvino``: the same file, ``openvino.Core().compile_model(..., 'CPU')`` in fp32, latency hint, one
  stream, ``--threads`` threads; skipped with its reason when the package is not installed
  (``pip install "vitblocks[cpu]"``).

Before any timing, each runtime's output for each model and batch size is checked against eager PyTorch:
finite, and max abs error at most ``--check-tol`` times the output's scale (max |output|, at least 1); a
runtime that computes something else is reported as wrong, never as a speed-up.

Timing: for each batch size (``--batch-sizes``, default 1 = latency and 16 = throughput), ``--runs`` runs;
in each, the deployed and the vanilla model take turns call by call (``vitblocks.profile.interleaved_times``:
``--warmup`` untimed rounds, then ``--rounds`` timed ones), in reversed order every other run. The ratio
of a run is deployed median ms / vanilla median ms (latency ratio: below 1 the deployed model is faster;
the throughput ratio is its inverse); the table gives the median over runs with min-max. The MAC ratio is
``vitblocks.profile.count_macs`` (attention included) of one image.

Runtime options: ``--compile-mode`` and ``--inductor-freezing`` (torch.compile), ``--ort-spinning off``
(ONNX Runtime's workers sleep instead of spinning between calls, so neither session's idle threads compete
with the other's run). Models other than the registered ones at 224 px: ``--pair`` and ``--model-arg``.

``--ort-profile DIR`` writes ONNX Runtime's per-op profile (JSON) of each model at each batch size to DIR,
from sessions of their own (profiling slows a session, so the timed ones run without), with the exported
ONNX files beside them, and prints the op types that take the time, with their share.
"""
import argparse
import ast
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import timm
import torch

import vitblocks  # noqa: F401  (registers the deployed models' architectures with timm)
from vitblocks.deploy import reparameterize
from vitblocks.deploy.export import export_onnx
from vitblocks.profile import COMPILE_MODES, count_macs, fixed_threads, input_size_of, interleaved_times

from _cpu_runtimes import ISA_FLAGS, RUNTIMES, Compiled, OnnxRuntime, RuntimeUnavailable, as_tensor, machine, op_profile
from _cpu_runtimes_report import markdown, print_profile, verdict_lines, write_outputs
from _ratio_runs import load_average


@dataclass(frozen=True)
class Target:
    """``latency``: deployed / vanilla time at most ``bound``; ``throughput``: vanilla / deployed time at least
    ``bound``; ``macs``: deployed / vanilla time at most (1 + ``bound``) x the MAC ratio."""
    kind: str
    bound: float

    def threshold(self, mac_ratio: float) -> float:
        return (1 + self.bound) * mac_ratio if self.kind == 'macs' else self.bound

    def describe(self, mac_ratio: float) -> str:
        if self.kind == 'throughput':
            return f'throughput >= {self.bound:.2f}x'
        if self.kind == 'macs':
            return f'latency <= {self.threshold(mac_ratio):.2f}x ({1 + self.bound:.2f} x MACs)'
        return f'latency <= {self.bound:.2f}x'

    def judge(self, latency_ratios: List[float], mac_ratio: float):
        """(the judged ratios, the threshold, whether the ratio must be at least it): throughput targets judge
        the inverse ratio."""
        if self.kind == 'throughput':
            return [1 / r for r in latency_ratios], self.bound, True
        return list(latency_ratios), self.threshold(mac_ratio), False


@dataclass(frozen=True)
class Pair:
    label: str
    deployed: str  # registered model, deployed with vitblocks.deploy.reparameterize
    vanilla: str
    target: Optional[Target] = None


PAIRS = {
    'repa-deit-b': Pair('RePa-DeiT-B / DeiT-B', 'repa_deit_base_patch16_224', 'deit_base_patch16_224',
                        Target('throughput', 1.55)),
    'iffn-deit-s': Pair('IFFN-DeiT-S / DeiT-S', 'iffn_deit_small_patch16_224', 'deit_small_patch16_224',
                        Target('latency', 0.95)),
    'afbo-deit-t': Pair('AFBO-DeiT-T / DeiT-T', 'afbo_deit_tiny_patch16_224', 'deit_tiny_patch16_224',
                        Target('latency', 1.25)),
    'afbo-poolformer-s12': Pair('AFBO-PoolFormer-S12 / PoolFormer-S12', 'afbo_poolformer_s12', 'poolformer_s12',
                                Target('macs', 0.10)),
    'afbo-edgevit-xxs': Pair('AFBO-EdgeViT-XXS / EdgeViT-XXS', 'afbo_edgevit_xxs', 'edgevit_xxs',
                             Target('latency', 1.12)),
    'repa-poolformer-s12': Pair('RePa-PoolFormer-S12 / PoolFormer-S12', 'repa_poolformer_s12', 'poolformer_s12'),
    'repa-swin-t': Pair('RePa-Swin-T / Swin-T', 'repa_swin_tiny_patch4_window7_224', 'swin_tiny_patch4_window7_224'),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--models', nargs='+', choices=list(PAIRS), metavar='PAIR',
                   help=f'pairs to run: {", ".join(PAIRS)} (default: all, or none when --pair is given)')
    p.add_argument('--pair', nargs=2, action='append', default=[], metavar=('DEPLOYED', 'VANILLA'),
                   help='another pair of registered models (repeatable): DEPLOYED is deployed with '
                        'reparameterize, VANILLA runs as built; no target')
    p.add_argument('--model-arg', action='append', default=[], metavar='KEY=VALUE',
                   help='a keyword of timm.create_model for both models of every pair (repeatable; VALUE a Python '
                        'literal, e.g. depth=2 or img_size=160, or else a string: act_layer=gelu)')
    p.add_argument('--runtimes', nargs='+', choices=list(RUNTIMES),
                   help=f'runtimes, in this order (default: {", ".join(RUNTIMES)}; those not installed are skipped '
                        f'with the reason; one named here that is not installed is an error)')
    p.add_argument('--batch-sizes', nargs='+', type=int, default=[1, 16],
                   help='images per batch: 1 is the latency, a larger one the throughput (default 1 16)')
    p.add_argument('--threads', type=int, default=2, help='intra-op threads of every runtime (default 2)')
    p.add_argument('--runs', type=int, default=3,
                   help='interleaved runs, order reversed every other one; ratios give min/median/max (default 3)')
    p.add_argument('--rounds', type=int, default=10, help='timed calls per model in a run, median kept (default 10)')
    p.add_argument('--warmup', type=int, default=2, help='untimed rounds before each run (default 2)')
    p.add_argument('--compile-mode', choices=COMPILE_MODES, default='default',
                   help="torch.compile's mode (default: default)")
    p.add_argument('--inductor-freezing', action='store_true',
                   help="torch.compile with inductor's freezing (weights as constants, prepacked for oneDNN)")
    p.add_argument('--ort-spinning', choices=('on', 'off'), default='on',
                   help="ONNX Runtime's worker threads spin after each parallel section (on: its default) or sleep "
                        '(off: no spinning session overlaps the other one\'s run)')
    p.add_argument('--targets', action='store_true', help='judge the targets above: a verdict per ratio')
    p.add_argument('--check-tol', type=float, default=1e-3,
                   help="largest max abs error of a runtime's output against eager PyTorch, relative to the "
                        'output scale (default 1e-3)')
    p.add_argument('--seed', type=int, default=0, help='seed of the weights and inputs (default 0)')
    p.add_argument('--out', type=Path, metavar='FILE',
                   help='also write the table to FILE with suffix .md and the records to FILE with suffix .json')
    p.add_argument('--ort-profile', type=Path, metavar='DIR',
                   help="write ONNX Runtime's per-op profiles (and the ONNX files) to DIR; print the top ops")
    p.add_argument('--profile-top', type=int, default=10, help='op types listed per profile (default 10)')
    args = p.parse_args(argv)
    for name, low in (('threads', 1), ('runs', 1), ('rounds', 1), ('warmup', 0), ('profile_top', 1)):
        if getattr(args, name) < low:
            p.error(f'--{name.replace("_", "-")} must be at least {low}, got {getattr(args, name)}')
    if any(b < 1 for b in args.batch_sizes) or len(set(args.batch_sizes)) != len(args.batch_sizes):
        p.error(f'--batch-sizes takes distinct sizes >= 1, got {args.batch_sizes}')
    if not args.check_tol > 0:  # also refuses nan
        p.error(f'--check-tol must be a positive number, got {args.check_tol}')
    for flag, default, runtime in (('compile_mode', 'default', 'compile'), ('inductor_freezing', False, 'compile'),
                                   ('ort_spinning', 'on', 'onnxruntime')):
        if getattr(args, flag) != default and args.runtimes is not None and runtime not in args.runtimes:
            p.error(f'--{flag.replace("_", "-")} is an option of the {runtime} runtime, which --runtimes leaves out')
    if args.ort_profile is not None and args.runtimes is not None and 'onnxruntime' not in args.runtimes:
        p.error('--ort-profile profiles ONNX Runtime: add onnxruntime to --runtimes or drop --ort-profile')
    if args.out is not None and args.out.suffix not in ('', '.md', '.json'):
        p.error(f'--out {args.out}: give a name with suffix .md or .json (both files are written)')
    for flag, items in (('--models', args.models or []), ('--runtimes', args.runtimes or []),
                        ('--pair', [tuple(pair) for pair in args.pair])):
        if len(set(items)) != len(items):
            p.error(f'{flag} names one twice: {items}')
    args.model_kwargs = {}
    for item in args.model_arg:
        key, eq, value = item.partition('=')
        if not eq or not key.isidentifier():
            p.error(f'--model-arg {item!r}: expected KEY=VALUE, e.g. depth=2')
        if key in args.model_kwargs:
            p.error(f'--model-arg gives {key} twice')
        try:
            args.model_kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            args.model_kwargs[key] = value  # a bare word: a string (act_layer=gelu)
    args.pairs = [PAIRS[k] for k in (args.models or ([] if args.pair else list(PAIRS)))]
    args.pairs += [Pair(f'{d} / {v}', d, v) for d, v in args.pair]
    if not args.pairs:
        p.error('no pair to run: name some with --models or --pair')
    return args


def make_runtime(name: str, args):
    """The runtime ``name`` (see _cpu_runtimes.py) with the options of the command line."""
    if name == 'compile':
        return Compiled(args.threads, mode=args.compile_mode, freezing=args.inductor_freezing)
    if name == 'onnxruntime':
        return OnnxRuntime(args.threads, spinning=args.ort_spinning == 'on')
    return RUNTIMES[name](args.threads)


def open_runtimes(args) -> Dict[str, type]:
    """The runtimes to run, by name; skips (printing why) a default one that is not installed."""
    chosen = {}
    for name in args.runtimes or list(RUNTIMES):
        try:
            make_runtime(name, args).close()
        except RuntimeUnavailable as e:
            if args.runtimes:
                raise SystemExit(f'--runtimes {name}: {e}') from None
            print(f'skipping {RUNTIMES[name].label}: {e}')
            continue
        chosen[name] = RUNTIMES[name]
    if args.ort_profile is not None and 'onnxruntime' not in chosen:
        raise SystemExit('--ort-profile: onnxruntime is not installed (pip install onnxruntime)')
    return chosen


def build(name: str, seed: int, deploy: bool, model_kwargs: dict) -> torch.nn.Module:
    torch.manual_seed(seed)
    try:
        model = timm.create_model(name, **model_kwargs)
    except TypeError as e:
        raise SystemExit(f'--model-arg {model_kwargs}: {name} does not take it ({e})') from None
    return reparameterize(model) if deploy else model.eval()


class WrongOutput(ValueError):
    """A runtime's output that is not eager PyTorch's: reported as wrong, never timed."""


def check(runtime_label: str, role: str, got, expected: torch.Tensor, tol: float) -> Dict[str, float]:
    """The max abs error of a runtime's output against eager PyTorch; raises when the output is not finite,
    of another shape, or further off than ``tol`` x its scale."""
    got = as_tensor(got)
    scale = max(1.0, expected.abs().max().item())
    if got.shape != expected.shape:
        raise WrongOutput(f'{runtime_label} {role}: output shape {tuple(got.shape)}, eager {tuple(expected.shape)}')
    if not torch.isfinite(got).all():
        raise WrongOutput(f'{runtime_label} {role}: output not finite')
    err = (got - expected).abs().max().item()
    if not err <= tol * scale:
        raise WrongOutput(f'{runtime_label} {role}: max abs error {err:.3g} against eager PyTorch on outputs up to '
                         f'{scale:.3g} (tolerance {tol:g} x {scale:.3g}): the runtime computes something else')
    return dict(max_abs_error=err, scale=scale)


def ratio_runs(calls: Dict[str, object], args) -> Dict[str, List[float]]:
    """Median ms of each model in each of ``--runs`` interleaved runs (order reversed every other run)."""
    names, medians = list(calls), {n: [] for n in calls}
    for r in range(args.runs):
        order = names if r % 2 == 0 else names[::-1]
        times = interleaved_times({n: calls[n] for n in order}, repeats=args.rounds, warmup=args.warmup)
        for n in names:
            medians[n].append(statistics.median(times[n]))
    return medians


def judge(record: dict, pair: Pair) -> None:
    if pair.target is None or record['status'] != 'ok':
        return
    values, threshold, at_least = pair.target.judge(record['ratios'], record['mac_ratio'])
    med = statistics.median(values)
    record['target'] = dict(describe=pair.target.describe(record['mac_ratio']), judged=values, threshold=threshold,
                            at_least=at_least, median=med, met=bool(med >= threshold if at_least else med <= threshold))


def run_runtime(runtime, pair: Pair, models, onnx_paths, inputs, refs, mac_ratio, args) -> List[dict]:
    """One runtime on one pair at every batch size: load, check, time; the records (one per batch size)."""
    records = []
    loaded = {role: runtime.load(models[role], onnx_paths.get(role)) for role in models}
    for b, x in inputs.items():
        record = dict(pair=pair.label, deployed=pair.deployed, vanilla=pair.vanilla, batch=b, runtime=runtime.name,
                      mac_ratio=mac_ratio)
        try:
            calls, first_call_s = {}, {}
            for role in models:
                calls[role] = loaded[role].bind(x)
                t0 = time.perf_counter()
                out = calls[role]()
                first_call_s[role] = time.perf_counter() - t0
                record[f'{role}_check'] = check(runtime.label, role, out, refs[b][role], args.check_tol)
            medians = ratio_runs(calls, args)
        except Exception as e:  # a runtime that fails or is wrong here is reported as such; the others go on
            record.update(status='wrong' if isinstance(e, WrongOutput) else 'failed', error=f'{type(e).__name__}: {e}')
            print(f'  {runtime.label}, batch {b}: {record["status"].upper()}: {record["error"]}')
            records.append(record)
            continue
        ratios = [d / v for d, v in zip(medians['deployed'], medians['vanilla'])]
        record.update(status='ok', first_call_s=first_call_s, deployed_ms=statistics.median(medians['deployed']),
                      vanilla_ms=statistics.median(medians['vanilla']), run_medians_ms=medians, ratios=ratios,
                      ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
        judge(record, pair)
        runs = ', '.join(f'{r:.3f}' for r in ratios)
        print(f'  {runtime.label}, batch {b}: deployed {record["deployed_ms"]:.2f} ms, vanilla '
              f'{record["vanilla_ms"]:.2f} ms, ratio {record["ratio"]:.3f}x (runs {runs});'
              f' max abs error {record["deployed_check"]["max_abs_error"]:.2g} / '
              f'{record["vanilla_check"]["max_abs_error"]:.2g}; first call {first_call_s["deployed"]:.1f} / '
              f'{first_call_s["vanilla"]:.1f} s; load average {load_average()}')
        records.append(record)
    return records


def profile_ort(runtime, pair: Pair, onnx_paths, inputs, args, records: List[dict]) -> None:
    """Per-op profiles of both models at each batch size from sessions of their own, into ``--ort-profile``."""
    stem = _file_stem(pair)
    for b, x in inputs.items():
        record = next(r for r in records if r['batch'] == b)
        record['ort_profile'] = {}
        for role, path in onnx_paths.items():
            loaded = runtime.load(None, path, profile_prefix=args.ort_profile / f'{stem}_{role}_b{b}')
            call = loaded.bind(x)
            for _ in range(args.warmup + args.rounds):
                call()
            profile_file = Path(loaded.session.end_profiling())
            summary = op_profile(profile_file, skip_runs=args.warmup)
            record['ort_profile'][role] = dict(file=str(profile_file), **summary)
            print_profile(f'{pair.label}, {role} ({getattr(pair, role)}), batch {b}', summary, profile_file,
                          args.profile_top)
        runtime.close()


def _file_stem(pair: Pair) -> str:
    return re.sub(r'[^A-Za-z0-9_.-]+', '_', pair.deployed + '__' + pair.vanilla)


def failed_records(pair: Pair, runtime: str, batch_sizes, mac_ratio: float, error: Exception) -> List[dict]:
    return [dict(pair=pair.label, deployed=pair.deployed, vanilla=pair.vanilla, batch=b, runtime=runtime,
                 mac_ratio=mac_ratio, status='failed', error=f'{type(error).__name__}: {error}') for b in batch_sizes]


def export_pair(pair: Pair, models, size, onnx_dir: Path) -> Dict[str, Path]:
    paths = {}
    for role, model in models.items():
        t0 = time.perf_counter()
        paths[role] = export_onnx(model, onnx_dir / f'{_file_stem(pair)}_{role}.onnx', size)
        print(f'  exported {role} to ONNX in {time.perf_counter() - t0:.1f} s: {paths[role]}')
    return paths


def run_pair(pair: Pair, runtimes: Dict[str, type], onnx_dir: Path, args) -> List[dict]:
    print(f'\n{pair.label}: {pair.deployed} (deployed) against {pair.vanilla}')
    models = {'deployed': build(pair.deployed, args.seed, True, args.model_kwargs),
              'vanilla': build(pair.vanilla, args.seed, False, args.model_kwargs)}
    size = input_size_of(models['vanilla'])
    if input_size_of(models['deployed']) != size:
        raise SystemExit(f'{pair.label}: the models take different inputs ({input_size_of(models["deployed"])} '
                         f'and {size}); pair models of the same input size')
    macs = {role: count_macs(m, size).total for role, m in models.items()}
    mac_ratio = macs['deployed'] / macs['vanilla']
    print(f'  MACs per image: deployed {macs["deployed"] / 1e9:.3f} G, vanilla {macs["vanilla"] / 1e9:.3f} G, '
          f'ratio {mac_ratio:.3f}x; input {size}')
    onnx_paths, export_error = {}, None
    if any(r.needs_onnx for r in runtimes.values()):
        try:
            onnx_paths = export_pair(pair, models, size, onnx_dir)
        except Exception as e:  # the ONNX runtimes of this pair are reported failed; the others go on
            export_error = e
            print(f'  ONNX export FAILED: {type(e).__name__}: {e}')
    gen = torch.Generator().manual_seed(args.seed)
    inputs = {b: torch.randn(b, *size, generator=gen) for b in args.batch_sizes}
    with torch.inference_mode():
        refs = {b: {role: m(x).float().clone() for role, m in models.items()} for b, x in inputs.items()}
    records = []
    for name, runtime_class in runtimes.items():
        if runtime_class.needs_onnx and export_error is not None:
            records += failed_records(pair, name, inputs, mac_ratio, export_error)
            continue
        runtime = make_runtime(name, args)
        try:
            with torch.inference_mode():
                records += run_runtime(runtime, pair, models, onnx_paths, inputs, refs, mac_ratio, args)
        except Exception as e:  # loading failed: every batch size of this runtime is reported failed
            print(f'  {runtime.label}: FAILED to load: {type(e).__name__}: {e}')
            records += failed_records(pair, name, inputs, mac_ratio, e)
            continue
        finally:
            runtime.close()
        if name == 'onnxruntime' and args.ort_profile is not None:
            try:
                profile_ort(runtime, pair, onnx_paths, inputs, args, [r for r in records if r['runtime'] == name])
            except Exception as e:  # the timings stand; say why there is no profile
                print(f'  ONNX Runtime profile FAILED: {type(e).__name__}: {e}')
    if args.ort_profile is None:  # the files are kept beside the profiles only
        for path in onnx_paths.values():
            for f in (path, path.with_name(path.name + '.data')):
                f.unlink(missing_ok=True)
    return records


def header(args, runtimes) -> Dict[str, object]:
    info = machine()
    info.update(threads=args.threads, model_kwargs=args.model_kwargs, runtimes=list(runtimes),
                compile_mode=args.compile_mode, inductor_freezing=args.inductor_freezing,
                ort_spinning=args.ort_spinning, batch_sizes=args.batch_sizes, runs=args.runs,
                rounds=args.rounds, warmup=args.warmup, seed=args.seed, check_tol=args.check_tol,
                load_average=load_average())
    versions = ', '.join(f'{k} {v}' for k, v in info['versions'].items() if v)
    isa = ' '.join(info['isa']) or 'none of ' + ', '.join(ISA_FLAGS)
    print(f'{info["cpu"]} ({info["cpu_id"]}); ISA {isa}; '
          f'torch CPU capability {info["torch_cpu_capability"]}; {info["logical_cpus"]} logical CPUs, '
          f'load average {info["load_average"]}')
    print(f'{args.threads} intra-op thread(s) in every runtime; fp32 (torch float32 matmul precision '
          f'{info["float32_matmul_precision"]}), inference mode; random weights (seed '
          f'{args.seed}: latency does not depend on their values); Python {info["python"]}, {versions}')
    built = f'; models built with {args.model_kwargs}' if args.model_kwargs else ''
    print(f'batch sizes {args.batch_sizes}{built}; {args.runs} run(s) of {args.warmup} warm-up + {args.rounds} timed '
          f'rounds; ratio = deployed ms / vanilla ms (latency; throughput ratio = its inverse)')
    print(f'torch.compile mode {args.compile_mode}{" with inductor freezing" * args.inductor_freezing}; ONNX Runtime '
          f'spinning {args.ort_spinning}; outputs checked against eager PyTorch to {args.check_tol:g} x their scale')
    return info


def main(argv=None):
    args = parse_args(argv)
    runtimes = open_runtimes(args)
    with fixed_threads(args.threads):
        info = header(args, runtimes)
        records = []
        with tempfile.TemporaryDirectory() as tmp:
            onnx_dir = args.ort_profile or Path(tmp)
            onnx_dir.mkdir(parents=True, exist_ok=True)
            for pair in args.pairs:
                records += run_pair(pair, runtimes, onnx_dir, args)
    table = markdown(records, [RUNTIMES[n] for n in runtimes], args.pairs, args.batch_sizes, args.targets)
    print('\n' + table)
    if args.targets:
        print('\n'.join(verdict_lines(records)))
    if args.out is not None:
        for path in write_outputs(args.out, info, records, table):
            print(f'wrote {path}')
    return records


if __name__ == '__main__':
    main()
