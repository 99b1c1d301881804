"""Forward pre-hooks that tell the swapped blocks what the text around them knows.

* On the base model (``model.base_model``): the 2-D ``attention_mask`` never reaches an FFN (the model turns it
  into a 4-D attention mask or drops it), so the hook keeps its last L columns, the tokens of this call, as the
  context's ``keep`` mask (``None`` when every token is real). For vision models it sets the patch grid from
  ``pixel_values``.
* On each causal layer: the generation cache the layer is called with (``cache``, or ``past_key_values`` before
  transformers 5.24) and the layer's index in it, for :mod:`vitblocks.hf.conv_cache`.

The mask is not cleared after the forward: gradient checkpointing recomputes the layers in the backward pass, and
the recomputed blocks must read the mask of that same batch.
"""
import inspect
from functools import partial
from typing import Optional

import torch
from torch import nn

__all__ = ['install_input_hook', 'install_layer_hook']

def _bound(signature: inspect.Signature, args, kwargs) -> dict:
    try:
        return signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return dict(kwargs)


def _read_text_inputs(context, signature, module, args, kwargs) -> None:
    inputs = _bound(signature, args, kwargs)
    tokens = inputs.get('input_ids')
    if tokens is None:
        tokens = inputs.get('inputs_embeds')
    mask: Optional[torch.Tensor] = inputs.get('attention_mask')
    keep = None
    if tokens is not None and mask is not None and mask.ndim == 2:
        keep = mask[:, mask.shape[1] - tokens.shape[1]:].bool()  # (B, past + L) -> (B, L): this call's tokens
        if not (torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()) \
                and bool(keep.all()):  # a traced graph keeps the masking for any mask
            keep = None
    elif mask is not None and mask.ndim != 2:
        raise ValueError(f'vitblocks.hf needs the 2-D attention_mask (B, L) of real tokens to keep pads out of the '
                         f'convs; got a {mask.ndim}-D mask')
    context.keep = keep


def _read_pixels(layout, signature, patch_size, module, args, kwargs) -> None:
    pixels = _bound(signature, args, kwargs).get('pixel_values')
    if pixels is not None:
        layout.grid_size = (pixels.shape[-2] // patch_size[0], pixels.shape[-1] // patch_size[1])


def _read_cache(context, signature, layer_idx, module, args, kwargs) -> None:
    inputs = _bound(signature, args, kwargs)
    cache = inputs.get('cache', inputs.get('past_key_values'))
    context.cache = cache
    context.layer_idx = layer_idx


def install_input_hook(model: nn.Module, layout, vision: bool) -> None:
    """The base-model hook (see the module docstring)."""
    base = model.base_model
    signature = inspect.signature(base.forward)
    if vision:
        patch = getattr(model.config, 'patch_size', 16)
        patch = (patch, patch) if isinstance(patch, int) else tuple(patch)
        hook = partial(_read_pixels, layout, signature, patch)
    else:
        hook = partial(_read_text_inputs, layout, signature)
    base.register_forward_pre_hook(hook, with_kwargs=True)


def install_layer_hook(model: nn.Module, layer: nn.Module, context, layer_idx: int) -> None:
    """The per-layer cache hook of a causal layer."""
    hook = partial(_read_cache, context, inspect.signature(layer.forward), layer_idx)
    layer.register_forward_pre_hook(hook, with_kwargs=True)
