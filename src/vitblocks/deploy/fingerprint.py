"""A deployed file's own test: what its model computed on a fixed input when it was saved.

``save_deployed`` runs the deployed model once on a seeded random image and records the first
outputs (``reference_output`` in the file's metadata); ``load_deployed`` runs the rebuilt model on the
same image and refuses a model that computes something else. The state dict alone cannot tell an
activation, an activation position or an image-size option apart (they hold no weights), so this is
what makes a file that does not record everything its model was built with fail loudly instead of
loading into a model that computes other outputs.
"""
import json
from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

__all__ = ['REFERENCE_KEY', 'reference_output', 'check_reference_output']

REFERENCE_KEY = 'reference_output'
NUM_VALUES = 64  # outputs recorded: enough to tell models apart, small enough for a file header
REL_TOL = 1e-2  # of the largest recorded output: above float32 (and TF32 conv) round-off, below a changed block


def _model_place(model: nn.Module):
    p = next(iter(model.parameters()), None)
    return (p.device, p.dtype) if p is not None else (torch.device('cpu'), torch.float32)


@torch.no_grad()
def _outputs(model: nn.Module, input_size: Sequence[int], seed: int) -> Optional[torch.Tensor]:
    device, dtype = _model_place(model)
    x = torch.randn(1, *input_size, generator=torch.Generator().manual_seed(seed))
    out = model(x.to(device, dtype if dtype.is_floating_point else torch.float32))
    return out.detach().float().flatten().cpu() if isinstance(out, torch.Tensor) else None


def reference_output(model: nn.Module, input_size: Sequence[int], seed: int = 0) -> Optional[str]:
    """JSON of the first outputs of ``model`` (eval mode) on a seeded ``(1, *input_size)`` image; None when its
    output is not one tensor (nothing to compare)."""
    out = _outputs(model, input_size, seed)
    if out is None or not torch.isfinite(out).all():
        return None
    return json.dumps({'input_size': [int(s) for s in input_size], 'seed': seed, 'dtype': str(_model_place(model)[1]),
                       'values': [float(f'{v:.7g}') for v in out[:NUM_VALUES].tolist()]})


def _tolerance(values: torch.Tensor, *dtypes: torch.dtype) -> float:
    rel = max([REL_TOL] + [8 * torch.finfo(d).eps for d in dtypes if d.is_floating_point])
    return 1e-4 + rel * values.abs().max().item()


def check_reference_output(model: nn.Module, recorded: str) -> Optional[Dict[str, Any]]:
    """None when ``model`` computes the ``recorded`` reference (within round-off), else what differs
    (``max_abs_error``, ``largest_output``, ``tolerance``)."""
    ref = json.loads(recorded)
    want = torch.tensor(ref['values'], dtype=torch.float32)
    got = _outputs(model, ref['input_size'], int(ref.get('seed', 0)))
    saved_dtype = getattr(torch, str(ref.get('dtype', 'torch.float32')).replace('torch.', ''), torch.float32)
    tol = _tolerance(want, saved_dtype, _model_place(model)[1])
    if got is None or got.numel() < want.numel():
        return {'max_abs_error': float('inf'), 'largest_output': want.abs().max().item(), 'tolerance': tol}
    err = (got[:want.numel()] - want).abs().max().item()
    if err <= tol:
        return None
    return {'max_abs_error': err, 'largest_output': want.abs().max().item(), 'tolerance': tol}
