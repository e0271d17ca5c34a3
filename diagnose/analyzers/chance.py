"""How likely a record is under chance alone: the one-sided tests the straggler check runs.

A binomial tail (how often a rank comes last, against 1/n) and Student's t (whether its lateness
is positive on average), written out here rather than imported from scipy, which the install
does not otherwise need: a few lines each, exact enough for p-values compared against alpha.
"""
from __future__ import annotations

import math

import numpy as np


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: int) -> float:
    """P(T >= t) for Student's t with df degrees of freedom."""
    tail = 0.5 * _betai(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def mean_positive_p(d: np.ndarray) -> float:
    """One-sided p-value that the mean of d is > 0 (one-sample t-test); 1.0 when it cannot say."""
    d = d[np.isfinite(d)]
    if len(d) < 2 or d.mean() <= 0:
        return 1.0
    sd = float(d.std(ddof=1))
    if sd == 0.0:
        return 0.0  # every difference equal and positive
    return t_sf(float(d.mean()) / (sd / math.sqrt(len(d))), len(d) - 1)


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): how likely a rank is last k or more times of n by chance."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0 or p >= 1.0:
        return 0.0 if p <= 0.0 else 1.0
    lp, lq = math.log(p), math.log1p(-p)
    # log-space terms: exact for the thousands of collectives a long profile holds
    logs = [math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * lp + (n - j) * lq
            for j in range(k, n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(x - top) for x in logs))
