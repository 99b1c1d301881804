"""Multi-process training through torch's own DDP, launched with ``torchrun``.

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; we then join the process group (NCCL on
CUDA, gloo on CPU). A plain ``python``/``vitblocks`` launch is one process, no group.
"""
import os
from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist

__all__ = ['DistInfo', 'init_distributed', 'all_reduce_sum', 'barrier', 'broadcast_object', 'shutdown']


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistInfo:
    world = int(os.environ.get('WORLD_SIZE', '1'))
    if world <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ['RANK']), world, int(os.environ.get('LOCAL_RANK', '0')))
    if not dist.is_initialized():
        backend = 'nccl' if device_type == 'cuda' else 'gloo'
        if device_type == 'cuda':
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group(backend=backend)
    return info


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (e.g. a run folder name or an error)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box: List[Any] = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
