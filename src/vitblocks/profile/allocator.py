"""Keep freed CPU memory in the process, so that no timed forward pays for fresh pages.

glibc's ``malloc`` serves a block above its mmap threshold (128 KiB at start, raised by the first
free of such a block up to 32 MiB on 64-bit) with a fresh mapping, and gives free memory at the top
of the heap back to the kernel once it exceeds the trim threshold. Either way the next forward's
activations land on pages the kernel must zero-fill at first touch: a minor page fault per 4 KiB.
Where a model's activations land depends on the allocation history of the process, so in one
benchmark run one model can pay 100,000-800,000 faults per forward and the other none (DeiT-S
217,446 against 0 for deployed IFFN-S, docs/iffn_speed.md), and the latency ratio then measures
the allocator as much as the models.

:func:`steady_malloc` turns both off through glibc's ``mallopt`` (no mmapped blocks, no trimming),
so that after a warm-up forward every model reuses heap pages it has already touched. It is what
PyTorch's CPU performance guide gets from a caching allocator (jemalloc, tcmalloc) via
``LD_PRELOAD``, without installing one, and it cannot be undone for the process: the heap keeps the
peak of what the process ever held.
"""
import ctypes
import sys
from typing import Dict

__all__ = ['AllocatorError', 'steady_malloc', 'minor_page_faults', 'fault_note', 'FAULTS_NOTED']

FAULTS_NOTED = 1000  # fresh pages (4 MiB) by which two models must differ for fault_note to speak

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2 ** 31 - 1


class AllocatorError(RuntimeError):
    """The C library is not glibc, or refused a setting."""


def _glibc() -> ctypes.CDLL:
    if not sys.platform.startswith('linux'):
        raise AllocatorError(f'steady_malloc needs glibc (Linux); this is {sys.platform}: run without it, '
                             f'or preload a caching allocator (jemalloc, tcmalloc)')
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    if not hasattr(libc, 'gnu_get_libc_version'):
        raise AllocatorError('steady_malloc needs glibc; this Linux C library is not glibc (musl?): run without '
                             'it, or preload a caching allocator (jemalloc, tcmalloc)')
    return libc


def steady_malloc() -> str:
    """Make glibc keep every freed block in the heap (for the rest of the process).

    Returns the glibc version. Raises :class:`AllocatorError` on another C library, or if glibc
    refuses a setting (``mallopt`` returns 0)."""
    libc = _glibc()
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    for name, param, value in (('M_MMAP_MAX', _M_MMAP_MAX, 0), ('M_TRIM_THRESHOLD', _M_TRIM_THRESHOLD, _INT_MAX)):
        if libc.mallopt(param, value) != 1:
            raise AllocatorError(f'glibc refused mallopt({name}, {value})')
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    return libc.gnu_get_libc_version().decode()


def minor_page_faults() -> int:
    """Minor page faults of this process so far (fresh pages the kernel zero-filled); 0 off POSIX."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fault_note(faults: Dict[str, int], steady: bool = False, per: str = 'forward') -> str:
    """A note line when the models' fresh pages ``per`` forward (or batch) differ by ``FAULTS_NOTED``
    or more, else ''.

    Such a difference comes from glibc's allocation history in the process, not from the models,
    and moves their time ratio by as much as the page faults cost (DeiT-S 2316 ms per batch of 32
    with 217,446 faults per forward, 1859 ms with none). With ``steady`` (:func:`steady_malloc`
    on), the pages are the heap's growth."""
    if len(faults) < 2 or max(faults.values()) - min(faults.values()) < FAULTS_NOTED:
        return ''
    most = max(faults, key=faults.get)
    least = min(faults, key=faults.get)
    head = f'note: {most} took {faults[most]:,} fresh pages per {per} and {least} {faults[least]:,}'
    if steady:
        return head + ' (with --steady-malloc on: the heap grew during that ' + per + ')'
    return head + ': the ratio includes glibc zero-filling them; --steady-malloc compares compute'
