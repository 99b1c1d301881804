"""A traffic and time model of one FFN on a GPU: the fused kernels of the deployed IFFN and AFBO against
timm's ``Mlp``, at the roofline (a model, not a measurement).

Each kernel and GEMM is an :class:`Op` with the bytes it reads and writes in DRAM and its FLOPs; its time is
``max(bytes / bandwidth, FLOPs / peak)`` (GEMMs at the tensor-core peak of the setting, element-wise
kernels at the fp32 CUDA-core peak), and an FFN's time is the sum over its ops (they run one after the
other). Assumptions, printed with every table (:data:`ASSUMPTIONS`):

* every tensor is read and written once per op, at its storage dtype (fp32 for ``tf32``, bf16 for
  ``bf16``), weights included; under bf16 autocast each GEMM's fp32 weight is first cast to bf16
  (read 4 B, write 2 B per element), as autocast does;
* the depthwise kernels' halo re-reads (each tile of ``w`` pixels reads ``w + k - 1`` columns of ``k``
  rows) are counted in the bytes; the time comes from L2 for them (the grid runs the rows of an image
  one after the other, so a row's neighbours are read while they are cached); the last column repeats
  the ratio with the column halo read again from DRAM, an upper bound on its cost;
* the grouped GEMM of AFBO reads its input once and its weights once per token tile;
* no launch overhead, no tail effects, full bandwidth and peak: a lower bound on time.
"""
from dataclasses import dataclass
from typing import Dict, List

__all__ = ['Op', 'GPUS', 'ASSUMPTIONS', 'mlp_ops', 'iffn_ops', 'afbo_ops', 'ffn_time_ms', 'ffn_model',
           'model_table']

# dense peaks (no sparsity) and HBM bandwidth from NVIDIA's data sheets (SXM parts)
GPUS = {'H100': dict(bandwidth=3.35e12, tf32=494.7e12, bf16=989.4e12, fp32=66.9e12),
        'H200': dict(bandwidth=4.8e12, tf32=494.7e12, bf16=989.4e12, fp32=66.9e12)}
ASSUMPTIONS = __doc__.split('Assumptions, printed with every table (:data:`ASSUMPTIONS`):')[1].strip()
_BYTES = {'tf32': 4, 'bf16': 2}


@dataclass
class Op:
    """One kernel or GEMM: DRAM bytes read and written, FLOPs, and whether its FLOPs run on tensor cores."""
    name: str
    read: float
    write: float
    flops: float
    tensor_cores: bool = False
    halo: float = 0.0  # bytes read again for the neighbours of a depthwise conv (column halo of the tiles)
    rows_halo: float = 0.0  # bytes read again for the k - 1 rows above and below (from L2)

    def time_s(self, gpu: dict, setting: str, halo_from_dram: bool = False) -> float:
        peak = gpu[setting] if self.tensor_cores else gpu['fp32']
        dram = self.read + self.write + (self.halo if halo_from_dram else 0.0)
        return max(dram / gpu['bandwidth'], self.flops / peak)

    @property
    def bytes_moved(self) -> float:
        """Reads and writes, halo re-reads included."""
        return self.read + self.write + self.halo + self.rows_halo


def _gemm(name: str, tokens: int, k: int, n: int, setting: str, weight_reads: int = 1) -> List[Op]:
    """``(tokens, k) @ (k, n)``: activations at the setting's dtype, the fp32 weight cast first under bf16."""
    e = _BYTES[setting]
    ops = []
    if setting == 'bf16':
        ops.append(Op(f'{name} weight cast', 4 * k * n, 2 * k * n, 0))
    ops.append(Op(name, e * (tokens * k + weight_reads * k * n), e * tokens * n, 2 * tokens * k * n, True))
    return ops


def mlp_ops(tokens: int, dim: int, hidden: int, setting: str) -> List[Op]:
    """timm ``Mlp``: fc1, GELU (its own pass), fc2."""
    e = _BYTES[setting]
    return (_gemm('fc1', tokens, dim, hidden, setting) + [Op('GELU', e * tokens * hidden, e * tokens * hidden,
                                                              20 * tokens * hidden)]
            + _gemm('fc2', tokens, hidden, dim, setting))


def _halo(tensor_bytes: float, width: int, k: int, w_block: int):
    """``(column halo, row halo)`` re-read bytes of a depthwise conv over ``tensor_bytes`` in tiles of ``w_block``
    pixels of one row: each output row reads k rows of ``tile + k - 1`` columns."""
    if not k:
        return 0.0, 0.0
    tile = min(w_block, width)
    columns = tensor_bytes * (k - 1) / tile
    return columns, (tensor_bytes + columns) * (k - 1)


def iffn_ops(tokens: int, width: int, dim: int, hidden: int, num_functions: int, k: int, setting: str,
             w_block: int = 8) -> List[Op]:
    """The deployed IFFN's fused path: fc1 (C -> C'/N), activations + concat + LayerNorm, DWConv + act +
    residual, fc2, the output LayerNorm (``width``: the grid's width, for the halo)."""
    e = _BYTES[setting]
    narrow = hidden // num_functions
    return (_gemm('fc1', tokens, dim, narrow, setting)
            + [Op('agelu_concat_layernorm', e * tokens * narrow, e * tokens * hidden, 30 * tokens * hidden),
               Op('dwconv_act_residual', e * tokens * hidden, e * tokens * hidden, (2 * k * k + 20) * tokens * hidden,
                  False, *_halo(e * tokens * hidden, width, k, w_block))]
            + _gemm('fc2', tokens, hidden, dim, setting)
            + [Op('LayerNorm (output)', e * tokens * dim, e * tokens * dim, 8 * tokens * dim)])


def afbo_ops(tokens: int, width: int, dim: int, hidden: int, window_l: int, window_r: int, k: int, setting: str,
             token_tile: int = 64, w_block: int = 8) -> List[Op]:
    """The deployed AFBO's fused path: both channel maps (output channel j of a map reads ``window`` inputs)
    in one grouped GEMM, both DWConvs + activation + product, fc2 (``k=0``: no spatial op)."""
    e = _BYTES[setting]
    weights = 4 * (window_l + window_r) * hidden  # fp32 weights, read by each token tile
    tiles = -(-tokens // token_tile)
    maps = Op('window_maps', e * tokens * dim + weights * tiles, 2 * e * tokens * hidden,
              2 * tokens * (window_l + window_r) * hidden, True)
    pair = Op('dwconv_pair_product', 2 * e * tokens * hidden, e * tokens * hidden, (4 * k * k + 25) * tokens * hidden,
              False, *_halo(2 * e * tokens * hidden, width, k, w_block))
    return [maps, pair] + _gemm('fc2', tokens, hidden, dim, setting)


def ffn_time_ms(ops: List[Op], gpu: str, setting: str, halo_from_dram: bool = False) -> float:
    return 1e3 * sum(op.time_s(GPUS[gpu], setting, halo_from_dram) for op in ops)


def ffn_model(name: str, batch: int = 128) -> Dict[str, dict]:
    """The model of the first FFN of registered model ``name`` against the vanilla ``Mlp`` it replaces,
    at ``batch``: ``{setting: {bytes, flops, ms per GPU, ratio per GPU}}``. Shapes from the model itself."""
    from .launches import _stage_layers
    method, model = name.split('_', 1)
    layer, shape = _stage_layers(method, model)[0]  # the model's own kernel size
    if len(shape) == 4:  # channels-first map (B, C, H, W)
        tokens, dim, width = shape[2] * shape[3] * batch, shape[1], shape[3]
    else:
        tokens, dim = shape[1] * batch, shape[2]
        width = layer.layout.grid_size[1] if layer.layout.grid_size else 1
    out = {}
    for setting in ('tf32', 'bf16'):
        vanilla = mlp_ops(tokens, dim, 4 * dim, setting)  # timm's Mlp at mlp_ratio 4
        if method == 'iffn':
            k = layer.spatial.conv.kernel_size[0] if layer.spatial is not None else 0
            fused = iffn_ops(tokens, width, dim, layer.hidden_features, layer.act.num_functions, k, setting)
        else:
            k = layer.left_spatial.kernel_size[0] if layer.spatial_kind else 0
            windows = [m.bmm_weight().shape[-2] if m.bmm_weight().ndim == 3 else dim
                       for m in (layer.left_map, layer.right_map)]
            fused = afbo_ops(tokens, width, dim, layer.hidden_features, windows[0], windows[1], k, setting)
        row = dict(fused=[vars(o) for o in fused], vanilla=[vars(o) for o in vanilla],
                   bytes=dict(fused=sum(o.bytes_moved for o in fused),
                              vanilla=sum(o.bytes_moved for o in vanilla)),
                   flops=dict(fused=sum(o.flops for o in fused), vanilla=sum(o.flops for o in vanilla)),
                   ms={}, ratio={}, ratio_halo_from_dram={})
        for gpu in GPUS:
            f, v = ffn_time_ms(fused, gpu, setting), ffn_time_ms(vanilla, gpu, setting)
            row['ms'][gpu] = dict(fused=f, vanilla=v)
            row['ratio'][gpu] = v / f
            row['ratio_halo_from_dram'][gpu] = v / ffn_time_ms(fused, gpu, setting, True)
        out[setting] = row
    return out


def model_table(names, batch: int = 128, targets: Dict[str, float] = None) -> str:
    """The markdown table of :func:`ffn_model` for ``names`` (with the whole-model ``targets`` checked against
    what the roofline allows), followed by the assumptions."""
    lines = [f'FFN model, batch {batch} (roofline: a lower bound on time, not a measurement; GB include halo re-reads)',
             '',
             '| model (first FFN) | setting | GB fused / Mlp | GFLOP fused / Mlp | H100 ms fused / Mlp | '
             'H200 ms fused / Mlp | ratio H100 | ratio H200 | H100, halo from DRAM |',
             '| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |']
    notes = []
    for name in names:
        for setting, r in ffn_model(name, batch).items():
            h100, h200 = r['ms']['H100'], r['ms']['H200']
            gb, gflop = r['bytes'], r['flops']
            lines.append(f"| {name} | {setting} | {gb['fused'] / 1e9:.2f} / {gb['vanilla'] / 1e9:.2f} | "
                         f"{gflop['fused'] / 1e9:.1f} / {gflop['vanilla'] / 1e9:.1f} | "
                         f"{h100['fused']:.3f} / {h100['vanilla']:.3f} | {h200['fused']:.3f} / {h200['vanilla']:.3f} | "
                         f"{r['ratio']['H100']:.2f}x | {r['ratio']['H200']:.2f}x | "
                         f"{r['ratio_halo_from_dram']['H100']:.2f}x |")
            target = (targets or {}).get(name)
            best = max(r['ratio'].values())
            if setting != 'tf32' or target is None or best >= target:
                continue
            if target >= 1.0:
                notes.append(f'- {name}: cannot reach its whole-model target {target:.2f}x even at the roofline: its '
                             f'FFN models at {best:.2f}x the Mlp, and the rest of the model is unchanged, so the '
                             f'whole model lies between {best:.2f}x and 1.00x.')
            else:  # whole = 1 / ((1 - f) + f / best) for an FFN share f of vanilla's time
                share = (1 / target - 1) / (1 / best - 1)
                notes.append(f'- {name}: its FFN models at {best:.2f}x the Mlp, so the whole model reaches its target '
                             f'{target:.2f}x only if FFNs like this one take at most {share:.0%} of the vanilla '
                             "model's time.")
    lines += [''] + notes + ([''] if notes else []) + ['Assumptions:', '', ASSUMPTIONS]
    return '\n'.join(lines)
