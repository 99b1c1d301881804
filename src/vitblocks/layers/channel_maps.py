"""Channel maps of AFBO (Sec. 3.2.2, Fig. 2): dense, grouped (Eq. 5), GCCM (Eq. 6), OCCM (Eq. 7).

A channel map is a per-token linear map ``z = W x + b`` from ``in_features`` (d) to
``out_features`` (Md) channels whose weight matrix ``W`` has a fixed block-sparsity pattern.
The input channels are cut into ``groups`` (G) contiguous groups of ``d/G`` channels. All maps
take channels-last input ``(..., d)`` and return ``(..., Md)``.

| map (class)                                   | eq. | output group reads        | params      | MACs / token |
| --------------------------------------------- | --- | ------------------------- | ----------- | ------------ |
| dense (:class:`DenseChannelMap`)              | -   | every input channel       | Md^2        | Md^2         |
| grouped (:class:`GroupedChannelMap`)          | 5   | input group g             | Md^2/G      | Md^2/G       |
| GCCM (:class:`GroupedCrossChannelMap`)        | 6   | 2G groups, shared pairs   | Md^2/(2G)   | Md^2/G       |
| OCCM (:class:`OverlappedCycleChannelMap`)     | 7   | cyclic window, G-1 groups | M(G-1)d^2/G | M(G-1)d^2/G  |

Why these readings: Eq. 6 and 7 are printed garbled and do not say how they generalize, so
they are read together with Table 1's complexity formulas and Table 7 (DeiT-T with several
G1, G2), where parameters and FLOPs rise with the OCCM group number G2 and fall with the GCCM
group number G1. See each class docstring and docs/afbo.md.

Speed: every map is one batched matmul (``torch.bmm`` / ``baddbmm``) over a strided *view* of
the input, with the groups as the batch; no dense matrix with zeros is ever built in the
forward, and there is no Python loop over groups. Under autograd the result is laid out with
one copy; without autograd (``torch.no_grad`` / ``inference_mode``) the matmul writes straight
into the ``(tokens, Md)`` output through ``out=``, so a map costs what its MACs cost
(``benchmarks/afbo_latency.py`` measures it against a dense matmul of equal MACs). Under autocast
the autograd form runs: autocast does not cast a call with ``out=``, which would stay in fp32.
"""
from typing import List, Optional, Type

import torch
from torch import nn

from .layout import plain_eager_inference

__all__ = ['ChannelMap', 'DenseChannelMap', 'GroupedChannelMap', 'GroupedCrossChannelMap',
           'OverlappedCycleChannelMap', 'CHANNEL_MAPS', 'create_channel_map', 'map_cost', 'valid_group_numbers',
           'check_group_number']


def valid_group_numbers(*constraints: int, limit: Optional[int] = None) -> List[int]:
    """Group numbers G >= 2 such that ``G * k`` divides ``n`` for every ``(n, k)`` constraint pair.

    ``constraints`` is a flat sequence ``n1, k1, n2, k2, ...``; e.g. GCCM needs G | d and 2G | Md.
    """
    pairs = list(zip(constraints[::2], constraints[1::2]))
    top = min(n // k for n, k in pairs)
    out = [g for g in range(2, top + 1) if all(n % (g * k) == 0 for n, k in pairs)]
    return out[:limit] if limit else out


def check_group_number(groups: int, in_features: int, out_features: int, symbol: str = 'groups',
                       out_multiple: int = 1, min_groups: int = 1) -> None:
    """Raise a ValueError saying what is wrong and which group numbers would work.

    The input width must be a multiple of ``groups`` and the output width a multiple of
    ``out_multiple * groups`` (2G output groups for GCCM).
    """
    def suggestion() -> str:
        ok = valid_group_numbers(in_features, 1, out_features, out_multiple)
        ok = [g for g in ok if g >= min_groups]
        if not ok:
            return 'no group number works for these widths'
        return 'use one of ' + ', '.join(map(str, ok[:6])) + (', ...' if len(ok) > 6 else '')

    if not isinstance(groups, int) or isinstance(groups, bool):
        raise TypeError(f'{symbol} must be an int, got {groups!r}')
    if groups < min_groups:
        raise ValueError(f'{symbol}={groups} is too small: this map needs at least {min_groups} groups; {suggestion()}')
    if in_features % groups:
        raise ValueError(f'{symbol}={groups} does not divide {in_features} channels; {suggestion()}')
    if out_features % (groups * out_multiple):
        what = f'{out_multiple}*{symbol}={groups * out_multiple}' if out_multiple > 1 else f'{symbol}={groups}'
        raise ValueError(f'{what} does not divide {out_features} output channels; {suggestion()}')


class ChannelMap(nn.Module):
    """Base class: a structured-sparse linear map on the last dim, computed as one batched matmul.

    Subclasses define the batched weight (:meth:`bmm_weight`, shape ``(G, K, n)``), how the
    ``(G, T, K)`` input view is taken from the ``(T, d)`` rows (:meth:`_input_view`) and how the
    ``(G, T, n)`` result sits in the ``(T, Md)`` output (always ``(T, G, n)``: output group g is
    channels ``g*n ... (g+1)*n - 1``). ``bias`` has one value per output channel (Eq. 4's b^c).
    """
    in_features: int
    out_features: int
    groups: int

    def __init__(self, in_features: int, out_features: int, groups: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    # -- structure, defined by subclasses -------------------------------------------------
    def bmm_weight(self) -> torch.Tensor:
        """Weight as ``(G, K, n)``: batch g maps its K input channels to its n output channels."""
        return self.weight

    def _input_view(self, x: torch.Tensor) -> torch.Tensor:
        """``(T, d)`` rows -> ``(G, T, K)`` view (no copy unless documented)."""
        raise NotImplementedError

    def dense_weight(self) -> torch.Tensor:
        """The equivalent ``(Md, d)`` dense matrix, zeros included (for analysis and plots only)."""
        raise NotImplementedError

    def input_channels(self) -> torch.Tensor:
        """``(G, K)`` indices: the input channels batch g of :meth:`bmm_weight` reads, in its order.
        Default: group g reads the g-th block of ``d/G`` channels (block-wise maps, GCCM)."""
        return torch.arange(self.in_features, device=self.weight.device).view(self.groups, -1)

    def export_weight(self) -> torch.Tensor:
        """The ``(Md, d)`` dense matrix, zeros included, built from the parameters with plain ops (a scatter), for
        exported graphs: ONNX Runtime folds it into a constant and runs the map as one dense MatMul, which measured
        faster there than any grouped form of these maps (the transposes they need cost more than the zero
        blocks' MACs; docs/cpu_deploy.md)."""
        w = self.bmm_weight()  # (G, K, n)
        g, k, n = w.shape
        index = self.input_channels().unsqueeze(-1).expand(g, k, n)  # (G, K) -> (G, K, n)
        full = w.new_zeros(g, self.in_features, n).scatter(1, index, w)  # (G, d, n): zeros off each group's rows
        return full.transpose(1, 2).reshape(g * n, self.in_features)  # (G, d, n) -> (G, n, d) -> (Md, d)

    # -- shared forward ------------------------------------------------------------------
    def init_weights(self):
        nn.init.trunc_normal_(self.weight, std=.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def check_width(self, x: torch.Tensor) -> None:
        """A clear error for input whose last dim is not ``in_features`` (``forward`` checks; callers of
        ``forward_into`` check once per call of theirs, not per batch slice)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f'this channel map takes {self.in_features} input channels (last dim) to '
                             f'{self.out_features}, got input of shape {list(x.shape)}')

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_width(x)
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)  # (..., d) -> (T, d); a view for contiguous input
        if plain_eager_inference(rows, False):  # out= into the output: not while a graph is recorded
            y = self.forward_into(rows, rows.new_empty(rows.shape[0], self.out_features))
        else:
            y = self._matmul_autograd(rows)
        return y.view(list(lead) + [self.out_features])  # (T, Md) -> (..., Md)

    def _matmul_autograd(self, rows: torch.Tensor) -> torch.Tensor:
        g = self.groups
        if self.bias is not None:
            y = torch.baddbmm(self.bias.view(g, 1, -1), self._input_view(rows), self.bmm_weight())
        else:
            y = torch.bmm(self._input_view(rows), self.bmm_weight())  # (G, T, K) @ (G, K, n) -> (G, T, n)
        return y.transpose(0, 1).reshape(rows.shape[0], self.out_features)  # (G, T, n) -> (T, G*n), one copy

    def forward_into(self, rows: torch.Tensor, out: torch.Tensor,
                     weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """No-autograd path: ``out[T, Md] = rows[T, d] @ W^T + b`` written in place, no layout copy.

        ``weight`` may be a precomputed :meth:`bmm_weight` (the inference path of AFBO builds it
        once per forward instead of once per batch slice). The caller checks the width (:meth:`check_width`).
        """
        g = self.groups
        w = self.bmm_weight() if weight is None else weight
        out_view = out.view(out.shape[0], g, -1).transpose(0, 1)  # (T, Md) -> (G, T, n) view of out
        if self.bias is not None:
            torch.baddbmm(self.bias.view(g, 1, -1), self._input_view(rows), w, out=out_view)
        else:
            torch.bmm(self._input_view(rows), w, out=out_view)
        return out

    def extra_repr(self) -> str:
        return f'{self.in_features}, {self.out_features}, groups={self.groups}, bias={self.bias is not None}'


class DenseChannelMap(ChannelMap):
    """Dense map (Fig. 2a): the FFN's fully-connected layer, ``Md x d`` parameters and MACs.

    ``groups`` is accepted for a uniform constructor and must be 1. The FULL variant of
    AFBO (Table 14) uses it in both branches.
    """

    def __init__(self, in_features: int, out_features: int, groups: int = 1, bias: bool = True,
                 device=None, dtype=None):
        if groups != 1:
            raise ValueError(f'a dense channel map has one group, got groups={groups}')
        super().__init__(in_features, out_features, 1, bias, device, dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))  # (Md, d)
        self.init_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_width(x)
        return nn.functional.linear(x, self.weight, self.bias)

    def forward_into(self, rows: torch.Tensor, out: torch.Tensor,
                     weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = self.weight if weight is None else weight
        if self.bias is None:
            return torch.mm(rows, w.t(), out=out)
        return torch.addmm(self.bias, rows, w.t(), out=out)

    def bmm_weight(self) -> torch.Tensor:
        return self.weight

    def export_weight(self) -> torch.Tensor:
        return self.weight

    def dense_weight(self) -> torch.Tensor:
        return self.weight.detach().clone()


class GroupedChannelMap(ChannelMap):
    """Block-wise (grouped) map, Eq. 5 / Fig. 2b: block-diagonal ``W``, no interaction between groups.

    Output group g (``Md/G`` channels) reads input group g (``d/G`` channels) with its own
    ``W(g)``: ``Md^2/G`` parameters and MACs. This is the grouped 1x1 convolution of the
    "Group FFN" / "Group Convolution" rows of Tables 1 and 13.
    """

    def __init__(self, in_features: int, out_features: int, groups: int, bias: bool = True, device=None, dtype=None):
        check_group_number(groups, in_features, out_features, 'G')
        super().__init__(in_features, out_features, groups, bias, device, dtype)
        self.weight = nn.Parameter(torch.empty(groups, in_features // groups, out_features // groups,
                                               device=device, dtype=dtype))  # (G, d/G, Md/G)
        self.init_weights()

    def _input_view(self, x):
        return x.view(x.shape[0], self.groups, -1).transpose(0, 1)  # (T, d) -> (G, T, d/G), a view

    def dense_weight(self) -> torch.Tensor:
        return torch.block_diag(*[w.t() for w in self.weight.detach()])  # (Md, d)


class GroupedCrossChannelMap(ChannelMap):
    """Grouped Cross Channel Mapping (GCCM), Eq. 6 / Fig. 2c.

    Reading (paper symbol G1 = ``groups``): the d inputs form G groups ``x_1 .. x_G`` and the
    Md outputs 2G groups of ``Md/(2G)`` channels. There are G weights ``W(i)`` of shape
    ``Md/(2G) x d/G``; ``W(i)`` is shared by output group i, which reads input group i, and
    output group ``i + G``, which reads input group ``i - 1`` (cyclically, ``x_0 = x_G``). That is
    Eq. 6 read row by row: the left half of the printed matrix is block-diagonal and its right
    half repeats the same blocks shifted by one group, with ``W(1)`` wrapping around.

    Cost: ``Md^2/(2G)`` parameters (the text's "1/2G of the original W^c") but ``Md^2/G`` MACs
    per token, since every one of the 2G output groups is a ``Md/(2G) x d/G`` product. This is
    Table 1's AFBO formula (FLOPs ``2Md^2/G1``); its parameter formula ``Md^2/G1^2`` and its
    SCFBO-GC FLOP formula ``4Md^2/G^2`` agree with this reading at the paper's G1 = 2 only (the
    tables use G1 = 2 everywhere but Table 7's last row, where ``Md^2/(2G1)`` fits better:
    5.69 M vs 5.7 M published, against 5.58 M for ``Md^2/G1^2``). Parameters shrink as G1 grows.

    Output channel order: input-group major. For input group j (0-based) the output holds
    ``[W(j) x_j, W(j+1) x_j]`` (``n = Md/(2G)`` channels each), i.e. paper output groups
    ``j`` and ``G + j + 1`` (mod G). Both halves of one input group come from one matmul
    against ``[W(j) | W(j+1)]``, so the whole map is a single batched matmul on a view of
    the input. The order is a fixed permutation of the paper's, which changes nothing for a
    channel-wise product followed by a dense projection.
    """

    def __init__(self, in_features: int, out_features: int, groups: int, bias: bool = True, device=None, dtype=None):
        check_group_number(groups, in_features, out_features, 'G1', out_multiple=2, min_groups=2)
        super().__init__(in_features, out_features, groups, bias, device, dtype)
        self.weight = nn.Parameter(torch.empty(groups, in_features // groups, out_features // (2 * groups),
                                               device=device, dtype=dtype))  # (G, d/G, Md/2G): W(i)^T
        self.init_weights()

    def bmm_weight(self) -> torch.Tensor:
        # input group j is read by W(j) (paper group j) and by W(j+1) (paper group G+j+1): [W(j) | W(j+1)]
        return torch.cat([self.weight, self.weight.roll(-1, dims=0)], dim=-1)  # (G, d/G, 2n), weight-sized

    def _input_view(self, x):
        return x.view(x.shape[0], self.groups, -1).transpose(0, 1)  # (T, d) -> (G, T, d/G), a view

    def dense_weight(self) -> torch.Tensor:
        w = self.bmm_weight().detach()  # (G, d/G, 2n)
        return torch.block_diag(*[wj.t() for wj in w])  # (G*2n, d): output group pair j reads input group j


class OverlappedCycleChannelMap(ChannelMap):
    """Overlapped Cycle Channel Mapping (OCCM), Eq. 7 / Fig. 2d.

    Reading (paper symbol G2 = ``groups``): inputs and outputs both form G groups; output group
    g (``Md/G`` channels) reads the cyclic window of ``G - 1`` consecutive input groups
    ``g, g+1, ..., g+G-2`` (mod G), i.e. every input group except ``g - 1``. Eq. 7 prints the
    G = 3 case (window of two groups, ``[W_L(g), W_R(g)]`` on the block diagonal and the last
    row wrapping around); Table 1's formulas ``M(G-1)d^2/G`` (parameters) and ``2M(G-1)d^2/G``
    (FLOPs) fix the window at G-1 groups for any G, so parameters and MACs *grow* with G2
    (Table 7: 5.6, 5.8, 6.0, 6.2 M for G2 = 2, 3, 4, 6). A fixed window of two groups would
    shrink them instead. G = 2 is block-diagonal (window of one group).

    Cost: ``M(G-1)d^2/G`` parameters and MACs per token. The forward builds a ``(T, d + (G-2)d/G)``
    copy of the input that repeats the first G-2 groups at the end (an input-width copy, small
    next to the ``Md``-wide output) so every window is a strided view, then runs one batched
    matmul over the G overlapping windows.
    """

    def __init__(self, in_features: int, out_features: int, groups: int, bias: bool = True, device=None, dtype=None):
        check_group_number(groups, in_features, out_features, 'G2', min_groups=2)
        super().__init__(in_features, out_features, groups, bias, device, dtype)
        gin = in_features // groups
        self.window = (groups - 1) * gin  # input channels each output group reads
        self.weight = nn.Parameter(torch.empty(groups, self.window, out_features // groups,
                                               device=device, dtype=dtype))  # (G, (G-1)d/G, Md/G)
        self.init_weights()

    def input_channels(self) -> torch.Tensor:
        gin = self.in_features // self.groups
        start = torch.arange(self.groups, device=self.weight.device).unsqueeze(1) * gin  # (G, 1): first channel
        return (start + torch.arange(self.window, device=self.weight.device)) % self.in_features  # (G, (G-1)d/G)

    def _input_view(self, x):
        gin = self.in_features // self.groups
        if self.groups > 2:  # (T, d) -> (T, d + (G-2)d/G): wrap the first G-2 groups around
            x = torch.cat([x, x[:, :(self.groups - 2) * gin]], dim=1)
        return x.unfold(1, self.window, gin).transpose(0, 1)  # (T, G, (G-1)d/G) -> (G, T, (G-1)d/G), overlapping view

    def dense_weight(self) -> torch.Tensor:
        G, gin = self.groups, self.in_features // self.groups
        n = self.out_features // G
        w = self.weight.detach()
        dense = w.new_zeros(self.out_features, self.in_features)
        for g in range(G):  # analysis helper only, not the forward
            for k in range(G - 1):
                j = (g + k) % G
                dense[g * n:(g + 1) * n, j * gin:(j + 1) * gin] = w[g, k * gin:(k + 1) * gin].t()
        return dense


CHANNEL_MAPS = {
    'dense': DenseChannelMap,
    'grouped': GroupedChannelMap,
    'gccm': GroupedCrossChannelMap,
    'occm': OverlappedCycleChannelMap,
}


def create_channel_map(kind: str, in_features: int, out_features: int, groups: int = 1, bias: bool = True,
                       device=None, dtype=None) -> ChannelMap:
    """Build a channel map by name: 'dense', 'grouped' (Eq. 5), 'gccm' (Eq. 6) or 'occm' (Eq. 7)."""
    if kind not in CHANNEL_MAPS:
        raise ValueError(f'unknown channel map {kind!r}; choose one of {", ".join(CHANNEL_MAPS)}')
    cls: Type[ChannelMap] = CHANNEL_MAPS[kind]
    if kind == 'dense':
        groups = 1
    return cls(in_features, out_features, groups, bias=bias, device=device, dtype=dtype)


def map_cost(kind: str, in_features: int, out_features: int, groups: int = 1) -> dict:
    """Weights and MACs per token of a channel map (biases excluded), from the formulas above."""
    d, h, g = in_features, out_features, groups
    params = {'dense': h * d, 'grouped': h * d // g, 'gccm': h * d // (2 * g), 'occm': h * d * (g - 1) // g}[kind]
    macs = {'dense': h * d, 'grouped': h * d // g, 'gccm': h * d // g, 'occm': h * d * (g - 1) // g}[kind]
    return {'params': params, 'macs': macs}

