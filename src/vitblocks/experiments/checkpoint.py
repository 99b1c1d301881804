"""Checkpoints: atomic writes, loads that never execute code, clear errors for bad files.

A training checkpoint is a plain dict of tensors, numbers, strings, lists and dicts (RNG
states included, converted to tensors), so ``torch.load(weights_only=True)`` reads it. It is
written to a temporary file in the same folder, flushed and fsynced, then renamed over the
old one: a run killed while saving leaves the previous checkpoint intact. It also stores a
SHA-256 digest of everything it holds (``state_digest``: every tensor, and every number, string and
flag, such as an optimizer's betas or the step count), checked on every load: torch's zip reader
does not notice flipped bytes, which would otherwise load as silently wrong weights or settings.
Checkpoints written before hold ``tensor_digest`` (tensors only), still checked.

Model weights for evaluation are also read from ``.safetensors`` files and from the usual
timm / plain ``state_dict`` layouts.
"""
import hashlib
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Union

import numpy as np
import torch

__all__ = ['CheckpointError', 'save_checkpoint', 'load_checkpoint', 'load_model_weights', 'read_checkpoint',
           'missing_checkpoint', 'rng_state', 'set_rng_state', 'tensor_digest', 'state_digest', 'FORMAT',
           'keep_in_history', 'newest_good_in_history', 'HISTORY']

FORMAT = 'vitblocks-train-checkpoint-v1'


class CheckpointError(ValueError):
    """A missing, truncated, foreign or mismatched checkpoint (the message names the file)."""


def tensor_digest(obj: Any) -> str:
    """SHA-256 over every tensor in ``obj`` (nested dicts/lists), with its place, dtype and shape."""
    h = hashlib.sha256()

    def walk(o: Any, where: str) -> None:
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            h.update(f'{where}|{t.dtype}|{tuple(t.shape)}|'.encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # the raw bytes, any dtype
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f'{where}/{k}')
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, f'{where}/{i}')

    walk(obj, '')
    return 'sha256:' + h.hexdigest()


def state_digest(obj: Any) -> str:
    """SHA-256 over everything in ``obj`` (nested dicts/lists): each tensor as :func:`tensor_digest` hashes it,
    and each other value by its type and exact ``repr`` (floats round-trip), with its place."""
    h = hashlib.sha256()

    def walk(o: Any, where: str) -> None:
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            h.update(f'{where}|{t.dtype}|{tuple(t.shape)}|'.encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            h.update(f'{where}|dict|{len(o)}|'.encode())
            for k, v in o.items():
                walk(v, f'{where}/{k!r}')
        elif isinstance(o, (list, tuple)):
            h.update(f'{where}|{type(o).__name__}|{len(o)}|'.encode())
            for i, v in enumerate(o):
                walk(v, f'{where}/{i}')
        else:
            h.update(f'{where}|{type(o).__name__}|{o!r}|'.encode())

    walk(obj, '')
    return 'sha256:' + h.hexdigest()


def verify_digest(ckpt: Any, path: Path) -> None:
    """Raise CheckpointError if ``ckpt`` carries a ``state_digest`` (or, written before, a ``tensor_digest``) that
    its contents do not match."""
    if not isinstance(ckpt, dict):
        return
    if 'state_digest' in ckpt:
        key, digest = 'state_digest', state_digest
    elif 'tensor_digest' in ckpt:
        key, digest = 'tensor_digest', tensor_digest
    else:
        return  # written by torch.save or an older vitblocks: nothing to check against
    stored = ckpt[key]
    if digest({k: v for k, v in ckpt.items() if k != key}) != stored:
        raise CheckpointError(f'{path}: corrupt: its tensors do not match the digest stored when it was written '
                              f'(bytes changed on disk or in a copy); use another checkpoint (best.pth, a backup) '
                              f'or re-copy the file')


HISTORY = 'history'  # a run folder's copies of its newest last.pth (checkpoint_hist)


def keep_in_history(run_dir: Path, step: int, keep: int) -> None:
    """Copy the run's ``last.pth`` to ``history/step<step>.pth`` and delete all but the ``keep`` newest copies.
    A copy, not a link: a byte flipped on disk in one must not reach the other."""
    history = Path(run_dir) / HISTORY
    history.mkdir(exist_ok=True)
    dst = history / f'step{step:09d}.pth'
    tmp = history / f'.{dst.name}.tmp'
    try:
        shutil.copyfile(Path(run_dir) / 'last.pth', tmp)
        os.replace(tmp, dst)
    except OSError as e:  # a full disk: last.pth itself is saved; the history stays as it was
        tmp.unlink(missing_ok=True)
        print(f'checkpoint history: could not copy last.pth to {dst} ({e.strerror or e}); kept the older copies',
              flush=True)
        return
    for old in sorted(history.glob('step*.pth'))[:-keep]:
        old.unlink(missing_ok=True)


def newest_good_in_history(run_dir: Path):
    """(path, checkpoint) of the newest copy in the run's history that loads and passes its digest, else None."""
    for path in sorted((Path(run_dir) / HISTORY).glob('step*.pth'), reverse=True):
        try:
            return path, load_checkpoint(path)
        except CheckpointError:
            continue
    return None


def save_checkpoint(state: Dict[str, Any], path: Union[str, Path]) -> None:
    path = Path(path)
    state = {'format': FORMAT, **{k: v for k, v in state.items() if k not in ('tensor_digest', 'state_digest')}}
    state['state_digest'] = state_digest(state)  # a loaded checkpoint saved again: its contents, not its old digest
    try:
        fd, tmp = tempfile.mkstemp(prefix=f'.{path.name}.', suffix='.tmp', dir=path.parent)
    except OSError as e:
        raise CheckpointError(f'{path}: cannot write a checkpoint there ({e.strerror or e})') from None
    try:
        with os.fdopen(fd, 'wb') as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        kept = 'the previous checkpoint is intact' if path.exists() else 'no checkpoint was written'
        if isinstance(e, OSError):  # a full disk, a quota, a vanished folder
            raise CheckpointError(f'{path}: cannot write the checkpoint ({e.strerror or e}); {kept}') from None
        if isinstance(e, RuntimeError) and _stream_write_failed(e):  # torch's zip writer: "unexpected pos ..."
            raise CheckpointError(f'{path}: cannot write the checkpoint: the write stopped part-way '
                                  f'({_free_space(path.parent)}; a full disk or quota?); {kept}') from None
        raise


def _stream_write_failed(e: RuntimeError) -> bool:
    """Whether torch.save's zip writer failed to write (it reports a short write as a position mismatch)."""
    text = str(e)
    return any(m in text for m in ('unexpected pos', 'PytorchStreamWriter failed', 'file write failed'))


def _free_space(folder: Path) -> str:
    try:
        return f'{shutil.disk_usage(folder).free / 2 ** 20:.1f} MiB free in {folder}'
    except OSError:
        return f'free space in {folder} unknown'


def missing_checkpoint(path: Path) -> str:
    """Why ``path`` (not a file) cannot be read: a run folder given for its checkpoint names the files in it."""
    if path.is_dir():
        found = sorted(p.name for p in path.iterdir() if p.suffix in ('.pth', '.safetensors'))
        hint = f'give one of its files ({", ".join(found)})' if found else 'it holds no .pth or .safetensors file'
        return f'{path}: a folder, not a checkpoint file; {hint}'
    return f'{path}: no such checkpoint file'


def read_checkpoint(path: Path) -> Any:
    """Whatever a ``.pth`` file holds, loaded with ``weights_only=True``; a clear error otherwise."""
    if not path.is_file():
        raise CheckpointError(missing_checkpoint(path))
    if path.stat().st_size == 0:
        raise CheckpointError(f'{path}: empty file (a checkpoint cut off while being written?)')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except PermissionError as e:  # not corrupt: unreadable for this user
        raise CheckpointError(f'{path}: cannot read it ({e.strerror or e}); check its permissions') from None
    except Exception as e:  # zip reader errors, EOF, unpickling refused by weights_only, ...
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if 'Unsupported operand' in str(e):  # the weights-only unpickler met bytes that are no pickle opcode
            raise CheckpointError(f'{path}: corrupt: its pickled data does not read ({_unpickler_detail(e)}); use '
                                  f'another checkpoint (best.pth, a backup) or re-copy the file') from None
        if 'Unsupported global' in str(e) or 'weights_only' in str(e):
            raise CheckpointError(f'{path}: refused to load: it holds Python objects that would run code when '
                                  f'unpickled ({msg[:200]}); vitblocks only loads tensors '
                                  f'(weights_only=True)') from None
        raise CheckpointError(f'{path}: not a readable PyTorch checkpoint; truncated or corrupt? '
                              f'({type(e).__name__}: {msg[:200]})') from None
    verify_digest(ckpt, path)
    return ckpt


def _unpickler_detail(e: Exception) -> str:
    """The weights-only unpickler's own line ('Unsupported operand 250'), without torch's advice around it."""
    text = str(e)
    i = text.find('Unsupported operand')
    return text[i:].splitlines()[0].strip() if i >= 0 else type(e).__name__


def load_checkpoint(path: Union[str, Path]) -> Dict[str, Any]:
    """A vitblocks training checkpoint (for ``--resume``)."""
    path = Path(path)
    ckpt = read_checkpoint(path)
    if not isinstance(ckpt, dict) or ckpt.get('format') != FORMAT:
        keys = sorted(ckpt)[:6] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f'{path}: not a vitblocks training checkpoint (top-level keys: {keys}); '
                              f'--resume needs the last.pth of a vitblocks run folder')
    return ckpt


def load_model_weights(path: Union[str, Path], ema: bool = False) -> Dict[str, torch.Tensor]:
    """A model ``state_dict`` from a vitblocks checkpoint (``ema``: its EMA weights), a safetensors
    file, a timm-style ``{'state_dict': ...}`` / ``{'model': ...}`` checkpoint or a bare state dict."""
    path = Path(path)
    if path.suffix == '.safetensors':
        if ema:
            raise CheckpointError(f'{path}: EMA weights are only read from vitblocks training checkpoints '
                                  f'(a safetensors file holds one set of weights); drop --ema')
        if not path.is_file():
            raise CheckpointError(missing_checkpoint(path))
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f'{path}: not a readable safetensors file ({e})') from None
    ckpt = read_checkpoint(path)
    if isinstance(ckpt, dict) and ckpt.get('format') == FORMAT:
        if ema:
            if ckpt.get('model_ema') is None:
                raise CheckpointError(f'{path}: this run kept no EMA weights (train with model_ema=true)')
            return ckpt['model_ema']
        return ckpt['model']
    if ema:
        raise CheckpointError(f'{path}: EMA weights are only read from vitblocks training checkpoints')
    for key in ('state_dict', 'model'):
        if isinstance(ckpt, dict) and isinstance(ckpt.get(key), dict):
            ckpt = ckpt[key]
            break
    if not isinstance(ckpt, dict) or not ckpt or not all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        raise CheckpointError(f'{path}: holds no model state_dict (expected a mapping of parameter names to tensors)')
    return {k[7:] if k.startswith('module.') else k: v for k, v in ckpt.items()}  # strip a DDP prefix


def rng_state() -> Dict[str, Any]:
    """Every RNG a training step draws from, as tensors/ints (weights_only-loadable)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        'torch': torch.get_rng_state(),
        'numpy': {'keys': torch.from_numpy(np_state[1].astype(np.int64)), 'pos': int(np_state[2]),
                  'has_gauss': int(np_state[3]), 'cached_gaussian': float(np_state[4])},
        'python': {'version': py_state[0], 'state': list(py_state[1]), 'gauss': py_state[2]},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state['torch'])
    n = state['numpy']
    np.random.set_state(('MT19937', n['keys'].numpy().astype(np.uint32), n['pos'], n['has_gauss'],
                         n['cached_gaussian']))
    p = state['python']
    random.setstate((p['version'], tuple(p['state']), p['gauss']))
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])
