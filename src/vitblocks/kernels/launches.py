"""The kernel launches the deployed IFFN and AFBO layers make, recorded without a GPU.

:func:`record_launches` runs a deployed layer's ``_forward_fused`` on CPU tensors with every Triton launch
intercepted: the host code chooses its tiles, warps and grid exactly as on a GPU, and each launch is
bound the way Triton binds it for a CUDA target (argument types, constexprs, the alignment
specialization of pointers and integers), but nothing runs: the outputs stay uninitialized, which is
harmless because no host decision depends on a kernel's result. :func:`deployed_launches` does this for
the first FFN of every stage of the registered models, so the compile check (:mod:`.compile_check`)
always sees the configurations the layers really choose.

Run it in a process without ``TRITON_INTERPRET``: the interpreter replaces the kernels with Python
functions that cannot be compiled.
"""
import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import interpreting

__all__ = ['KernelLaunch', 'record_launches', 'deployed_launches', 'MODELS', 'KERNEL_SIZES', 'PRECISIONS']

# the backbones and settings the compile check covers (registered names without their method prefix)
MODELS = ('deit_tiny_patch16_224', 'deit_small_patch16_224', 'deit_base_patch16_224', 'swin_tiny_patch4_window7_224',
          'poolformer_s12')
KERNEL_SIZES = (3, 5, 7)
PRECISIONS = ('tf32', 'fp32', 'bf16')  # fp32 with TF32 matmuls, strict fp32, bf16 autocast
# one block per stage: the stages' FFNs see the shapes of the full model, at a fraction of the building time
ONE_BLOCK_PER_STAGE = {'deit': dict(depth=1), 'swin': dict(depths=(1, 1, 1, 1))}


@dataclass
class KernelLaunch:
    """One launch as Triton would compile it: the kernel, its bound signature, constexprs and options."""
    fn: object = field(repr=False)  # the triton JITFunction
    signature: Dict[str, str]
    constexprs: Dict[Tuple[int, ...], object]
    attrs: Dict[Tuple[int, ...], list]
    options: Dict[str, object]  # num_warps, num_stages as the launch passed them (defaults otherwise)
    grid: Tuple[int, ...]

    @property
    def kernel(self) -> str:
        return self.fn.__name__.lstrip('_').removesuffix('_kernel')

    def key(self) -> str:
        """What makes two launches one compilation (Triton's own cache key, less the target)."""
        return repr((self.fn.module, self.fn.__name__, sorted(self.signature.items()), sorted(self.constexprs.items()),
                     sorted(self.attrs.items()), sorted(self.options.items())))

    def config(self) -> str:
        """The constexprs and options a reader compares (tiles, warps, dtype), as ``NAME=value`` words."""
        names = list(self.signature)
        words = [f'{names[path[0]]}={_short(v)}' for path, v in sorted(self.constexprs.items())
                 if names[path[0]] not in ('ACT', 'COMBINE', 'UPCAST')]
        dtypes = sorted({t[1:] for t in self.signature.values() if t.startswith('*')} - {'i8'})
        words.append('/'.join(dtypes))
        words += [f'{k.removeprefix("num_")}={v}' for k, v in sorted(self.options.items())]
        return ' '.join(words)


def _short(value) -> str:
    return str(value).removeprefix('triton.language.') if not isinstance(value, str) else value


@contextlib.contextmanager
def record_launches() -> Iterator[List[KernelLaunch]]:
    """Within the block, every Triton launch is bound for a CUDA target and recorded, not run; a kernel with
    several candidate configurations (:class:`~vitblocks.kernels._common.LaunchTuner`) launches them all."""
    if interpreting():
        raise RuntimeError('record_launches needs the compiled kernels, not Triton\'s interpreter: run it in a '
                           'process without TRITON_INTERPRET=1 (python -m vitblocks.kernels.report does)')
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget('cuda', 90, 32))  # argument binding is the same for every CUDA target
    launches: List[KernelLaunch] = []
    binders = {}

    def run(self, *args, grid, warmup, **kwargs):
        if self not in binders:
            binders[self] = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binders[self](*args, **kwargs)
        _, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        given = {k: v for k, v in kwargs.items() if k not in self.arg_names}
        launches.append(KernelLaunch(self, signature, constexprs, attrs, given, tuple(grid)))

    from ._common import LaunchTuner
    original = JITFunction.run
    JITFunction.run, LaunchTuner.recording_all = run, True
    try:
        yield launches
    finally:
        JITFunction.run, LaunchTuner.recording_all = original, False


def _set_precision(precision: str) -> contextlib.AbstractContextManager:
    """torch's fp32 matmul mode for ``precision`` (the kernels follow it) and bf16 autocast for 'bf16'."""
    stack = contextlib.ExitStack()
    matmul = torch.backends.cuda.matmul
    old = matmul.allow_tf32
    matmul.allow_tf32 = precision != 'fp32'
    stack.callback(setattr, matmul, 'allow_tf32', old)
    if precision == 'bf16':
        stack.enter_context(torch.autocast('cpu', dtype=torch.bfloat16))
    return stack


def _stage_layers(method: str, model: str, kernel_size: Optional[int] = None):
    """``(qualified name, deployed layer on the CPU, input shape)`` of the first FFN of each distinct input
    shape: the model is built and run on the meta device (shapes only), then those layers are made real.
    ``kernel_size`` None: the model's own."""
    import timm

    from ..layers import AFBO, IFFN
    shallow = next((v for k, v in ONE_BLOCK_PER_STAGE.items() if model.startswith(k)), {})
    with torch.device('meta'):
        cfg = {} if kernel_size is None else {'kernel_size': kernel_size}
        net = timm.create_model(f'{method}_{model}', block_cfg=cfg, **shallow).eval()
    seen = {}

    def hook(module, args):
        key = (tuple(args[0].shape), module.layout.grid_size, module.layout.num_prefix_tokens)
        seen.setdefault(key, module)

    handles = [m.register_forward_pre_hook(hook) for m in net.modules() if isinstance(m, (IFFN, AFBO))]
    with torch.inference_mode():
        net(torch.empty(1, 3, 224, 224, device='meta'))
    for h in handles:
        h.remove()
    layers = []
    for (shape, grid, prefix), module in seen.items():
        module.layout.grid_size, module.layout.num_prefix_tokens = grid, prefix  # as the hooks set them
        layer = module.fuse().to_empty(device='cpu')  # fused while on meta: no weights to fold
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            if t.is_floating_point():  # any finite values: no launch depends on them
                t.data.fill_(1.0 if name.endswith('running_var') else 0.0)
        layers.append((layer.eval(), shape))
    return layers


def deployed_launches(methods: Sequence[str] = ('iffn', 'afbo'), models: Sequence[str] = MODELS,
                      kernel_sizes: Sequence[int] = KERNEL_SIZES, precisions: Sequence[str] = PRECISIONS):
    """``{(method, model, k, precision): [KernelLaunch, ...]}`` of the deployed layers' fused path, batch 1."""
    out = {}
    for method in methods:
        for model in models:
            for k in kernel_sizes:
                layers = _stage_layers(method, model, k)
                for precision in precisions:
                    with record_launches() as launches, torch.inference_mode(), _set_precision(precision):
                        for layer, shape in layers:
                            layer._forward_fused(torch.zeros(shape))
                    out[method, model, k, precision] = launches
    return out
