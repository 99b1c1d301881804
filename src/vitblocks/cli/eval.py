"""`vitblocks eval --model NAME --checkpoint PATH --data PATH [--reparam]`: accuracy, loss, speed."""
import dataclasses
import re
import sys
from pathlib import Path

import torch
from timm.utils import reparameterize_model

from ..data import DataError, build_dataset, eval_split_of
from ..deploy.io import (DeployedCheckpointError, is_deployed_file, load_deployed, read_deployed_metadata,
                         recorded_preprocessing)
from ..experiments import CheckpointError, ConfigError, evaluate, load_model_weights, merge, parse_overrides
from ..experiments.checkpoint import FORMAT, read_checkpoint
from ..experiments.distributed import init_distributed
from ..experiments.robustness import ROBUSTNESS_SETS, mean_corruption_error, robustness_sets
from ..experiments.runlog import write_json
from ..experiments.setup import (DataSetup, auto_pipeline, create_model, make_loader, model_input_size, norm_stats,
                                 resolve_device)
from ..profile import count_macs, count_params, fixed_image_size
from .common import (CliError, check_writable_file, positive_int, refuse_disagreeing_flags, refuse_exported_file,
                     render_table, resolve)

NAME = 'eval'

EPILOG = """\
examples:
  vitblocks eval --checkpoint runs/RUN/best.pth --data /path/to/cifar10
  vitblocks eval --model repa_deit_tiny_patch16_224 --checkpoint w.safetensors --data /path/to/imagenet --reparam
  vitblocks eval --model deit_tiny_patch16_224 --checkpoint w.pth --data /path/to/imagenet-r --robustness imagenet-r
  vitblocks eval --checkpoint deployed.safetensors --data /path/to/cifar10

A vitblocks run checkpoint carries its model, classes and preprocessing (--model is then
optional); other checkpoints (safetensors, timm .pth, bare state_dict) need --model, and
KEY=VALUE config overrides such as model_kwargs='{img_size: 32}' if the model was built so.
A deployed file (vitblocks.deploy.io.save_deployed) is evaluated as it is: built in deploy form by
the name, num_classes, img_size, in_chans and block config it records (--model is then optional;
another model is refused), normalized with the mean/std/input size it records, else the model
config's (a note then names the overrides to pass: mean=[...] std=[...] input_size=[C,H,W]).
--reparam on it does nothing (it says so); --ema is refused (a deployed file holds one set of weights).
Top-5 is top-k with k = min(5, classes). images/s is measured over the whole evaluation
(data pipeline included) on the chosen device. GMACs are counted for one image. val_subset=N
evaluates the first N images only (a run's own val_subset, a check while training, is not used).
The data's class names must be among the checkpoint's (an MNIST checkpoint on CIFAR-10 is
refused); --split must name a split the data has. KEY=VALUE takes the keys evaluation reads
(model, data, preprocessing, loader); a key only training reads (lr=, epochs=, mixup=, amp=,
threads= ...) is refused rather than ignored.
--train-augment N evaluates a run checkpoint (its config holds the augmentation) N more times with the
split's images through the run's training transform (every image once per pass, passes seeded 0..N-1),
as the NiNformer authors' script measures its test accuracy; the clean evaluation is printed first.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(NAME, help='evaluate a checkpoint: top-1/top-5, loss, per-class accuracy, speed',
                              description='Evaluate a model checkpoint on a dataset split.', epilog=EPILOG)
    p.add_argument('--model', help='model name (default: the one a vitblocks checkpoint was trained as)')
    p.add_argument('--checkpoint', required=True, help='last.pth/best.pth of a run, a .safetensors or a timm .pth')
    p.add_argument('--data', required=True, help='dataset path or name')
    p.add_argument('--split', help="split to evaluate (default: 'val' if present, else 'test'; or val_split=)")
    p.add_argument('--ema', action='store_true', help='evaluate the run\'s EMA weights')
    p.add_argument('--reparam', action='store_true', help='evaluate the deployed form (timm reparameterize_model)')
    p.add_argument('--robustness', choices=ROBUSTNESS_SETS, help='--data is this robustness set (ImageNet model)')
    p.add_argument('--batch-size', type=positive_int, help='images per batch (default 256; or batch_size=)')
    p.add_argument('--device', help="'cpu', 'cuda', 'cuda:1' (default auto: cuda if available; or device=)")
    p.add_argument('--threads', type=positive_int)
    p.add_argument('--workers', type=int, help='DataLoader worker processes (default 0; or workers=)')
    p.add_argument('--train-augment', type=positive_int, metavar='PASSES',
                   help='also evaluate PASSES times through the run\'s training augmentation (its crops, flips, '
                        'erasing, RandAugment; not mixup), each pass with its own random draws, as the NiNformer '
                        'authors\' script evaluates; prints each pass and their mean')
    p.add_argument('--per-class', action='store_true', help='print the accuracy of every class')
    p.add_argument('--json', metavar='PATH', help='also write the results as JSON')
    p.add_argument('--progress', choices=('auto', 'bar', 'log', 'none'), default='auto',
                   help='progress of the evaluation on stderr: a bar on a terminal, else a line every 10 s (auto)')
    p.add_argument('overrides', nargs='*', metavar='KEY=VALUE', help='config keys, e.g. model_kwargs=... mean=...')
    p.set_defaults(run=run)


# eval's defaults for the keys its flags set: above a run's config (its batch size and device were for training,
# its val_subset a quick check while training), below KEY=VALUE overrides and the flags
EVAL_DEFAULTS = {'batch_size': 256, 'workers': 0, 'device': 'auto', 'val_subset': None}
FLAG_KEYS = {'data': '--data', 'batch_size': '--batch-size', 'workers': '--workers', 'device': '--device',
             'val_split': '--split'}


# the config keys evaluation reads (model, data, preprocessing, loader); any other KEY=VALUE only changes training
# (optimizer, schedule, augmentation, dropout, run bookkeeping) and would be silently ignored, so it is refused
EVAL_READS = frozenset({'model', 'model_kwargs', 'num_classes', 'data', 'val_split', 'val_subset', 'input_size', 'mean',
                        'std', 'interpolation', 'crop_pct', 'pipeline', 'uint8_batches', 'images_on_device',
                        'batch_size', 'workers', 'device'})
EVAL_FLAG_FOR = {'threads': '--threads', 'progress': '--progress', 'model_ema': '--ema'}


def refuse_training_only(overrides: dict, items) -> None:
    """Parsed KEY=VALUE ``overrides`` (keys known and values checked by ``parse_overrides``) that evaluation never
    reads are an error that names them as typed in ``items`` (and eval's flag, if it has one)."""
    ignored = sorted(set(overrides) - EVAL_READS)
    if ignored:
        typed = {item.partition('=')[0].strip(): item for item in items}
        flags = [f'{EVAL_FLAG_FOR[k]} instead of {k}=' for k in ignored if k in EVAL_FLAG_FOR]
        raise CliError(f'{", ".join(typed[k] for k in ignored)}: only training reads '
                       f'{"this key" if len(ignored) == 1 else "these keys"}; evaluation would ignore '
                       f'{"it" if len(ignored) == 1 else "them"} ({"; ".join(flags) or "drop them"})')


def _flags(args, overrides) -> dict:
    """The config keys the flags given set; a key given both as a flag and as KEY=VALUE with another value is refused
    (the flag would silently win)."""
    flags = {k: getattr(args, 'split' if k == 'val_split' else k) for k in FLAG_KEYS}
    flags = {k: v for k, v in flags.items() if v is not None}
    refuse_disagreeing_flags(flags, overrides, lambda key, value: f'{FLAG_KEYS[key]} {value}')
    return flags


def _load(args, overrides: dict):
    """(config, state_dict, checkpoint metadata or {}); ``overrides``: the parsed KEY=VALUE items"""
    path = Path(args.checkpoint)
    meta = {}
    if path.suffix != '.safetensors':
        raw = read_checkpoint(path)
        if isinstance(raw, dict) and raw.get('format') == FORMAT:
            meta = raw
    state = load_model_weights(path, ema=args.ema)
    base = dict(meta.get('config', {}))
    if args.model:
        resolve(args.model)
        if meta and args.model != base.get('model'):
            raise CliError(f'{path} was trained as {base.get("model")}, not {args.model}; drop --model')
        base['model'] = args.model
    if not base.get('model'):
        raise CliError(f'{path} is not a vitblocks run checkpoint; say which model it holds with --model')
    return merge(base, EVAL_DEFAULTS, overrides, _flags(args, overrides)), state, meta


def _load_deployed(args, path: Path, overrides: dict):
    """(config, model in deploy form with the file's weights, checkpoint-like metadata) for a deployed
    safetensors file: built by the name and sizes the file records, loaded strictly (``load_deployed``)."""
    metadata = read_deployed_metadata(path)
    saved = metadata.get('architecture', '')
    if args.ema:
        raise CliError(f'{path} is a deployed file: it holds one set of weights (folded from the model it was '
                       f'saved from, EMA or not); drop --ema')
    if args.model and saved and resolve(args.model).split('.')[0] != saved.split('.')[0]:
        raise CliError(f'{path} holds the deployed weights of {saved}, not {args.model}; drop --model (the file '
                       f'names its model)')
    name = saved or (resolve(args.model) if args.model else '')
    if not name:
        raise CliError(f'{path} is a deployed file that records no model name; say which model it holds with --model')
    if args.reparam:
        print(f'vitblocks eval: note: {path} is already deployed (re-parameterized); --reparam does nothing',
              file=sys.stderr)
    recorded = recorded_preprocessing(metadata)
    for key in sorted(set(recorded) & set(overrides)):
        given = overrides[key] if isinstance(overrides[key], str) else [float(v) for v in overrides[key]]
        if given != [float(v) for v in recorded[key]]:
            raise CliError(f'{path} records {key}={recorded[key]} (the preprocessing it was trained with), not '
                           f'{overrides[key]}; drop {key}=')
    cfg = merge({'model': name}, EVAL_DEFAULTS, overrides, _flags(args, overrides))
    kwargs = dict(cfg.model_kwargs)  # e.g. the architecture of a custom-size model; sizes must match the file's
    block_cfg = kwargs.pop('block_cfg', None)
    if cfg.num_classes is not None:
        kwargs['num_classes'] = cfg.num_classes
    try:
        model = load_deployed(name, path, block_cfg=block_cfg, **kwargs)
    except DeployedCheckpointError as e:
        raise CliError(f'{e} (sizes and block config are model_kwargs={{...}} here)'
                       if 'records no sizes' in str(e) else str(e)) from None
    missing = [f'{k}=[...]' for k in ('mean', 'std') if k not in recorded and k not in overrides]
    if ('input_size' not in recorded and 'input_size' not in overrides and 'img_size' not in cfg.model_kwargs
            and fixed_image_size(model) is None):  # a model that takes any size: the file does not say which
        missing.append('input_size=[C,H,W]')
    if missing:
        print(f'vitblocks eval: note: {path} records no {", ".join(m.split("=")[0] for m in missing)}; using the '
              f'model config\'s (pass {" ".join(missing)} if it was trained with others)', file=sys.stderr)
    return cfg, model, {**recorded, 'num_classes': model.num_classes}


def _split_opened(dataset) -> str:
    """The split a dataset was really opened as: '[test]' in a shard source, or the split folder's name."""
    tag = re.search(r'\[(\w+)\]$', dataset.source)
    return tag.group(1) if tag else Path(dataset.source.split(' (')[0]).name


def _open_split(cfg, split: str, explicit: bool, classes):
    """The eval split, refusing a different split than asked for, and data whose classes the checkpoint lacks."""
    ds = build_dataset(cfg.data, split)
    opened = _split_opened(ds)
    same = {'val': 'validation', 'validation': 'val'}
    if explicit and opened in ('train', 'val', 'validation', 'test') and opened not in (split, same.get(split)):
        raise DataError(f'{cfg.data} has no {split!r} split (it fell back to {opened!r}); use --split {opened}')
    if classes:
        foreign = [c for c in ds.classes if c not in classes]
        if foreign:
            raise DataError(f'{cfg.data}: classes {foreign[:4]}{"..." if len(foreign) > 4 else ""} are not among the '
                            f'{len(classes)} the checkpoint was trained on ({", ".join(map(str, classes[:4]))}, ...); '
                            f'evaluate on the dataset it was trained on (add a classes.txt to shards without one)')
        if list(ds.classes) != list(classes):  # a subset or another order: label indices as the checkpoint's
            ds = build_dataset(cfg.data, split, classes=classes)
    if cfg.val_subset:
        if cfg.val_subset > len(ds):
            raise DataError(f'val_subset={cfg.val_subset}: {ds.source} has only {len(ds)} images')
        ds = ds.subset(range(cfg.val_subset))
    return ds


def _augmented_passes(args, cfg, data, model, device, dist):
    """``args.train_augment`` evaluations of ``data.val`` through the run's training transform (PIL's where the
    run needs it: RandAugment, color jitter, RandomResizedCrop)."""
    data = dataclasses.replace(data, pipeline=auto_pipeline(cfg, data.val.images is not None))
    loader = make_loader(cfg, data, False, device, dist.rank, dist.world_size, augment=True)
    passes = []
    for k in range(args.train_augment):
        torch.manual_seed(k)  # erasing draws from the global generator
        passes.append(evaluate(model, loader, data.val.num_classes, device, epoch=k,  # pass k: epoch k's draws
                               progress=args.progress if dist.is_main else 'none'))
    return passes


def _read(args, overrides: dict, deployed: bool):
    """(config, model or None, state dict or None, metadata) of the checkpoint or deployed file."""
    if deployed:
        cfg, model, meta = _load_deployed(args, Path(args.checkpoint), overrides)
        return cfg, model, None, meta
    cfg, state, meta = _load(args, overrides)
    if args.train_augment and not meta:
        raise CliError(f'--train-augment: {args.checkpoint} is not a vitblocks run checkpoint, so no '
                       f'training augmentation is known for it (give last.pth/best.pth of a run)')
    return cfg, None, state, meta


def _eval_sets(args, cfg, overrides: dict, meta: dict):
    """The robustness sets, or ``[None]`` for the one split; that split's dataset and name; the class count."""
    num_classes = meta.get('num_classes') or cfg.num_classes or (1000 if args.robustness else None)
    if args.robustness:
        return robustness_sets(args.robustness, Path(cfg.data)), None, None, num_classes
    explicit = args.split is not None or 'val_split' in overrides  # not a run's own
    split = cfg.val_split if explicit else eval_split_of(cfg.data)
    ds = _open_split(cfg, split, explicit, meta.get('classes'))
    return [None], ds, split, num_classes or ds.num_classes


def _build(args, cfg, state, num_classes: int):
    """The run's model with the checkpoint's weights (reparameterized with --reparam)."""
    model = create_model(cfg, num_classes)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise CheckpointError(f'{args.checkpoint}: does not fit {cfg.model} with {num_classes} classes '
                              f'({str(e).splitlines()[0][:200]}...)') from None
    return reparameterize_model(model.eval()) if args.reparam else model


def _evaluate_sets(args, cfg, model, meta: dict, sets, ds, split, num_classes: int, size, device, dist):
    """``[(robustness set or None, dataset, EvalResult)]`` and the DataSetup of the last one."""
    results, data = [], None
    for rs in sets:
        dataset = ds if rs is None else rs.dataset
        if rs is None and dataset.num_classes > num_classes:
            raise DataError(f'{cfg.data}: {dataset.num_classes} classes but the model has {num_classes} outputs')
        if meta.get('mean') and meta.get('std'):
            mean, std = tuple(meta['mean']), tuple(meta['std'])
        else:  # each of the two the file does not record: the config's, else the model's
            mean, std = norm_stats(cfg, model, dataset, size[0])
            mean, std = tuple(meta.get('mean') or mean), tuple(meta.get('std') or std)
        data = DataSetup(dataset, dataset, rs.name if rs else split, size, mean, std,
                         'tensor' if dataset.images is not None else 'pil')
        loader = make_loader(cfg, data, False, device, dist.rank, dist.world_size)
        res = evaluate(model, loader, dataset.num_classes, device, class_subset=rs.class_subset if rs else None,
                       progress=args.progress if dist.is_main else 'none')
        results.append((rs, dataset, res))
    return results, data


def _report(args, cfg, model, size, deployed: bool, device, results, augmented) -> dict:
    """Print the model line, each set's top-1/top-5 (per class where asked or few), the augmented passes and
    the mean corruption error; return the same as the --json document."""
    with torch.no_grad():
        macs = count_macs(model, input_size=size)
    params = count_params(model)
    form = ' (deployed file)' if deployed else ' (reparameterized)' if args.reparam else ''
    print(f'model    {cfg.model}{form}{" EMA" if args.ema else ""}: '
          f'{params / 1e6:.3f} M params, {macs.gmacs:.3f} GMACs at {"x".join(map(str, size))}')
    out = {'model': cfg.model, 'checkpoint': str(args.checkpoint), 'reparam': args.reparam or deployed,
           'deployed_file': deployed, 'params': params,
           'gmacs': macs.gmacs, 'input_size': list(size), 'results': {}}
    for rs, dataset, res in results:
        label = rs.name if rs else dataset.source
        print(f'data     {label}: {res.num_images} images, {dataset.num_classes} classes')
        print(f'top-1    {res.top1:.2f}%   top-5 {res.top5:.2f}%   loss {res.loss:.4f}   '
              f'{res.images_per_s:.1f} images/s on {device}')
        out['results'][label] = res.to_dict()
        if args.per_class or (rs is None and dataset.num_classes <= 20):
            rows = [[i, dataset.classes[i], t, f'{a:.2f}' if a is not None else '-']
                    for i, (t, a) in enumerate(zip(res.per_class_total, res.per_class_top1))]
            print('\n'.join(render_table(['class', 'name', 'images', 'top-1 %'], rows, 'llrr', indent='  ')))
    if augmented:
        top1 = torch.tensor([res.top1 for res in augmented], dtype=torch.float64)
        std = top1.std().item() if len(augmented) > 1 else 0.0
        print(f'top-1 through the training augmentation, {len(augmented)} pass(es): {top1.mean().item():.2f}% '
              f'(std {std:.2f}; {", ".join(f"{v:.2f}" for v in top1.tolist())})')
        out['train_augment'] = {'passes': [res.to_dict() for res in augmented], 'top1_mean': top1.mean().item(),
                                'top1_std': std}
    if args.robustness == 'imagenet-c':
        errors = {}
        for rs, _, res in results:
            errors.setdefault(rs.corruption, {})[rs.severity] = 100.0 - res.top1
        mce = mean_corruption_error(errors)
        print(f'mean corruption error (unnormalized, top-1 error % averaged over severities and corruptions): '
              f'{mce["mean"]:.2f}')
        out['mean_corruption_error'] = mce
    return out


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.json:
        check_writable_file(Path(args.json), '--json')  # before the evaluation, not after it
    refuse_exported_file(args.checkpoint, '--checkpoint', 'eval builds a model and loads weights into it: give the '
                         'deployed safetensors file (vitblocks export --format safetensors) or the run checkpoint it '
                         'was exported from (`vitblocks export ... --check` compares an export with its model)')
    deployed = is_deployed_file(args.checkpoint)
    try:
        overrides = parse_overrides(args.overrides)
        refuse_training_only(overrides, args.overrides)  # before any checkpoint or data is read
        if args.train_augment and (deployed or args.robustness):
            raise CliError(f'--train-augment evaluates through a run\'s training augmentation, which '
                           f'{"a deployed file" if deployed else "--robustness"} does not go with; drop one')
        cfg, model, state, meta = _read(args, overrides, deployed)
        device = resolve_device(cfg.device)
        dist = init_distributed(device.type)
        if device.type == 'cuda' and dist.enabled:
            device = torch.device('cuda', dist.local_rank)
        sets, ds, split, num_classes = _eval_sets(args, cfg, overrides, meta)
        if not deployed:
            model = _build(args, cfg, state, num_classes)
        model.to(device).eval()
        size = tuple(meta['input_size']) if meta.get('input_size') else model_input_size(model, cfg)
        results, data = _evaluate_sets(args, cfg, model, meta, sets, ds, split, num_classes, size, device, dist)
        augmented = _augmented_passes(args, cfg, data, model, device, dist) if args.train_augment else []
    except (ConfigError, DataError, CheckpointError) as e:
        raise CliError(str(e)) from None
    if not dist.is_main:
        return 0
    out = _report(args, cfg, model, size, deployed, device, results, augmented)
    if args.json:
        try:
            write_json(Path(args.json), out)
        except OSError as e:
            raise CliError(f'--json {args.json}: cannot write it ({e.strerror or e}); the results are printed '
                           f'above') from None
    return 0
