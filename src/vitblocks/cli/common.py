"""Shared CLI helpers: errors, the argument parser, building models by name, aligned tables
(``render_table``, from :mod:`vitblocks.text_tables`)."""
import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import timm
import yaml
from torch import nn

from ..experiments import CheckpointError, ConfigError, load_model_weights, merge
from ..experiments.checkpoint import FORMAT as RUN_FORMAT, missing_checkpoint, read_checkpoint
from ..experiments.schema import yaml_load
from ..experiments.setup import create_model
from ..models import get_variant, list_models, resolve_model_name, swap_ffn
from ..text_tables import render_table

__all__ = ['CliError', 'ArgumentParser', 'resolve', 'is_vitblocks_model', 'build_model', 'describe_model',
           'format_cfg', 'parse_block_cfg', 'positive_int', 'positive_float', 'non_negative_int', 'render_table',
           'progress', 'end_progress', 'check_writable_dir', 'check_writable_file', 'add_model_size_args',
           'model_size_kwargs', 'load_trained_model', 'refuse_disagreeing_flags', 'non_negative_float',
           'exported_file_kind', 'refuse_exported_file']


class CliError(Exception):
    """A user error: printed as one line on stderr, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (``vitblocks bench: error: ... (see --help)``), exit code 2."""

    def error(self, message: str):
        self.exit(2, f'{self.prog}: error: {message} (see `{self.prog} --help`)\n')


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f'expected an integer >= {low}, got {text!r}')
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float('inf'):
        raise argparse.ArgumentTypeError(f'expected a number > 0, got {text!r}')
    return value


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (NaN, infinities and negative numbers are refused)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < float('inf'):
        raise argparse.ArgumentTypeError(f'expected a finite number >= 0, got {text!r}')
    return value


# files `vitblocks export` writes that hold a traced program, not weights to build a model for
EXPORTED_KINDS = {'.pt2': 'a torch.export program (.pt2)', '.onnx': 'an ONNX model (.onnx)'}


def exported_file_kind(path) -> Optional[str]:
    """What an exported program file is (by its suffix), or None for anything else."""
    return EXPORTED_KINDS.get(Path(path).suffix.lower())


def refuse_exported_file(path, flag: str, instead: str) -> None:
    """A CliError when ``path`` is an exported program (.pt2 / .onnx): it holds a traced graph, not weights."""
    kind = exported_file_kind(path)
    if kind:
        raise CliError(f'{flag} {path} is {kind}, a traced graph written by `vitblocks export`, not a checkpoint; '
                       f'{instead}')


def resolve(name: str) -> str:
    """The model name if timm or vitblocks knows it, else a CliError with a did-you-mean hint."""
    try:
        return resolve_model_name(name)
    except ValueError as e:
        raise CliError(str(e)) from None


def is_vitblocks_model(name: str) -> bool:
    return name.split('.')[0] in list_models()


def parse_block_cfg(items: Optional[Sequence[str]], flag: str = '--block-cfg') -> Dict[str, Any]:
    """``['kernel_size=7', 'spatial_part=false']`` -> ``{'kernel_size': 7, 'spatial_part': False}`` (YAML values).
    ``flag``: the option the items came from, named in the errors (``--model-args`` parses the same way)."""
    cfg: Dict[str, Any] = {}
    example = 'kernel_size=7' if flag == '--block-cfg' else 'num_classes=100'
    for item in items or ():
        key, sep, value = item.partition('=')
        if not sep or not key:
            raise CliError(f'{flag} expects KEY=VALUE, got {item!r} (e.g. {flag} {example})')
        try:
            cfg[key.strip()] = yaml_load(value)
        except yaml.YAMLError:
            raise CliError(f'{flag} {item}: cannot parse the value {value!r} (YAML)') from None
    return cfg


def add_model_size_args(p) -> None:
    """--num-classes / --img-size for commands that build a model from its name."""
    p.add_argument('--num-classes', type=positive_int, metavar='N', help='classifier outputs (default: the model\'s)')
    p.add_argument('--img-size', nargs='+', type=positive_int, metavar='PX',
                   help='build the model for this image size: one value (square) or H W')


def model_size_kwargs(args) -> Dict[str, Any]:
    """timm.create_model kwargs from --num-classes / --img-size."""
    out: Dict[str, Any] = {}
    if args.num_classes is not None:
        out['num_classes'] = args.num_classes
    if args.img_size:
        if len(args.img_size) > 2:
            raise CliError(f'--img-size takes one value (square) or two (H W), got {len(args.img_size)}')
        out['img_size'] = args.img_size[0] if len(args.img_size) == 1 else tuple(args.img_size)
    return out


def check_writable_dir(path: Path, what: str, shown: Optional[Path] = None) -> None:
    """Fail now, with one line, if ``path`` (a folder, created later if missing) cannot be written.
    ``shown``: the path the user gave, for the message (default ``path``)."""
    path = Path(path)
    shown = shown or path
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise CliError(f'{what} {shown}: {probe} is a file, not a folder')
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise CliError(f'{what} {shown}: cannot write into {probe} ({e.strerror or e}); pick another place') from None


def refuse_disagreeing_flags(flags: dict, given: dict, shown) -> None:
    """Refuse config keys set both by a flag (``flags``) and by KEY=VALUE (``given``) to different values: the
    flag would silently win. ``shown(key, value)`` spells the flag as typed (``--epochs 3``)."""
    clash = sorted(k for k in set(given) & set(flags) if given[k] != flags[k])  # both typed (schema, argparse)
    if clash:
        raise CliError('; '.join(f'{shown(k, flags[k])} and {k}={given[k]} disagree' for k in clash)
                       + '; give one of them')


def check_writable_file(path: Path, what: str) -> None:
    """Fail now if the file ``path`` cannot be written later (checked without touching it)."""
    path = Path(path)
    if path.is_dir():
        raise CliError(f'{what} {path}: is a folder; give a file name')
    check_writable_dir(path.parent, what, shown=path)


def format_cfg(cfg: Dict[str, Any]) -> str:
    return ' '.join(f'{k}={v}' for k, v in cfg.items())


def build_model(name: str, block_cfg: Optional[Dict[str, Any]] = None, base_kwargs: Optional[Dict[str, Any]] = None,
                ffn: Optional[str] = None) -> nn.Module:
    """Build a model the way a paper row or the command line describes it (random init, CPU).

    ``ffn``: swap that registered FFN into the model with ``block_cfg`` as its config;
    otherwise ``block_cfg`` overrides a vitblocks model's block config.
    """
    name = resolve(name)
    block_cfg, base_kwargs = dict(block_cfg or {}), dict(base_kwargs or {})
    if block_cfg and not ffn and not is_vitblocks_model(name):
        raise CliError(f'a block config applies to vitblocks models only; {name} is a timm model '
                       f'(vitblocks models: `vitblocks list`)')
    what = f'{name}' + (f' with {ffn}' if ffn else '') + (f' ({format_cfg(block_cfg)})' if block_cfg else '')
    try:
        if ffn:
            model = timm.create_model(name, **base_kwargs)
            swap_ffn(model, ffn, **block_cfg)
        elif block_cfg:
            model = timm.create_model(name, block_cfg=block_cfg, **base_kwargs)
        else:
            model = timm.create_model(name, **base_kwargs)
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise CliError(f'cannot build {what}: {type(e).__name__}: {e}') from None
    return model.eval()


def load_trained_model(name: str, path: Path, block_cfg: Optional[Dict[str, Any]] = None,
                       base_kwargs: Optional[Dict[str, Any]] = None,
                       overrides: str = '--block-cfg / --num-classes / --img-size') -> Tuple[nn.Module, Dict[str, Any]]:
    """``(model in eval mode with the trained weights of path, run metadata or {})``.

    A vitblocks run checkpoint (``last.pth`` / ``best.pth``) rebuilds its model as it was trained
    (config, classes; the metadata also carries the input size and normalization), so
    ``block_cfg`` / ``base_kwargs`` must be empty; any other checkpoint (``.safetensors``, a timm
    ``.pth``, a bare state dict) is loaded into ``name`` built with them. ``overrides``: the
    command's flags for those, named in the errors.
    """
    path = Path(path)
    if path.is_dir():
        raise CliError(f'--checkpoint {missing_checkpoint(path)}')
    if not path.is_file():
        raise CliError(f'--checkpoint {path}: no such file')
    try:
        raw = read_checkpoint(path) if path.suffix != '.safetensors' else None
        meta = raw if isinstance(raw, dict) and raw.get('format') == RUN_FORMAT else {}
        if meta:
            cfg = merge(meta['config'])
            if resolve(cfg.model) != name:
                raise CliError(f'{path} was trained as {cfg.model}, not {name}; name that model')
            if block_cfg or base_kwargs:
                raise CliError(f'{path} is a vitblocks run checkpoint: it rebuilds its model as trained; drop '
                               f'{overrides}')
            model, state = create_model(cfg, meta['num_classes']), meta['model']
        else:
            model, state = build_model(name, block_cfg, base_kwargs), load_model_weights(path)
        model.load_state_dict(state)
    except (CheckpointError, ConfigError) as e:
        raise CliError(str(e)) from None
    except RuntimeError as e:  # missing / unexpected keys, shape mismatch
        raise CliError(f'cannot load {path} into {name}: {" ".join(str(e).split())[:200]}; check {overrides}') \
            from None
    return model.eval(), meta


def describe_model(name: str, block_cfg: Optional[Dict[str, Any]] = None) -> str:
    """One line saying what ``name`` is: a timm model, or which vitblocks variant of which base."""
    base = name.split('.')[0]
    if not is_vitblocks_model(base):
        return f'timm model {name}'
    spec = get_variant(base)
    cfg = {**spec.cfg, **(block_cfg or {})}
    return f'vitblocks {spec.method} variant of timm {spec.base}; block config: {format_cfg(cfg) or "default"}'


def progress(message: str) -> None:
    """A transient progress line on an interactive stderr (nothing when redirected)."""
    if sys.stderr.isatty():
        sys.stderr.write(f'\r\033[K{message}')
        sys.stderr.flush()


def end_progress() -> None:
    if sys.stderr.isatty():
        sys.stderr.write('\r\033[K')
        sys.stderr.flush()
