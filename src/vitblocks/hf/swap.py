"""``vitblocks.hf.swap_ffn``: put any vitblocks FFN into the FFN slots of a Hugging Face transformers model."""
import json
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn

from ..layers import FFN_INHERITS, RePaFFN, TokenLayout, create_ffn, list_ffns
from ..models.surgery import hidden_width
from .activation import activation_of
from .families import Family, find_layers
from .ffn import HFFeedForward
from .hooks import install_input_hook, install_layer_hook
from .sequence import BATCH_NORMS, PADDINGS, SequenceContext, convert_block
from .warm_start import check_warm_start, warm_start

__all__ = ['swap_ffn', 'list_hf_ffns', 'CONTEXT_ATTR', 'CONFIG_KEY']

CONTEXT_ATTR = 'vitblocks_context'  # the layout / sequence context shared by a model's swapped blocks
CONFIG_KEY = 'vitblocks'  # config.vitblocks: the swap spec, so that vitblocks.hf.from_pretrained can redo it
RESIDUAL_UNITS = ('repa',)
GATED = ('glu', 'swiglu')  # blocks whose width argument is a gated width (expansion=None: the slot's own)


def list_hf_ffns() -> List[str]:
    """Every block ``swap_ffn`` takes: the registered FFNs and RePa's residual unit."""
    return sorted(list_ffns() + list(RESIDUAL_UNITS))


def _check_model(model: nn.Module, layers) -> None:
    config = getattr(model, 'config', None)
    if config is None or not hasattr(model, 'base_model'):
        raise TypeError(f'vitblocks.hf works on transformers PreTrainedModel instances, got {type(model).__name__}; '
                        f'for timm models use vitblocks.swap_ffn')
    if getattr(config, 'chunk_size_feed_forward', 0):
        raise ValueError(f'config.chunk_size_feed_forward={config.chunk_size_feed_forward}: chunked feed-forward '
                         f'cuts the sequence into pieces, which a conv over the sequence cannot honour; set it to 0')
    if getattr(model, '_tp_size', None) not in (None, 1) or getattr(model, '_device_mesh', None) is not None:
        raise ValueError('this model is sharded with a tensor-parallel plan, whose entries name the FFN modules a '
                         'swap replaces; load it without tp_plan (vitblocks blocks are not tensor-parallel)')
    for name, layer, family in layers:
        if isinstance(family.get_ffn(layer), HFFeedForward):
            raise ValueError(f'{name} already holds a vitblocks block; swap into a freshly built model')


def _drop_tp_plan(model: nn.Module) -> None:
    """The model's tensor-parallel plans name the FFN's gate/up/down projections, which are gone: drop those."""
    for owner in (model.config, getattr(model.config, 'get_text_config', lambda: model.config)()):
        plan = getattr(owner, 'base_model_tp_plan', None)
        if plan:
            owner.base_model_tp_plan = {k: v for k, v in plan.items() if '.mlp.' not in k}
    for m in (model, model.base_model):
        plan = getattr(m, '_tp_plan', None)
        if isinstance(plan, dict):
            m._tp_plan = {k: v for k, v in plan.items() if '.mlp.' not in k}


def _context(model: nn.Module, family: Family, causal: bool, batch_norm: str) -> TokenLayout:
    """The model's shared layout, made (and its input hook installed) by the first swap."""
    existing = model.__dict__.get(CONTEXT_ATTR)
    if existing is not None:
        return existing
    if family.vision:
        config = model.config
        patch = config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0]
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        prefix = 2 if 'deit' in type(model.base_model).__name__.lower() else 1  # DeiT: class + distillation
        layout = TokenLayout((size // patch, size // patch), num_prefix_tokens=prefix)
    else:
        layout = SequenceContext(causal=causal, batch_norm=batch_norm)
    install_input_hook(model, layout, family.vision)
    model.__dict__[CONTEXT_ATTR] = layout
    return layout


def _resolve(family: Family, config, padding: Optional[str], batch_norm: Optional[str]) -> Tuple[bool, str, str]:
    causal = family.causal(config)
    padding = padding or ('causal' if causal else 'same')
    batch_norm = batch_norm or ('running' if causal else 'batch')
    if padding not in PADDINGS:
        raise ValueError(f'padding={padding!r}: use one of {", ".join(PADDINGS)}')
    if batch_norm not in BATCH_NORMS:
        raise ValueError(f'batch_norm={batch_norm!r}: use one of {", ".join(BATCH_NORMS)}')
    if causal and padding == 'same':
        raise ValueError(f'{family.name} is a causal model: centred taps would read later tokens; use '
                         f'padding="causal"')
    if causal and batch_norm == 'batch':
        raise ValueError(f'{family.name} is a causal model: batch statistics would let each token see later tokens '
                         f'of its batch; use batch_norm="running"')
    return padding == 'causal', padding, batch_norm


def _build(name: str, c_in: int, hidden: int, c_out: int, bias: bool, layout, act: Optional[str], cfg: Dict,
           ref, gated: bool) -> Tuple[nn.Module, bool]:
    dd = {'device': ref.device, 'dtype': ref.dtype}
    if name in RESIDUAL_UNITS:
        kwargs = dict(cfg)
        if act is not None and 'act_layer' not in kwargs:
            kwargs['act_layer'] = act
        return RePaFFN(c_in, hidden, c_out, bias=bias, layout=layout, **kwargs, **dd), True
    kwargs = dict(cfg)
    if act is not None and 'act_layer' in FFN_INHERITS.get(name, ()) and 'act_layer' not in kwargs:
        kwargs['act_layer'] = act
    if gated and name in GATED and 'expansion' not in kwargs:
        kwargs['expansion'] = None  # a gated FFN's intermediate size is already the gated width (LLaMA)
    return create_ffn(name, c_in, hidden, c_out, layout=layout, bias=bias, **kwargs, **dd), False


def swap_ffn(model: nn.Module, name: str, *, include: Optional[Callable[[str], bool]] = None,
             mlp_ratio: Optional[float] = None, warm_start_from_dense: bool = False, padding: Optional[str] = None,
             batch_norm: Optional[str] = None, **block_cfg) -> int:
    """Replace the FFNs of a transformers model (BERT, RoBERTa, GPT-2, OpenAI GPT, LLaMA, Qwen2, Mistral, ViT,
    DeiT: :mod:`vitblocks.hf.families`) by the vitblocks block ``name``; returns how many were replaced.

    Args:
        model: a transformers ``PreTrainedModel`` (any head); changed in place.
        name: a block of :func:`list_hf_ffns` (``vitblocks.list_ffns()`` and ``'repa'``).
        include: predicate on a layer's qualified name (``'bert.encoder.layer.3'``) selecting the layers to swap.
        mlp_ratio: hidden width / model width; default keeps the FFN's intermediate size.
        warm_start_from_dense: copy the replaced FFN's weights into the block (``mlp``, ``repa``: fc1 / fc2;
            ``swiglu``: gate / up / down), :mod:`vitblocks.hf.warm_start`; an error for blocks that cannot.
        padding: text only: 'same' (centred taps; the default for encoders) or 'causal' (the default, and the only
            choice, for decoders).
        batch_norm: text only: 'batch' (training statistics over the real tokens; encoders' default) or 'running'
            (normalize with the running statistics; decoders' default and only choice), :mod:`.masked_norm`.
        **block_cfg: the block's own arguments (``kernel_size=3``, ``occm_groups=4``, ...). A block that takes the
            activation over (IFFN, SCHEME, ``mlp``, RePa) gets the model's own unless ``act_layer`` is given.

    The swap is recorded in ``model.config.vitblocks`` (:func:`vitblocks.hf.save_pretrained` /
    :func:`vitblocks.hf.from_pretrained` redo it). Errors: an unknown layer class (naming the supported ones),
    ``chunk_size_feed_forward != 0``, a tensor-parallel sharded model, a second swap into the same model, a pooling
    spatial op on text, options that would break causality.
    """
    if name not in list_hf_ffns():
        raise ValueError(f'unknown block {name!r}; vitblocks.hf swaps in one of {", ".join(list_hf_ffns())}')
    layers = find_layers(model)
    _check_model(model, layers)
    selected = [(q, layer, fam) for q, layer, fam in layers if include is None or include(q)]
    if not selected:
        raise ValueError(f'include= selected none of the {len(layers)} layers of {type(model).__name__} '
                         f'(e.g. {layers[0][0]!r})')
    family = selected[0][2]
    causal, padding, batch_norm = _resolve(family, model.config, padding, batch_norm) if not family.vision \
        else (False, None, None)
    if warm_start_from_dense:
        check_warm_start(name, family.dense(selected[0][1]), family.name)
    try:
        json.dumps(block_cfg)  # config.vitblocks records it, and config.json is JSON
    except TypeError as e:
        raise ValueError(f'block arguments are recorded in config.json, so they must be names, numbers and lists '
                         f'(e.g. act_layer="silu", not a class): {e}') from None
    layout = _context(model, family, causal, batch_norm)
    for index, (qualname, layer, fam) in enumerate(selected):
        dense = fam.dense(layer)
        (w1, b1), (w2, _) = (dense['fc1'], dense['fc2']) if 'fc1' in dense else (dense['gate'], dense['down'])
        c_out, hidden, c_in = w2.shape[0], w1.shape[0], w1.shape[1]
        hidden = hidden_width(c_in, mlp_ratio, hidden, qualname)
        act = activation_of(fam.activation(layer))
        block, residual = _build(name, c_in, hidden, c_out, b1 is not None, layout, act, block_cfg, w1, 'gate' in dense)
        if isinstance(layout, SequenceContext):
            convert_block(block, layout, qualname)
        if warm_start_from_dense:
            warm_start(block, name, dense, qualname)
        old = fam.get_ffn(layer)
        slot = HFFeedForward(block, name, fam.dropout(layer), residual).train(old.training)
        fam.install(layer, slot)
        if residual and fam.pre_norm is not None:
            setattr(layer, fam.pre_norm, nn.Identity())  # RePa's BatchNorm replaces the pre-FFN norm
        if causal:
            attn = getattr(layer, 'self_attn', getattr(layer, 'attn', None))
            layer_idx = getattr(attn, 'layer_idx', None)
            install_layer_hook(model, layer, layout, _layer_number(qualname, index) if layer_idx is None else layer_idx)
    _drop_tp_plan(model)
    spec = dict(getattr(model.config, CONFIG_KEY, None) or {})
    spec.update(ffn=name, cfg=block_cfg, mlp_ratio=mlp_ratio, padding=padding, batch_norm=batch_norm,
                layers=[q for q, _, _ in selected])
    from .. import __version__
    spec['version'] = __version__
    setattr(model.config, CONFIG_KEY, spec)
    return len(selected)


def _layer_number(qualname: str, default: int) -> int:
    last = qualname.rsplit('.', 1)[-1]
    return int(last) if last.isdigit() else default
