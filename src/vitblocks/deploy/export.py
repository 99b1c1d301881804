"""Export a deployed model to a torch.export program (.pt2) or ONNX, and check the export against PyTorch.

    from vitblocks.deploy import reparameterize
    from vitblocks.deploy.export import check_export, export_onnx, export_pt2

    deployed = reparameterize(model)                       # fuse first: the export is what you run
    path = export_pt2(deployed, 'repa_deit_b.pt2')         # torch.export + torch.export.save, dynamic batch
    max_abs_error = check_export(path, deployed)           # torch.export.load vs eager on a random batch
    path = export_onnx(deployed, 'repa_deit_b.onnx')       # batch dimension dynamic
    max_abs_error = check_export(path, deployed)           # onnxruntime vs PyTorch on a random batch

``.pt2`` files load with ``torch.export.load(path).module()`` (no Python model code needed) and
feed ``torch.compile`` / AOTInductor. ONNX needs the ``onnx`` package; torch's default exporter
(``dynamo=True``, via ``torch.export``) also needs ``onnxscript``, and writes the weights to a
``<file>.data`` file beside the model when they exceed protobuf's 2 GB limit (ViT-H);
``dynamo=False`` selects torch's TorchScript-based exporter instead. Checking an ONNX file needs
``onnxruntime``. TorchScript (``torch.jit.trace``, deprecated in torch 2.x) is kept for existing
users: :func:`export_torchscript` warns and points to :func:`export_pt2`.
The command line is ``vitblocks export``.
"""
import importlib.util
import io
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import nn

from ..profile import input_size_of
from .io import written_in_place_at_the_end

__all__ = ['export_pt2', 'export_onnx', 'export_torchscript', 'check_export', 'example_input', 'traced_batch_size',
           'ExportDependencyError', 'ExportCheckError', 'DYNAMO_MIN_OPSET', 'verify_tolerance', 'require_packages',
           'FORMATS', 'ONNX_PROTOBUF_LIMIT', 'weight_bytes']

FORMATS = ('pt2', 'onnx', 'torchscript')  # torchscript: deprecated, kept for existing users
ONNX_PROTOBUF_LIMIT = 2 ** 31  # bytes; an ONNX file holding more weights must keep them as external data
# the oldest opset torch's dynamo exporter writes itself; below it, it converts its file down and keeps opset 18
# where an op has no older form (LayerNormalization, in every transformer)
DYNAMO_MIN_OPSET = 18

PathLike = Union[str, Path]


class ExportDependencyError(ImportError):
    """An optional package needed for ONNX export or checking is missing (the message says which)."""


def require_packages(*packages: str, purpose: str) -> None:
    """``ExportDependencyError`` naming the optional ``packages`` not installed (with the pip command)."""
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


def _batch_dim() -> dict:
    return {0: torch.export.Dim('batch')}  # the batch dimension symbolic (batch 1 runs too)


def traced_batch_size(batch_size: int, dynamic_batch: bool) -> int:
    """torch.export specializes a size-1 dimension to the constant 1, so a dynamic batch is traced
    with an example batch of at least 2 (the exported program still runs batch 1)."""
    return max(batch_size, 2) if dynamic_batch else batch_size


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (what an export stores)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


@torch.no_grad()
def export_pt2(model: nn.Module, path: PathLike, input_size: Optional[Sequence[int]] = None, batch_size: int = 2,
               dynamic_batch: bool = True, verify: bool = True) -> Path:
    """Export ``model`` (eval mode; deploy it first) with ``torch.export.export`` and write the
    program with ``torch.export.save`` (load it with ``torch.export.load(path).module()``).

    Args:
        input_size: ``(C, H, W)`` (default: the model's config).
        batch_size: batch of the example input (at least 2 with ``dynamic_batch``, see above).
        dynamic_batch: leave the batch dimension symbolic, so any batch size runs.
        verify: before the file is put in place, load it back and :func:`check_export` it (called with autograd
            on and under no_grad, at another batch size where it is dynamic): a program that fails or computes
            other outputs (max abs error above :func:`verify_tolerance`) is an ``ExportCheckError`` and nothing
            is written. ``False`` writes whatever the exporter produced.
    """
    path = _prepare(model, path)
    x = example_input(model, input_size, traced_batch_size(batch_size, dynamic_batch))
    program = torch.export.export(model, (x,), dynamic_shapes=(_batch_dim(),) if dynamic_batch else None)
    # serialized in memory first: torch's C++ zip writer aborts the whole process when a write to a file fails (a
    # full disk); Python's write below raises an OSError the caller reports, and the old file stays
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    with written_in_place_at_the_end(path) as tmp:
        tmp.write_bytes(buffer.getbuffer())
        if verify:
            _verify(tmp, path, model, x, dynamic_batch, 'export_onnx, or save_deployed and run the model in PyTorch')
    return path


@torch.no_grad()
def export_onnx(model: nn.Module, path: PathLike, input_size: Optional[Sequence[int]] = None, batch_size: int = 2,
                dynamic_batch: bool = True, opset: Optional[int] = None, dynamo: bool = True,
                external_data: Optional[bool] = None, verify: bool = True) -> Path:
    """Export ``model`` (eval mode; deploy it first) to an ONNX file with input ``input`` and output ``output``.

    Args:
        input_size: ``(C, H, W)`` (default: the model's pretrained config).
        batch_size: batch of the example input used for tracing.
        dynamic_batch: leave the batch dimension symbolic, so any batch size runs.
        opset: ONNX opset (default: the exporter's).
        dynamo: torch's ``torch.export``-based exporter (default; needs ``onnxscript``);
            ``False`` selects the TorchScript-based one.
        external_data: (dynamo exporter) write the weights to ``<path>.data`` beside the model
            file. Default: only when they exceed protobuf's 2 GB limit, so smaller models stay one
            self-contained file. Keep the two files together; onnxruntime reads both.
        verify: as in :func:`export_pt2`, run in onnxruntime where it is installed (without it the file is
            written unchecked).
    """
    require_packages('onnx', *(('onnxscript',) if dynamo else ()), purpose='ONNX export')
    if external_data and not dynamo:
        raise ValueError('external_data is an option of the dynamo exporter; drop it or use dynamo=True')
    if dynamo and opset is not None and opset < DYNAMO_MIN_OPSET:
        raise ValueError(f'opset {opset}: torch\'s dynamo exporter writes opset {DYNAMO_MIN_OPSET} and later; give '
                         f'opset >= {DYNAMO_MIN_OPSET}, or dynamo=False (the TorchScript-based exporter) for older')
    path = _prepare(model, path)
    x = example_input(model, input_size, traced_batch_size(batch_size, dynamic_batch and dynamo))
    kwargs = dict(input_names=['input'], output_names=['output'], opset_version=opset, dynamo=dynamo)
    if dynamic_batch and dynamo:
        kwargs['dynamic_shapes'] = (_batch_dim(),)
    elif dynamic_batch:
        kwargs['dynamic_axes'] = {'input': {0: 'batch'}, 'output': {0: 'batch'}}
    if dynamo:
        if external_data is None:
            external_data = weight_bytes(model) >= ONNX_PROTOBUF_LIMIT
        kwargs.update(verbose=False, external_data=external_data)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', torch.jit.TracerWarning)  # timm's shape asserts, constant when traced
        with written_in_place_at_the_end(path) as tmp:
            with (_native_stdout_discarded() if not dynamo else _nothing()):
                torch.onnx.export(model, (x,), str(tmp), **kwargs)
            _check_opset(tmp, opset)
            if verify and importlib.util.find_spec('onnxruntime') is not None:
                _verify(tmp, path, model, x, dynamic_batch, 'the dynamo exporter (dynamo=True)' if not dynamo else
                        'the legacy exporter (dynamo=False) or export_pt2')
            stale = not tmp.with_name(tmp.name + '.data').exists()  # an earlier export's weights, now no one's
    data = path.with_name(path.name + '.data')
    if stale and data.is_file():
        data.unlink()
    return path


@contextmanager
def _nothing():
    yield


@contextmanager
def _native_stdout_discarded():
    """Discard what C++ code writes to the process's stdout (file descriptor 1) inside the block. torch's
    TorchScript-based ONNX exporter turns its own log on and, when a conversion fails, writes the whole IR graph
    there (hundreds of lines) before raising; the exception says what failed."""
    try:
        fd = sys.__stdout__.fileno() if sys.__stdout__ is not None else 1
        saved = os.dup(fd)
    except (OSError, ValueError, AttributeError):  # no real stdout (an embedding host): nothing to protect
        yield
        return
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        try:
            sys.stdout.flush()
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            os.close(devnull)


def _check_opset(path: Path, opset: Optional[int]) -> None:
    """torch's dynamo exporter keeps its own opset when it cannot convert to the one asked for (it only logs
    that): an opset the file does not have is an error, not a silently different file."""
    if opset is None:
        return
    import onnx
    got = {imp.version for imp in onnx.load(str(path), load_external_data=False).opset_import
           if imp.domain in ('', 'ai.onnx')}
    if got != {opset}:
        raise ValueError(f'asked for ONNX opset {opset}, but the exporter wrote opset {", ".join(map(str, got))} '
                         f'(torch\'s dynamo exporter starts at 18; older opsets need dynamo=False, '
                         f'--onnx-exporter legacy)')


@torch.no_grad()
def export_torchscript(model: nn.Module, path: PathLike, input_size: Optional[Sequence[int]] = None,
                       batch_size: int = 2, verify: bool = True) -> Path:
    """Trace ``model`` (eval mode; deploy it first) with ``torch.jit.trace`` and save it to ``path``.

    Deprecated (torch 2.x deprecates TorchScript): use :func:`export_pt2`. ``verify`` as there."""
    warnings.warn('export_torchscript is deprecated (torch deprecates TorchScript); use export_pt2 '
                  '(torch.export, a .pt2 file)', DeprecationWarning, stacklevel=2)
    path = _prepare(model, path)
    x = example_input(model, input_size, batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', torch.jit.TracerWarning)
        traced = torch.jit.trace(model, (x,))
    with written_in_place_at_the_end(path) as tmp:
        torch.jit.save(traced, str(tmp))
        if verify:
            _verify(tmp, path, model, x, True, 'export_pt2 (torch.export)')
    return path


def verify_tolerance(model: nn.Module) -> float:
    """Largest max abs error an export may have against its model: far above float32 round-off (1e-6 on a ViT's
    logits), far below a wrong graph; wider for half-precision models."""
    dtype = next(model.parameters()).dtype
    return max(1e-3, 50 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-3


def _verify(tmp: Path, path: Path, model: nn.Module, traced: torch.Tensor, dynamic_batch: bool, instead: str) -> None:
    """Refuse (``ExportCheckError``; the file is not written) an export that fails when called or computes other
    outputs than ``model``, at another batch size than the traced one where the batch is dynamic."""
    batch = traced.shape[0] + 1 if dynamic_batch else traced.shape[0]
    with torch.enable_grad():  # the exporters run under no_grad; the check calls the file the plain way too
        try:
            err = check_export(tmp, model, input_size=tuple(traced.shape[1:]), batch_size=batch)
        except ExportCheckError as e:
            raise ExportCheckError(f'{e}; {path} was not written (try {instead})'.replace(str(tmp), str(path))) \
                from None
    tol = verify_tolerance(model)
    if not err <= tol:  # NaN fails too
        raise ExportCheckError(f'the export computes other outputs than the model (max abs error {err:.3g} > {tol:g} '
                               f'at batch {batch}); {path} was not written (try {instead})')


class ExportCheckError(RuntimeError):
    """An exported file loads but fails when it is called (the message says how it was called and why)."""


def _called(run, path: Path, how: str) -> torch.Tensor:
    """``run()`` as a float CPU tensor; an exception from the exported program becomes an ``ExportCheckError``."""
    try:
        return run().detach().float().cpu()
    except Exception as e:  # whatever the exported program raises: the file does not run as it is meant to
        raise ExportCheckError(f'{path} loads but fails when {how}: {type(e).__name__}: '
                               f'{" ".join(str(e).split())[:300]}') from None


def check_export(path: PathLike, model: nn.Module, input_size: Optional[Sequence[int]] = None,
                 batch_size: int = 3, seed: int = 0) -> float:
    """Max absolute difference between the exported file and ``model`` on one random batch.

    ``.onnx`` files run in onnxruntime (CPU). ``.pt2`` files are loaded with ``torch.export.load`` and
    their module called both the plain way (autograd on, as a user calls it) and under ``torch.no_grad``;
    TorchScript files (anything else) are loaded with ``torch.jit.load`` and called both ways too. The
    error is the larger of the two calls'. The default batch differs from the export's example batch,
    so a batch dimension that was frozen at export time shows up as an error.

    Raises:
        ExportCheckError: the file loads but one of the calls fails (e.g. in-place ops traced into a
            ``.pt2`` program, which autograd refuses).
        ValueError: it returns another shape than the model (a frozen batch dimension).
    """
    path = Path(path)
    gen = torch.Generator().manual_seed(seed)
    size = tuple(input_size) if input_size is not None else input_size_of(model)
    x = torch.randn(batch_size, *size, generator=gen)
    p = next(model.parameters())
    x = x.to(p.device, p.dtype)
    with torch.no_grad():
        expected = model(x).float().cpu()
    if path.suffix == '.onnx':
        require_packages('onnxruntime', purpose='checking an ONNX export')
        import onnxruntime
        session = onnxruntime.InferenceSession(str(path), providers=['CPUExecutionProvider'])
        name = session.get_inputs()[0].name
        outputs = [_called(lambda: torch.from_numpy(session.run(None, {name: x.cpu().numpy()})[0]), path,
                           'run in onnxruntime')]
    else:
        if path.suffix == '.pt2':
            module = torch.export.load(str(path)).module()
            what = 'its module (torch.export.load(path).module()) is called'
        else:
            module = torch.jit.load(str(path), map_location=p.device)
            what = 'its module (torch.jit.load(path)) is called'
        with torch.enable_grad():
            outputs = [_called(lambda: module(x), path, f'{what} the plain way, with autograd on')]
        with torch.no_grad():
            outputs.append(_called(lambda: module(x), path, f'{what} under torch.no_grad()'))
    for got in outputs:
        if got.shape != expected.shape:
            raise ValueError(f'{path} returned shape {tuple(got.shape)} for a batch of {batch_size}, expected '
                             f'{tuple(expected.shape)}; was the batch dimension exported as dynamic?')
    return max((got - expected).abs().max().item() for got in outputs)
