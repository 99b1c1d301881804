"""Lipschitz constant of an FFN: the SDP upper bound of IFFN Theorem 4.3, the naive product of
norms, and an empirical lower bound from the Jacobian on real inputs.

IFFN (Sec. 4.2) writes its channel part as ``f(x) = W1 concat(phi_1(W0 x + b0), phi_2(W0 x + b0)) + b1``
(the "AFFN") and splits it (Appendix A, Eq. 13) into ``f = g_1 + g_2``, ``g_i = W1_i phi_i(W0 x + b0)``
with ``W1 = [W1_1 W1_2]``. If ``phi_i`` is slope-restricted on ``[p_i, q_i]`` (Lemma 4.2) and

    M_i = [[-2 W0^T T P_i Q_i W0 - rho_i I,  W0^T T (P_i + Q_i)],
           [(P_i + Q_i) T W0,                -2 T + W1_i^T W1_i]]  <= 0                 (Eq. 9)

for a diagonal ``T >= 0``, then ``L(f) <= sqrt(rho_1) + sqrt(rho_2)`` (Eq. 21). We solve, per part,
``min rho_i`` over ``(rho_i, T_i)`` with cvxpy. Two readings, both sound by the paper's own proof:
each part gets its own ``T_i`` (Eq. 9 names one ``T``, but the proof applies Lemma 4.2 to each part
separately, Eq. 14-19), which can only tighten the bound; and the slope bounds are per channel
(``P = diag(p)``, ``Q = diag(q)``), as Lemma 4.2 holds channel by channel (Fazlyab et al. 2019),
because AGeLU's slope ``alpha * beta * GELU'`` differs per channel. A timm ``Mlp`` is the case of one
part. Where the theorem does not hold (LayerNorm, the depthwise block, bilinear FFNs) the report says so.
"""
import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from ..layers.activations import BASE_ACTIVATIONS, get_base_activation
from .components import eval_forward_with_hooks, ffn_modules

__all__ = ['slope_range', 'agelu_slopes', 'sdp_lipschitz_bound', 'jacobian_norm_lower_bound', 'AffnForm',
           'affn_form', 'FfnLipschitz', 'ffn_lipschitz', 'capture_inputs', 'model_lipschitz']


def slope_range(base: str) -> Tuple[float, float]:
    """``[p, q]`` with ``p <= phi'(x) <= q`` for every x, for a base activation of Eq. 3.

    GELU: ``phi'' = pdf(x) (2 - x^2)`` vanishes at ``+-sqrt(2)``, so the bounds are
    ``GELU'(-+sqrt 2) = Phi(-+sqrt 2) -+ sqrt(2) pdf(sqrt 2)``, i.e. [-0.1289, 1.1289], exact.
    Others: the derivative on a fine grid over [-12, 12]; every base here has slope -> 0 at
    -inf and -> 1 at +inf, so [0, 1] is always included (exact for ReLU, Softplus, ELU).
    """
    base = get_base_activation(base)
    if base == 'gelu':
        pdf = math.exp(-1) / math.sqrt(2 * math.pi)

        def normal_cdf(t):
            return 0.5 * (1 + math.erf(t / math.sqrt(2)))

        return normal_cdf(-math.sqrt(2)) - math.sqrt(2) * pdf, normal_cdf(math.sqrt(2)) + math.sqrt(2) * pdf
    x = torch.linspace(-12, 12, 240001, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(BASE_ACTIVATIONS[base](x).sum(), x)
    return min(grad.min().item(), 0.0), max(grad.max().item(), 1.0)


def agelu_slopes(alpha: torch.Tensor, beta: torch.Tensor, base: str = 'gelu') -> Tuple[np.ndarray, np.ndarray]:
    """Per-channel slope bounds of ``beta * phi(alpha * x + gamma) + theta`` (Eq. 3): its slope is
    ``alpha * beta * phi'(.)``, so ``[p, q]`` of phi scaled by ``alpha * beta`` (ends swapped when negative);
    gamma and theta do not change slopes."""
    p0, q0 = slope_range(base)
    s = (alpha.detach().double() * beta.detach().double()).cpu().numpy()
    return np.minimum(s * p0, s * q0), np.maximum(s * p0, s * q0)


def sdp_lipschitz_bound(w0: np.ndarray, w1: np.ndarray, p: np.ndarray, q: np.ndarray,
                        solver: str = 'SCS', **solver_kwargs) -> float:
    """``sqrt(min rho)`` subject to Eq. 9 for ``x -> w1 phi(w0 x + b0)``: an upper bound of its
    Lipschitz constant (L2 norms). ``w0``: (n, d), ``w1``: (m, n), ``p``, ``q``: (n,) slope bounds.

    ``solver``: a cvxpy SDP solver. SCS (default): the 192x192 matrix inequality of a width-64 IFFN
    part takes ~20 s on one busy CPU core, the 320x320 one of a width-64 ``Mlp`` ~2 min; CLARABEL is
    more accurate but was ~10x slower here on these dense SDPs.
    """
    import cvxpy as cp  # imported here: only this analysis needs it
    w0, w1 = np.asarray(w0, np.float64), np.asarray(w1, np.float64)
    p, q = np.asarray(p, np.float64).reshape(-1), np.asarray(q, np.float64).reshape(-1)
    n, d = w0.shape
    if w1.shape[1] != n or p.shape != (n,) or q.shape != (n,):
        raise ValueError(f'shapes do not chain: w0 {w0.shape}, w1 {w1.shape}, p {p.shape}, q {q.shape}; '
                         f'expected w0 (n, d), w1 (m, n), p and q (n,)')
    if np.any(p > q):
        raise ValueError('slope bounds need p <= q in every channel')
    lam = cp.Variable(n, nonneg=True)  # the diagonal of T (Eq. 8)
    rho = cp.Variable(nonneg=True)
    t = cp.diag(lam)
    top_left = -2 * (w0.T @ t @ (w0 * (p * q)[:, None])) - rho * np.eye(d)  # -2 W0^T T P Q W0 - rho I
    off = (w0 * (p + q)[:, None]).T @ t  # W0^T (P + Q) T: diagonal matrices commute
    m = cp.bmat([[top_left, off], [off.T, -2 * t + w1.T @ w1]])
    problem = cp.Problem(cp.Minimize(rho), [m << 0])
    if solver == 'SCS':  # 1e-5 gave the same bound as 1e-7 to 1e-8 relative on width-64 Mlps, 1.5x faster
        solver_kwargs = {'eps_abs': 1e-5, 'eps_rel': 1e-5, 'max_iters': 200000, **solver_kwargs}
    problem.solve(solver=solver, **solver_kwargs)
    if problem.status not in ('optimal', 'optimal_inaccurate') or rho.value is None:
        raise RuntimeError(f'the Lipschitz SDP was not solved ({solver}: {problem.status}); try solver="CLARABEL"')
    return math.sqrt(max(float(rho.value), 0.0))


def jacobian_norm_lower_bound(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, iters: int = 30,
                              seed: int = 0) -> torch.Tensor:
    """Spectral norm of the Jacobian of ``f`` at each sample of ``x`` (dim 0), by power iteration
    on ``J^T J`` with jvp/vjp (``torch.func``), never forming J. Samples must not interact in ``f``.

    Each value is a Rayleigh-quotient estimate, at most the true ``||J(x_b)||_2``, and every
    ``||J(x)||_2`` is a lower bound of the Lipschitz constant: so ``max`` of the result is one.
    Returns a tensor of shape ``(B,)`` in the dtype of ``x``.
    """
    g = torch.Generator(device='cpu').manual_seed(seed)
    v = torch.randn(x.shape, generator=g, dtype=x.dtype).to(x.device)

    def per_sample_norm(t):
        return t.flatten(1).norm(dim=1).view(-1, *([1] * (t.ndim - 1)))  # (B,) as (B, 1, ...)

    v = v / per_sample_norm(v)
    sigma = torch.zeros(x.shape[0], device=x.device)
    with torch.enable_grad():
        for _ in range(iters):
            _, jv = torch.func.jvp(f, (x,), (v,))  # J v
            _, pullback = torch.func.vjp(f, x)
            (jtjv,) = pullback(jv)  # J^T J v
            sigma = per_sample_norm(jv).flatten()  # ||J v|| with ||v|| = 1
            v = (jtjv / per_sample_norm(jtjv).clamp_min(1e-30)).detach()
    return sigma.detach()


@dataclass
class AffnForm:
    """An FFN read as Theorem 4.3's ``f(x) = sum_i W1_i phi_i(W0 x + b0) + b1``."""
    w0: torch.Tensor  # (n, d)
    b0: Optional[torch.Tensor]
    w1_parts: List[torch.Tensor]  # each (m, n)
    b1: Optional[torch.Tensor]
    phis: List[Callable[[torch.Tensor], torch.Tensor]]  # channel-wise activations of the n channels
    slopes: List[Tuple[np.ndarray, np.ndarray]]  # per part: (p, q), each (n,)
    left_out: List[str] = field(default_factory=list)  # parts of the module the theorem's f omits

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.linear(x, self.w0, self.b0)  # (..., d) -> (..., n)
        out = sum(nn.functional.linear(phi(h), w) for phi, w in zip(self.phis, self.w1_parts))
        return out + self.b1 if self.b1 is not None else out


def _weight(layer: nn.Module) -> torch.Tensor:
    return layer.weight.detach().flatten(1)  # Linear (out, in); 1x1 Conv2d (out, in, 1, 1) -> (out, in)


def _bias(layer: nn.Module) -> Optional[torch.Tensor]:
    return None if layer.bias is None else layer.bias.detach()


def affn_form(ffn: nn.Module) -> Tuple[Optional[AffnForm], str]:
    """``(form, note)``: the theorem's function for an FFN module, or ``(None, why not)``.

    Supported: vitblocks ``IFFN`` with its channel part (the AGeLU copies; its LayerNorms and the
    depthwise block are left out and named in ``form.left_out``) and timm's ``Mlp`` with a
    slope-restricted activation (GELU, ReLU, SiLU, ...).
    """
    from timm.layers import Mlp
    from ..layers.iffn import IFFN
    if isinstance(ffn, IFFN):
        if not ffn.channel_part:
            return None, 'IFFN without its channel part (no AGeLU)'
        act = ffn.act
        n = act.alpha.shape[1]
        w1 = _weight(ffn.fc2)
        phis, slopes = [], []
        for i in range(act.num_functions):
            a, g, b, t = (getattr(act, k)[i].detach() for k in ('alpha', 'gamma', 'beta', 'theta'))
            phis.append(lambda h, a=a, g=g, b=b, t=t: b * act._phi(a * h + g) + t)  # Eq. 3, copy i
            slopes.append(agelu_slopes(a, b, act.base))
        left_out = ['LayerNorm after the concat', 'output LayerNorm']
        if ffn.spatial is not None:
            left_out.insert(1, 'depthwise block')
        parts = [w1[:, i * n:(i + 1) * n] for i in range(act.num_functions)]  # W1 = [W1_1 ... W1_N], Eq. 13
        return AffnForm(_weight(ffn.fc1), _bias(ffn.fc1), parts, _bias(ffn.fc2), phis, slopes, left_out), ''
    if type(ffn) is Mlp:
        act_cls = type(ffn.act)
        try:
            base = get_base_activation(act_cls)
        except ValueError:
            return None, f'Mlp with {act_cls.__name__}, no known slope bounds'
        n = ffn.fc1.out_features if hasattr(ffn.fc1, 'out_features') else ffn.fc1.out_channels
        p, q = slope_range(base)
        left_out = [] if isinstance(ffn.norm, nn.Identity) else ['norm inside the Mlp']
        return AffnForm(_weight(ffn.fc1), _bias(ffn.fc1), [_weight(ffn.fc2)], _bias(ffn.fc2),
                        [BASE_ACTIVATIONS[base]], [(np.full(n, p), np.full(n, q))], left_out), ''
    return None, f'{type(ffn).__name__}: not of the form W1 phi(W0 x) (bilinear/gated or residual FFN)'


@dataclass
class FfnLipschitz:
    """Bounds for one FFN; ``None`` where the theorem does not apply (see ``note``)."""
    name: str
    kind: str
    naive: Optional[float] = None  # sum_i ||W1_i|| max|slope_i| ||W0||
    sdp: Optional[float] = None  # sum_i sqrt(rho_i), Theorem 4.3
    empirical: Optional[float] = None  # max ||J_f(x)|| of the theorem's f over the real tokens
    module_empirical: Optional[float] = None  # the same for the whole module as built (norms, spatial part)
    slope_min: Optional[float] = None  # most negative per-channel slope bound over parts
    slope_max: Optional[float] = None
    note: str = ''
    block: Optional[int] = None  # index of its block in the model (model_lipschitz), for plots against depth


def ffn_lipschitz(ffn: nn.Module, tokens: torch.Tensor, name: str = '', solver: str = 'SCS',
                  iters: int = 30) -> FfnLipschitz:
    """Naive, SDP and empirical bounds of one FFN at the inputs ``tokens`` it received in a forward,
    channels-last ``(B, N, C)`` (or ``(B, H, W, C)``); prefix tokens may be included."""
    form, why = affn_form(ffn)
    kind = type(ffn).__name__
    if form is None:
        return FfnLipschitz(name, kind, note=why)
    if tokens.shape[-1] != form.w0.shape[1] or (_channels_first(ffn) and tokens.ndim != 4):
        raise ValueError(f'{name or kind}: tokens of shape {tuple(tokens.shape)} have {tokens.shape[-1]} channels '
                         f'last, the FFN reads {form.w0.shape[1]}; give channels-last tokens (B, N, C) or (B, H, W, C) '
                         f'((B, H, W, C) for a 1x1-conv FFN; a (B, C, H, W) map: permute(0, 2, 3, 1))')
    tokens = tokens.detach().double()
    flat = tokens.reshape(-1, tokens.shape[-1])  # (B, N, C) -> (B*N, C): f acts token by token
    form64 = AffnForm(form.w0.double(), None if form.b0 is None else form.b0.double(),
                      [w.double() for w in form.w1_parts], None if form.b1 is None else form.b1.double(),
                      form.phis, form.slopes, form.left_out)
    with torch.no_grad():
        w0_norm = torch.linalg.matrix_norm(form64.w0, ord=2).item()
        naive = sum(torch.linalg.matrix_norm(w, ord=2).item() * float(np.max(np.abs(np.concatenate([p, q]))))
                    * w0_norm for w, (p, q) in zip(form64.w1_parts, form.slopes))
    sdp = sum(sdp_lipschitz_bound(form64.w0.numpy(), w.numpy(), p, q, solver=solver)
              for w, (p, q) in zip(form64.w1_parts, form.slopes))
    empirical = jacobian_norm_lower_bound(form64, flat, iters=iters).max().item()
    module = _module_jacobian_lower_bound(ffn, tokens, iters)
    note = ('theorem omits: ' + ', '.join(form.left_out)) if form.left_out else 'theorem holds for the whole module'
    return FfnLipschitz(name, kind, naive, sdp, empirical, module,
                        min(float(p.min()) for p, _ in form.slopes), max(float(q.max()) for _, q in form.slopes), note)


def _module_jacobian_lower_bound(ffn: nn.Module, tokens: torch.Tensor, iters: int) -> float:
    """Largest Jacobian norm of the module as built (per image: its spatial part mixes tokens)."""
    module = copy.deepcopy(ffn).double().eval()
    x = tokens.permute(0, 3, 1, 2) if _channels_first(ffn) else tokens  # (B, H, W, C) -> (B, C, H, W)
    return jacobian_norm_lower_bound(module, x.contiguous(), iters=iters).max().item()


def _channels_first(ffn: nn.Module) -> bool:
    """Whether ``ffn`` reads channels-first ``(B, C, H, W)`` maps: its fc1 is a 1x1 conv (timm's
    ``Mlp(use_conv=True)`` and a channels-first IFFN, as in PoolFormer)."""
    return isinstance(getattr(ffn, 'fc1', None), nn.Conv2d)


@torch.no_grad()
def capture_inputs(model: nn.Module, modules: Sequence[Tuple[str, nn.Module]], images: torch.Tensor):
    """``{name: first positional input}`` of each module during one eval forward of ``model``."""
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.__setitem__(n, args[0])) for n, m in modules]
    eval_forward_with_hooks(model, images, hooks)
    return seen


def model_lipschitz(model: nn.Module, images: torch.Tensor, solver: str = 'SCS', iters: int = 30,
                    blocks: Optional[Sequence[int]] = None) -> List[FfnLipschitz]:
    """:func:`ffn_lipschitz` for the FFN of every block (or the block indices in ``blocks``), each at
    the tokens it receives when ``model`` runs on ``images``."""
    ffns = ffn_modules(model)
    if blocks is not None:
        bad = [i for i in blocks if not 0 <= i < len(ffns)]
        if bad:
            raise ValueError(f'block indices {bad} out of range: the model has {len(ffns)} blocks (0..{len(ffns) - 1})')
    indices = list(range(len(ffns))) if blocks is None else list(blocks)
    ffns = [ffns[i] for i in indices]
    inputs = capture_inputs(model, ffns, images)
    # channels-first FFNs (PoolFormer) received (B, C, H, W) maps: (B, C, H, W) -> (B, H, W, C), as ffn_lipschitz reads
    inputs = {n: inputs[n].permute(0, 2, 3, 1) if _channels_first(m) else inputs[n] for n, m in ffns}
    return [dataclasses.replace(ffn_lipschitz(m, inputs[n], name=n, solver=solver, iters=iters), block=i)
            for i, (n, m) in zip(indices, ffns)]
