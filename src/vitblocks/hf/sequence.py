"""The spatial part of a block on a 1-D token sequence: depthwise convs along the sequence, pads and causality.

vitblocks' blocks act on a ``(B, C, H, W)`` map that their :class:`~vitblocks.layers.TokenLayout` cuts out of the
tokens. Built with a :class:`SequenceContext` (a layout in ``sequence`` mode) a block sees a text batch
``(B, L, C)`` as a ``(B, C, 1, L)`` map, and :func:`convert_block` then replaces each k x k conv of the block by a
:class:`SequenceConv` with k taps along the sequence (``(1, k)`` kernel: k weights per channel, k MACs per output),
and each BatchNorm by one that leaves pad tokens out of its statistics (:mod:`.masked_norm`).

Our reading of a 2-D spatial op on text (the papers are about images and do not say):

* a k x k depthwise conv becomes a depthwise conv with k taps over the sequence, same k;
* ``padding='same'`` (encoders): the taps are centred, k // 2 on each side (an image's same padding);
* ``padding='causal'`` (decoders): the k - 1 taps before the token and the token itself, zeros before the first;
* pad tokens (``attention_mask == 0``) are zeroed right before each conv, so no real token reads them: a right-padded
  encoder batch gives each sequence what it gives alone, and a left-padded decoder prompt sees zeros before its
  first token, as the causal padding of the prompt alone would;
* AFBO's max / average pooling has no reading here (a pooled pad is not a zero): those variants are refused.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.batchnorm import TokenBatchNorm
from ..layers.layout import TokenLayout
from .conv_cache import load_conv_state, store_conv_state
from .masked_norm import MaskedBatchNorm2d, MaskedTokenBatchNorm

__all__ = ['SequenceContext', 'SequenceConv', 'convert_block', 'PADDINGS', 'BATCH_NORMS']

PADDINGS = ('same', 'causal')
BATCH_NORMS = ('batch', 'running')


class SequenceContext(TokenLayout):
    """A sequence layout shared by every swapped block of one model, carrying what the text around a block knows.

    Set by the hooks of :mod:`vitblocks.hf.hooks` before each forward: ``keep`` the ``(B, L)`` bool mask of the
    real tokens of the current input (``None``: no pads), ``cache`` / ``layer_idx`` the generation cache and layer
    the running layer reads (``None``: no cache). Fixed at swap time: ``causal`` (pad on the left only; cache the
    last k - 1 inputs of each conv) and ``batch_norm`` ('batch': batch statistics over the real tokens in
    training; 'running': always the running statistics, left unchanged; :mod:`.masked_norm`).
    """

    def __init__(self, causal: bool = False, batch_norm: str = 'batch'):
        super().__init__(sequence=True)
        if batch_norm not in BATCH_NORMS:
            raise ValueError(f'batch_norm={batch_norm!r}: use one of {", ".join(BATCH_NORMS)}')
        self.causal = causal
        self.batch_norm = batch_norm
        self.keep: Optional[torch.Tensor] = None
        self.cache = None
        self.layer_idx: Optional[int] = None

    def token_mask(self, batch: int, length: int) -> Optional[torch.Tensor]:
        """The ``(B, L)`` real-token mask for an input of that size, or None; a mask of another size is an error."""
        keep = self.keep
        if keep is None:
            return None
        if tuple(keep.shape) != (batch, length):
            raise RuntimeError(f'the attention mask seen by the model is {tuple(keep.shape)}, but a swapped block got '
                               f'{batch} sequences of {length} tokens; call the swapped blocks through the model '
                               f'(its forward sets the mask), or clear it with model.vitblocks_context.keep = None')
        return keep

    def __getstate__(self):  # a pickled or copied model carries no input of an earlier forward
        state = self.__dict__.copy()
        state.update(keep=None, cache=None, layer_idx=None)
        return state

    def extra_repr(self) -> str:
        return f'causal={self.causal}, batch_norm={self.batch_norm!r}'


class SequenceConv(nn.Conv2d):
    """A conv with k taps along the sequence of a ``(B, C, 1, L)`` map: ``(1, k)`` kernel, same channels and groups
    as the k x k conv it replaces, padded as the context says (centred or causal), pads zeroed first; in a causal
    model with a generation cache, the last k - 1 inputs are carried from one call to the next (``index`` names this
    conv's state within its layer)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, groups: int, bias: bool,
                 context: SequenceContext, index: int, device=None, dtype=None):
        super().__init__(in_channels, out_channels, (1, kernel_size), padding=0, groups=groups, bias=bias,
                         device=device, dtype=dtype)
        self.context = context
        self.index = index
        self.taps = kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, L = x.shape
        if H != 1:
            raise ValueError(f'SequenceConv expects a (B, C, 1, L) sequence map, got {list(x.shape)}')
        keep = self.context.token_mask(B, L)
        if keep is not None:
            x = x * keep.view(B, 1, 1, L).to(x.dtype)  # pads read as zeros
        k = self.taps
        if self.context.causal:
            state = load_conv_state(self.context, self.index, x)  # (B, C, 1, k - 1) or None
            x = torch.cat([state, x], dim=-1) if state is not None else F.pad(x, (k - 1, 0))  # (B, C, 1, k - 1 + L)
            store_conv_state(self.context, self.index, x[..., x.shape[-1] - (k - 1):], L)
        else:
            x = F.pad(x, ((k - 1) // 2, k // 2))  # centred taps: (B, C, 1, L + k - 1)
        return F.conv2d(x, self.weight, self.bias, groups=self.groups)

    def extra_repr(self) -> str:
        return f'{self.in_channels}, {self.out_channels}, taps={self.taps}, groups={self.groups}, ' \
               f'causal={self.context.causal}'


def _square_kernel(conv: nn.Conv2d, qualname: str) -> int:
    kh, kw = conv.kernel_size
    if kh != kw or conv.stride != (1, 1) or conv.dilation != (1, 1):
        raise ValueError(f'{qualname}: a {kh}x{kw} conv with stride {conv.stride} and dilation {conv.dilation} has '
                         f'no sequence reading here (square, stride 1, dilation 1 only)')
    return kh


def convert_block(block: nn.Module, context: SequenceContext, block_name: str = 'block') -> Tuple[int, int]:
    """Make a block built with ``layout=context`` act on sequences, in place: k x k convs (k > 1) become
    :class:`SequenceConv` with k taps (freshly initialized, as the swap initializes the block), BatchNorms become
    masked ones with the same parameters and statistics. Returns ``(convs, norms)`` converted. Pooling (AFBO's
    'maxpool' / 'avgpool') is an error."""
    convs = norms = 0
    for qualname, module in list(block.named_modules()):
        for attr, child in list(module.named_children()):
            where = f'{block_name}.{qualname + "." if qualname else ""}{attr}'
            if isinstance(child, (nn.MaxPool2d, nn.AvgPool2d)):
                raise ValueError(f'{where} is a {type(child).__name__}: pooling over the sequence has no reading in '
                                 f'vitblocks.hf (a pad is not a zero for a pool); use spatial="dwconv" (the default)')
            if type(child) is nn.Conv2d and child.kernel_size != (1, 1):
                k = _square_kernel(child, where)
                w = child.weight
                setattr(module, attr, SequenceConv(child.in_channels, child.out_channels, k, child.groups,
                                                   child.bias is not None, context, convs, device=w.device,
                                                   dtype=w.dtype))
                convs += 1
            elif type(child) is nn.BatchNorm2d:
                setattr(module, attr, MaskedBatchNorm2d.from_batchnorm(child, context))
                norms += 1
            elif type(child) is TokenBatchNorm:
                setattr(module, attr, MaskedTokenBatchNorm.from_batchnorm(child, context))
                norms += 1
    return convs, norms
