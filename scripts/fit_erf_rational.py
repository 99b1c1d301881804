"""Fit the rational erf of ``vitblocks.layers.rational_gelu`` and print its coefficients and error.

    .venv/bin/python scripts/fit_erf_rational.py            # prints P, Q and the max errors

erf is odd, so the form is ``erf(x) ~ x * P(x^2) / Q(x^2)`` on ``|x| <= 4`` (``Q(0) = 1``; beyond 4,
erf is 1 to within 1.6e-8 and the layer clamps its argument there), with 7 coefficients in P and
5 in Q. The fit is a minimax one by Lawson's iteration on the linearized problem: each step solves
the weighted least squares ``x P(t) - erf(x) Q(t) = 0`` (``t = x^2``) on a dense grid, dividing by
the previous denominator (so the residual approaches ``x P / Q - erf``) and multiplying each
point's weight by its current error, which drives the weights onto the points of largest error;
the step with the smallest maximum error is kept. The reference is ``math.erf`` in float64.
"""
import argparse
import math

import numpy as np

XMAX = 4.0
NUM_P, NUM_Q = 7, 5


def fit(num_p: int = NUM_P, num_q: int = NUM_Q, xmax: float = XMAX, points: int = 20001, steps: int = 300):
    """Coefficients ``(p, q)`` (lowest power of ``t = x^2`` first, ``q[0] = 1``) and their float64 max error."""
    x = np.linspace(0.0, xmax, points)
    t, f = x * x, np.array([math.erf(v) for v in x])
    basis = np.concatenate([x[:, None] * t[:, None] ** np.arange(num_p),  # x * t^i, i < num_p
                            -f[:, None] * t[:, None] ** np.arange(1, num_q)], axis=1)  # -erf * t^j, 1 <= j < num_q
    lawson = np.full_like(x, 1.0 / points)
    q = np.r_[1.0, np.zeros(num_q - 1)]
    best_err, best = math.inf, None
    for _ in range(steps):
        w = np.sqrt(lawson) / np.abs(np.polyval(q[::-1], t))
        sol = np.linalg.lstsq(basis * w[:, None], f * w, rcond=None)[0]
        p, q = sol[:num_p], np.r_[1.0, sol[num_p:]]
        err = np.abs(x * np.polyval(p[::-1], t) / np.polyval(q[::-1], t) - f)
        if err.max() < best_err:
            best_err, best = err.max(), (p.copy(), q.copy())
        lawson = lawson * (err + 1e-3 * err.max())
        lawson /= lawson.sum()
    return best[0], best[1], best_err


def erf_float32(p, q, x: np.ndarray, xmax: float = XMAX) -> np.ndarray:
    """The rational erf evaluated in float32, Horner's rule, as the layer computes it."""
    x = np.clip(x.astype(np.float32), np.float32(-xmax), np.float32(xmax))
    t = x * x
    num, den = np.float32(p[-1]), np.float32(q[-1])
    for c in p[-2::-1]:
        num = num * t + np.float32(c)
    for c in q[-2::-1]:
        den = den * t + np.float32(c)
    return x * num / den


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    p, q, err64 = fit()
    xs = np.linspace(-8.0, 8.0, 1_600_001)
    err32 = np.abs(erf_float32(p, q, xs).astype(np.float64) - np.array([math.erf(v) for v in xs]))
    print(f'P = {tuple(float(c) for c in p)}')
    print(f'Q = {tuple(float(c) for c in q)}')
    print(f'max |error| on [0, {XMAX:g}], float64: {err64:.2e}; evaluated in float32 on [-8, 8]: {err32.max():.2e}')


if __name__ == '__main__':
    main()
