"""What the compiler says about each kernel launch, without a GPU: registers, spills, shared memory, occupancy.

Every launch recorded by :mod:`.launches` is compiled by Triton for a named CUDA architecture (no
driver needed), and the PTX goes through the ``ptxas`` that ships in the Triton wheel with ``-v``,
which prints registers per thread, spill bytes and performance warnings. A launch passes when it
compiles, spills nothing, draws no performance warning, and, unless it is a GEMM kernel (``tl.dot``: the
accumulator tile lives in registers), uses at most :data:`MAX_REGISTERS` registers per thread: a
memory-bound kernel needs many warps in flight to hide DRAM latency, and 128 registers still allow
16 warps per SM (25% occupancy) at any block size.

Compilations are cached by Triton (``~/.triton/cache`` or ``TRITON_CACHE_DIR``), and the ``ptxas``
report beside them, so a second run costs seconds.
"""
import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from .launches import KernelLaunch

__all__ = ['KernelStats', 'ptxas_path', 'compile_launch', 'compile_launches', 'MAX_REGISTERS', 'ARCHS']

MAX_REGISTERS = 128
ARCHS = (80, 90)
GEMM_KERNELS = ('window_maps',)  # kernels whose accumulator tiles live in registers (tl.dot)
# per SM, as NVIDIA's occupancy calculator: registers, warps, blocks, shared memory (bytes, usable by blocks)
_REGISTERS_PER_SM, _MAX_WARPS, _MAX_BLOCKS = 65536, 64, 32
_SHARED_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
_SHARED_RESERVED_PER_BLOCK = 1024


@dataclass
class KernelStats:
    """The compiler's report on one launch configuration for one architecture."""
    kernel: str
    config: str
    arch: int
    registers: Optional[int] = None
    spill_bytes: Optional[int] = None  # spill stores + spill loads
    shared_bytes: Optional[int] = None
    warps: Optional[int] = None
    warnings: tuple = ()
    error: Optional[str] = None

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks per SM: the least of the register, shared-memory, warp and block limits."""
        if self.registers is None:
            return 0
        per_warp = -(-self.registers * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
        by_regs = _REGISTERS_PER_SM // (per_warp * self.warps)
        by_shared = _SHARED_PER_SM[self.arch] // (self.shared_bytes + _SHARED_RESERVED_PER_BLOCK)
        return min(by_regs, by_shared, _MAX_WARPS // self.warps, _MAX_BLOCKS)

    @property
    def occupancy(self) -> float:
        """Resident warps over the SM's 64."""
        return self.blocks_per_sm * (self.warps or 0) / _MAX_WARPS

    def problems(self) -> List[str]:
        """Why this configuration fails the check (empty when it passes)."""
        if self.error:
            return [f'does not compile: {self.error}']
        out = [f'ptxas: {w}' for w in self.warnings]
        if self.spill_bytes:
            out.append(f'{self.spill_bytes} bytes of spills')
        if self.kernel not in GEMM_KERNELS and self.registers > MAX_REGISTERS:
            out.append(f'{self.registers} registers per thread > {MAX_REGISTERS}')
        return out

    def as_dict(self) -> dict:
        return dict(asdict(self), blocks_per_sm=self.blocks_per_sm, occupancy=self.occupancy, problems=self.problems())


def ptxas_path() -> Optional[str]:
    """The ``ptxas`` inside the Triton wheel (None without Triton or without it)."""
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'ptxas')
    return path if os.access(path, os.X_OK) else None


def _ptxas_report(ptx: str, arch: int) -> str:
    """``ptxas -v`` on ``ptx`` with the flags Triton itself uses; its log (stderr)."""
    gpu = f'sm_{arch}a' if arch >= 90 else f'sm_{arch}'  # Triton's PTX for Hopper uses the sm_90a features
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, 'kernel.ptx')
        with open(src, 'w') as f:
            f.write(ptx)
        run = subprocess.run([ptxas_path(), '-lineinfo', '-v', '--regAllocOptLevel=2', f'--gpu-name={gpu}', src,
                              '-o', os.path.join(tmp, 'kernel.cubin')], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(run.stderr.strip()[-500:])
    return run.stderr


def parse_ptxas(log: str) -> dict:
    """Registers, spill bytes and warnings from a ``ptxas -v`` log of one kernel."""
    regs = re.search(r'Used (\d+) registers', log)
    spills = re.search(r'(\d+) bytes spill stores, (\d+) bytes spill loads', log)
    warnings = tuple(line.split('warning :', 1)[-1].strip() for line in log.splitlines() if 'warning' in line.lower())
    return dict(registers=int(regs.group(1)) if regs else None,
                spill_bytes=int(spills.group(1)) + int(spills.group(2)) if spills else None, warnings=warnings)


def compile_launch(launch: KernelLaunch, arch: int) -> KernelStats:
    """Compile ``launch`` for ``sm_<arch>`` and read ``ptxas``'s report (both cached by Triton)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.cache import get_cache_manager

    stats = KernelStats(launch.kernel, launch.config(), arch)
    try:
        compiled = triton.compile(ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs),
                                  target=GPUTarget('cuda', arch, 32), options=dict(launch.options))
        cache = get_cache_manager(compiled.hash)
        log_path = cache.get_file('ptxas_verbose.log')
        if log_path is None:
            log_path = cache.put(_ptxas_report(compiled.asm['ptx'], arch), 'ptxas_verbose.log', binary=False)
        with open(log_path) as f:
            stats.__dict__.update(parse_ptxas(f.read()))
        stats.shared_bytes, stats.warps = compiled.metadata.shared, compiled.metadata.num_warps
    except Exception as e:  # a compiler error is a finding of the check, reported with its configuration
        stats.error = f'{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ""}'[:300]
    return stats


def _compile_by_name(args) -> KernelStats:
    module, name, signature, constexprs, attrs, options, grid, arch = args
    import importlib
    fn = getattr(importlib.import_module(module), name)
    return compile_launch(KernelLaunch(fn, signature, constexprs, attrs, options, grid), arch)


def compile_launches(launches: Sequence[KernelLaunch], archs: Sequence[int] = ARCHS,
                     workers: Optional[int] = None) -> Dict[tuple, KernelStats]:
    """``{(launch key, arch): KernelStats}`` for the distinct launches, compiled in ``workers`` processes
    (default: the CPUs this process may use, at most 8; 1 compiles here)."""
    unique = {launch.key(): launch for launch in launches}
    jobs = [(key, arch) for key in unique for arch in archs]
    workers = workers or min(8, len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else 1)
    if workers <= 1:
        return {(key, arch): compile_launch(unique[key], arch) for key, arch in jobs}
    args = [(unique[key].fn.module, unique[key].fn.__name__, unique[key].signature, unique[key].constexprs,
             unique[key].attrs, unique[key].options, unique[key].grid, arch) for key, arch in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return dict(zip(jobs, pool.map(_compile_by_name, args)))
