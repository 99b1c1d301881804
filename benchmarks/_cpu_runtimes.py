"""The CPU runtimes of benchmarks/cpu_runtimes.py, the machine it reports, and ONNX Runtime's per-op profile.

Each runtime loads a model (an ``nn.Module`` or, for the ONNX runtimes, its exported file) and binds it to an
input: ``runtime.load(model, onnx_path).bind(x)`` is a call without arguments that runs one batch, what the
timing loop calls; ``as_tensor`` turns what it returns into a float tensor for the output check. Every
runtime runs fp32 with ``threads`` intra-op threads; ``close()`` frees its sessions / compiled graphs.
"""
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from torch import nn

# /proc/cpuinfo flags that decide which fp32 GEMM kernels a runtime can use
ISA_FLAGS = ('avx2', 'fma', 'avx512f', 'avx512bw', 'avx512_vnni', 'avx512_bf16', 'avx_vnni', 'amx_tile', 'amx_bf16',
             'amx_int8')
CPU_ID = ('vendor_id', 'cpu family', 'model', 'stepping', 'cache size')  # /proc/cpuinfo fields naming the CPU
PACKAGES = ('torch', 'timm', 'vitblocks', 'onnx', 'onnxscript', 'onnxruntime', 'openvino')


class RuntimeUnavailable(RuntimeError):
    """A runtime whose package is not installed (the message says which and how to install it)."""


def _cpuinfo() -> Dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path('/proc/cpuinfo').read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split('\n\n')[0].splitlines():
        key, _, value = line.partition(':')
        fields[key.strip()] = value.strip()
    return fields


def machine() -> Dict[str, object]:
    """The CPU model, its ISA flags (the GEMM-relevant ones), torch's CPU capability, cores and versions."""
    info = _cpuinfo()
    flags = set(info.get('flags', '').split())
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return dict(cpu=info.get('model name') or platform.processor() or platform.machine(),
                cpu_id=', '.join(f'{k} {info[k]}' for k in CPU_ID if k in info),
                isa=[f for f in ISA_FLAGS if f in flags], torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                float32_matmul_precision=torch.get_float32_matmul_precision(), logical_cpus=os.cpu_count(),
                python=platform.python_version(), versions=versions)


def as_tensor(out) -> torch.Tensor:
    """A runtime's output (tensor, numpy array, or a list of them: the first) as a float CPU tensor."""
    if isinstance(out, (list, tuple)):
        out = out[0]
    if isinstance(out, torch.Tensor):
        return out.detach().float().cpu().clone()
    return torch.from_numpy(np.array(out, dtype=np.float32, copy=True))


class Loaded:
    """One model loaded in a runtime: ``bind(x)`` returns the call the timing loop makes."""

    def __init__(self, bind: Callable[[torch.Tensor], Callable[[], object]]):
        self.bind = bind


def _needs(package: str, runtime: str, extra: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise RuntimeUnavailable(f'{runtime} needs the {package} package: pip install {package} '
                                 f'(or pip install "vitblocks[{extra}]")')


class Eager:
    name, label, needs_onnx = 'eager', 'PyTorch eager', False

    def __init__(self, threads: int):
        self.threads = threads  # the caller holds torch.set_num_threads(threads)

    def load(self, model: nn.Module, onnx_path: Optional[Path]) -> Loaded:
        return Loaded(lambda x: lambda: model(x))  # the caller holds torch.inference_mode

    def close(self) -> None:
        pass


class Compiled(Eager):
    """``torch.compile`` with its default backend (inductor, C++/OpenMP kernels on the CPU) in ``mode``, static
    shapes: one graph per batch size, compiled by the first call (the output check), whose time is reported.
    ``freezing``: inductor's ``freezing`` option (weights folded in as constants and prepacked for oneDNN,
    what inductor recommends for CPU inference), set while this runtime is open."""
    name, label = 'compile', 'torch.compile'

    def __init__(self, threads: int, mode: str = 'default', freezing: bool = False):
        super().__init__(threads)
        import torch._inductor.config as inductor_config
        self.mode, self.inductor_config = mode, inductor_config
        self.old_freezing, inductor_config.freezing = inductor_config.freezing, freezing

    def load(self, model: nn.Module, onnx_path: Optional[Path]) -> Loaded:
        compiled = torch.compile(model, mode=self.mode, dynamic=False)
        return Loaded(lambda x: lambda: compiled(x))

    def close(self) -> None:
        self.inductor_config.freezing = self.old_freezing
        torch._dynamo.reset()  # drops the compiled graphs and the models they hold
        gc.collect()


class OnnxRuntime:
    """``onnxruntime.InferenceSession`` on the CPU provider: all graph optimisations, ``threads`` intra-op
    threads, one inter-op thread, sequential execution; the exported file as is (dynamic batch).

    Each session has its own thread pool, whose workers by default spin for a moment after each parallel
    section before they sleep; with two sessions taking turns, that spinning overlaps the other session's
    run on a machine with few cores. ``spinning=False`` sets ``session.intra_op.allow_spinning`` to 0."""
    name, label, needs_onnx = 'onnxruntime', 'ONNX Runtime', True

    def __init__(self, threads: int, spinning: bool = True):
        _needs('onnxruntime', 'ONNX Runtime', 'export')
        self.threads, self.spinning = threads, spinning
        self.sessions = []

    def session(self, onnx_path: Path, profile_prefix: Optional[Path] = None):
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if not self.spinning:
            options.add_session_config_entry('session.intra_op.allow_spinning', '0')
        if profile_prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = str(profile_prefix)
        session = ort.InferenceSession(str(onnx_path), options, providers=['CPUExecutionProvider'])
        self.sessions.append(session)
        return session

    def load(self, model: nn.Module, onnx_path: Path, profile_prefix: Optional[Path] = None) -> Loaded:
        session = self.session(onnx_path, profile_prefix)
        name = session.get_inputs()[0].name

        def bind(x):
            feed = {name: x.numpy()}
            return lambda: session.run(None, feed)
        loaded = Loaded(bind)
        loaded.session = session
        return loaded

    def close(self) -> None:
        self.sessions.clear()
        gc.collect()


class OpenVino:
    """OpenVINO's CPU plugin on the exported ONNX file (``read_model`` + ``compile_model``): fp32 inference
    precision (the plugin's default is bf16 on CPUs with AMX / AVX-512 BF16), the latency hint with one stream,
    ``threads`` inference threads; the batch dimension left dynamic, as in ONNX Runtime."""
    name, label, needs_onnx = 'openvino', 'OpenVINO', True

    def __init__(self, threads: int):
        _needs('openvino', 'OpenVINO', 'cpu')
        import openvino
        self.core = openvino.Core()
        self.threads = threads
        self.compiled = []

    def load(self, model: nn.Module, onnx_path: Path) -> Loaded:
        compiled = self.core.compile_model(self.core.read_model(str(onnx_path)), 'CPU', {
            'INFERENCE_PRECISION_HINT': 'f32', 'PERFORMANCE_HINT': 'LATENCY', 'NUM_STREAMS': '1',
            'INFERENCE_NUM_THREADS': str(self.threads)})
        self.compiled.append(compiled)

        def bind(x):
            request, feed = compiled.create_infer_request(), {0: x.numpy()}

            def call():
                request.infer(feed)
                return request.get_output_tensor(0).data
            return call
        return Loaded(bind)

    def close(self) -> None:
        self.compiled.clear()
        gc.collect()


RUNTIMES = {r.name: r for r in (Eager, Compiled, OnnxRuntime, OpenVino)}


def _shapes(entries) -> List[List[int]]:
    return [shape for entry in entries or [] for shape in entry.values()]


def op_profile(path: Path, skip_runs: int) -> Dict[str, object]:
    """Where the time goes in an ONNX Runtime profile (the JSON ``end_profiling`` wrote), over the model runs
    after the first ``skip_runs`` (warm-up). Returns ``runs``, ``ms_per_run`` (kernel time), ``ops``: per op type
    ``(op, calls per run, ms per run, share of the kernel time)``, and ``nodes``: per graph node its op, ms per
    run, share, input and output shapes and the bytes it reads and writes (inputs, weights and output, as
    ONNX Runtime counts them); both slowest first."""
    events = json.loads(Path(path).read_text())
    runs = sorted((e for e in events if e.get('cat') == 'Session' and e.get('name') == 'model_run'),
                  key=lambda e: e['ts'])
    if len(runs) <= skip_runs:
        raise ValueError(f'{path}: {len(runs)} model runs profiled, expected more than the {skip_runs} warm-up runs')
    start = runs[skip_runs]['ts']
    timed = len(runs) - skip_runs
    op_us: Dict[str, float] = defaultdict(float)
    calls: Dict[str, int] = defaultdict(int)
    nodes: Dict[str, dict] = {}
    for e in events:
        if e.get('cat') != 'Node' or not e.get('name', '').endswith('_kernel_time') or e['ts'] < start:
            continue
        a = e.get('args', {})
        op = a.get('op_name', '?')
        op_us[op] += e['dur']
        calls[op] += 1
        node = nodes.setdefault(e['name'][:-len('_kernel_time')], dict(
            op=op, us=0.0, inputs=_shapes(a.get('input_type_shape')), outputs=_shapes(a.get('output_type_shape')),
            bytes=sum(int(a.get(k, 0)) for k in ('activation_size', 'parameter_size', 'output_size'))))
        node['us'] += e['dur']
    kernel_us = sum(op_us.values())
    share = (lambda us: us / kernel_us) if kernel_us else (lambda us: 0.0)
    ops: List[tuple] = sorted(((op, calls[op] / timed, us / timed / 1e3, share(us)) for op, us in op_us.items()),
                              key=lambda row: -row[2])
    node_rows = sorted((dict(name=name, op=n['op'], ms_per_run=n['us'] / timed / 1e3, share=share(n['us']),
                             inputs=n['inputs'], outputs=n['outputs'], bytes=n['bytes']) for name, n in nodes.items()),
                       key=lambda row: -row['ms_per_run'])
    return dict(runs=timed, ms_per_run=kernel_us / timed / 1e3, ops=ops, nodes=node_rows)
