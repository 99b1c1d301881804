"""The ``vitblocks`` command line: ``vitblocks <command> --help`` for each command.

Each command is one module with ``add_parser(subparsers)`` and ``run(args) -> exit code``.
User errors (unknown model, paper, table, bad argument) print one line on stderr and exit 2.
"""
import argparse
import os
import sys
import textwrap
from typing import List, Optional

from . import analyze, bench, compare, convert, export, glue, list_models, plot, profile_model, reproduce, train
from . import eval as eval_cmd  # module is eval.py; keeps the builtin unshadowed
from ..experiments.distributed import shutdown
from .common import ArgumentParser, CliError

__all__ = ['main', 'build_parser']

COMMANDS = (compare, profile_model, bench, list_models, train, eval_cmd, plot, reproduce, analyze, export, convert,
            glue)

EPILOG = """\
examples:
  vitblocks compare                      # ours vs the papers' published params/GMACs
  vitblocks profile iffn_deit_tiny_patch16_224
  vitblocks bench iffn_deit_tiny_patch16_224 --baseline deit_tiny_patch16_224
  vitblocks list --params
  vitblocks train --model ninformer_vit_patch4_32 --data /path/to/cifar10 --config ninformer
  vitblocks eval --checkpoint runs/RUN/best.pth --data /path/to/cifar10
  vitblocks reproduce ninformer-table1 --datasets mnist --max-steps 60 --test-subset 2000
  vitblocks analyze collapse deit_small_patch16_224
  vitblocks glue cola --data glue_data/CoLA --model path/to/bert-base-uncased
  vitblocks convert RePaViT_Base.pth repavit_base.safetensors --model repa_prenorm_deit_base_patch16_224
"""


def build_parser() -> ArgumentParser:
    from .. import __version__
    parser = ArgumentParser(prog='vitblocks', description='Vision-transformer blocks for timm: compare with the '
                            'papers, profile, benchmark.', epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--version', action='version', version=f'vitblocks {__version__}')
    sub = parser.add_subparsers(dest='command', metavar='COMMAND', required=True)
    for cmd in COMMANDS:
        cmd.add_parser(_Subparsers(sub))
    return parser


class _Subparsers:
    """Gives every subcommand the raw-description help formatter (epilog examples keep their lines)."""

    def __init__(self, sub):
        self._sub = sub

    def add_parser(self, name, **kwargs):
        kwargs.setdefault('formatter_class', argparse.RawDescriptionHelpFormatter)
        if 'description' in kwargs:  # the raw formatter does not wrap it
            kwargs['description'] = textwrap.fill(kwargs['description'], 90)
        return self._sub.add_parser(name, **kwargs)


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``vitblocks`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        # KEY=VALUE overrides may come anywhere, also after a flag (`--epochs 1 lr=5e-4 --threads 2`)
        stray = [a for a in extra if a.startswith('-') or '=' not in a or not hasattr(args, 'overrides')]
        if stray:
            parser.error(f'unrecognized arguments: {" ".join(stray)}')
        if extra:
            args.overrides = list(args.overrides or []) + extra
    except SystemExit as e:  # --help / --version (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 0
    try:
        return args.run(args)
    except CliError as e:
        message = ' '.join(line.strip() for line in str(e).splitlines())  # always one line
        print(f'vitblocks {args.command}: error: {message}', file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f'vitblocks {args.command}: interrupted', file=sys.stderr)
        return 130
    except BrokenPipeError:  # `vitblocks eval ... | head`: the reader left; say nothing more
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        except OSError:
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe
    finally:
        shutdown()  # a torchrun process's group, before the interpreter tears down gloo's threads (distributed.py)
