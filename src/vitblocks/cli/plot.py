"""`vitblocks plot RUN [RUN ...]`: curves per run, and accuracy vs GMACs / latency across runs (PNG)."""
from pathlib import Path

import torch

from ..experiments import ConfigError, load_config
from ..experiments.plots import TradeoffPoint, plot_curves, plot_tradeoff, run_summary
from ..experiments.setup import create_model, model_input_size
from ..profile import benchmark_models, count_macs, fixed_threads
from .common import CliError, check_writable_dir, positive_int

NAME = 'plot'

EPILOG = """\
examples:
  vitblocks plot runs/ninformer-table1/mnist/*                 # curves.png in each run + tradeoff.png
  vitblocks plot runs/a runs/b --output figs --latency-batch 64 --threads 1
  vitblocks plot runs/a --no-latency

Each run folder gets curves.png (accuracy and loss against epochs, from metrics.csv). With
finished runs (results.json), tradeoff.png plots final top-1 against GMACs per image (counted
at the run's input size) and against latency: wall-clock ms per batch of --latency-batch
images, inference mode, median of --repeats batches after warm-up, measured interleaved.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='plot training curves and accuracy vs GMACs / latency (PNG)',
                              description='Plot runs made by `vitblocks train` / `reproduce`.', epilog=EPILOG)
    p.add_argument('runs', nargs='+', help='run folders')
    p.add_argument('--output', help='folder for tradeoff.png (default: the first run\'s parent folder)')
    p.add_argument('--no-latency', action='store_true', help='skip the latency measurement')
    p.add_argument('--latency-batch', type=positive_int, help=f'images per timed batch (default {LATENCY_BATCH})')
    p.add_argument('--repeats', type=positive_int, help=f'timed batches per model (default {REPEATS})')
    p.add_argument('--threads', type=positive_int)
    p.add_argument('--device', help='device the latency is measured on (default cpu)')
    p.set_defaults(run=run)


LATENCY_BATCH, REPEATS = 32, 10
_LATENCY_OPTIONS = ('latency_batch', 'repeats', 'device')


def run(args) -> int:
    given = [f'--{k.replace("_", "-")}' for k in _LATENCY_OPTIONS if getattr(args, k) is not None]
    if args.no_latency and given:
        raise CliError(f'{", ".join(given)}: options of the latency measurement, which --no-latency skips; '
                       f'drop one or the other')
    args.latency_batch, args.repeats = args.latency_batch or LATENCY_BATCH, args.repeats or REPEATS
    args.device = args.device or 'cpu'
    dirs = [Path(r) for r in args.runs]
    for d in dirs:
        if not (d / 'metrics.csv').is_file():
            raise CliError(f'{d}: not a run folder (no metrics.csv)')
    if args.output:
        check_writable_dir(Path(args.output), '--output')  # before any model is built and timed
    try:
        for d in dirs:
            print(f'{plot_curves(d)}')
    except ImportError as e:  # matplotlib missing
        raise CliError(str(e)) from None
    except ValueError as e:  # an empty metrics.csv ('no rows yet'), or a hand-edited one
        raise CliError(str(e) if str(d) in str(e) else f'{d / "metrics.csv"}: cannot plot it ({e})') from None
    except KeyError as e:
        raise CliError(f'{d / "metrics.csv"}: no column {e}; not a vitblocks metrics file') from None
    except OSError as e:
        raise CliError(f'{d}: cannot write curves.png there ({e.strerror or e})') from None
    finished = [d for d in dirs if (d / 'results.json').is_file()]
    if not finished:
        print('no finished run (results.json): no tradeoff plot')
        return 0
    points, models, sizes = [], {}, {}
    with torch.no_grad(), fixed_threads(args.threads):
        for d in finished:
            try:
                cfg = load_config(d / 'config.yaml')
                summary = run_summary(d)
                model = create_model(cfg, len(summary['classes'])).eval()
            except (ConfigError, ValueError) as e:
                raise CliError(str(e)) from None
            size = model_input_size(model, cfg)
            label = d.name if len(set(x.name for x in finished)) == len(finished) else str(d)
            top1 = summary['final']['top1']
            points.append(TradeoffPoint(label, top1, count_macs(model, input_size=size).gmacs))
            models[label], sizes[label] = model, size
    note = ''
    if not args.no_latency:
        for p in points:  # one model per call: input sizes may differ
            res = benchmark_models({p.label: models[p.label]}, batch_size=args.latency_batch,
                                   input_size=sizes[p.label], repeats=args.repeats, num_threads=args.threads,
                                   device=args.device)
            p.latency_ms = res[p.label].median_ms
        note = f'batch {args.latency_batch}, {args.device}'
    out = Path(args.output) if args.output else finished[0].parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = plot_tradeoff(points, out / 'tradeoff.png', note)
    except OSError as e:
        raise CliError(f'{out}: cannot write tradeoff.png there ({e.strerror or e})') from None
    for p in points:
        lat = f', {p.latency_ms:.1f} ms/batch' if p.latency_ms is not None else ''
        print(f'  {p.label}: top-1 {p.top1:.2f}%, {p.gmacs:.4f} GMACs{lat}')
    print(path)
    return 0
