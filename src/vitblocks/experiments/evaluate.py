"""Evaluation: top-1/top-5, loss, per-class accuracy and images/s, summed over DDP ranks."""
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..ticker import Ticker
from .distributed import all_reduce_sum

__all__ = ['EvalResult', 'evaluate']


@dataclass
class EvalResult:
    loss: float
    top1: float                     # %
    top5: float                     # % (top-k with k = min(5, classes))
    num_images: int
    seconds: float
    per_class_correct: List[int] = field(default_factory=list)
    per_class_total: List[int] = field(default_factory=list)

    @property
    def images_per_s(self) -> float:
        return self.num_images / self.seconds if self.seconds else float('nan')

    @property
    def per_class_top1(self) -> List[Optional[float]]:
        return [100.0 * c / t if t else None for c, t in zip(self.per_class_correct, self.per_class_total)]

    def to_dict(self) -> Dict:
        return {'loss': self.loss, 'top1': self.top1, 'top5': self.top5, 'num_images': self.num_images,
                'seconds': self.seconds, 'images_per_s': self.images_per_s, 'per_class_top1': self.per_class_top1}


@torch.inference_mode()
def evaluate(model: nn.Module, loader, num_classes: int, device: torch.device, autocast=None,
             class_subset: Optional[Sequence[int]] = None, progress: str = 'none',
             stop: Optional[Callable[[], bool]] = None, epoch: int = 0) -> Optional[EvalResult]:
    """Evaluate ``model`` on one pass of ``loader`` (``loader.epoch(epoch)`` yields (images, labels); a loader
    with random augmentation draws other ones in each epoch).

    ``progress``: 'auto', 'bar', 'log' or 'none' (``vitblocks.ticker.Ticker``, counted in images).

    ``class_subset``: model output indices to keep, in label order (e.g. ImageNet-R's 200 of
    the 1000 ImageNet classes); labels then index the subset.

    ``stop``: asked after each batch (under DDP: each of the batches every rank has, so a vote that is a
    collective stays matched); when it says True the evaluation is abandoned and ``None`` returned (a
    training run preempted mid-evaluation saves its checkpoint instead of finishing it). Every rank must
    get the same answers from it.
    """
    was_training = model.training
    model.eval()
    stats = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top1, top5, images
    correct = torch.zeros(num_classes, dtype=torch.float64, device=device)
    total = torch.zeros(num_classes, dtype=torch.float64, device=device)
    subset = torch.as_tensor(class_subset, device=device) if class_subset is not None else None
    k = min(5, num_classes)
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    order = getattr(loader, 'order', None)  # this rank's images, when the loader says
    ticker = Ticker(len(order.indices(epoch)) if order is not None else None, 'img', 'evaluating', progress)
    asked = order.batches_on_every_rank if order is not None else float('inf')  # batches `stop` is asked after
    for i, (x, y) in enumerate(loader.epoch(epoch)):
        with autocast or nullcontext():
            logits = model(x)
        logits = logits.float()
        if subset is not None:
            logits = logits.index_select(1, subset)
        stats[0] += F.cross_entropy(logits, y, reduction='sum').double()
        top = logits.topk(k, dim=1).indices  # (B, k)
        hit = top.eq(y[:, None])
        stats[1] += hit[:, 0].sum()
        stats[2] += hit.any(1).sum()
        stats[3] += y.numel()
        correct.index_add_(0, y, hit[:, 0].double())
        total.index_add_(0, y, torch.ones_like(y, dtype=torch.float64))
        ticker.update(y.numel())
        if stop is not None and i < asked and stop():
            ticker.close()
            model.train(was_training)
            return None
    ticker.close()
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    all_reduce_sum(stats)
    all_reduce_sum(correct)
    all_reduce_sum(total)
    model.train(was_training)
    n = max(int(stats[3]), 1)
    return EvalResult(loss=float(stats[0]) / n, top1=100.0 * float(stats[1]) / n, top5=100.0 * float(stats[2]) / n,
                      num_images=int(stats[3]), seconds=seconds, per_class_correct=[int(v) for v in correct.tolist()],
                      per_class_total=[int(v) for v in total.tolist()])
