"""The settings of a GLUE fine-tuning run, as stored in its run folder's ``config.yaml``."""
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, Optional

import yaml

from ..experiments.config import ConfigError
from ..experiments.runlog import write_text_atomic
from ..experiments.schema import SchemaError, coerce, yaml_load
from .tasks import TASKS

__all__ = ['GlueConfig', 'RESUME_CHANGEABLE', 'save_glue_config', 'load_glue_config', 'check_glue_config']

# what a resume may set anew: the budget, where and how it runs, what it writes how often; ``data`` may name a new
# place of the same files (their SHA-256 is checked)
RESUME_CHANGEABLE = frozenset({'data', 'epochs', 'max_steps', 'device', 'threads', 'log_interval',
                               'checkpoint_interval', 'progress'})


@dataclass
class GlueConfig:
    """One fine-tuning run. The defaults are BERT's GLUE recipe (AdamW, lr 2e-5, 10% linear warm-up then linear
    decay to 0, weight decay 0.01 off biases and norms, gradients clipped at norm 1, 3 epochs of batches of 32,
    sequences cut at 128 tokens)."""
    task: str
    data: str
    model: str
    model_args: Dict[str, Any] = field(default_factory=dict)  # config overrides (num_hidden_layers=2, ...)
    tokenizer: Optional[str] = None
    train_tokenizer: Optional[int] = None  # vocabulary size of a WordPiece tokenizer trained on the task's text
    ffn: Optional[str] = None  # a vitblocks FFN swapped into the model (vitblocks.hf.swap_ffn)
    block_cfg: Dict[str, Any] = field(default_factory=dict)
    warm_start: bool = False  # the swapped blocks take the pretrained dense FFN's weights (mlp, repa, swiglu)
    epochs: int = 3
    batch_size: int = 32
    eval_batch_size: int = 64
    lr: float = 2e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    clip_grad: Optional[float] = 1.0
    max_length: int = 128
    seed: int = 0
    max_steps: Optional[int] = None  # stop after this many steps (the schedule still spans all epochs)
    max_examples: Optional[int] = None  # read only the first N examples of each file (smoke runs)
    device: str = 'auto'
    threads: Optional[int] = None
    log_interval: int = 50
    checkpoint_interval: int = 0  # save last.pth every N steps too (0: at each epoch's end and on a stop)
    progress: str = 'auto'  # 'bar', 'log' (a line every log_interval steps), 'none'; auto: bar on a terminal

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def check_glue_config(cfg: GlueConfig) -> None:
    """Refuse contradictory or out-of-range settings with one line each."""
    if cfg.task not in TASKS:
        raise ConfigError(f'unknown GLUE task {cfg.task!r}; supported: {", ".join(TASKS)}')
    if cfg.tokenizer and cfg.train_tokenizer:
        raise ConfigError('--tokenizer and --train-tokenizer both name the tokenizer; give one of them')
    if cfg.block_cfg and not cfg.ffn:
        raise ConfigError('--block-cfg configures the FFN that --ffn swaps in; give --ffn NAME (or drop --block-cfg)')
    if cfg.warm_start and not cfg.ffn:
        raise ConfigError('--warm-start copies the dense FFN\'s weights into the block --ffn swaps in; give --ffn NAME '
                          '(or drop --warm-start)')
    for name in ('epochs', 'batch_size', 'eval_batch_size', 'max_length', 'log_interval'):
        if getattr(cfg, name) < 1:
            raise ConfigError(f'{name}={getattr(cfg, name)}: expected an integer >= 1')
    for name in ('weight_decay', 'clip_grad'):
        if (getattr(cfg, name) or 0) < 0:
            raise ConfigError(f'{name}={getattr(cfg, name)}: expected a number >= 0')
    if not 0 <= cfg.warmup_ratio <= 1:
        raise ConfigError(f'warmup_ratio={cfg.warmup_ratio}: expected a number in [0, 1]')
    if not cfg.lr > 0:
        raise ConfigError(f'lr={cfg.lr}: expected a number > 0')
    if cfg.progress not in ('auto', 'bar', 'log', 'none'):
        raise ConfigError(f'progress={cfg.progress!r}: expected auto, bar, log or none')


def save_glue_config(cfg: GlueConfig, path: Path) -> None:
    header = f'# GLUE fine-tuning run {path.parent.name}; resume: vitblocks glue --resume {path.parent}\n'
    write_text_atomic(path, header + yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def load_glue_config(path: Path) -> GlueConfig:
    try:
        raw = yaml_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f'{path}: cannot read it ({e.strerror or e}); point --resume to a GLUE run folder') from None
    except yaml.YAMLError as e:
        raise ConfigError(f'{path}: not valid YAML ({" ".join(str(e).split())[:200]})') from None
    known = {f.name for f in fields(GlueConfig)}
    if not isinstance(raw, dict) or not {'task', 'data', 'model'} <= set(raw):
        raise ConfigError(f'{path}: not the config of a GLUE run (no task, data and model); point --resume to a '
                          f'folder written by vitblocks glue')
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f'{path}: unknown keys {", ".join(unknown)} (not written by vitblocks glue?)')
    types = typing.get_type_hints(GlueConfig)
    try:  # a hand-edited value of the wrong type ('lr: 1e-3' is a string to plain YAML) is named, not crashed on
        return GlueConfig(**{key: coerce(key, value, types[key]) for key, value in raw.items()})
    except SchemaError as e:
        raise ConfigError(f'{path}: {e}') from None
