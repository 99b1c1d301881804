"""Training configuration: one flat dataclass, recipes as YAML files, ``key=value`` overrides.

Precedence: dataclass defaults < recipe (``--config deit`` or a YAML path) < command line.
The resolved config is written to ``<run dir>/config.yaml``; that file alone re-launches or
resumes the run (``python -m vitblocks.experiments <run dir>/config.yaml``).
"""
import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import yaml

from .schema import SchemaError, check_auto_augment, coerce, yaml_load

__all__ = ['TrainConfig', 'ConfigError', 'RESUME_CHANGEABLE', 'RESUME_ON_REQUEST', 'load_recipe', 'list_recipes',
           'recipe_path', 'merge', 'parse_overrides', 'save_config', 'load_config', 'check_resume_config']

RECIPE_DIR = Path(__file__).parent / 'recipes'

# keys a resumed run may change without leaving the trajectory it was on (budgets, logging, where it runs)
RESUME_CHANGEABLE = frozenset({'epochs', 'max_steps', 'workers', 'threads', 'progress', 'log_interval',
                               'checkpoint_interval', 'eval_interval', 'tensorboard', 'device',
                               'compile', 'compile_mode', 'resume', 'channels_last', 'grad_accum',
                               'grad_checkpointing', 'dist_timeout_min', 'checkpoint_hist'})
# optimisation settings a resume changes only when asked to (vitblocks train --resume RUN --change KEY=VALUE): a
# diverged or stalled run continues with another learning rate, warm-up, clipping or weight decay, and the run
# records the change (changes.jsonl)
RESUME_ON_REQUEST = frozenset({'lr', 'lr_base', 'warmup_epochs', 'warmup_lr', 'min_lr', 'clip_grad', 'weight_decay'})
# keys that say where a run lives or reads from, not what it computes: a resumed run may differ in them
# (``data``/``train_url`` only when the dataset is the same one, checked against the checkpoint's dataset manifest)
RESUME_LOCATION = frozenset({'data', 'train_url', 'output', 'name', 'initial_checkpoint'})


class ConfigError(ValueError):
    """A bad recipe or override; the message names the key and what was expected."""


@dataclass
class TrainConfig:
    # --- what to train on what ---
    model: str = ''                 # timm or vitblocks model name
    data: str = ''                  # dataset path or name (see vitblocks.data.build_dataset)
    recipe: str = ''                # the recipe it came from (informational)
    model_kwargs: Dict[str, Any] = field(default_factory=dict)  # extra timm.create_model kwargs
    initial_checkpoint: Optional[str] = None  # start from these weights (fine-tuning; a differing head re-initialized)
    drop_rate: Optional[float] = None       # timm drop_rate (head dropout), passed only when set
    drop_path_rate: Optional[float] = None  # stochastic depth, passed only when set
    mlp_drop: Optional[float] = None        # dropout after every MLP layer (see setup.mlp_dropout_kwargs)
    num_classes: Optional[int] = None       # default: the dataset's
    train_split: str = 'train'
    val_split: Optional[str] = None         # default: 'val' if the dataset has one, else 'test'
    train_subset: Optional[int] = None      # train on a fixed random subset of this many images
    val_subset: Optional[int] = None        # evaluate on the first N images only (quick checks)
    # --- input and augmentation ---
    input_size: Optional[List[int]] = None  # [C, H, W]; default: the model's
    mean: Union[str, List[float]] = 'model'  # 'model' (timm config), 'dataset' (train split) or values
    std: Union[str, List[float]] = 'model'
    interpolation: str = 'bicubic'
    pipeline: str = 'auto'          # 'tensor' (batched uint8, in-memory data), 'pil' (timm transforms), 'auto'
    uint8_batches: bool = True      # pil: workers return uint8, normalized (and erased) on the device; false: float32
    streaming: bool = False         # stream the training shards through timm's WebDataset reader (approximate epochs)
    train_url: Optional[str] = None  # streaming: the training shards as a WebDataset URL spec (pipe:, https://, s3://)
    train_samples: Optional[int] = None  # streaming: the training split's sample count, if MANIFEST.json has none
    hflip: float = 0.5
    vflip: float = 0.0
    crop_padding: int = 0           # random crop of the zero-padded image (CIFAR style)
    scale: Optional[List[float]] = None  # RandomResizedCrop scale range (PIL pipeline); None: plain resize
    ratio: Optional[List[float]] = None
    color_jitter: Optional[float] = None
    auto_augment: Optional[str] = None   # timm string, e.g. rand-m9-mstd0.5-inc1
    reprob: float = 0.0             # random erasing probability
    remode: str = 'pixel'
    recount: int = 1
    crop_pct: float = 1.0           # eval resize = size / crop_pct, then center crop
    mixup: float = 0.0
    cutmix: float = 0.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = 'batch'
    smoothing: float = 0.0          # label smoothing
    # --- optimization ---
    epochs: int = 100
    batch_size: int = 128           # per process; the global batch is batch_size x processes
    opt: str = 'adamw'              # any timm optimizer name: adam, adamw, lamb, sgd, ...
    lr: Optional[float] = None      # default: lr_base x global batch / lr_base_size
    lr_base: float = 5e-4
    lr_base_size: int = 512
    weight_decay: float = 0.05
    momentum: float = 0.9
    opt_eps: Optional[float] = None          # only for optimizers that have one (adam*, lamb, ...; not sgd)
    opt_betas: Optional[List[float]] = None  # as many as the optimizer takes (2; adan 3); not for sgd
    layer_decay: Optional[float] = None      # layer-wise lr decay in (0, 1] (fine-tuning, timm --layer-decay): a unit
                                             # of model.group_matcher() k units below the head trains at lr x this^k
    clip_grad: Optional[float] = None
    clip_mode: str = 'norm'
    sched: str = 'cosine'           # timm scheduler name ('cosine', 'step', ...) or 'none' (constant lr)
    warmup_epochs: float = 0
    warmup_lr: float = 1e-6
    min_lr: float = 0.0
    decay_epochs: float = 30        # 'step' scheduler
    decay_rate: float = 0.1         # 'step' and 'plateau' schedulers
    patience_epochs: int = 10       # 'plateau': evaluated epochs without a better val top-1 before decaying
    model_ema: bool = False
    model_ema_decay: float = 0.9998
    model_ema_warmup: bool = False
    # --- runtime ---
    device: str = 'auto'            # 'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1'
    amp: bool = True                # autocast on CUDA (ignored on CPU)
    amp_dtype: str = 'bfloat16'     # or 'float16' (uses a GradScaler)
    matmul_precision: str = 'highest'  # CUDA fp32 matmuls/convs: 'highest' fp32, 'high' TF32 (ignored on CPU)
    compile: bool = False           # torch.compile the model
    grad_checkpointing: bool = False  # recompute each block's activations in the backward pass (timm's
                                      # set_grad_checkpointing): less memory, ~1/3 more compute, the same result
    compile_mode: str = 'default'   # torch.compile mode; 'reduce-overhead' (CUDA graphs) suits small models on a GPU
                                    # (on the CPU torch has no graphs to capture: it runs as 'default')
    threads: Optional[int] = None   # torch intra-op threads (default: torch's; 1 is fastest on a busy CPU)
    seed: int = 0
    deterministic: bool = True      # torch.use_deterministic_algorithms (warn only)
    workers: int = 0                # DataLoader worker processes (PIL pipeline)
    images_on_device: bool = True   # tensor pipeline on CUDA: keep the uint8 dataset on the GPU
    max_steps: Optional[int] = None  # stop after this many optimizer steps (a budget; schedule unchanged)
    log_interval: int = 50          # steps between metric rows / progress lines
    checkpoint_interval: int = 0    # also save last.pth every N steps (0: at epoch ends only)
    checkpoint_hist: int = 0        # keep copies of the N newest last.pth in history/ (resume falls back to them)
    eval_interval: int = 1          # epochs between evaluations
    progress: str = 'auto'          # 'bar' (tqdm), 'log' (lines), 'none', 'auto' (bar on a terminal)
    tensorboard: bool = True        # if the tensorboard package is installed
    output: str = 'runs'            # parent folder of run folders
    name: Optional[str] = None      # run folder name; default <model>-<data>-<recipe>
    # --- scale (several GPUs / nodes; see docs/training.md) ---
    resume: Optional[str] = None    # 'auto': resume output/name if it holds last.pth, else start it
    grad_accum: int = 1             # micro-batches per optimizer step; global batch = batch_size x processes x this
    sync_bn: bool = False           # BatchNorm statistics over all processes (torch SyncBatchNorm; CUDA only)
    dist_bn: str = 'reduce'         # without sync_bn: 'reduce' (average) or 'broadcast' BN stats before eval/save
    dist_timeout_min: float = 30.0  # minutes a collective (and the processes' first meeting) waits before failing
    channels_last: bool = False     # model and input batches in channels-last memory format

    @property
    def field_names(self) -> List[str]:
        return [f.name for f in dataclasses.fields(self)]

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_TYPES = typing.get_type_hints(TrainConfig)  # the schema: each key's type (vitblocks.experiments.schema.RULES: ranges)


def list_recipes() -> List[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob('*.yaml'))


def recipe_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in ('.yaml', '.yml'):
        if not p.is_file():
            raise ConfigError(f'{p}: no such recipe file')
        return p
    if name_or_path in list_recipes():
        return RECIPE_DIR / f'{name_or_path}.yaml'
    close = difflib.get_close_matches(name_or_path, list_recipes(), n=3, cutoff=0.5)
    hint = f' Did you mean: {", ".join(close)}?' if close else ''
    raise ConfigError(f'unknown recipe {name_or_path!r}.{hint} Recipes: {", ".join(list_recipes())} '
                      f'(or a .yaml path)')


def load_recipe(name_or_path: str) -> Dict[str, Any]:
    """The settings of a recipe (by name or path), checked against the config's keys."""
    path = recipe_path(name_or_path)
    data = _read_yaml_mapping(path, 'a recipe')
    data.setdefault('recipe', path.stem)
    _check_keys(data, str(path))
    return _check_values(data, str(path))


def _read_yaml_mapping(path: Path, what: str) -> Dict[str, Any]:
    try:
        data = yaml_load(path.read_text(encoding='utf-8')) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, 'problem_mark', None)
        where = f'line {mark.line + 1}, column {mark.column + 1}: ' if mark else ''
        raise ConfigError(f'{path}: not valid YAML ({where}{getattr(e, "problem", None) or e})') from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f'{path}: cannot read it ({e})') from None
    if not isinstance(data, dict):
        raise ConfigError(f'{path}: {what} is a mapping of config keys (key: value lines), got '
                          f'{type(data).__name__}')
    return data


def parse_overrides(items: List[str]) -> Dict[str, Any]:
    """``['lr=1e-3', 'scale=[0.5, 1.0]']`` -> ``{'lr': 0.001, 'scale': [0.5, 1.0]}`` (YAML values)."""
    out: Dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition('=')
        if not sep or not key.strip():
            raise ConfigError(f'overrides are KEY=VALUE, got {item!r} (e.g. lr=1e-3 epochs=5)')
        try:
            out[key.strip()] = yaml_load(value)
        except yaml.YAMLError:
            raise ConfigError(f'{key}: cannot parse value {value!r}') from None
    _check_keys(out, 'command line')
    return _check_values(out, 'command line')


def merge(*layers: Mapping[str, Any]) -> TrainConfig:
    """A validated config from dict layers (later wins). ``model_kwargs`` dicts are merged.

    A layer that picks another optimizer (``opt``) resets the ``opt_eps`` / ``opt_betas`` of earlier layers that
    it cannot take (``--config deit opt=sgd``: the recipe's epsilon was AdamW's), as timm's factory does; given in
    the same layer as ``opt``, or a later one, they are the user's and a mismatch stays an error."""
    values: Dict[str, Any] = {}
    layer_of: Dict[str, int] = {}  # key -> index of the layer that set it last
    for i, layer in enumerate(layers):
        for k, v in layer.items():
            if k == 'model_kwargs' and isinstance(v, dict):
                values[k] = {**values.get(k, {}), **v}
            else:
                values[k] = v
            layer_of[k] = i
    _check_keys(values, 'config')
    _reset_options_of_a_replaced_optimizer(values, layer_of)
    cfg = TrainConfig(**_check_values(values, 'config'))
    _validate(cfg)
    return cfg


def _check_keys(data: Mapping[str, Any], where: str) -> None:
    for key in data:
        if key not in _FIELDS:
            close = difflib.get_close_matches(key, list(_FIELDS), n=3, cutoff=0.6)
            hint = f' Did you mean: {", ".join(close)}?' if close else ''
            raise ConfigError(f'{where}: unknown config key {key!r}.{hint}')


def _check_values(data: Mapping[str, Any], where: str) -> Dict[str, Any]:
    """Every value coerced to its key's type and checked against its rule (one error, naming the key)."""
    out = {}
    for key, value in data.items():
        try:
            out[key] = coerce(key, value, _TYPES[key])
        except SchemaError as e:
            raise ConfigError(str(e) if where in ('config', 'command line') else f'{where}: {e}') from None
    return out


def _nesterov(opt: str) -> bool:
    """Whether timm's optimizer ``opt`` is built with Nesterov momentum (sgd, nesterov, sgdp, nlars)."""
    from timm.optim import get_optimizer_info
    try:
        return bool((get_optimizer_info(opt.lower()).defaults or {}).get('nesterov'))
    except (ValueError, KeyError):  # an unknown name: the optimizer factory names it
        return False


def _validate(cfg: TrainConfig) -> None:
    """Checks that involve more than one key (single values are checked by the schema)."""
    if cfg.name is not None and (cfg.name in ('', '.', '..') or any(sep in cfg.name for sep in ('/', '\\'))):
        raise ConfigError(f'name={cfg.name!r} must be one folder name inside output={cfg.output!r} (no / or \\, '
                          f'not . or ..); put the folder in output to train elsewhere')
    if cfg.momentum is not None and cfg.momentum <= 0 and _nesterov(cfg.opt):
        raise ConfigError(f'opt={cfg.opt} is timm\'s SGD with Nesterov momentum, which needs momentum > 0 (got '
                          f'momentum={cfg.momentum}); give momentum > 0, or opt=momentum momentum=0 for plain SGD')
    std = cfg.std if isinstance(cfg.std, (list, tuple)) else ()
    if any(isinstance(v, (int, float)) and v <= 0 for v in std):
        raise ConfigError(f'std={list(std)}: every channel\'s std must be > 0 (the input is divided by it); give '
                          f'the dataset\'s std, or std=model / std=dataset')
    for key in ('train_url', 'train_samples'):
        if getattr(cfg, key) is not None and not cfg.streaming:
            raise ConfigError(f'{key}={getattr(cfg, key)} describes a streamed training split; set streaming=true '
                              f'(the map-style reader finds and counts the shards of data itself), or drop {key}')
    if cfg.streaming:  # a stream has neither random access nor a position inside an epoch
        clash = [(cfg.pipeline == 'tensor', 'pipeline=tensor (decodes the whole split in memory)', 'pipeline=pil'),
                 (cfg.train_subset, f'train_subset={cfg.train_subset} (a random subset needs random access)',
                  'no train_subset'),
                 ('dataset' in (cfg.mean, cfg.std), 'mean/std=dataset (statistics of a sample of the split)',
                  'mean/std values or model'),
                 (cfg.checkpoint_interval, f'checkpoint_interval={cfg.checkpoint_interval} (exact mid-epoch resume; '
                  f'a streamed epoch restarts from its beginning)', 'checkpoints at epoch ends only')]
        for bad, what, fix in clash:
            if bad:
                raise ConfigError(f'streaming=true cannot go with {what}; use {fix}, or drop streaming=true')
    if cfg.ratio is not None and cfg.scale is None:
        raise ConfigError(f'ratio={cfg.ratio} is the aspect-ratio range of RandomResizedCrop, which only '
                          f'scale=[lo, hi] turns on; set scale too, or drop ratio')
    if cfg.crop_padding and cfg.scale is not None:
        raise ConfigError(f'crop_padding={cfg.crop_padding} (random crop of the padded image) and scale={cfg.scale} '
                          f'(RandomResizedCrop) are two different crops; keep one')
    if (cfg.mixup > 0 or cfg.cutmix > 0) and cfg.batch_size % 2:
        raise ConfigError(f'mixup/cutmix mix each image with another of its batch (timm\'s Mixup), so the batch per '
                          f'process must be even; batch_size={cfg.batch_size}')
    if cfg.sched == 'none' and cfg.warmup_epochs:
        raise ConfigError(f'warmup_epochs={cfg.warmup_epochs:g} warms up to a schedule, and sched=none keeps the '
                          f'learning rate constant from the first step; set sched (cosine, or step with decay_rate=1 '
                          f'for a constant learning rate after the warm-up), or drop warmup_epochs')
    _check_optimizer_options(cfg)
    if cfg.auto_augment:
        problem = check_auto_augment(cfg.auto_augment, random_resized_crop=cfg.scale is not None)
        if problem:
            raise ConfigError(f'auto_augment={cfg.auto_augment!r}: expected {problem}')


def _options_the_optimizer_cannot_take(opt: str, eps, betas):
    """(keys, info): ``opt_eps`` if timm optimizer ``opt`` has no epsilon, ``opt_betas`` if it has no betas or
    another number of them (timm's factory drops such options silently; Adan fails at its first step), and timm's
    ``OptimInfo`` of ``opt``. Raises ValueError for an unknown optimizer."""
    from timm.optim import get_optimizer_info
    info = get_optimizer_info(str(opt).lower())
    keys = []
    if eps is not None and not info.has_eps:
        keys.append('opt_eps')
    miscounted = isinstance(betas, (list, tuple)) and len(betas) != info.num_betas  # (a wrong type: the schema's)
    if betas is not None and (not info.has_betas or miscounted):
        keys.append('opt_betas')
    return keys, info


def _reset_options_of_a_replaced_optimizer(values: Dict[str, Any], layer_of: Mapping[str, int]) -> None:
    """Drop the ``opt_eps`` / ``opt_betas`` set in a layer before the one that chose ``opt``, where that optimizer
    cannot take them (they were given for the earlier layer's optimizer)."""
    stale = {k: values[k] for k in ('opt_eps', 'opt_betas')
             if values.get(k) is not None and layer_of[k] < layer_of.get('opt', -1)}
    if not stale:
        return
    try:
        keys, _ = _options_the_optimizer_cannot_take(values['opt'], stale.get('opt_eps'), stale.get('opt_betas'))
    except ValueError:  # an unknown optimizer: the schema's check of opt names it
        return
    for key in keys:
        values[key] = None


def _check_optimizer_options(cfg: TrainConfig) -> None:
    """``opt_eps`` / ``opt_betas`` only where ``cfg.opt`` takes them: timm's factory drops them silently otherwise."""
    if cfg.opt_eps is None and cfg.opt_betas is None:
        return
    keys, info = _options_the_optimizer_cannot_take(cfg.opt, cfg.opt_eps, cfg.opt_betas)
    if 'opt_eps' in keys:
        raise ConfigError(f'opt_eps={cfg.opt_eps:g}: opt={cfg.opt} has no epsilon (timm would drop it silently); '
                          f'drop opt_eps (opt_eps=null), or pick an optimizer that has one (adamw, lamb, ...)')
    if 'opt_betas' in keys and not info.has_betas:
        raise ConfigError(f'opt_betas={cfg.opt_betas}: opt={cfg.opt} has no betas (timm would drop them silently); '
                          f'drop opt_betas (opt_betas=null), or pick an optimizer that has them (adamw, lamb, ...)')
    if 'opt_betas' in keys:
        raise ConfigError(f'opt_betas={cfg.opt_betas}: opt={cfg.opt} takes {info.num_betas} betas; give '
                          f'{info.num_betas} values')


def save_config(cfg: TrainConfig, path: Path, header: str = '') -> None:
    """Write ``cfg`` as YAML under ``header`` (as comments), atomically: a run killed mid-write keeps the
    previous config.yaml, which ``--resume`` reads."""
    from .runlog import write_text_atomic
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)
    write_text_atomic(Path(path), ''.join(f'# {line}\n' for line in header.splitlines()) + text)


def load_config(path: Union[str, Path]) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f'{path}: no such config file')
    data = _read_yaml_mapping(path, 'a run config')
    _check_keys(data, str(path))
    _check_values(data, str(path))
    return merge(data)


def check_resume_config(cfg: TrainConfig, saved: Mapping[str, Any], path: Union[str, Path],
                        changed: Sequence[str] = ()) -> None:
    """Refuse to resume when ``cfg`` (e.g. from an edited or truncated config.yaml) differs from the
    config stored in the checkpoint ``path`` in a key that changes what is computed (``changed``: keys of
    :data:`RESUME_ON_REQUEST` the user asked to change)."""
    unknown = sorted(set(changed) - RESUME_ON_REQUEST)
    if unknown:
        raise ConfigError(f'a resume can be asked to change {", ".join(sorted(RESUME_ON_REQUEST))}, not '
                          f'{", ".join(unknown)}; start a new run from its weights (initial_checkpoint=...) instead')
    free = RESUME_CHANGEABLE | RESUME_LOCATION | set(changed)
    changed = sorted(k for k, v in saved.items() if k in _FIELDS and k not in free and getattr(cfg, k) != v)
    if changed:
        diff = ', '.join(f'{k}: {saved[k]!r} -> {getattr(cfg, k)!r}' for k in changed[:4])
        raise ConfigError(f'{path} was trained with another config ({diff}{", ..." if len(changed) > 4 else ""}); '
                          f'resume with the config stored in the checkpoint (restore config.yaml), or start a '
                          f'new run')
