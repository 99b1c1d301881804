"""From a config to the objects a run needs: the model, its input size, datasets and loaders."""
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import timm
import torch
from torch import nn

from ..data import (BatchTransform, DataError, EpochOrder, ImageDataset, PILLoader, StreamingShards, StreamLoader,
                    TensorLoader, build_dataset, build_pil_transform, dataset_mean_std, derive_seed, eval_split_of,
                    resolve_data_path)
from ..data.shards import is_shard_path
from ..data.transforms import PIL_ONLY_AUGMENTS
from ..models import get_variant, resolve_model_name
from ..profile import fixed_image_size, input_size_of
from .config import ConfigError, TrainConfig

__all__ = ['create_model', 'enable_grad_checkpointing', 'model_name', 'mlp_dropout_kwargs', 'model_input_size',
           'norm_stats', 'DataSetup', 'setup_data', 'make_loader', 'pil_transform', 'open_train_split',
           'resolve_device', 'load_initial_weights', 'dataset_manifest', 'check_same_dataset',
           'set_cuda_matmul_precision']


def resolve_device(name: str) -> torch.device:
    if name == 'auto':
        return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    dev = torch.device(name)
    if dev.type == 'cuda' and not torch.cuda.is_available():
        raise ConfigError(f'device={name}: CUDA is not available here; use device=cpu')
    return dev


def set_cuda_matmul_precision(precision: str) -> None:
    """``matmul_precision`` of a CUDA run: 'high' lets fp32 matmuls (cuBLAS) and convolutions (cuDNN)
    round their inputs to TF32 on tensor cores (10-bit mantissa, fp32 range and accumulation; Ampere
    and newer GPUs); 'highest' keeps both in full fp32. Process-wide (torch has no per-model switch);
    autocast regions are unaffected."""
    tf32 = precision == 'high'
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32


def mlp_dropout_kwargs(name: str, p: float) -> Dict[str, Any]:
    """Model kwargs for dropout ``p`` in a model's MLP sub-units, the NiNformer authors' setting
    (0.5 in every feed-forward net: NiNformer's Mixer token/channel MLPs and its outer FFN,
    ``block_cfg=dict(drop=0.5)`` per ``vitblocks.models.ninformer``). A registered model says where it
    takes it (``VariantSpec.mlp_drop_kwarg``): the NiNformer-paper models that swap blocks in (NiNformer,
    MLP-Mixer, LocalViT) as ``block_cfg.drop``; timm models (and the paper's plain ViT baseline) as
    ``proj_drop_rate`` (dropout in the blocks' MLP and attention projection)."""
    if not p:
        return {}
    try:
        key = get_variant(name).mlp_drop_kwarg
    except ValueError:  # not a vitblocks model: a timm one
        key = 'proj_drop_rate'
    return {'block_cfg': {'drop': p}} if key == 'block_cfg' else {key: p}


def model_name(cfg: TrainConfig) -> str:
    """``cfg.model`` as timm knows it, or a ConfigError with a did-you-mean hint (cheap: check it before
    decoding a dataset)."""
    try:
        return resolve_model_name(cfg.model)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def create_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """``timm.create_model(cfg.model, num_classes=..., **cfg.model_kwargs)`` with readable errors."""
    name = model_name(cfg)
    kwargs = dict(cfg.model_kwargs, num_classes=num_classes)
    for key, value in mlp_dropout_kwargs(name, cfg.mlp_drop or 0).items():  # explicit model_kwargs win
        kwargs[key] = {**value, **kwargs.get(key, {})} if isinstance(value, dict) else kwargs.get(key, value)
    for key in ('drop_rate', 'drop_path_rate'):
        if getattr(cfg, key) is not None:
            kwargs[key] = getattr(cfg, key)
    try:
        return timm.create_model(name, **kwargs)
    except (TypeError, ValueError, AssertionError, RuntimeError, ZeroDivisionError) as e:
        # an unknown keyword, or a value the model cannot be built with (embed_dim=-1: a negative dimension)
        detail = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise ConfigError(f'cannot build {name} with {kwargs}: {type(e).__name__}: {detail}; check model_kwargs / '
                          f'drop_rate / drop_path_rate') from None


def enable_grad_checkpointing(model: nn.Module, name: str) -> int:
    """timm's activation checkpointing (``set_grad_checkpointing``: each block's forward is recomputed in the
    backward pass instead of keeping its activations), or a ConfigError for a model that has none.

    A recomputed BatchNorm (IFFN's, RePa's training form, ...) would update its running statistics a second
    time per step; each one gets a forward pre-hook that keeps them still while the forward runs inside the
    backward pass (the recomputation; its output uses the batch statistics either way), so the run ends with the
    statistics, and the evaluations, of a run without checkpointing. Returns how many BatchNorms got the hook."""
    setter = getattr(model, 'set_grad_checkpointing', None)
    if not callable(setter):
        raise ConfigError(f'grad_checkpointing=true: {name} ({type(model).__name__}) has no set_grad_checkpointing() '
                          f'(timm\'s switch for recomputing its blocks in the backward pass); drop grad_checkpointing')
    try:
        setter(True)
    except (AssertionError, NotImplementedError) as e:  # timm models that do not support it assert so
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f'grad_checkpointing=true: {name} does not support it ({why}); '
                          f'drop grad_checkpointing') from None
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    for norm in norms:
        norm.momentum_outside_backward = norm.momentum
        norm.register_forward_pre_hook(_running_stats_still_in_backward)
    return len(norms)


def _running_stats_still_in_backward(norm: nn.Module, args) -> None:
    """BatchNorm forward pre-hook. Inside a backward pass (where a checkpointed block is recomputed) the update of
    the running statistics is made a no-op: momentum 0 (``running x 1 + batch x 0``, exact) and the batch counter
    one lower, which the forward adds back; the forward itself, the tensors it saves and its output are unchanged.
    Outside, the module's own momentum (torch's BatchNorm reads both at each forward)."""
    if torch._C._current_graph_task_id() == -1:
        norm.momentum = norm.momentum_outside_backward
        return
    norm.momentum = 0.0
    if norm.num_batches_tracked is not None:
        norm.num_batches_tracked.sub_(1)


def model_input_size(model: nn.Module, cfg: TrainConfig) -> Tuple[int, int, int]:
    """(C, H, W) the model takes: ``cfg.input_size`` (checked against a fixed-size model), else what
    the built model says (``vitblocks.profile.input_size_of``, with ``model_kwargs`` img_size/in_chans)."""
    fixed = fixed_image_size(model)
    if cfg.input_size:
        size = tuple(int(v) for v in cfg.input_size)
        if fixed is not None and tuple(size[1:]) != fixed:
            raise ConfigError(f'input_size={list(size)}: {cfg.model} is built for {fixed[0]}x{fixed[1]} images only; '
                              f'build it for this size with model_kwargs="{{img_size: [{size[1]}, {size[2]}]}}" '
                              f'or drop input_size')
        return size
    chans, height, width = input_size_of(model)
    chans = int(cfg.model_kwargs.get('in_chans', chans))
    if fixed is None and cfg.model_kwargs.get('img_size') is not None:  # a dynamic-size model built for this size
        img = cfg.model_kwargs['img_size']
        height, width = (img, img) if isinstance(img, int) else tuple(img)
    return chans, int(height), int(width)


def load_initial_weights(model: nn.Module, path: str) -> str:
    """Load ``path`` (any layout ``load_model_weights`` reads) into ``model`` to fine-tune from it,
    as timm's ``--initial-checkpoint``; a classifier whose shape differs (another number of
    classes) keeps its fresh initialization. Returns a line saying what was loaded."""
    from .checkpoint import CheckpointError, load_model_weights
    state = load_model_weights(path)
    own = model.state_dict()
    classifier = (getattr(model, 'pretrained_cfg', None) or {}).get('classifier', 'head')
    heads = (classifier,) if isinstance(classifier, str) else tuple(classifier)
    skipped = [k for k, v in state.items() if k in own and own[k].shape != v.shape and k.startswith(heads)]
    state = {k: v for k, v in state.items() if k not in skipped}
    missing = sorted(set(own) - set(state) - set(skipped))
    unexpected = sorted(set(state) - set(own))
    wrong = [k for k in state if k in own and own[k].shape != state[k].shape]
    if missing or unexpected or wrong:
        parts = [f'{len(x)} {what} (e.g. {", ".join(x[:3])})' for x, what in
                 ((missing, 'missing'), (unexpected, 'unexpected'), (wrong, 'of another shape')) if x]
        raise CheckpointError(f'{path}: does not fit {type(model).__name__}: {"; ".join(parts)} tensors; check '
                              f'--model / model_kwargs against the model the weights were trained as')
    model.load_state_dict(state, strict=False)
    head = f'; classifier {", ".join(skipped)} re-initialized (another number of classes)' if skipped else ''
    return f'initial weights: {len(state)} tensors from {path}{head}'


@dataclass
class DataSetup:
    train: ImageDataset
    val: ImageDataset
    val_split: str
    input_size: Tuple[int, int, int]
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    pipeline: str


def norm_stats(cfg: TrainConfig, model: nn.Module, train: ImageDataset, channels: int):
    """(mean, std) per channel from ``cfg.mean/std``: 'model', 'dataset' (of ``train``) or values."""
    pre = getattr(model, 'pretrained_cfg', None) or {}
    out = []
    ds_stats = dataset_mean_std(train, channels) if 'dataset' in (cfg.mean, cfg.std) else None
    for key, default in (('mean', (0.485, 0.456, 0.406)), ('std', (0.229, 0.224, 0.225))):
        v = getattr(cfg, key)
        if v == 'dataset':
            v = ds_stats[0 if key == 'mean' else 1]
        elif v == 'model':
            v = tuple(pre.get(key, default))
            if len(v) != channels:  # an RGB model's statistics for a 1-channel model: their average
                v = (sum(v) / len(v),) * channels
        v = tuple(float(x) for x in v)
        if len(v) != channels:
            raise ConfigError(f'{key}={list(v)}: {channels}-channel input needs {channels} values')
        out.append(v)
    return out


def open_train_split(cfg: TrainConfig) -> ImageDataset:
    """The training split: map-style (``build_dataset``), or a ``StreamingShards`` under ``streaming=true``
    (``data``'s shards, or ``train_url``'s described by ``data``'s MANIFEST.json)."""
    if not cfg.streaming:
        return build_dataset(cfg.data, cfg.train_split)
    path = resolve_data_path(cfg.data)
    if not cfg.train_url and not is_shard_path(path):
        raise ConfigError(f'streaming=true streams WebDataset shards (.tar/.tar.gz); {cfg.data} holds none (drop '
                          f'streaming=true for image folders, or give the shards as train_url=URL)')
    return StreamingShards(path, cfg.train_split, url=cfg.train_url, num_samples=cfg.train_samples,
                           num_classes=cfg.num_classes)


def auto_pipeline(cfg: TrainConfig, decoded: bool) -> str:
    """``pipeline=auto``'s choice for ``cfg``'s training transform: 'tensor' for a split decoded in memory, unless an
    augmentation only the PIL pipeline has (RandAugment, color jitter, RandomResizedCrop) is on; else 'pil'."""
    return 'tensor' if decoded and not any(getattr(cfg, k) for k in PIL_ONLY_AUGMENTS) else 'pil'


def setup_data(cfg: TrainConfig, model: nn.Module, num_classes: Optional[int] = None) -> DataSetup:
    train = open_train_split(cfg)
    val_split = cfg.val_split or eval_split_of(cfg.data)
    # a class list made up from num_classes (a streamed split without one) does not name the val split's classes
    named = getattr(train, 'classes_named', True)
    val = build_dataset(cfg.data, val_split, classes=train.classes if named else None)
    if val.source == train.source:  # a shard, a pattern or one ImageFolder tree has no other split
        raise DataError(f'{cfg.data}: no held-out split: evaluation ({val_split!r}) would read the training images '
                        f'({train.source}); give the folder holding both splits (<split>/ sub-folders, or shards named '
                        f'<name>-train-*/<name>-test-*)')
    if val.num_classes != train.num_classes:
        raise DataError(f'{cfg.data}: split {val_split!r} has {val.num_classes} classes, {cfg.train_split!r} has '
                        f'{train.num_classes}')
    if num_classes is not None and num_classes < train.num_classes:
        raise DataError(f'{cfg.data}: the data has {train.num_classes} classes but the model has {num_classes} '
                        f'outputs; '
                        f'set num_classes={train.num_classes}')
    for key, ds in (('train_subset', train), ('val_subset', val)):
        if getattr(cfg, key) and getattr(cfg, key) > len(ds):
            raise DataError(f'{key}={getattr(cfg, key)}: {ds.source} has only {len(ds)} images; use at most '
                            f'{len(ds)} (or drop {key})')
    if cfg.train_subset and cfg.train_subset < len(train):
        g = torch.Generator().manual_seed(derive_seed(cfg.seed, 7))
        train = train.subset(torch.randperm(len(train), generator=g)[:cfg.train_subset].sort().values)
    if cfg.val_subset and cfg.val_subset < len(val):
        val = val.subset(range(cfg.val_subset))
    size = model_input_size(model, cfg)
    mean, std = norm_stats(cfg, model, train, size[0])
    pil_only = [k for k in PIL_ONLY_AUGMENTS if getattr(cfg, k)]
    pipeline = cfg.pipeline
    if pipeline == 'auto':
        pipeline = auto_pipeline(cfg, train.images is not None)
    if pipeline == 'tensor':
        if train.images is None:
            raise ConfigError(f'pipeline=tensor needs a dataset decoded in memory; {cfg.data} is read image by image '
                              f'(use pipeline=pil)')
        if pil_only:
            raise ConfigError(f'pipeline=tensor does not implement {", ".join(pil_only)}; use pipeline=pil')
        if not cfg.uint8_batches:
            raise ConfigError('uint8_batches=false: the tensor pipeline always moves uint8 batches and normalizes '
                              'them on the device; float batches exist in pipeline=pil only (set pipeline=pil, or '
                              'drop uint8_batches=false)')
    return DataSetup(train, val, val_split, size, mean, std, pipeline)


def dataset_manifest(data: DataSetup) -> Dict[str, Any]:
    """What identifies a run's data, whatever its path: class names and split sizes (after the
    subsets the config asks for). Stored in checkpoints, compared when ``--data`` changes on resume."""
    return {'classes': list(data.train.classes), 'train_images': len(data.train), 'val_split': data.val_split,
            'val_images': len(data.val)}


def check_same_dataset(saved: Optional[Dict[str, Any]], data: DataSetup, saved_path: str, new_path: str) -> None:
    """Refuse a resume whose ``data`` path changed unless it holds the same dataset as before."""
    if saved is None:
        raise ConfigError(f'data moved from {saved_path} to {new_path}, but the checkpoint predates dataset '
                          f'manifests, so vitblocks cannot check it is the same data; resume with data={saved_path}')
    now = dataset_manifest(data)
    diff = [k for k in now if saved.get(k) != now[k]]
    if diff:
        what = ', '.join(f'{k} {saved.get(k) if k != "classes" else len(saved.get(k) or [])} -> '
                         f'{now[k] if k != "classes" else len(now[k])}' for k in diff)
        raise DataError(f'{new_path} is not the dataset this run was trained on ({saved_path}): {what}; resume '
                        f'with the original data')


def make_loader(cfg: TrainConfig, data: DataSetup, training: bool, device: torch.device, rank: int = 0,
                world_size: int = 1, batch_size: Optional[int] = None, augment: bool = False):
    """A TensorLoader, PILLoader or (``streaming=true``, training) StreamLoader over the train or val split.

    ``augment``: the val split through the training transform (crops, flips, erasing, RandAugment as ``cfg`` sets
    them), in evaluation order, every image once; epoch ``k`` of the loader is the k-th set of random draws."""
    ds = data.train if training else data.val
    bs = batch_size or cfg.batch_size
    augmented = training or augment  # the training transform
    if data.pipeline == 'tensor' and ds.images is not None:
        tf = BatchTransform(data.input_size, data.mean, data.std, augmented, hflip=cfg.hflip, vflip=cfg.vflip,
                            crop_padding=cfg.crop_padding, interpolation=cfg.interpolation, reprob=cfg.reprob,
                            remode=cfg.remode, recount=cfg.recount, crop_pct=cfg.crop_pct, device=device)
        on_device = cfg.images_on_device and device.type == 'cuda'
        return TensorLoader(ds, _epoch_order(cfg, ds, bs, training, rank, world_size), tf, device=device,
                            images_on_device=on_device)
    # per-sample PIL transforms; uint8 batches are normalized (and randomly erased) on the device
    uint8 = cfg.uint8_batches
    tf = pil_transform(cfg, data, augmented, uint8)
    erase = None
    if uint8 and augmented and cfg.reprob:
        from timm.data.random_erasing import RandomErasing
        erase = RandomErasing(cfg.reprob, mode=cfg.remode, max_count=cfg.recount, device=str(device))
    normalize = (data.mean, data.std) if uint8 else None
    if isinstance(ds, StreamingShards):
        return StreamLoader(ds, tf, bs, seed=cfg.seed, workers=cfg.workers, device=device, rank=rank,
                            world_size=world_size, channels=data.input_size[0], normalize=normalize, erase=erase)
    return PILLoader(ds, _epoch_order(cfg, ds, bs, training, rank, world_size), tf, workers=cfg.workers,
                     device=device, normalize=normalize, erase=erase)


def _epoch_order(cfg: TrainConfig, ds: ImageDataset, batch_size: int, training: bool, rank: int,
                 world_size: int) -> EpochOrder:
    try:
        return EpochOrder(len(ds), batch_size, seed=cfg.seed, shuffle=training, rank=rank, world_size=world_size)
    except ValueError as e:
        raise ConfigError(f'{ds.source}: {e}') from None


def pil_transform(cfg: TrainConfig, data: DataSetup, training: bool, uint8: bool):
    """timm's per-sample transform for the config (``build_pil_transform``)."""
    return build_pil_transform(data.input_size, data.mean, data.std, training, hflip=cfg.hflip, vflip=cfg.vflip,
                               scale=tuple(cfg.scale) if cfg.scale else None,
                               ratio=tuple(cfg.ratio) if cfg.ratio else None, color_jitter=cfg.color_jitter,
                               auto_augment=cfg.auto_augment, interpolation=cfg.interpolation, reprob=cfg.reprob,
                               remode=cfg.remode, recount=cfg.recount, crop_pct=cfg.crop_pct,
                               crop_padding=cfg.crop_padding, uint8=uint8)
