"""The state a causal conv carries through generation: the last k - 1 inputs of each conv, kept with the cache.

A decoder that generates with a cache runs its layers on one new token (or a chunk) at a time. A causal conv over
those tokens needs the k - 1 inputs before them, which the earlier calls saw. Each :class:`SequenceConv` of a
swapped layer therefore stores ``(state, seen)`` in the generation cache object itself, under its
``(layer_idx, conv index)``: ``state`` the last k - 1 conv inputs ``(B, C, 1, k - 1)`` (pads zeroed, zeros before
the first token) and ``seen`` the number of tokens it covers. The attention of the layer runs first and has already
added the current tokens to the cache, so ``seen + L`` must equal the cache's length for that layer: a cache that
was cropped, reused for another prompt or filled without vitblocks is an error, not a silently wrong state.

Beam search and batch expansion go through the cache's own ``reorder_cache``, ``batch_repeat_interleave`` and
``batch_select_indices``; the first time a cache gets conv state, those methods of that cache object are wrapped so
that they reorder the conv state too. ``crop`` (assisted decoding, contrastive search) would need the inputs it
drops: it raises.
"""
from typing import Optional

import torch

__all__ = ['load_conv_state', 'store_conv_state', 'CONV_STATE_ATTR']

CONV_STATE_ATTR = '_vitblocks_conv_state'


def _cache_length(cache, layer_idx: int) -> int:
    return int(cache.get_seq_length(layer_idx))


def load_conv_state(context, index: int, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The ``(B, C, 1, k - 1)`` inputs before ``x`` (B, C, 1, L) kept by an earlier call, or None to pad with zeros
    (no cache, or the first chunk of a fresh cache)."""
    cache, layer = context.cache, context.layer_idx
    if cache is None:
        return None
    states = cache.__dict__.get(CONV_STATE_ATTR, {})
    length, L = _cache_length(cache, layer), x.shape[-1]
    if (layer, index) not in states:
        if length != L:
            raise RuntimeError(f'layer {layer}: the cache already holds {length - L} earlier tokens but no conv state '
                               f'of vitblocks; a cache for a swapped model must be filled by the swapped model '
                               f'(start generation from a fresh cache)')
        return None
    state, seen = states[(layer, index)]
    if seen + L != length:
        raise RuntimeError(f'layer {layer}: the conv state covers {seen} tokens but the cache holds {length - L} '
                           f'before these {L}; the cache was cropped or reused (not supported with vitblocks convs)')
    if state.shape[0] != x.shape[0]:
        raise RuntimeError(f'layer {layer}: conv state for {state.shape[0]} sequences, input of {x.shape[0]}; '
                           f'change the batch through the cache methods (reorder_cache, batch_select_indices)')
    return state.to(x.dtype)


def store_conv_state(context, index: int, tail: torch.Tensor, length: int) -> None:
    """Keep the last k - 1 conv inputs ``tail`` after a call on ``length`` new tokens (a no-op without a cache)."""
    cache, layer = context.cache, context.layer_idx
    if cache is None:
        return
    states = cache.__dict__.get(CONV_STATE_ATTR)
    if states is None:
        states = cache.__dict__[CONV_STATE_ATTR] = {}
        _wrap_batch_methods(cache, states)
    seen = states[(layer, index)][1] if (layer, index) in states else 0
    states[(layer, index)] = (tail.detach(), seen + length)


def _wrap_batch_methods(cache, states: dict) -> None:
    """Make this cache object's batch reordering reorder the conv state too, and its ``crop`` refuse."""
    def remap(fn):
        for key, (state, seen) in list(states.items()):
            states[key] = (fn(state), seen)

    def wrap(name, on_states):
        original = getattr(cache, name, None)
        if original is None:
            return

        def method(*args, **kwargs):
            result = original(*args, **kwargs)
            on_states(*args, **kwargs)
            return result
        setattr(cache, name, method)

    wrap('reorder_cache', lambda beam_idx: remap(lambda s: s.index_select(0, beam_idx.to(s.device))))
    wrap('batch_select_indices', lambda indices: remap(lambda s: s[indices.to(s.device)]))
    wrap('batch_repeat_interleave', lambda repeats: remap(lambda s: s.repeat_interleave(repeats, dim=0)))

    def crop(*args, **kwargs):
        raise NotImplementedError('this cache carries the conv state of vitblocks blocks, which cannot be cropped '
                                  '(assisted decoding and contrastive search crop the cache); use greedy or beam '
                                  'search, or generate without the cache (use_cache=False)')
    cache.crop = crop
