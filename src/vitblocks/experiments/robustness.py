"""ImageNet robustness sets given as folders, evaluated with a 1000-class ImageNet model.

- ImageNet-A and ImageNet-R: ``root/<wnid>/*`` over a 200-class subset; the model's logits are
  restricted to those 200 classes (the sets' protocol), using timm's synset lists.
- ImageNet-Sketch: ``root/<wnid>/*`` over all 1000 classes.
- ImageNet-C: ``root/<corruption>/<severity 1-5>/<wnid>/*``; we report top-1 error per
  corruption (mean over severities) and their mean, the *unnormalized* mean corruption error.
  Hendrycks & Dietterich's mCE further divides each corruption's error by AlexNet's; pass those
  errors with ``alexnet_errors`` to get it (we do not ship them).
"""
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from ..data import DataError, FolderDataset

__all__ = ['ROBUSTNESS_SETS', 'RobustnessSet', 'robustness_sets', 'mean_corruption_error']

ROBUSTNESS_SETS = ('imagenet-a', 'imagenet-r', 'imagenet-sketch', 'imagenet-c')


@dataclass
class RobustnessSet:
    name: str                       # e.g. 'imagenet-r' or 'imagenet-c/fog/3'
    dataset: FolderDataset
    class_subset: Optional[List[int]]  # model output indices per dataset label (None: all 1000)
    corruption: str = ''
    severity: int = 0


def _imagenet_synsets() -> List[str]:
    from timm.data import ImageNetInfo
    return list(ImageNetInfo('imagenet-1k').label_names())


def _subset_classes(kind: str) -> List[str]:
    import pkgutil  # timm ships the 200 synsets of ImageNet-A and -R (sorted, as the folders are)
    name = {'imagenet-a': 'imagenet_a_synsets.txt', 'imagenet-r': 'imagenet_r_synsets.txt'}[kind]
    return pkgutil.get_data('timm.data', f'_info/{name}').decode('utf-8').split()


def robustness_sets(kind: str, root: Path) -> List[RobustnessSet]:
    if kind not in ROBUSTNESS_SETS:
        raise DataError(f'unknown robustness set {kind!r}; one of {", ".join(ROBUSTNESS_SETS)}')
    if not root.is_dir():
        raise DataError(f'{root}: no such folder')
    synsets = _imagenet_synsets()
    index = {s: i for i, s in enumerate(synsets)}
    if kind in ('imagenet-a', 'imagenet-r'):
        classes = _subset_classes(kind)
        ds = FolderDataset(root, classes=classes)
        return [RobustnessSet(kind, ds, [index[c] for c in classes])]
    if kind == 'imagenet-sketch':
        return [RobustnessSet(kind, FolderDataset(root, classes=synsets), None)]
    out = []
    for corruption in sorted(d for d in root.iterdir() if d.is_dir()):
        for sev in sorted(d for d in corruption.iterdir() if d.is_dir() and d.name.isdigit()):
            out.append(RobustnessSet(f'{kind}/{corruption.name}/{sev.name}', FolderDataset(sev, classes=synsets),
                                     None, corruption.name, int(sev.name)))
    if not out:
        raise DataError(f'{root}: expected ImageNet-C layout <corruption>/<severity>/<wnid>/<image>')
    return out


def mean_corruption_error(errors: Dict[str, Dict[int, float]],
                          alexnet_errors: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """{corruption: mean error over severities, ..., 'mean': their mean} (errors in %). With
    ``alexnet_errors`` ({corruption: AlexNet's mean error}), each is normalized first (mCE)."""
    per = {c: sum(s.values()) / len(s) for c, s in errors.items()}
    if alexnet_errors:
        missing = sorted(set(per) - set(alexnet_errors))
        if missing:
            raise DataError(f'no AlexNet error given for corruption(s) {missing}')
        per = {c: 100.0 * e / alexnet_errors[c] for c, e in per.items()}
    return {**per, 'mean': sum(per.values()) / len(per)}
