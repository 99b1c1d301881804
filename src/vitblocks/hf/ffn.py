"""The module a swap puts into a Hugging Face layer's FFN slot: the vitblocks block, the family's dropout, and the
residual-unit convention; and its deployment (``fuse``)."""
import torch
from torch import nn

from ..models.surgery import SWAPPED_ATTR
from .sequence import SequenceConv

__all__ = ['HFFeedForward']


class HFFeedForward(nn.Module):
    """``dropout(block(x))`` in an HF layer's FFN slot (``dropout(block(x) - x)`` for a residual unit such as RePa,
    whose shortcut the family already adds).

    Args:
        block: the vitblocks block (``create_ffn``), built for the model's layout.
        name: its registry name (recorded as ``_vitblocks_ffn``).
        drop: the replaced FFN's own output dropout (GPT-1/2's ``resid_pdrop``); 0 where the layer applies it.
        residual_unit: the block returns ``x + branch``; the slot returns the branch.
    """

    def __init__(self, block: nn.Module, name: str, drop: float = 0., residual_unit: bool = False):
        super().__init__()
        self.block = block
        self.dropout = nn.Dropout(drop)
        self.residual_unit = residual_unit
        setattr(self, SWAPPED_ATTR, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        if self.residual_unit:
            y = y - x
        return self.dropout(y)

    @torch.no_grad()
    def fuse(self) -> 'HFFeedForward':
        """The inference form (vitblocks.deploy.reparameterize calls it): RePa folded into its three matrices, every
        BatchNorm after a sequence conv (IFFN, LocalViT) folded into that conv, a vision block's own ``fuse()``.
        Sequence blocks keep their reference forward (the deployed fast paths assume an image grid).

        Returns a new slot holding the fused block and leaves this one empty, because timm's model walk
        (``reparameterize_model``) goes on into the children of the module it just fused.
        """
        block = self.block
        if any(isinstance(m, SequenceConv) for m in block.modules()):
            _fold_conv_norms(block)  # in place; the block's own fuse() would rebuild image-grid convs
        elif hasattr(block, 'fuse'):  # vision blocks, and blocks with no conv (RePa, AFBO-C, ...)
            block = block.fuse()
        fused = HFFeedForward(block, getattr(self, SWAPPED_ATTR), self.dropout.p, self.residual_unit)
        del self.block
        return fused.train(self.training)


def _fold_conv_norms(block: nn.Module) -> None:
    """In place: each ``conv`` (SequenceConv) followed by ``bn`` (BatchNorm2d) in one module becomes the conv with
    the BatchNorm's running statistics and affine folded in, and ``bn`` an ``Identity`` (eval-mode exact)."""
    for module in block.modules():
        conv, bn = getattr(module, 'conv', None), getattr(module, 'bn', None)
        if not isinstance(conv, SequenceConv) or not isinstance(bn, nn.BatchNorm2d):
            continue
        scale = bn.weight.double() * torch.rsqrt(bn.running_var.double() + bn.eps)  # (C,)
        bias = conv.bias.double() if conv.bias is not None else torch.zeros_like(scale)
        folded = SequenceConv(conv.in_channels, conv.out_channels, conv.taps, conv.groups, True, conv.context,
                              conv.index, device=conv.weight.device, dtype=conv.weight.dtype)
        folded.weight.copy_(conv.weight.double() * scale.view(-1, 1, 1, 1))
        folded.bias.copy_((bias - bn.running_mean.double()) * scale + bn.bias.double())
        module.conv, module.bn = folded.train(conv.training), nn.Identity()
