"""Multi-process training through torch's own DDP, launched with ``torchrun``.

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; we then join the process group (NCCL on
CUDA, gloo on CPU). A plain ``python``/``vitblocks`` launch is one process, no group.
"""
import os
import socket
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from timm.utils import distribute_bn

__all__ = ['DistInfo', 'init_distributed', 'all_reduce_sum', 'barrier', 'broadcast_object', 'gather_object',
           'raise_on_every_rank', 'sync_batchnorm_stats', 'shutdown']


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


def gather_object(obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def raise_on_every_rank(error: Optional[str], exc_type: type = RuntimeError) -> None:
    """Raise ``exc_type`` on every rank if any rank has an ``error``, naming the ranks and hosts.

    A rank that raised alone would leave the others waiting in their next collective until the
    NCCL/gloo timeout (30 min by default); this way every process stops with the same message.
    """
    errors = gather_object(None if error is None else (socket.gethostname(), error))
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if len(errors) == 1:
        raise exc_type(failed[0][1][1])
    first = failed[0][1][1]
    where = ', '.join(f'rank {rank} on {host}' for rank, (host, _) in failed)
    raise exc_type(f'{first} ({where} of {len(errors)} processes'
                   + ('; the others would have waited for them' if len(failed) < len(errors) else '') + ')')


def sync_batchnorm_stats(model: torch.nn.Module, mode: str) -> None:
    """Make every rank's BatchNorm running statistics equal before evaluating or saving: ``'reduce'``
    averages them (timm's ``distribute_bn``), ``'broadcast'`` copies rank 0's, ``'none'`` leaves them.
    Without this each rank keeps statistics of its own shard of the data, and the checkpoint only
    has rank 0's."""
    if mode != 'none' and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        distribute_bn(model, dist.get_world_size(), reduce=mode == 'reduce')


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
