"""MACs of a swapped HF model for a sequence length (or an image size): ``vitblocks.profile.count_macs`` on the
model's own input. A sequence conv has a ``(1, k)`` kernel, so it counts k MACs per output element, not k x k."""
from typing import Dict, Optional

import torch
from torch import nn

from ..profile import count_macs as _count_macs

__all__ = ['count_macs', 'example_inputs']


def example_inputs(model: nn.Module, length: Optional[int] = None, batch_size: int = 1) -> Dict[str, torch.Tensor]:
    """Keyword inputs of one forward: ``input_ids`` of ``length`` tokens (token id 0) for text models,
    ``pixel_values`` at the config's image size for vision ones."""
    config = model.config
    device = next(model.parameters()).device
    if hasattr(config, 'image_size') and not hasattr(config, 'vocab_size'):
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        return {'pixel_values': torch.zeros(batch_size, getattr(config, 'num_channels', 3), size, size,
                                            device=device, dtype=next(model.parameters()).dtype)}
    if length is None or length < 1:
        raise ValueError(f'give the sequence length to count at (length >= 1), got {length!r}')
    return {'input_ids': torch.zeros(batch_size, length, dtype=torch.long, device=device)}


class _KeywordCall(nn.Module):
    def __init__(self, model: nn.Module, inputs: Dict[str, torch.Tensor]):
        super().__init__()
        self.model, self.inputs = model, inputs

    def forward(self, _):
        return self.model(**self.inputs, use_cache=False) if 'input_ids' in self.inputs else self.model(**self.inputs)


def count_macs(model: nn.Module, length: Optional[int] = None, **kwargs):
    """:func:`vitblocks.profile.count_macs` of one sequence of ``length`` tokens (or one image);
    ``kwargs`` are its conventions (``include_norms``, ``include_attention``, ...)."""
    inputs = example_inputs(model, length)
    return _count_macs(_KeywordCall(model, inputs), inputs=torch.zeros(1), **kwargs)
