"""GLUE's metrics: Matthews correlation (CoLA) and accuracy (RTE, MNLI, QNLI)."""
import math
from typing import Dict, Sequence

import torch

__all__ = ['accuracy', 'matthews_corrcoef', 'task_metrics', 'METRIC_NAMES']

METRIC_NAMES = {'matthews': 'Matthews correlation', 'accuracy': 'accuracy'}


def accuracy(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Fraction of predictions equal to their label, in [0, 1]."""
    p, y = torch.as_tensor(predictions), torch.as_tensor(labels)
    if p.shape != y.shape or p.numel() == 0:
        raise ValueError(f'{p.numel()} predictions for {y.numel()} labels')
    return (p == y).double().mean().item()


def matthews_corrcoef(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Matthews correlation coefficient in [-1, 1], the multi-class form (Gorodkin 2004) that is the binary
    (TP TN - FP FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) for two classes. 0 when either the predictions or the
    labels hold one class only (the denominator vanishes), as scikit-learn returns."""
    p, y = torch.as_tensor(predictions).long(), torch.as_tensor(labels).long()
    if p.shape != y.shape or p.numel() == 0:
        raise ValueError(f'{p.numel()} predictions for {y.numel()} labels')
    k = int(max(p.max(), y.max())) + 1
    confusion = torch.zeros(k, k, dtype=torch.float64)
    confusion.index_put_((y, p), torch.ones(len(y), dtype=torch.float64), accumulate=True)  # rows: labels
    true_per_class, predicted_per_class = confusion.sum(1), confusion.sum(0)
    correct, total = confusion.trace(), confusion.sum()
    cov_yp = correct * total - true_per_class @ predicted_per_class
    cov_pp = total ** 2 - predicted_per_class @ predicted_per_class
    cov_yy = total ** 2 - true_per_class @ true_per_class
    denominator = math.sqrt(float(cov_pp) * float(cov_yy))
    return float(cov_yp) / denominator if denominator else 0.0


def task_metrics(predictions: Sequence[int], labels: Sequence[int]) -> Dict[str, float]:
    """Every metric GLUE reports for a classification task (the task picks which one it ranks by)."""
    return {'accuracy': accuracy(predictions, labels), 'matthews': matthews_corrcoef(predictions, labels)}
