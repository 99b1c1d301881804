"""Parameter and MAC counting, with the papers' conventions.

The papers' "FLOPs" are multiply-accumulates (MACs). We count with torch's own
``torch.utils.flop_counter.FlopCounterMode`` (which reports FLOPs = 2 x MACs for matmuls and
convolutions) and halve. Out of the box it misses the attention matmuls of fused
``scaled_dot_product_attention`` on CPU (``aten._scaled_dot_product_flash_attention_for_cpu``
has no formula), which makes timm's DeiT-Ti read 1.08 GMACs instead of 1.26; we register the
same formula torch uses for the CUDA kernels, and torch's ``addmm`` formula for the in-place ``addmm_``
(which it does not count either). Element-wise ops (activations, softmax, residual adds) are never counted.

Two conventions differ between papers' counters, so both can be declared:

* Normalization layers. With ``include_norms=True`` each LayerNorm/GroupNorm/BatchNorm output
  element costs 1 MAC, or 2 with an affine scale and shift (the ptflops convention). IFFN's
  Table 1 was evidently counted that way: with it all 22 Table 1 numbers of timm-backed rows
  land within 0.4% (without it IFFN rows read 0.3-1.8% low, since IFFN adds norms on the
  4x-wide hidden features). ``norm_macs_per_element=5`` charges a flat 5 per element instead,
  fvcore's rule for LayerNorm/GroupNorm (and BatchNorm in training mode), which is how RePa's
  Table 1 was counted.
* Attention matmuls. ``include_attention=False`` leaves out the two attention matmuls
  (``q k^T`` and ``attn v``), as counters that cannot see fused attention do (RePa's Table 1).
  They are recognized by op: the fused ``scaled_dot_product_attention`` kernels, and the batched
  matmuls (``bmm``, ``baddbmm``) that timm's unfused attention runs (Swin) and that SDPA
  decomposes into on the meta device. The channel maps of AFBO and SCHEME
  (:mod:`vitblocks.layers.channel_maps`) are batched matmuls too, and stay counted: a batched
  matmul run inside a channel map, or inside a module that holds one (AFBO's inference path calls
  its maps directly), is channel mixing, not attention. A model whose *other* layers use batched
  matmuls would lose those; the timm backbones the papers use (ViT, DeiT, Swin, PoolFormer,
  MLP-Mixer) have none. ``MacReport.by_op`` shows what was counted.
"""
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils import flop_counter

__all__ = ['count_params', 'count_macs', 'MacReport', 'input_size_of', 'fixed_image_size', 'ATTENTION_OPS']

_aten = torch.ops.aten


def _cpu_sdpa_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)  # shapes, as torch's CUDA formula


def _cpu_sdpa_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


def _addmm_inplace_flops(self, mat1, mat2, *args, out_shape=None, **kwargs) -> int:
    (m, k), (_, n) = mat1, mat2
    return 2 * m * k * n  # as torch's addmm formula (the added matrix is not counted)


_EXTRA_FORMULAS = {  # FlopCounterMode wraps these so they receive shapes
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
    _aten.addmm_: _addmm_inplace_flops,  # in-place accumulation (deployed RePa); torch counts only addmm
}


# the attention matmuls (q k^T, attn v): every fused SDPA kernel, and the batched matmuls of unfused attention
ATTENTION_OPS = (
    _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention,
    _aten._flash_attention_forward,
    _aten._efficient_attention_forward,
    _aten.bmm,
    _aten.baddbmm,
)


def _no_flops(*args, out_shape=None, **kwargs) -> int:
    return 0


class _ChannelMapScope:
    """Depth of the forward inside modules that run channel maps, whose batched matmuls are not attention."""

    def __init__(self):
        self.depth = 0

    def hook(self, model: nn.Module) -> list:
        """Hooks on every channel map and every module holding one (AFBO calls ``forward_into`` directly)."""
        from ..layers.channel_maps import ChannelMap
        handles = []
        for m in model.modules():
            if isinstance(m, ChannelMap) or any(isinstance(c, ChannelMap) for c in m.children()):
                handles.append(m.register_forward_pre_hook(self._enter))
                handles.append(m.register_forward_hook(self._leave, always_call=True))
        return handles

    def _enter(self, *args) -> None:
        self.depth += 1

    def _leave(self, *args) -> None:
        self.depth -= 1

    def counted_in_channel_maps(self, op):
        """``op``'s own formula inside a channel map, 0 elsewhere (a batched matmul of attention)."""
        formula = flop_counter.flop_registry[op]

        def flops(*args, out_shape=None, **kwargs) -> int:
            return formula(*args, **kwargs) if self.depth else 0
        return flops


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _norm_flops(x, weight=None, *args, out_shape=None, **kwargs) -> int:
    """FLOPs (= 2 x MACs) of a norm: 1 MAC per element, 2 with affine weight (ptflops)."""
    return 2 * _numel(x) * (2 if weight is not None else 1)


def _layer_norm_flops(x, normalized_shape, weight=None, *args, out_shape=None, **kwargs) -> int:
    return _norm_flops(x, weight)


_NORM_OPS = (_aten.native_layer_norm, _aten.native_group_norm, _aten.native_batch_norm,
             _aten._native_batch_norm_legit, _aten._native_batch_norm_legit_no_training)
_NORM_FORMULAS = {op: _layer_norm_flops if op is _aten.native_layer_norm else _norm_flops for op in _NORM_OPS}


def _flat_norm_formulas(macs_per_element: int) -> Dict:
    """A flat cost per normalization output element, affine or not (fvcore charges 5)."""
    def flops(x, *args, out_shape=None, **kwargs) -> int:
        return 2 * _numel(x) * macs_per_element
    return {op: flops for op in _NORM_OPS}


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (all of them by default, as the papers count)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


@dataclass
class MacReport:
    """MACs of one forward pass of a single image (or the given batch)."""
    total: int
    by_op: Dict[str, int] = field(default_factory=dict)
    by_module: Dict[str, int] = field(default_factory=dict)  # fully qualified module name -> MACs

    @property
    def gmacs(self) -> float:
        return self.total / 1e9

    @property
    def gflops(self) -> float:
        """FLOPs = 2 x MACs."""
        return 2 * self.total / 1e9

    def top_modules(self, depth: int = 1) -> Dict[str, int]:
        """MACs summed over modules ``depth`` levels below the root (``'Global'`` excluded)."""
        out: Dict[str, int] = {}
        for name, macs in self.by_module.items():
            if name == 'Global' or name.count('.') != depth:
                continue
            out[name] = macs
        return out


def fixed_image_size(model: nn.Module) -> Optional[Tuple[int, int]]:
    """(H, W) a model was built for, if it accepts that size only (timm ``PatchEmbed`` with
    ``strict_img_size`` and no ``dynamic_img_size``; GC ViT, whose windows and relative-position
    tables follow ``img_size``), else None."""
    from timm.layers import PatchEmbed
    from timm.models.gcvit import GlobalContextVit
    if isinstance(model, GlobalContextVit):  # the stem reduces by 4; the first stage keeps that grid
        h, w = model.stages[0].feat_size
        return 4 * int(h), 4 * int(w)
    embed = next((m for m in model.modules() if isinstance(m, PatchEmbed)), None)
    if embed is None or embed.img_size is None or getattr(embed, 'dynamic_img_size', False) \
            or not getattr(embed, 'strict_img_size', True):
        return None
    return int(embed.img_size[0]), int(embed.img_size[1])


def input_size_of(model: nn.Module) -> Tuple[int, int, int]:
    """The ``(C, H, W)`` input of a built model: the channels of its first convolution and the
    image size its patch embedding was built with (``img_size=(256, 192)`` counts at 256x192);
    what the model does not fix comes from its pretrained config (default 3x224x224)."""
    pre = tuple((getattr(model, 'pretrained_cfg', None) or {}).get('input_size', (3, 224, 224)))
    first_conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    chans = first_conv.in_channels if first_conv is not None else pre[0]
    size = fixed_image_size(model) or pre[1:]
    return int(chans), int(size[0]), int(size[1])


@torch.no_grad()
def count_macs(model: nn.Module, input_size: Optional[Sequence[int]] = None,
               inputs: Optional[Union[torch.Tensor, Tuple[torch.Tensor, ...]]] = None,
               include_norms: bool = False, norm_macs_per_element: Optional[int] = None,
               include_attention: bool = True) -> MacReport:
    """Count the MACs of ``model`` on one ``(1, C, H, W)`` input (or on ``inputs``).

    Matmuls and convolutions are always counted. The papers' conventions (module docstring):

    Args:
        include_norms: also count normalization layers, by default 2 MACs per output element
            with an affine scale and shift, 1 without (ptflops).
        norm_macs_per_element: with ``include_norms``, a flat cost per normalization output
            element instead (5: fvcore's rule).
        include_attention: count the attention matmuls ``q k^T`` and ``attn v`` (default; they
            are real work: 0.18 of DeiT-Ti's 1.25 GMACs). ``False`` drops them.

    The model is run in eval mode (restored afterwards) under ``torch.no_grad``, on its own
    device and dtype.
    """
    if norm_macs_per_element is not None:
        if not include_norms:
            raise ValueError(f'norm_macs_per_element={norm_macs_per_element} applies to counted norms; pass '
                             f'include_norms=True with it (or drop it to leave norms out)')
        if isinstance(norm_macs_per_element, bool) or not isinstance(norm_macs_per_element, int) \
                or norm_macs_per_element < 0:
            raise ValueError(f'norm_macs_per_element must be a non-negative integer (MACs per normalization '
                             f'output element, e.g. 5 for fvcore\'s rule), got {norm_macs_per_element!r}')
    if inputs is None:
        p = next(model.parameters())
        size = tuple(input_size) if input_size is not None else input_size_of(model)
        inputs = torch.randn(1, *size, device=p.device, dtype=p.dtype)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    formulas = dict(_EXTRA_FORMULAS)
    if include_norms:
        formulas.update(_NORM_FORMULAS if norm_macs_per_element is None else _flat_norm_formulas(norm_macs_per_element))
    handles = []
    if not include_attention:
        formulas.update({op: _no_flops for op in ATTENTION_OPS})
        scope = _ChannelMapScope()  # batched matmuls of channel maps (AFBO, SCHEME) are not attention
        formulas.update({op: scope.counted_in_channel_maps(op) for op in (_aten.bmm, _aten.baddbmm)})
        handles = scope.hook(model)
    was_training = model.training
    model.eval()
    try:
        with flop_counter.FlopCounterMode(display=False, custom_mapping=formulas) as counter:
            model(*inputs)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    counts = counter.get_flop_counts()
    by_module = {name: sum(ops.values()) // 2 for name, ops in counts.items()}
    by_op = {str(op).split('.')[-1]: flops // 2 for op, flops in counts.get('Global', {}).items()
             if flops}  # ops a convention drops (counted as 0) are not listed
    return MacReport(total=counter.get_total_flops() // 2, by_op=by_op, by_module=by_module)
