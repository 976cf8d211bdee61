"""Chi-square tails for the statistical tests (numpy only; no scipy in the test environment):
the central chi-square survival function and its inverse, the non-central chi-square CDF (for
a test's power), and the binned Pearson statistic.

    P(a, x)          regularised lower incomplete gamma, by its power series for x < a + 1 and
                     by the continued fraction of Q = 1 - P otherwise (both converge fast there)
    chi2_sf(x, df)   = Q(df / 2, x / 2)
    ncx2_cdf(x, df, lam)
                     = sum_j Poisson(j; lam / 2) * P(df / 2 + j, x / 2), the Poisson mixture
                     of central chi-squares, summed over the Poisson's mass to 1e-16"""
from __future__ import annotations

import math

import numpy as np


def _lower_series(a: float, x: float) -> float:
    term = total = 1.0 / a
    n = a
    while term > total * 1e-17:
        n += 1
        term *= x / n
        total += term
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _upper_fraction(a: float, x: float) -> float:
    """Q(a, x) by the modified Lentz evaluation of its continued fraction."""
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 100000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return h * math.exp(-x + a * math.log(x) - math.lgamma(a))


def gamma_p(a: float, x: float) -> float:
    if x <= 0:
        return 0.0
    return _lower_series(a, x) if x < a + 1 else 1.0 - _upper_fraction(a, x)


def gamma_q(a: float, x: float) -> float:
    if x <= 0:
        return 1.0
    return 1.0 - _lower_series(a, x) if x < a + 1 else _upper_fraction(a, x)


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square with df degrees of freedom."""
    return gamma_q(df / 2, x / 2)


def chi2_isf(alpha: float, df: int) -> float:
    """The x with chi2_sf(x, df) = alpha (bisection to relative 1e-12)."""
    lo, hi = 0.0, float(df) + 10.0
    while chi2_sf(hi, df) > alpha:
        hi *= 2
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


def ncx2_cdf(x: float, df: int, lam: float) -> float:
    """P(X <= x) for X ~ non-central chi-square (df, non-centrality lam)."""
    if lam == 0:
        return gamma_p(df / 2, x / 2)
    half = lam / 2
    mode = int(half)
    total = 0.0
    # out from the Poisson's mode both ways until the remaining weight is negligible
    for step in (1, -1):
        j = mode if step == 1 else mode - 1
        while j >= 0:
            wj = math.exp(-half + j * math.log(half) - math.lgamma(j + 1))
            total += wj * gamma_p(df / 2 + j, x / 2)
            if wj < 1e-18 and abs(j - mode) > 10:
                break
            j += step
    return min(total, 1.0)


def bins(q: np.ndarray, n: int, min_expected: float = 5.0) -> list[np.ndarray]:
    """Cells for a Pearson test of n draws from q (positions of q > 0, most likely first):
    one cell per position while its expected count is at least min_expected, the rest of the
    tail merged into cells of at least that expectation (the last one may absorb a short rest)."""
    pos = [int(i) for i in np.flatnonzero(q > 0)]
    cells, cur, cur_e = [], [], 0.0
    for i in pos:
        cur.append(i)
        cur_e += q[i] * n
        if cur_e >= min_expected:
            cells.append(np.array(cur))
            cur, cur_e = [], 0.0
    if cur:
        if cells:
            cells[-1] = np.concatenate([cells[-1], cur])
        else:
            cells.append(np.array(cur))
    return cells


def pearson(counts: np.ndarray, q: np.ndarray, n: int, cells: list[np.ndarray]) -> float:
    """Pearson's statistic of the counts per position against n draws from q over the cells;
    infinite when a position outside the cells (q == 0) was drawn."""
    inside = np.concatenate(cells)
    if counts.sum() != counts[inside].sum():
        return math.inf
    obs = np.array([counts[c].sum() for c in cells], dtype=np.float64)
    exp = np.array([q[c].sum() * n for c in cells])
    return float(np.sum((obs - exp) ** 2 / exp))


def noncentrality(q: np.ndarray, q_alt: np.ndarray, n: int, cells: list[np.ndarray]) -> float:
    """n * sum over cells of (q_alt - q)^2 / q: the non-centrality of Pearson's statistic when
    the draws come from q_alt (the large-n approximation the power calculation uses)."""
    p0 = np.array([q[c].sum() for c in cells])
    p1 = np.array([q_alt[c].sum() for c in cells])
    return float(n * np.sum((p1 - p0) ** 2 / p0))
