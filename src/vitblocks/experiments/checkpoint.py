"""Checkpoints: atomic writes, loads that never execute code, clear errors for bad files.

A training checkpoint is a plain dict of tensors, numbers, strings, lists and dicts (RNG
states included, converted to tensors), so ``torch.load(weights_only=True)`` reads it. It is
written to a temporary file in the same folder, flushed and fsynced, then renamed over the
old one: a run killed while saving leaves the previous checkpoint intact.

Model weights for evaluation are also read from ``.safetensors`` files and from the usual
timm / plain ``state_dict`` layouts.
"""
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Dict, Union

import numpy as np
import torch

__all__ = ['CheckpointError', 'save_checkpoint', 'load_checkpoint', 'load_model_weights', 'read_checkpoint',
           'rng_state', 'set_rng_state', 'FORMAT']

FORMAT = 'vitblocks-train-checkpoint-v1'


class CheckpointError(ValueError):
    """A missing, truncated, foreign or mismatched checkpoint (the message names the file)."""


def save_checkpoint(state: Dict[str, Any], path: Union[str, Path]) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f'.{path.name}.', suffix='.tmp', dir=path.parent)
    try:
        with os.fdopen(fd, 'wb') as f:
            torch.save({'format': FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_checkpoint(path: Path) -> Any:
    """Whatever a ``.pth`` file holds, loaded with ``weights_only=True``; a clear error otherwise."""
    if not path.is_file():
        raise CheckpointError(f'{path}: no such checkpoint file')
    if path.stat().st_size == 0:
        raise CheckpointError(f'{path}: empty file (a checkpoint cut off while being written?)')
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # zip reader errors, EOF, unpickling refused by weights_only, ...
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if 'weights_only' in str(e) or 'Unsupported global' in str(e):
            raise CheckpointError(f'{path}: refused to load: it holds Python objects that would run code when '
                                  f'unpickled ({msg[:200]}); vitblocks only loads tensors '
                                  f'(weights_only=True)') from None
        raise CheckpointError(f'{path}: not a readable PyTorch checkpoint; truncated or corrupt? '
                              f'({type(e).__name__}: {msg[:200]})') from None


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
        if not path.is_file():
            raise CheckpointError(f'{path}: no such checkpoint file')
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
