"""`vitblocks train --model NAME --data PATH|NAME [--config RECIPE] [KEY=VALUE ...]`."""
import os
import sys
from pathlib import Path

from ..data import DataError, resolve_data_path
from ..experiments import (CheckpointError, ConfigError, LostProcess, TrainingDiverged, TrainingInterrupted,
                           list_recipes, load_config, load_recipe, merge, parse_overrides, train)
from ..experiments.config import RESUME_CHANGEABLE, RESUME_ON_REQUEST
from ..experiments.distributed import launched_rank
from ..experiments.engine import default_run_name, new_run_folder_problem
from ..deploy.io import is_deployed_file
from .common import CliError, check_writable_dir, positive_int, refuse_disagreeing_flags, refuse_exported_file

NAME = 'train'

EPILOG = """\
examples:
  vitblocks train --model vit_tiny_patch16_224 --data /path/to/mnist --config ninformer --epochs 1 \\
      model_kwargs='{img_size: 28, patch_size: 4, in_chans: 1}'
  vitblocks train --model iffn_deit_tiny_patch16_224 --data /path/to/imagenet --config deit
  vitblocks train --resume runs/vit_tiny_patch16_224-mnist-ninformer          # after a crash or kill
  vitblocks train --model vit_tiny_patch16_224 --data /path/to/cifar10 --config ninformer \\
      --initial-checkpoint runs/pretrained/best.pth --num-classes 10               # fine-tune
  torchrun --nproc_per_node 2 $(which vitblocks) train --model ... --data ... --config ninformer

--data is a folder of WebDataset shards (.tar/.tar.gz), a shard pattern, a torchvision
CIFAR/MNIST folder, an ImageNet train/val folder or any ImageFolder tree, or a dataset NAME
looked up under $VITBLOCKS_DATA; the run stores its absolute path. KEY=VALUE pairs (anywhere
on the line) override any config key (YAML values; see vitblocks/experiments/config.py). The
run folder (--output/--name) receives config.yaml, last.pth / best.pth (atomic, with a digest
of their tensors checked on load), metrics.csv, results.json and tensorboard/. Ctrl-C or
SIGTERM saves last.pth and prints the resume command. On --resume, --data may name the same
dataset at a new place (its classes and split sizes must match the checkpoint's).
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='train a model on a dataset with a recipe (resumable, DDP via torchrun)',
                              description='Train a timm or vitblocks model. Recipes: ' + ', '.join(list_recipes()),
                              epilog=EPILOG)
    p.add_argument('--model', help='timm or vitblocks model name')
    p.add_argument('--data', help='dataset path or name (see below)')
    p.add_argument('--config', metavar='RECIPE', help=f'recipe name ({", ".join(list_recipes())}) or YAML file')
    p.add_argument('--epochs', type=positive_int)
    p.add_argument('--batch-size', type=positive_int, help='per process')
    p.add_argument('--lr', type=float, help='peak learning rate (default: the recipe\'s lr_base scaling)')
    p.add_argument('--max-steps', type=positive_int, help='stop after this many optimizer steps')
    p.add_argument('--train-subset', type=positive_int, metavar='N', help='train on a fixed random N images')
    p.add_argument('--device', help="'cpu', 'cuda', 'cuda:1' (default: cuda if available)")
    p.add_argument('--threads', type=positive_int, help='torch CPU threads')
    p.add_argument('--workers', type=int, help='DataLoader worker processes (PIL pipeline)')
    p.add_argument('--seed', type=int)
    p.add_argument('--output', help='parent folder of run folders (default runs)')
    p.add_argument('--name', help='run folder name (default <model>-<data>-<recipe>)')
    p.add_argument('--compile', action='store_true', default=None, help='torch.compile the model')
    p.add_argument('--no-amp', dest='amp', action='store_false', default=None, help='no autocast on CUDA')
    p.add_argument('--resume', metavar='RUN', help='continue the run in this folder (or from this last.pth)')
    p.add_argument('--change', nargs='+', metavar='KEY=VALUE', default=[],
                   help=f'with --resume: continue with other optimisation settings '
                        f'({", ".join(sorted(RESUME_ON_REQUEST))}), e.g. after a divergence --change lr=5e-4 '
                        f'clip_grad=1.0; recorded in the run\'s changes.jsonl')
    p.add_argument('--initial-checkpoint', metavar='PATH',
                   help='start from these weights (a run\'s .pth, timm .pth, .safetensors); a classifier of another '
                        'size is re-initialized')
    p.add_argument('--num-classes', type=positive_int, help='classifier outputs (default: the dataset\'s)')
    p.add_argument('overrides', nargs='*', metavar='KEY=VALUE', help='config overrides, e.g. lr=5e-4 hflip=0')
    p.set_defaults(run=run)


def _flag_overrides(args) -> dict:
    out = {}
    for flag, key in (('model', 'model'), ('data', 'data'), ('epochs', 'epochs'), ('batch_size', 'batch_size'),
                      ('lr', 'lr'), ('max_steps', 'max_steps'), ('train_subset', 'train_subset'), ('device', 'device'),
                      ('threads', 'threads'), ('workers', 'workers'), ('seed', 'seed'), ('output', 'output'),
                      ('name', 'name'), ('compile', 'compile'), ('amp', 'amp'),
                      ('initial_checkpoint', 'initial_checkpoint'), ('num_classes', 'num_classes')):
        value = getattr(args, flag)
        if value is not None:
            out[key] = value
    return out


def _flag_shown(key: str, value) -> str:
    """The flag that set config ``key``, as typed (``--no-amp``, ``--epochs 3``)."""
    return {'amp': '--no-amp', 'compile': '--compile'}.get(key, f'--{key.replace("_", "-")} {value}')


def build_config(args):
    """(config, resume checkpoint or None, the keys --change asks to change) from the command line."""
    keys = [item.partition('=')[0].strip() for item in args.overrides or ()]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:  # the last would win silently
        given_twice = ', '.join(item for item in args.overrides if item.partition('=')[0].strip() in twice)
        raise CliError(f'{", ".join(twice)} given more than once ({given_twice}); give each key once')
    given, flags = parse_overrides(args.overrides), _flag_overrides(args)
    refuse_disagreeing_flags(flags, given, _flag_shown)
    overrides = {**given, **flags}
    if overrides.get('data'):  # the run must find its data from any working directory (--resume elsewhere)
        overrides['data'] = os.path.abspath(resolve_data_path(str(overrides['data'])))
    if overrides.get('initial_checkpoint'):
        overrides['initial_checkpoint'] = os.path.abspath(overrides['initial_checkpoint'])
    if args.resume:
        run = Path(args.resume)
        run_dir = run.parent if run.is_file() else run
        ckpt = run if run.is_file() else run / 'last.pth'
        if not (run_dir / 'config.yaml').is_file():
            raise CliError(f'--resume {args.resume}: no config.yaml there; point to a vitblocks run folder')
        saved = load_config(run_dir / 'config.yaml')
        placed = sorted(k for k in ('output', 'name', 'initial_checkpoint') if k in overrides)
        if placed:
            raise CliError(f'--resume {args.resume} continues that folder from its own weights; drop '
                           f'{", ".join("--" + k.replace("_", "-") for k in placed)}')
        # data may move: the trainer checks the new path holds the same dataset (classes, split sizes)
        changed = sorted(k for k, v in overrides.items()
                         if k not in RESUME_CHANGEABLE | {'data'} and getattr(saved, k) != v)
        if changed:
            on_request = [k for k in changed if k in RESUME_ON_REQUEST]
            hint = (f'; to continue with another {", ".join(on_request)}, say so: --change '
                    f'{" ".join(f"{k}={overrides[k]}" for k in on_request)}') if on_request else ''
            raise CliError(f'--resume keeps the run\'s config; cannot change {", ".join(changed)} (only '
                           f'{", ".join(sorted(RESUME_CHANGEABLE))}){hint}; or start a new run')
        if args.config:
            raise CliError('--resume takes the recipe from the run folder; drop --config')
        changes = parse_overrides(args.change)
        asked = sorted(set(changes) - RESUME_ON_REQUEST)
        if asked:
            raise CliError(f'--change {", ".join(asked)}: a resume can be asked to change '
                           f'{", ".join(sorted(RESUME_ON_REQUEST))} only; start a new run for the rest')
        return merge(saved.to_dict(), overrides, changes), ckpt, sorted(changes)
    if args.change:
        raise CliError('--change changes the settings of a run being resumed; give --resume RUN, or set them as '
                       'KEY=VALUE for a new run')
    if not args.model or not args.data:
        raise CliError('--model and --data are required (or --resume RUN)')
    recipe = load_recipe(args.config) if args.config else {}
    cfg = merge(recipe, overrides)
    if cfg.initial_checkpoint:
        check_initial_checkpoint(cfg.initial_checkpoint)
    check_writable_dir(Path(cfg.output), '--output')  # before the data is decoded, not after
    problem = new_run_folder_problem(Path(cfg.output) / (cfg.name or default_run_name(cfg)))
    if problem:  # the same check the trainer makes, before the long work
        raise CliError(problem)
    return cfg, None, []


def check_initial_checkpoint(path: str) -> None:
    """Refuse, before the data is read, initial weights that are not a training form: an exported program or a
    deployed file (its blocks folded: BatchNorms into the weights, RePa into smaller matrices)."""
    refuse_exported_file(path, '--initial-checkpoint', 'fine-tuning starts from weights of the training form: '
                         'give a run checkpoint (last.pth/best.pth) or a timm .pth/.safetensors')
    if is_deployed_file(path):
        raise CliError(f'--initial-checkpoint {path} is a deployed file (vitblocks.deploy.io.save_deployed): its '
                       f'blocks are folded for inference and do not fit the training form; fine-tune from the run '
                       f'checkpoint (last.pth/best.pth) or the training-form weights it was deployed from')


def run(args) -> int:
    try:
        cfg, resume, changed = build_config(args)
        result = train(cfg, resume=resume, changed=changed)
    except (ConfigError, DataError, CheckpointError) as e:
        raise CliError(str(e)) from None
    except (TrainingDiverged, LostProcess) as e:
        print(f'vitblocks train: stopped: {e}', file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        print(f'vitblocks train: stopped by {e}', file=sys.stderr)
        return 130
    if launched_rank() != 0:  # under torchrun: one summary per run, from rank 0
        return 0
    f = result.final
    print(f'run      {result.run_dir}')
    print(f'trained  {result.global_step} steps ({result.epochs_done:.2f} epochs) in {result.seconds:.0f} s')
    if f is not None:
        print(f'final    top-1 {f.top1:.2f}%  top-5 {f.top5:.2f}%  loss {f.loss:.4f}  on {f.num_images} images')
    if result.final_ema is not None:
        print(f'EMA      top-1 {result.final_ema.top1:.2f}%  top-5 {result.final_ema.top5:.2f}%')
    print(f'best     top-1 {result.best_top1:.2f}%  ({result.run_dir / "best.pth"})')
    return 0
