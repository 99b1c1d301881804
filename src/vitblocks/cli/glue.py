"""`vitblocks glue TASK --data DIR --model SRC [--ffn NAME ...]`: fine-tune a Hugging Face classifier on GLUE files."""
import os
import sys
from dataclasses import fields
from pathlib import Path

from ..experiments import CheckpointError, ConfigError, TrainingDiverged, TrainingInterrupted
from .common import CliError, check_writable_dir, parse_block_cfg, positive_float, positive_int

NAME = 'glue'

EPILOG = """\
examples:
  vitblocks glue cola --data glue_data/CoLA --model path/to/bert-base-uncased      # a local pretrained folder
  vitblocks glue rte --data glue_data/RTE --model path/to/bert-base-uncased --ffn repa --block-cfg idle_ratio=0.75
  vitblocks glue mnli --data glue_data/MNLI --model bert-tiny --train-tokenizer 8000 --epochs 1   # random init
  vitblocks glue qnli --data glue_data/QNLI --model bert-base --model-args num_hidden_layers=4 \\
      --tokenizer path/to/tokenizer.json
  vitblocks glue --resume runs/glue-cola-bert-base-uncased                           # after a crash or kill

--data is the task's folder in the GLUE layout: train.tsv and dev.tsv (MNLI: dev_matched.tsv and
dev_mismatched.tsv), as the GLUE distribution has them; the files are yours to bring, nothing is
downloaded. --model is a local Hugging Face folder (config.json and weights: fine-tunes them, with the
folder's tokenizer unless --tokenizer), a config.json alone, or a preset (bert-tiny, bert-base,
bert-large, openai-gpt, gpt2): random init, which needs --tokenizer or --train-tokenizer. The run
folder (--output/--name) receives config.yaml, tokenizer/, last.pth / best.pth, metrics.csv,
results.json and, at the end, model/ (from_pretrained loads it). CoLA is ranked by Matthews
correlation, the others by accuracy (the first dev file picks best.pth). Ctrl-C or SIGTERM saves
last.pth and prints the resume command; --resume may change the budget, device and logging only.
"""

# flag -> GlueConfig key, for the flags that set one value each
FLAGS = ('data', 'model', 'tokenizer', 'train_tokenizer', 'ffn', 'warm_start', 'epochs', 'batch_size',
         'eval_batch_size', 'lr', 'weight_decay', 'warmup_ratio', 'clip_grad', 'max_length', 'seed', 'max_steps',
         'max_examples', 'device', 'threads', 'log_interval', 'checkpoint_interval', 'progress')


def add_parser(subparsers) -> None:
    from ..glue.tasks import TASKS
    from ..glue.text_models import PRESETS
    p = subparsers.add_parser(NAME, help='fine-tune a Hugging Face model (vanilla or FFN-swapped) on GLUE TSV files',
                              description='Fine-tune a Hugging Face transformers sequence classifier on a GLUE task '
                                          f'({", ".join(t.upper() for t in TASKS)}) from its own TSV files, '
                                          'offline; resumable.', epilog=EPILOG)
    p.add_argument('task', nargs='?', choices=sorted(TASKS), metavar='TASK', help=f'one of {", ".join(TASKS)}')
    p.add_argument('--data', metavar='DIR', help='the task\'s folder of GLUE TSV files')
    p.add_argument('--model', metavar='SRC', help=f'local model folder, config.json, or preset ({", ".join(PRESETS)})')
    p.add_argument('--model-args', nargs='+', metavar='KEY=VALUE',
                   help='model config overrides, e.g. num_hidden_layers=2 hidden_dropout_prob=0.2')
    p.add_argument('--tokenizer', metavar='PATH', help='local tokenizer folder or tokenizer.json')
    p.add_argument('--train-tokenizer', type=positive_int, metavar='VOCAB_SIZE',
                   help='train a WordPiece tokenizer of this size on the task\'s training text (random-init models)')
    p.add_argument('--ffn', metavar='NAME', help='swap this vitblocks FFN into every layer (vitblocks.hf.swap_ffn)')
    p.add_argument('--block-cfg', nargs='+', metavar='KEY=VALUE',
                   help='the swapped FFN\'s config, e.g. kernel_size=3 (also swap_ffn\'s mlp_ratio, padding, '
                        'batch_norm)')
    p.add_argument('--warm-start', action='store_true', default=None,
                   help='the swapped blocks start from the pretrained dense FFN\'s weights (mlp, repa, swiglu)')
    p.add_argument('--epochs', type=positive_int, help='default 3')
    p.add_argument('--batch-size', type=positive_int, help='default 32')
    p.add_argument('--eval-batch-size', type=positive_int, help='default 64')
    p.add_argument('--lr', type=positive_float, help='peak learning rate (default 2e-5)')
    p.add_argument('--weight-decay', type=float, help='AdamW weight decay, not on biases and norms (default 0.01)')
    p.add_argument('--warmup-ratio', type=float, help='share of the steps of linear warm-up (default 0.1)')
    p.add_argument('--clip-grad', type=float, help='gradient norm clip, 0 for none (default 1.0)')
    p.add_argument('--max-length', type=positive_int, help='tokens per example, pair included (default 128)')
    p.add_argument('--seed', type=int, help='default 0')
    p.add_argument('--max-steps', type=positive_int, help='stop after this many steps (the schedule spans --epochs)')
    p.add_argument('--max-examples', type=positive_int, metavar='N', help='read the first N examples of each file')
    p.add_argument('--device', help="'cpu', 'cuda', 'cuda:1' (default: cuda if available)")
    p.add_argument('--threads', type=positive_int, help='torch CPU threads')
    p.add_argument('--log-interval', type=positive_int, help='a metrics row every N steps (default 50)')
    p.add_argument('--checkpoint-interval', type=int, help='also save last.pth every N steps (default 0: per epoch)')
    p.add_argument('--progress', choices=('auto', 'bar', 'log', 'none'), help='default auto (a bar on a terminal)')
    p.add_argument('--output', help='parent folder of run folders (default runs)')
    p.add_argument('--name', help='run folder name (default glue-<task>-<model>[-<ffn>])')
    p.add_argument('--resume', metavar='RUN', help='continue the run in this folder')
    p.set_defaults(run=run)


def _given(args) -> dict:
    out = {k: getattr(args, k) for k in FLAGS if getattr(args, k) is not None}
    for key in ('data', 'tokenizer'):
        if key in out:
            out[key] = os.path.abspath(out[key])
    if 'model' in out and os.path.exists(out['model']):  # a folder or file; a preset name stays a name
        out['model'] = os.path.abspath(out['model'])
    if args.model_args:
        out['model_args'] = parse_block_cfg(args.model_args, '--model-args')
    if args.block_cfg:
        out['block_cfg'] = parse_block_cfg(args.block_cfg)
    if args.task:
        out['task'] = args.task
    return out


def _flag(key: str) -> str:
    return 'TASK' if key == 'task' else '--' + key.replace('_', '-')


def build(args):
    """(config, run folder, whether it resumes) from the command line."""
    from ..glue.config import RESUME_CHANGEABLE, GlueConfig, load_glue_config
    given = _given(args)
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / 'config.yaml').is_file():
            raise CliError(f'--resume {args.resume}: no config.yaml there; point to a vitblocks glue run folder')
        if not (run_dir / 'last.pth').is_file():
            raise CliError(f'--resume {args.resume}: no last.pth there (the run stopped before its first checkpoint); '
                           f'start it anew with its first command (the folder takes a new run)')
        placed = [f for f in ('output', 'name') if getattr(args, f)]
        if placed:
            raise CliError(f'--resume {args.resume} continues that folder; drop {", ".join("--" + f for f in placed)}')
        saved = load_glue_config(run_dir / 'config.yaml')
        changed = sorted(k for k, v in given.items() if k not in RESUME_CHANGEABLE and getattr(saved, k) != v)
        if changed:
            raise CliError(f'--resume keeps the run\'s settings; cannot change {", ".join(map(_flag, changed))} (only '
                           f'{", ".join(map(_flag, sorted(RESUME_CHANGEABLE)))}); or start a new run')
        return GlueConfig(**{**saved.to_dict(), **given}), run_dir, True
    missing = [f for f in ('task', 'data', 'model') if f not in given]
    if missing:
        raise CliError(f'{", ".join(map(_flag, missing))} required (or --resume RUN)')
    known = {f.name for f in fields(GlueConfig)}
    cfg = GlueConfig(**{k: v for k, v in given.items() if k in known})
    output = Path(args.output or 'runs')
    check_writable_dir(output, '--output')
    name = args.name or '-'.join(['glue', cfg.task, Path(cfg.model).name] + ([cfg.ffn] if cfg.ffn else []))
    return cfg, output / name, False


def run(args) -> int:
    from ..glue.metrics import METRIC_NAMES
    from ..glue.tasks import GlueDataError
    from ..glue.text_models import GlueModelError
    try:
        from ..glue.finetune import fine_tune
        cfg, run_dir, resume = build(args)
        result = fine_tune(cfg, run_dir, resume=resume)
    except ImportError as e:
        raise CliError(f'vitblocks glue needs transformers and tokenizers (pip install vitblocks[hf]): {e}') from None
    except (ConfigError, GlueDataError, GlueModelError, CheckpointError) as e:
        raise CliError(str(e)) from None
    except TrainingDiverged as e:
        print(f'vitblocks glue: stopped: {e}', file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        print(f'vitblocks glue: stopped by {e}', file=sys.stderr)
        return 130
    name = METRIC_NAMES[result.metric]
    width = max(len(split) for split in ('trained', *result.final)) + 2

    def line(label: str, text: str) -> None:
        print(f'{label:<{width}}{text}')

    line('run', str(result.run_dir))
    line('trained', f'{result.global_step} steps ({result.epochs_done:.2f} epochs) in {result.seconds:.0f} s')
    for split, r in result.final.items():
        also = f'  accuracy {r["accuracy"]:.4f}' if result.metric != 'accuracy' else ''
        line(split, f'{name} {r[result.metric]:.4f}{also}  loss {r["loss"]:.4f}')
    line('best', f'{name} {result.best:.4f} at step {result.best_step} ({result.run_dir / "best.pth"})')
    line('model', f'{result.run_dir / "model"} (from_pretrained)')
    return 0
