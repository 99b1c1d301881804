"""Float32 precision settings of CUDA GEMMs and convolutions, set and recorded together.

A fair GPU comparison runs every model's GEMMs and convolutions at the same precision. torch's
defaults differ by library: cuBLAS float32 matmuls are strict fp32 (``allow_tf32`` False) while
cuDNN convolutions use TF32 (``cudnn.allow_tf32`` True), so a vanilla PoolFormer (1x1 convs, cuDNN)
ran its channel mixers in TF32 and an AFBO PoolFormer (matmuls, cuBLAS) in fp32. :func:`fp32_precision`
sets both (and ``cudnn.benchmark``) for a block of code; :func:`precision_settings` records them.
The fused Triton kernels follow the matmul setting (:func:`vitblocks.kernels._common.dot_precision`).
"""
from contextlib import contextmanager
from typing import Dict, Iterator

import torch

__all__ = ['fp32_precision', 'precision_settings', 'PRECISIONS']

PRECISIONS = ('tf32', 'strict')  # float32 GEMMs/convs in TF32 (both libraries), or in full fp32 (both)


def precision_settings() -> Dict[str, object]:
    """The settings in force: TF32 for cuBLAS matmuls and cuDNN convs, and ``cudnn.benchmark``."""
    return {'matmul_tf32': bool(torch.backends.cuda.matmul.allow_tf32),
            'cudnn_tf32': bool(torch.backends.cudnn.allow_tf32),
            'cudnn_benchmark': bool(torch.backends.cudnn.benchmark)}


@contextmanager
def fp32_precision(precision: str, cudnn_benchmark: bool = True) -> Iterator[Dict[str, object]]:
    """Run float32 matmuls *and* convs in TF32 (``'tf32'``) or strict fp32 (``'strict'``), restoring the
    previous settings afterwards; yields :func:`precision_settings` as set."""
    if precision not in PRECISIONS:
        raise ValueError(f'precision must be one of {", ".join(PRECISIONS)}, got {precision!r}')
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    tf32 = precision == 'tf32'
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark
    try:
        yield precision_settings()
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = before
