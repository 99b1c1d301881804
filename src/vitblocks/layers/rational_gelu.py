"""The exact (erf) GELU with erf as a rational function: a form ``torch.compile`` makes fast on CPUs.

``gelu_rational(x) = x/2 * (1 + erf(x / sqrt(2)))``, the erf GELU of ``F.gelu`` (not the tanh
approximation), with ``erf(x) ~ x * P(x^2) / Q(x^2)`` on ``|x| <= 4`` (the argument is clamped
there, where erf is 1 to within 1.6e-8). In float32 its erf is within 4.1e-7 of erf, and the GELU within
``ERROR_BOUND * max(1, |x|)`` of the float64 GELU (2.9e-7 at worst; torch's own float32 ``F.gelu``: 2.0e-7
with AVX2 kernels, 3.5e-7 with AVX-512);
``tests/test_rational_gelu.py`` checks both. The coefficients come from ``scripts/fit_erf_rational.py`` (a
minimax fit, its docstring has the method).

Why: inductor writes the erf GELU as a polynomial around a Sleef ``exp`` call, which on this AVX2 CPU takes
1.7x the time per element of these sums of products and one division (6.72 vs 4.00 ms for 32 x 196 x 1536
floats, 2 threads, ``benchmarks/iffn_ops.py --compile``), and the form fuses into the kernels around it like
any element-wise op. Eager it is the other way round: torch's GELU is one kernel as fast (4.25 ms, same
command) and this form would be ~20 passes, so only compiled graphs use it (IFFN's CPU inference path while
torch.compile traces it, ``IFFN.compile_rational_gelu``; docs/iffn_speed.md); exported programs (torch.export,
ONNX) keep the GELU op.
"""
import torch
from torch import nn

__all__ = ['erf_rational', 'gelu_rational', 'RationalGELU', 'ERROR_BOUND']

XMAX = 4.0
# numerator x * P(t) and denominator Q(t), t = x^2, lowest power first (scripts/fit_erf_rational.py)
P = (1.1283786771803084, 0.21394546247105475, 0.05243356521810057, 0.004293083812155467, 0.0001555374421514039,
     -1.9903200691277767e-06, 1.9217112595670827e-08)
Q = (1.0, 0.5229318852690177, 0.12079993414629413, 0.01555115345476799, 0.0010980452574592538)
ERROR_BOUND = 3e-7  # float32 GELU vs float64 F.gelu, relative to max(1, |x|)


def _horner(coefs, t: torch.Tensor) -> torch.Tensor:
    acc = t * coefs[-1] + coefs[-2]
    for c in coefs[-3::-1]:
        acc = acc * t + c
    return acc


def erf_rational(x: torch.Tensor) -> torch.Tensor:
    """erf(x) from the rational approximation (float32: within 4.1e-7 of erf)."""
    x = x.clamp(-XMAX, XMAX)
    t = x * x
    return x * _horner(P, t) / _horner(Q, t)


def gelu_rational(x: torch.Tensor) -> torch.Tensor:
    """The exact GELU, ``x/2 * (1 + erf(x / sqrt(2)))``, through :func:`erf_rational`."""
    return 0.5 * x * (1.0 + erf_rational(x * 0.7071067811865476))


class RationalGELU(nn.Module):
    """``nn.GELU()`` computed by :func:`gelu_rational`: for compiled CPU graphs (slower eager)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_rational(x)
