"""Multi-process training through torch's own DDP, launched with ``torchrun``.

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; we then join the process group (NCCL on
CUDA, gloo on CPU). A plain ``python``/``vitblocks`` launch is one process, no group.
"""
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from timm.utils import distribute_bn
from torch.distributed.constants import default_pg_timeout

__all__ = ['DistInfo', 'init_distributed', 'attempt_store', 'agree_on_attempt', 'all_reduce_sum', 'PendingSum',
           'all_reduce_sum_async', 'barrier', 'broadcast_object', 'gather_object', 'is_lost_peer',
           'raise_on_every_rank', 'sync_batchnorm_stats', 'batchnorm_stats', 'load_batchnorm_stats', 'shutdown',
           'launched_rank']


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


def launched_rank() -> int:
    """This process's rank as the launcher set it (torchrun's ``RANK``; 0 when not launched as several
    processes): what decides who prints a run's summary, also after the process group is gone."""
    return int(os.environ.get('RANK', '0')) if int(os.environ.get('WORLD_SIZE', '1')) > 1 else 0


def init_distributed(device_type: str, timeout: timedelta = default_pg_timeout) -> DistInfo:
    world = int(os.environ.get('WORLD_SIZE', '1'))
    if world <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ['RANK']), world, int(os.environ.get('LOCAL_RANK', '0')))
    if not dist.is_initialized():
        backend = 'nccl' if device_type == 'cuda' else 'gloo'
        if device_type == 'cuda':
            torch.cuda.set_device(info.local_rank)
        if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True':  # torchrun's c10d rendezvous (the default)
            store = attempt_store(info, timeout)
            dist.init_process_group(backend=backend, store=store, rank=info.rank, world_size=world, timeout=timeout)
        else:  # env:// (srun, a static rendezvous, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): a fresh store per launch
            dist.init_process_group(backend=backend, timeout=timeout)
    return info


_ATTEMPTS = 'vitblocks/attempt'


def attempt_store(info: DistInfo, timeout: timedelta) -> dist.Store:
    """torchrun's agent store, seen through a prefix that no earlier attempt of the run has used.

    torchrun's c10d rendezvous serves the workers' store from the agent (``TORCHELASTIC_USE_AGENT_STORE``)
    and keeps that store, keys included, across ``--max-restarts`` restarts. The restarted workers' process
    group then finds the killed attempt's keys under the same names -- every rank's gloo address, NCCL's
    unique id -- and a rank that reads its peer's key before the new peer has rewritten it connects to a
    dead port: "Gloo connectFullMesh failed ... Connection refused" (pytorch/pytorch#135712, #167288).
    torch dropped its per-attempt key prefix (``TORCHELASTIC_RESTART_COUNT``) when the agent took the
    store over, and that count would not do anyway: each node counts its own restarts. So rank 0 names
    the attempt: it pushes a fresh token to every other rank's queue and releases the token once every
    rank has acknowledged it. A rank holding a token that is never released (one an earlier attempt
    pushed for a rank that died before reading it) takes the next one from its queue.
    """
    store, _, _ = next(dist.rendezvous('env://', timeout=timeout))  # torch's client of the agent's store
    try:
        token = agree_on_attempt(store, info.rank, info.world_size, timeout)
    except dist.DistStoreError as e:
        where = f'{os.environ.get("MASTER_ADDR")}:{os.environ.get("MASTER_PORT")}'
        raise RuntimeError(f'rank {info.rank} of {info.world_size}: the processes did not all meet in torchrun\'s '
                           f'store at {where} within {timeout} ({e}); a process of this attempt did not start or '
                           f'cannot reach that address: check that every node runs the same torchrun command and '
                           f'can connect to it') from None
    return dist.PrefixStore(f'{_ATTEMPTS}/{token}/', store)


def agree_on_attempt(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """The attempt's token, the same on every rank (``attempt_store``'s handshake; DistStoreError on timeout)."""
    others = range(1, world_size)
    if rank == 0:
        token = uuid.uuid4().hex
        for peer in others:
            store.queue_push(f'{_ATTEMPTS}/queue/{peer}', token)
        store.wait([f'{_ATTEMPTS}/{token}/ack/{peer}' for peer in others], timeout)
        store.set(f'{_ATTEMPTS}/{token}/go', '1')
        return token
    queue, deadline = f'{_ATTEMPTS}/queue/{rank}', time.monotonic() + timeout.total_seconds()
    token = ''
    while not (token and store.check([f'{_ATTEMPTS}/{token}/go'])):
        if not token or store.queue_len(queue):  # the first token, or a newer one than ours
            token = store.queue_pop(queue).decode()  # blocks up to the store's timeout
            store.set(f'{_ATTEMPTS}/{token}/ack/{rank}', '1')
        elif time.monotonic() > deadline:
            raise dist.DistStoreError(f'rank 0 did not release attempt {token} within {timeout}')
        else:
            time.sleep(0.05)
    return token


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class PendingSum:
    """A sum over the ranks started by ``all_reduce_sum_async``; ``result()`` waits for it (a number).

    On a CUDA device the sum is copied to pinned host memory behind the collective and a CUDA event is
    recorded after the copy, when the sum is started: ``result()`` waits for that event only, so the kernels
    queued after it (the next training step) keep running. Reading the device tensor instead (``float(t)``)
    would wait for every kernel queued ahead of the read: a device sync per step."""

    def __init__(self, t: torch.Tensor, work: Optional[Any] = None):
        self._t, self._work, self._ready = t, work, None
        if t.is_cuda:
            if work is not None:  # NCCL: the current stream waits for the collective; the host does not
                work.wait()
                self._work = None
            self._t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._t.copy_(t, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> float:
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        if self._work is not None:
            self._work.wait()
            self._work = None
        return float(self._t.sum())


def all_reduce_sum_async(t: torch.Tensor) -> PendingSum:
    """Start summing ``t`` over the ranks without waiting for it (``t`` itself in one process)."""
    if dist.is_available() and dist.is_initialized():
        return PendingSum(t, dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True))
    return PendingSum(t)


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


_LOST_PEER = ('Connection closed by peer', 'Connection reset by peer', 'Broken pipe', 'NCCL', 'ProcessGroupGloo',
              'gloo/transport')


def is_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because another process of the group went away (killed,
    crashed): torch's ``DistError`` family (NCCL errors, timeouts) or gloo's plain ``RuntimeError``."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError)
                                                 and any(k in str(error) for k in _LOST_PEER))


def sync_batchnorm_stats(model: torch.nn.Module, mode: str) -> None:
    """Make every rank's BatchNorm running statistics equal before evaluating or saving: ``'reduce'``
    averages them (timm's ``distribute_bn``), ``'broadcast'`` copies rank 0's, ``'none'`` leaves them.
    Without this each rank keeps statistics of its own shard of the data, and the checkpoint only
    has rank 0's."""
    if mode != 'none' and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        distribute_bn(model, dist.get_world_size(), reduce=mode == 'reduce')


def batchnorm_stats(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """A CPU copy of the buffers ``sync_batchnorm_stats`` changes (the running means and variances)."""
    return {name: buf.detach().cpu().clone() for name, buf in model.named_buffers()
            if 'running_mean' in name or 'running_var' in name}


def load_batchnorm_stats(model: torch.nn.Module, stats: Dict[str, torch.Tensor]) -> None:
    """Put back what ``batchnorm_stats`` copied."""
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in stats.items():
            buffers[name].copy_(value)


def shutdown() -> None:
    """Destroy the process group, if any. The entry points call it before exiting: a process that leaves its gloo
    group to the interpreter's teardown can abort there (SIGABRT, "terminate called without an active exception",
    seen once in CI after a finished two-process run; pytorch PR 179291 describes the cause)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
