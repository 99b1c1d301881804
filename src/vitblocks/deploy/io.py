"""Save and load deployed (re-parameterized) weights as safetensors files.

A deployed checkpoint holds the state dict of a model in its inference form (every
re-parameterizable layer fused) plus the metadata that rebuilds that model by the file alone:

- the format tag and the model name (``architecture``);
- the sizes it was built with: ``num_classes``, ``in_chans`` and, for models that fix it or were built
  with ``dynamic_img_size=True``, ``img_size`` (and ``dynamic_img_size``);
- the block config (``block_cfg``) and the other timm kwargs (``build_kwargs``) a registered vitblocks
  model was built with (``timm.create_model('iffn_...', block_cfg={'act_layer': 'silu'})`` records
  them itself; ``save_deployed(block_cfg=...)`` overrides);
- the surgery a user applied to the model (``surgery``: ``swap_ffn``'d timm models, with the FFN, its
  config and the slots it replaced; see ``vitblocks.models.recipe``);
- what the model computed on a seeded image when it was saved (``reference_output``), so that a
  model rebuilt from the file is checked to compute the same before it is returned;
- if given, the preprocessing it was trained with (``input_size``, ``mean``, ``std``: what
  ``vitblocks eval`` needs to feed it the images it expects).

It loads into a model built *directly* in deploy form where the method has one (no training-form
weights are ever materialized), and by the file alone: name, sizes, config and surgery come from it::

    from vitblocks.deploy import reparameterize
    from vitblocks.deploy.io import load_deployed, save_deployed

    save_deployed(reparameterize(trained), 'repa_deit_b.safetensors')       # atomic write
    model = load_deployed('repa_deit_base_patch16_224', 'repa_deit_b.safetensors')
    model = load_deployed(None, 'repa_deit_b.safetensors')                  # the name recorded in the file

Files written before the sizes were recorded still load when the sizes are given
(``load_deployed(name, path, num_classes=10, img_size=32)``); files without a reference output are
loaded unchecked, as before. A model built with something a file cannot hold (a class or a function
given as a block config value or a surgery argument, ``act_layer=nn.SiLU`` rather than ``'silu'``)
is saved with the reason (``unrecordable``): it loads into a model you build (``load_deployed(model,
path)``), never by the file alone.

Writes are atomic (into a hidden folder beside the target, then ``os.replace``), so an
interrupted save never leaves a truncated checkpoint under the final name. Reading a missing,
corrupt or foreign file raises :class:`DeployedCheckpointError` saying which and what to do.
"""
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Union

import timm
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model
from timm.layers import to_2tuple
from torch import nn

from ..models.recipe import json_ready, recipe_of, replay_surgery
from .fingerprint import REFERENCE_KEY, check_reference_output, reference_output

__all__ = ['save_deployed', 'load_deployed', 'read_deployed_metadata', 'is_deployed_file', 'recorded_sizes',
           'recorded_preprocessing', 'model_sizes', 'write_safetensors', 'DeployedCheckpointError', 'FORMAT',
           'SIZE_KEYS', 'PREPROCESSING_KEYS']

FORMAT = 'vitblocks.deployed/1'  # metadata['format'] of every file save_deployed writes
SIZE_KEYS = ('num_classes', 'img_size', 'in_chans', 'dynamic_img_size')  # timm kwargs a file records (JSON values)
RECIPE_KEYS = ('block_cfg', 'build_kwargs', 'surgery', 'unrecordable')  # how it was built (JSON values)
# timm kwargs that change training only (dropout rates): not recorded, a deployed model runs in eval mode
TRAINING_ONLY_KWARGS = ('drop_rate', 'drop_path_rate', 'proj_drop_rate', 'attn_drop_rate', 'pos_drop_rate',
                        'patch_drop_rate')
PREPROCESSING_KEYS = ('input_size', 'mean', 'std')  # optional: [C, H, W] and per-channel normalization (JSON)

PathLike = Union[str, os.PathLike]


class DeployedCheckpointError(ValueError):
    """A deployed checkpoint is missing, unreadable, not ours, or does not fit the model."""


def _reparameterize(model: nn.Module, inplace: bool) -> nn.Module:
    # imported here: vitblocks.deploy's __init__ may import this module
    from . import reparameterize
    return reparameterize(model, inplace=inplace)


def _architecture(model: nn.Module) -> str:
    cfg = getattr(model, 'pretrained_cfg', None) or {}
    return str(cfg.get('architecture') or '')


def save_deployed(model: nn.Module, path: PathLike, name: Optional[str] = None,
                  block_cfg: Optional[Dict[str, Any]] = None,
                  preprocessing: Optional[Dict[str, Sequence[float]]] = None,
                  build_kwargs: Optional[Dict[str, Any]] = None) -> Path:
    """Write ``model``'s deployed weights to ``path`` (safetensors), atomically.

    Args:
        model: a model in deploy form, or in training form: then a re-parameterized copy is
            saved (``vitblocks.deploy.reparameterize``, eval-mode statistics); ``model`` itself
            is never changed. Saving a deployed model re-parameterizes nothing.
        path: the file to write (parent directories are created); an existing file is replaced
            only once the new one is complete.
        name: the timm / vitblocks model name to record (default: the model's
            ``pretrained_cfg['architecture']``).
        block_cfg: the block config the model was built with (e.g. ``{'idle_ratio': 0.5}``), recorded so
            :func:`load_deployed` rebuilds the same structure by default. Default: the one a registered
            vitblocks model records itself (``timm.create_model(name, block_cfg=...)``).
        preprocessing: the input the model was trained on, any of ``input_size`` ([C, H, W]),
            ``mean`` and ``std`` (C values each), e.g. a run checkpoint's; recorded so
            ``vitblocks eval`` normalizes and resizes as in training (without it eval uses the
            model config's, ImageNet statistics for most timm models).
        build_kwargs: timm kwargs beyond the sizes that the model was built with (``{'depth': 6}``). A
            plain timm model does not record them (``timm.create_model`` keeps no record of its kwargs),
            so give them here for a timm model built other than its defaults; a registered vitblocks
            model records its own. Sizes (``num_classes``, ``img_size``, ...) are read from the model.

    Returns:
        The path written.

    Raises:
        ValueError: ``block_cfg`` or ``build_kwargs`` that are not JSON (a class or a function), or
            ``build_kwargs`` that name a size.
    """
    deployed = _reparameterize(model, inplace=False)
    architecture = name or _architecture(model)
    metadata = {'format': FORMAT, 'architecture': architecture, 'torch': torch.__version__, 'timm': timm.__version__}
    sizes = model_sizes(deployed)
    metadata.update({k: json.dumps(v) for k, v in sizes.items()})
    recipe = _recipe_metadata(deployed, architecture, block_cfg)
    if build_kwargs:
        recipe['build_kwargs'] = {**recipe.get('build_kwargs', {}), **_checked_build_kwargs(build_kwargs)}
    metadata.update({k: json.dumps(v, sort_keys=True) for k, v in recipe.items()})
    checked = _checked_preprocessing(preprocessing or {}, deployed)
    metadata.update({k: json.dumps(v) for k, v in checked.items()})
    reference = reference_output(deployed, checked.get('input_size') or _probe_size(deployed, sizes))
    if reference is not None:
        metadata[REFERENCE_KEY] = reference
    return write_safetensors(deployed, path, metadata)


def _recipe_metadata(model: nn.Module, architecture: str, block_cfg: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The ``RECIPE_KEYS`` entries that rebuild ``model``: block config and kwargs of a registered build (when it is
    the recorded architecture; ``block_cfg`` given overrides), the user's surgery, and what could not be recorded."""
    recipe = recipe_of(model)
    build = recipe.get('build') or {}
    same = build.get('name', '').split('.')[0] == architecture.split('.')[0] != ''
    out: Dict[str, Any] = {}
    cfg = block_cfg if block_cfg is not None else build.get('block_cfg') if same else None
    if cfg and not json_ready(cfg):  # a class or a function: not a file's; loading by the file refuses
        if block_cfg is not None:
            raise ValueError(f'block_cfg {block_cfg}: a file records names and numbers only; give the registry '
                             f'names (act_layer=\'silu\') or load the file into a model you build')
        cfg = None  # recipe['unrecordable'] says why
    if cfg:
        out['block_cfg'] = cfg
    kwargs = {k: v for k, v in (build.get('kwargs') or {}).items()
              if k not in SIZE_KEYS and k not in TRAINING_ONLY_KWARGS and json_ready(v)} if same else {}
    if kwargs:
        out['build_kwargs'] = kwargs
    if recipe.get('surgery'):
        out['surgery'] = recipe['surgery']
    unrecordable = list(recipe.get('unrecordable') or [])
    if build and not same:
        unrecordable.append(f'it was built as {build["name"]}, saved as {architecture}')
    if unrecordable:
        out['unrecordable'] = unrecordable
    return out


def _checked_build_kwargs(build_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    sizes = sorted(set(build_kwargs) & set(SIZE_KEYS))
    if sizes:
        raise ValueError(f'build_kwargs {sizes}: the sizes are read from the model itself; drop them')
    bad = sorted(k for k, v in build_kwargs.items() if not json_ready(v))
    if bad:
        raise ValueError(f'build_kwargs {bad}: a file records names and numbers only, not {build_kwargs[bad[0]]!r}; '
                         f'give the registry name (act_layer=\'silu\') or load the file into a model you build')
    return dict(build_kwargs)


def _probe_size(model: nn.Module, sizes: Dict[str, Any]) -> Sequence[int]:
    """The (C, H, W) of the reference output: the model's input size, or the size a dynamic-size model was built for."""
    from ..profile import input_size_of  # profile imports deploy users; keep it lazy
    size = input_size_of(model)
    return (size[0], *sizes['img_size']) if sizes.get('dynamic_img_size') else size


def _checked_preprocessing(preprocessing: Dict[str, Sequence[float]], model: nn.Module) -> Dict[str, list]:
    """``preprocessing`` as JSON-ready lists, after checking its keys and lengths against the model."""
    from ..profile import fixed_image_size, input_size_of  # profile imports deploy users; keep it lazy
    unknown = sorted(set(preprocessing) - set(PREPROCESSING_KEYS))
    if unknown:
        raise ValueError(f'preprocessing keys {unknown} are not recorded; use {list(PREPROCESSING_KEYS)}')
    out = {k: [int(v) if k == 'input_size' else float(v) for v in preprocessing[k]]
           for k in PREPROCESSING_KEYS if preprocessing.get(k) is not None}
    chans = out['input_size'][0] if 'input_size' in out else input_size_of(model)[0]
    for key, value in out.items():
        want = 3 if key == 'input_size' else chans
        if len(value) != want:
            raise ValueError(f'preprocessing {key}={value}: expected {want} values'
                             + (' ([C, H, W])' if key == 'input_size' else ' (one per input channel)'))
    fixed = fixed_image_size(model)
    if 'input_size' in out and fixed is not None and tuple(out['input_size'][1:]) != fixed:
        raise ValueError(f'preprocessing input_size={out["input_size"]}: the model takes {fixed[0]}x{fixed[1]} '
                         f'images only')
    return out


def model_sizes(model: nn.Module) -> Dict[str, Any]:
    """The timm kwargs that rebuild ``model``'s shape: classes, input channels, and the image size
    when its patch embedding fixes one (ViT, Swin, Mixer; PoolFormer takes any size) or a ViT built with
    ``dynamic_img_size=True`` was built for (its position embedding's grid; ``dynamic_img_size`` too)."""
    from ..profile import fixed_image_size, input_size_of  # profile imports deploy users; keep it lazy
    sizes: Dict[str, Any] = {'in_chans': input_size_of(model)[0]}
    if isinstance(getattr(model, 'num_classes', None), int):
        sizes['num_classes'] = model.num_classes
    img_size = fixed_image_size(model)
    if img_size is not None:
        sizes['img_size'] = list(img_size)
    elif getattr(model, 'dynamic_img_size', False) is True:  # built for one size (its position embedding), runs any
        embed = getattr(model, 'patch_embed', None)
        if getattr(embed, 'img_size', None) is not None:
            sizes['img_size'] = [int(s) for s in embed.img_size]
            sizes['dynamic_img_size'] = True
    return sizes


def recorded_sizes(metadata: Dict[str, str]) -> Dict[str, Any]:
    """The sizes a deployed file records (``num_classes``, ``img_size``, ``in_chans``), as timm kwargs;
    empty for files written before vitblocks recorded them."""
    return {k: json.loads(metadata[k]) for k in SIZE_KEYS if k in metadata}


def recorded_preprocessing(metadata: Dict[str, str]) -> Dict[str, list]:
    """The preprocessing a deployed file records (any of ``input_size``, ``mean``, ``std``); empty when
    it was saved without (``save_deployed(..., preprocessing=None)``, files of older vitblocks)."""
    return {k: json.loads(metadata[k]) for k in PREPROCESSING_KEYS if k in metadata}


@contextmanager
def written_in_place_at_the_end(path: Path):
    """Yield where to write ``path``: a fresh hidden folder beside it. Once the write returns, what it wrote there
    (the file, and ONNX's ``<name>.data`` when the weights go outside) is renamed into place (``os.replace``:
    same directory, same file system), the named file last; a write that fails or is killed never leaves a
    truncated file at ``path`` nor replaces a good one."""
    folder = Path(tempfile.mkdtemp(prefix=f'.{path.name}.', suffix='.tmp', dir=path.parent))
    try:
        yield folder / path.name
        for f in sorted(folder.iterdir(), key=lambda f: f.name == path.name):  # the named file last
            os.replace(f, path.parent / f.name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


DIGEST_KEY = 'tensor_digest'  # metadata: 'sha256:<hex>' of the file's tensor data, checked by load_deployed


def data_digest(path: PathLike) -> str:
    """SHA-256 of a safetensors file's tensor data: every byte after its header (so the metadata, which holds the
    digest, is not part of it). Any flipped bit in a tensor changes it."""
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        header = int.from_bytes(f.read(8), 'little')
        f.seek(8 + header)
        for chunk in iter(lambda: f.read(1 << 20), b''):
            h.update(chunk)
    return 'sha256:' + h.hexdigest()


def write_safetensors(model: nn.Module, path: PathLike, metadata: Dict[str, str]) -> Path:
    """Write ``model``'s state dict and ``metadata`` to ``path`` atomically (``written_in_place_at_the_end``),
    with the digest of its tensor data in the metadata (:data:`DIGEST_KEY`); parent directories are created.
    Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_in_place_at_the_end(path) as tmp:
        try:
            save_model(model, str(tmp), metadata=metadata)  # shared tensors stored once, made contiguous
            # again with the digest of what was written: the metadata sits in the header, the data is laid out alike
            save_model(model, str(tmp), metadata={**metadata, DIGEST_KEY: data_digest(tmp)})
        except SafetensorError as e:  # safetensors reports a full disk as its own error: an OSError for the callers
            raise OSError(f'cannot write {path}: {e}') from None
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors writes its files 0600; give the usual mode (a server reads it)
    return path


def read_deployed_metadata(path: PathLike) -> Dict[str, str]:
    """The metadata of a deployed checkpoint, after checking that it is one."""
    path = Path(path)
    if path.is_dir():  # a run folder: its checkpoints are training form; `vitblocks export` writes the deployed file
        raise DeployedCheckpointError(f'no deployed checkpoint at {path}: a folder, not a file; give the .safetensors '
                                      f'file (`vitblocks export --format safetensors` writes one from a run)')
    if not path.is_file():
        raise DeployedCheckpointError(f'no deployed checkpoint at {path}: the file does not exist')
    try:
        with safe_open(str(path), framework='pt') as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise DeployedCheckpointError(
            f'{path} is not a readable safetensors file ({e}); it is corrupt or truncated, or another format '
            f'(a torch .pth/.bin checkpoint?). Re-save it with vitblocks.deploy.io.save_deployed') from None
    if metadata.get('format') != FORMAT:
        found = f"format {metadata['format']!r}" if 'format' in metadata else 'no vitblocks format tag'
        raise DeployedCheckpointError(
            f'{path} is a safetensors file but not a vitblocks deployed checkpoint ({found}; expected {FORMAT!r}). '
            f'For plain weights use safetensors.torch.load_file and model.load_state_dict')
    for key in (*SIZE_KEYS, *PREPROCESSING_KEYS, *RECIPE_KEYS, REFERENCE_KEY):  # JSON, checked where the path is known
        if key in metadata:
            try:
                json.loads(metadata[key])
            except ValueError:
                raise DeployedCheckpointError(f'{path}: its metadata {key}={metadata[key][:80]!r} is not JSON; the '
                                              f'header was damaged or edited: re-save the file with '
                                              f'vitblocks.deploy.io.save_deployed') from None
    return metadata


def is_deployed_file(path: PathLike) -> bool:
    """Whether ``path`` is a readable safetensors file tagged as a vitblocks deployed checkpoint (a
    plain safetensors state dict, another format or a missing file: False)."""
    path = Path(path)
    if path.suffix != '.safetensors' or not path.is_file():
        return False
    try:
        read_deployed_metadata(path)
    except DeployedCheckpointError:
        return False
    return True


def _build_deployed(name: str, block_cfg: Optional[Dict[str, Any]], surgery: Sequence[Dict[str, Any]] = (),
                    **kwargs) -> nn.Module:
    """``name`` in deploy form: a vitblocks model built directly with ``block_cfg['deploy'] = True``
    (no training-form weights); a timm model, or a vitblocks method without a deploy option (built with
    ``block_cfg``), built and re-parameterized. Recorded ``surgery`` is replayed on the training form, which is
    then re-parameterized."""
    from ..models import list_models, resolve_model_name
    try:
        name = resolve_model_name(name)
    except ValueError as e:
        raise DeployedCheckpointError(str(e)) from None
    try:
        if surgery:
            if block_cfg and name not in list_models():
                raise DeployedCheckpointError(f'block_cfg applies to vitblocks models only; {name} is a timm model')
            model = timm.create_model(name, **({'block_cfg': block_cfg} if block_cfg else {}), **kwargs)
            return _reparameterize(replay_surgery(model, list(surgery)), inplace=True)
        if name in list_models():
            try:
                return timm.create_model(name, block_cfg={**(block_cfg or {}), 'deploy': True}, **kwargs).eval()
            except (TypeError, ValueError) as e:  # a method without a deploy option (MABViT raises ValueError)
                if 'deploy' not in str(e):
                    raise
            # no deploy option: the training form with the same block config, re-parameterized
            return _reparameterize(timm.create_model(name, **({'block_cfg': block_cfg} if block_cfg else {}),
                                                     **kwargs), inplace=True)
        if block_cfg:
            raise DeployedCheckpointError(f'block_cfg applies to vitblocks models only; {name} is a timm model')
        return _reparameterize(timm.create_model(name, **kwargs), inplace=True)
    except (TypeError, ValueError, KeyError) as e:  # e.g. a recorded size or a block config the builder does not take
        if isinstance(e, DeployedCheckpointError):
            raise
        with_surgery = f' and surgery {[s.get("surgery") for s in surgery]}' if surgery else ''
        raise DeployedCheckpointError(f'cannot build {name} with {kwargs or "its defaults"}, block config '
                                      f'{block_cfg or {}}{with_surgery}: {type(e).__name__}: {e}') from None


def _as_size(key: str, value: Any) -> Any:
    """img_size 32, (32, 32) and [32, 32] are one size."""
    return tuple(to_2tuple(value)) if key == 'img_size' else value


def load_deployed(name_or_model: Union[str, nn.Module, None], path: PathLike,
                  block_cfg: Optional[Dict[str, Any]] = None, device: Union[str, torch.device] = 'cpu',
                  verify: bool = True, **kwargs) -> nn.Module:
    """Build a model in deploy form and load a deployed checkpoint into it (strict).

    Args:
        name_or_model: a timm / vitblocks model name, built directly in deploy form (RePa, IFFN
            and AFBO models with ``block_cfg={'deploy': True}``, so no training-form weights are
            created); ``None`` for the name recorded in the file; or a model, which is
            re-parameterized in place first if it is still in training form, then loaded into.
        path: a file written by :func:`save_deployed`.
        block_cfg: block config of the model (default: the one recorded in the file, if any).
        device: where the weights are loaded.
        verify: run the loaded model on the seeded image the file records its output for, and refuse
            a model that computes something else (``DeployedCheckpointError``: it was built otherwise
            than the file was saved from). Files without a reference output are not checked.
        **kwargs: timm kwargs for building by name. ``num_classes``, ``img_size``, ``in_chans`` and
            ``dynamic_img_size`` default to the file's, other kwargs to the ones the file records
            (``build_kwargs``); giving another size than the file records is an error. Files
            written before the sizes were recorded need them here if they are not the defaults.
            The surgery the file records (a ``swap_ffn``'d timm model) is replayed.

    Returns:
        The model with the checkpoint's weights, in eval mode.

    Raises:
        DeployedCheckpointError: the file is missing, damaged or not a deployed checkpoint; it does not fit
            the model; it records a model it cannot rebuild (``unrecordable``: load it into a model you build);
            or the loaded model does not compute the file's reference output.
    """
    path = Path(path)
    metadata = read_deployed_metadata(path)
    saved = metadata.get('architecture', '')
    recorded = recorded_sizes(metadata)
    if name_or_model is None:
        if not saved:
            raise DeployedCheckpointError(f'{path} records no model name; pass the name it was saved from')
        name_or_model = saved
    if isinstance(name_or_model, str):
        if saved and saved != name_or_model and saved.split('.')[0] != name_or_model.split('.')[0]:
            raise DeployedCheckpointError(f'{path} holds weights of {saved}, not {name_or_model}; '
                                          f'pass {saved!r} (or build the model yourself and pass it)')
        for key, value in recorded.items():
            given = kwargs.get(key, value)
            if _as_size(key, given) != _as_size(key, value):
                raise DeployedCheckpointError(f'{path} was saved with {key}={value}, not {given}; drop {key} (the '
                                              f'file sets it)')
        unrecordable = json.loads(metadata.get('unrecordable', '[]'))
        if unrecordable:
            raise DeployedCheckpointError(f'{path} cannot be rebuilt by the file alone: {"; ".join(unrecordable)}. '
                                          f'Build the model as it was built and pass it: load_deployed(model, path)')
        cfg = block_cfg if block_cfg is not None else json.loads(metadata.get('block_cfg', '{}'))
        build_kwargs = json.loads(metadata.get('build_kwargs', '{}'))
        surgery = json.loads(metadata.get('surgery', '[]'))
        model = _build_deployed(name_or_model, cfg, surgery, **{**build_kwargs, **kwargs, **recorded})
        what = name_or_model
    else:
        model = _reparameterize(name_or_model, inplace=True)
        what = _architecture(model) or type(model).__name__
    if DIGEST_KEY in metadata and data_digest(path) != metadata[DIGEST_KEY]:  # files written before: not checked
        raise DeployedCheckpointError(f'{path} is damaged: its tensors do not match the digest recorded when it was '
                                      f'saved (bytes changed on disk or in a copy); copy it again or re-save it with '
                                      f'vitblocks.deploy.io.save_deployed')
    try:
        load_model(model, str(path), strict=True, device=str(device))
    except SafetensorError as e:  # a valid header over truncated or damaged data
        raise DeployedCheckpointError(f'{path} is damaged: its header reads but its tensors do not ({e}); '
                                      f're-save it with vitblocks.deploy.io.save_deployed') from None
    except RuntimeError as e:  # missing / unexpected keys or shape mismatch
        detail = ' '.join(str(e).split())
        hint = ('Was it saved from another model or block config (idle_ratio?), or from a timm model built with '
                'kwargs it does not record (depth=...: save it with build_kwargs=, or pass them here)' if recorded else
                'It records no sizes (written before vitblocks recorded them): pass the num_classes / img_size / '
                'in_chans it was built with; or was it saved from another model or block config (idle_ratio?)')
        raise DeployedCheckpointError(
            f'{path} ({saved or "unknown model"}) does not fit {what} in deploy form: {detail[:500]}. {hint}') from None
    model = model.to(device).eval()
    if verify and REFERENCE_KEY in metadata:
        differs = check_reference_output(model, metadata[REFERENCE_KEY])
        if differs:
            raise DeployedCheckpointError(
                f'{path} loads into {what} but it does not compute what the saved model computed (max abs error '
                f'{differs["max_abs_error"]:.3g} on outputs up to {differs["largest_output"]:.3g}, tolerance '
                f'{differs["tolerance"]:.3g}): the model was built otherwise (a block config, an option, a surgery '
                f'or a module not recorded in the file, or block_cfg/kwargs given here); build it as it was built '
                f'and pass it, load_deployed(model, path)')
    return model
