"""The CPU's cache sizes, read from the machine it runs on, for the deployed layers' batch slices.

The CPU inference paths of :class:`~vitblocks.layers.IFFNDeployed` and :class:`~vitblocks.layers.AFBODeployed`
run a batch in slices whose widest intermediate fills the level-2 caches of the threads working on it, so the
intermediates of a slice stay in cache and the allocator recycles them between slices instead of mapping fresh
zero-filled pages on every call (docs/iffn_speed.md, docs/afbo.md). The size comes from the operating system;
where it says nothing, the layers run the whole batch at once.
"""
import functools
import os
from pathlib import Path
from typing import Optional

import torch

__all__ = ['l2_cache_bytes', 'slice_budget_bytes']

_SYSFS_CACHES = Path('/sys/devices/system/cpu/cpu0/cache')


def _parse_size(text: str) -> Optional[int]:
    """``'2048K'`` / ``'1M'`` / ``'524288'`` -> bytes; None for anything else."""
    text = text.strip().upper()
    scale = {'K': 2 ** 10, 'M': 2 ** 20, 'G': 2 ** 30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in 'KMG' else text
    return int(digits) * scale if digits.isdigit() and int(digits) > 0 else None


@functools.lru_cache(maxsize=None)
def l2_cache_bytes(caches: Path = _SYSFS_CACHES) -> Optional[int]:
    """Bytes of one core's level-2 (data or unified) cache, as Linux's sysfs or glibc's ``sysconf`` report it;
    None where neither says (another OS, a container hiding sysfs)."""
    try:
        for index in sorted(caches.glob('index*')):
            level, kind = (index / 'level').read_text().strip(), (index / 'type').read_text().strip()
            if level == '2' and kind in ('Unified', 'Data'):
                size = _parse_size((index / 'size').read_text())
                if size:
                    return size
    except OSError:
        pass
    try:
        size = os.sysconf('SC_LEVEL2_CACHE_SIZE')
    except (ValueError, OSError, AttributeError):
        return None
    return size if size and size > 0 else None


def slice_budget_bytes(threads: Optional[int] = None) -> int:
    """Bytes a batch slice's widest intermediate may take: the level-2 caches of ``threads`` cores (default: torch's
    intra-op threads) together; 0 (no slicing) where the cache size is unknown."""
    l2 = l2_cache_bytes()
    if not l2:
        return 0
    return l2 * (threads if threads is not None else torch.get_num_threads())
