"""The one schema of ``TrainConfig``: every key typed from its annotation, checked at load time.

A value's *type* comes from the dataclass annotation (``Optional[float]``, ``bool``,
``List[int]``, ...), so a new config key needs no entry here unless it has a range or a
fixed set of values; then it is one line in ``RULES``. Values are coerced the way a person
writes them: ``'5e-4'`` and ``1`` are numbers for a float key (PyYAML reads ``5e-4``
without a dot as a string, YAML 1.1), ``'false'`` / ``'no'`` are False for a bool key
(a non-empty string is otherwise truthy in Python, the silent bug this replaces).
"""
import difflib
import math
import re
import typing
from typing import Any, Callable, Dict, Sequence

import yaml

__all__ = ['SchemaError', 'coerce', 'RULES', 'CHOICES', 'yaml_load', 'check_auto_augment']


class SchemaError(ValueError):
    pass


# --- YAML: numbers as YAML 1.2 reads them ('1e-3' is a float, not a string) -------------------------
class _Loader(yaml.SafeLoader):
    pass


_FLOAT = re.compile(r'''^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$''', re.X)
_Loader.add_implicit_resolver('tag:yaml.org,2002:float', _FLOAT, list('-+0123456789.'))


def yaml_load(text: str) -> Any:
    """``yaml.safe_load`` that also reads ``5e-4`` / ``1e6`` as floats."""
    return yaml.load(text, Loader=_Loader)


# --- coercion from the annotation ------------------------------------------------------------------
_TRUE, _FALSE = {'true', 'yes', 'on', '1'}, {'false', 'no', 'off', '0'}


def _describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        return ' or '.join('null' if a is type(None) else _describe(a) for a in args)
    if origin in (list, Sequence):
        return f'a list of {_describe(args[0])}s'
    if origin is dict:
        return 'a mapping'
    if origin is typing.Literal:
        return 'one of ' + ', '.join(map(str, args))
    return {bool: 'true/false', int: 'an integer', float: 'a number', str: 'a string'}.get(tp, str(tp))


def _coerce_type(value: Any, tp) -> Any:
    """``value`` as type ``tp``, or raise TypeError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce_type(value, a)
            except TypeError:
                pass
        raise TypeError
    if tp is Any:
        return value
    if origin is typing.Literal:  # a key typed Literal['a', 'b'] needs no rule
        if value in args:
            return value
        raise TypeError
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise TypeError
        return [_coerce_type(v, args[0]) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise TypeError
    if tp is int:
        if isinstance(value, bool):
            raise TypeError
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r'\s*[-+]?\d+\s*', value):
            return int(value)
        raise TypeError
    if tp is float:
        if isinstance(value, bool):
            raise TypeError
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise TypeError from None
        raise TypeError
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # e.g. name=2024
            return str(value)
        raise TypeError
    raise TypeError


def _finite(value: Any) -> bool:
    """False for a float (or a list holding one) that is nan or +-inf; every float key wants a finite number."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def coerce(key: str, value: Any, tp) -> Any:
    try:
        value = _coerce_type(value, tp)
    except TypeError:
        raise SchemaError(f'{key}={value!r}: expected {_describe(tp)}') from None
    if not _finite(value):  # nan slips past every range rule (nan < 0 is False); inf is no learning rate either
        raise SchemaError(f'{key}={value!r}: expected ' + ('finite numbers' if isinstance(value, list) else
                                                            'a finite number'))
    rule = RULES.get(key)
    if rule is not None and value is not None:
        problem = rule(value)
        if problem:
            raise SchemaError(f'{key}={value!r}: expected {problem}')
    return value


# --- rules: a function returning what was expected, or '' when the value is fine ---------------------
def _at_least(low: float, strict: bool = False) -> Callable[[Any], str]:
    def check(v):
        bad = v <= low if strict else v < low
        return (f'a number > {low:g}' if strict else f'a number >= {low:g}') if bad else ''
    return check


def _between(low: float, high: float, high_open: bool = False) -> Callable[[Any], str]:
    def check(v):
        ok = low <= v < high if high_open else low <= v <= high
        return '' if ok else f'a number in [{low:g}, {high:g}{")" if high_open else "]"}'
    return check


def _one_of(choices: Sequence[str]) -> Callable[[Any], str]:
    def check(v):
        if v in choices:
            return ''
        close = difflib.get_close_matches(str(v), list(choices), n=3, cutoff=0.6)
        hint = f' (did you mean {", ".join(close)}?)' if close else ''
        return f'one of {", ".join(choices)}{hint}' if len(choices) <= 12 else \
            f'one of {len(choices)} names{hint or ", e.g. " + ", ".join(list(choices)[:6])}'
    return check


def _optimizer(v: str) -> str:
    from timm.optim import list_optimizers
    return _one_of(list_optimizers())(v.lower())


def _device(v: str) -> str:
    if v == 'auto':
        return ''
    import torch
    try:
        torch.device(v)
    except RuntimeError:
        return "'auto', 'cpu', 'cuda' or 'cuda:N'"
    return ''


def _list_len(n: int, item_rule: Callable[[Any], str]) -> Callable[[Any], str]:
    def check(v):
        if len(v) != n:
            return f'a list of {n} values'
        bad = [p for p in map(item_rule, v) if p]
        return f'a list of {n} values, each {bad[0]}' if bad else ''
    return check


def _positive_int(v) -> str:
    return '' if v >= 1 else 'a positive integer'


# timm's scheduler names (timm.scheduler.create_scheduler_v2), and 'none' for a constant lr
SCHEDULERS = ('cosine', 'tanh', 'step', 'multistep', 'plateau', 'poly', 'none')
CHOICES = {'compile_mode': ('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs'),
           'pipeline': ('auto', 'tensor', 'pil'), 'progress': ('auto', 'bar', 'log', 'none'),
           'amp_dtype': ('bfloat16', 'float16'), 'matmul_precision': ('highest', 'high'),
           'clip_mode': ('norm', 'value', 'agc'),
           'mixup_mode': ('batch', 'pair', 'elem'), 'sched': SCHEDULERS,
           'interpolation': ('bilinear', 'bicubic'),  # the two both pipelines implement
           'remode': ('const', 'rand', 'pixel'), 'dist_bn': ('reduce', 'broadcast', 'none')}

_NON_NEGATIVE = _at_least(0)
_PROBABILITY = _between(0, 1)
RULES: Dict[str, Callable[[Any], str]] = {
    **{k: _one_of(v) for k, v in CHOICES.items()},
    'opt': _optimizer, 'device': _device,
    'resume': lambda v: '' if v == 'auto' else ("'auto' (or null); to resume a given run use "
                                                 "vitblocks train --resume RUN"),
    **{k: _positive_int for k in ('epochs', 'batch_size', 'log_interval', 'eval_interval', 'lr_base_size',
                                  'max_steps', 'train_subset', 'val_subset', 'threads', 'num_classes', 'recount',
                                  'grad_accum', 'train_samples')},
    **{k: _NON_NEGATIVE for k in ('lr', 'lr_base', 'weight_decay', 'warmup_epochs', 'warmup_lr', 'min_lr',
                                  'clip_grad', 'mixup', 'cutmix', 'color_jitter', 'decay_epochs', 'momentum',
                                  'opt_eps')},
    **{k: (lambda v: '' if v >= 0 else 'an integer >= 0')
       for k in ('checkpoint_interval', 'workers', 'crop_padding', 'patience_epochs', 'checkpoint_hist')},
    **{k: _PROBABILITY for k in ('hflip', 'vflip', 'reprob', 'mixup_prob', 'mixup_switch_prob', 'decay_rate',
                                 'model_ema_decay')},
    **{k: _between(0, 1, high_open=True) for k in ('smoothing', 'drop_rate', 'drop_path_rate', 'mlp_drop')},
    **{k: (lambda v: '' if 0 < v <= 1 else 'a number in (0, 1]') for k in ('crop_pct', 'layer_decay')},
    'input_size': lambda v: '' if len(v) == 3 and v[0] in (1, 3) and min(v) >= 1 else '[C, H, W] with C = 1 or 3',
    'scale': _list_len(2, _PROBABILITY), 'ratio': _list_len(2, _at_least(0, strict=True)),
    'dist_timeout_min': _at_least(0, strict=True),
    'opt_betas': lambda v: _list_len(3 if len(v) == 3 else 2, _between(0, 1, high_open=True))(v),  # adan: 3
    'mean': lambda v: '' if not isinstance(v, str) or v in ('model', 'dataset')
    else "'model', 'dataset' or a list of per-channel values",
    'std': lambda v: '' if not isinstance(v, str) or v in ('model', 'dataset')
    else "'model', 'dataset' or a list of per-channel values",
}


# --- auto_augment: timm skips config sections it does not understand; we do not -------------------
_AA_KEYS = {'rand': ('mstd', 'mmax', 'inc', 'm', 'n', 'p'), 'augmix': ('mstd', 'm', 'w', 'd', 'a', 'b')}
_AA_POLICIES = ('original', 'originalr', 'v0', 'v0r', '3a')


def check_auto_augment(value: str, random_resized_crop: bool) -> str:
    """'' if timm reads ``value`` as written, else what was expected."""
    head, *sections = value.split('-')
    keys = _AA_KEYS.get(head, ('mstd',) if head in _AA_POLICIES else None)
    if keys is None:
        return f"'rand-...' (RandAugment), 'augmix-...' or an AutoAugment policy ({', '.join(_AA_POLICIES)})"
    pattern = re.compile(rf'({"|".join(keys)})[-+]?\d+(\.\d*)?')
    for s in sections:
        if not (pattern.fullmatch(s) or (head == 'rand' and s.startswith('t') and len(s) > 1)):
            return (f'{head} sections {", ".join(k + "<number>" for k in keys)}; {s!r} is not one '
                    '(e.g. rand-m9-mstd0.5-inc1)')
    if head != 'rand' and not random_resized_crop:
        return "'rand-...' unless scale is set (without RandomResizedCrop only RandAugment is applied)"
    return ''
