"""Export a deployed model to ONNX or TorchScript, and check the export against PyTorch.

    from vitblocks.deploy import reparameterize
    from vitblocks.deploy.export import check_export, export_onnx

    deployed = reparameterize(model)                       # fuse first: the export is what you run
    path = export_onnx(deployed, 'repa_deit_b.onnx')       # batch dimension dynamic
    max_abs_error = check_export(path, deployed)           # onnxruntime vs PyTorch on a random batch

ONNX needs the ``onnx`` package; torch's default exporter (``dynamo=True``, via
``torch.export``) also needs ``onnxscript``; ``dynamo=False`` selects torch's TorchScript-based
exporter instead. Checking an ONNX file needs ``onnxruntime``. TorchScript uses
``torch.jit.trace`` (shapes are fixed at trace time except the batch dimension of plain ViTs).
The command line is ``vitblocks export``.
"""
import importlib.util
import warnings
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import nn

from ..profile import input_size_of

__all__ = ['export_onnx', 'export_torchscript', 'check_export', 'example_input', 'ExportDependencyError', 'FORMATS']

FORMATS = ('onnx', 'torchscript')

PathLike = Union[str, Path]


class ExportDependencyError(ImportError):
    """An optional package needed for ONNX export or checking is missing (the message says which)."""


def _require(*packages: str, purpose: str) -> None:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ExportDependencyError(f'{purpose} needs {", ".join(missing)}: pip install {" ".join(missing)} '
                                    f'(or pip install "vitblocks[export]")')


def example_input(model: nn.Module, input_size: Optional[Sequence[int]] = None, batch_size: int = 1) -> torch.Tensor:
    """A random ``(batch_size, C, H, W)`` batch on the model's device and dtype (size from its config)."""
    p = next(model.parameters())
    size = tuple(input_size) if input_size is not None else input_size_of(model)
    return torch.randn(batch_size, *size, device=p.device, dtype=p.dtype)


def _prepare(model: nn.Module, path: PathLike) -> Path:
    if model.training:
        raise ValueError('export expects a model in eval mode (BatchNorm running statistics, no dropout); call '
                         'vitblocks.deploy.reparameterize(model) (returns it in eval mode) or model.eval() first')
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@torch.no_grad()
def export_onnx(model: nn.Module, path: PathLike, input_size: Optional[Sequence[int]] = None, batch_size: int = 2,
                dynamic_batch: bool = True, opset: Optional[int] = None, dynamo: bool = True) -> Path:
    """Export ``model`` (eval mode; deploy it first) to an ONNX file with input ``input`` and output ``output``.

    Args:
        input_size: ``(C, H, W)`` (default: the model's pretrained config).
        batch_size: batch of the example input used for tracing.
        dynamic_batch: leave the batch dimension symbolic, so any batch size runs.
        opset: ONNX opset (default: the exporter's).
        dynamo: torch's ``torch.export``-based exporter (default; needs ``onnxscript``);
            ``False`` selects the TorchScript-based one.
    """
    _require('onnx', *(('onnxscript',) if dynamo else ()), purpose='ONNX export')
    path = _prepare(model, path)
    x = example_input(model, input_size, batch_size)
    kwargs = dict(input_names=['input'], output_names=['output'], opset_version=opset, dynamo=dynamo)
    if dynamic_batch and dynamo:
        kwargs['dynamic_shapes'] = ({0: torch.export.Dim('batch')},)
    elif dynamic_batch:
        kwargs['dynamic_axes'] = {'input': {0: 'batch'}, 'output': {0: 'batch'}}
    if dynamo:
        kwargs.update(verbose=False, external_data=False)  # one self-contained file (under 2 GB)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', torch.jit.TracerWarning)  # timm's shape asserts, constant when traced
        torch.onnx.export(model, (x,), str(path), **kwargs)
    return path


@torch.no_grad()
def export_torchscript(model: nn.Module, path: PathLike, input_size: Optional[Sequence[int]] = None,
                       batch_size: int = 2) -> Path:
    """Trace ``model`` (eval mode; deploy it first) with ``torch.jit.trace`` and save it to ``path``."""
    path = _prepare(model, path)
    x = example_input(model, input_size, batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', torch.jit.TracerWarning)
        traced = torch.jit.trace(model, (x,))
    torch.jit.save(traced, str(path))
    return path


@torch.no_grad()
def check_export(path: PathLike, model: nn.Module, input_size: Optional[Sequence[int]] = None,
                 batch_size: int = 3, seed: int = 0) -> float:
    """Max absolute difference between the exported file and ``model`` on one random batch.

    ``.onnx`` files run in onnxruntime (CPU), anything else is loaded with ``torch.jit.load``.
    The default batch differs from the export's example batch, so a batch dimension that was
    frozen at export time shows up as an error.
    """
    path = Path(path)
    gen = torch.Generator().manual_seed(seed)
    size = tuple(input_size) if input_size is not None else input_size_of(model)
    x = torch.randn(batch_size, *size, generator=gen)
    p = next(model.parameters())
    expected = model(x.to(p.device, p.dtype)).float().cpu()
    if path.suffix == '.onnx':
        _require('onnxruntime', purpose='checking an ONNX export')
        import onnxruntime
        session = onnxruntime.InferenceSession(str(path), providers=['CPUExecutionProvider'])
        name = session.get_inputs()[0].name
        got = torch.from_numpy(session.run(None, {name: x.to(p.dtype).numpy()})[0]).float()
    else:
        got = torch.jit.load(str(path), map_location=p.device)(x.to(p.device, p.dtype)).float().cpu()
    if got.shape != expected.shape:
        raise ValueError(f'{path} returned shape {tuple(got.shape)} for a batch of {batch_size}, expected '
                         f'{tuple(expected.shape)}; was the batch dimension exported as dynamic?')
    return (got - expected).abs().max().item()
