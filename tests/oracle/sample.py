"""The sampling definition of docs/design.md, Decoding, on plain arrays: which tokens are the
candidates, the probability of each, and which one a seed draws. Written from that definition
and from the published splitmix64 generator (Steele, Lea & Flood, "Fast splittable
pseudorandom number generators", 2014), not from src/pipeline/sample.c.

    candidates  the min(64, V) most likely tokens, logit descending, equal logits lower id first
                (one, the first maximum, when greedy: temperature <= 0); of those, the first
                top_k when 0 < top_k
    q           softmax(logit / temperature) over the candidates
    cut         the shorter of: the smallest prefix of the candidates whose mass (sum of q)
                reaches top_p (all of them when top_p >= 1, at least one), and the candidates
                whose q is at least min_p times the largest q (all when min_p <= 0)
    draw        u = (splitmix64 output >> 11) * 2^-53 in [0, 1), one output per draw; the token
                is the first kept candidate whose cumulative mass, renormalised over the kept
                prefix, exceeds u

Everything is float64 and vectorised over draws. A floating-point definition can only be met up
to rounding, so `draw_positions` also says which draws lie within `eps` of a boundary between
two candidates (either neighbour is then a correct answer)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOP_MAX = 64
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(states) -> tuple[np.ndarray, np.ndarray]:
    """(outputs, next states) of one splitmix64 step from each state (uint64 arrays; arithmetic
    modulo 2^64): the state advances by the golden-ratio constant, the output is the advanced
    state through the two xor-shift-multiply rounds and a final xor-shift."""
    s = np.asarray(states, dtype=np.uint64).reshape(-1) + _GOLDEN
    z = (s ^ (s >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31)), s


def uniforms(outputs) -> np.ndarray:
    """The [0, 1) doubles of 64-bit outputs: their top 53 bits times 2^-53 (exact)."""
    return (np.asarray(outputs, dtype=np.uint64) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def seeds_uniforms(seed0: int, n: int) -> tuple[np.ndarray, int]:
    """One draw for each of n requests seeded seed0, seed0 + 1, ... (mod 2^64): their u, and the
    last request's state after its draw."""
    states = (np.uint64(seed0 % 2**64) + np.arange(n, dtype=np.uint64))
    out, after = splitmix64(states)
    return uniforms(out), int(after[-1]) if n else seed0 % 2**64


def stream_uniforms(seed: int, n: int) -> tuple[np.ndarray, int]:
    """n draws in a row from one request seeded seed: their u, and the state after them. The
    j-th step's state is seed + j * golden, so the stream is computed without a loop."""
    states = np.uint64(seed % 2**64) + np.arange(n, dtype=np.uint64) * _GOLDEN
    out, _ = splitmix64(states)
    after = (seed + n * int(_GOLDEN)) % 2**64
    return uniforms(out), after


@dataclass
class Distribution:
    ids: np.ndarray        # (k) candidate token ids, in candidate order
    q: np.ndarray          # (k) probability of each candidate after the cut (0 beyond it)
    n_kept: int            # the cut: candidates [0, n_kept) can be drawn
    cum: np.ndarray        # (n_kept) cumulative kept mass, renormalised; cum[-1] == 1
    cut_margin: float      # how far top_p (min_p) lies from the nearest prefix mass (ratio
                           # of q to the largest); inf: no cut


def candidates(logits, temperature: float, top_k: int = 0) -> np.ndarray:
    """Token ids of the candidates of a logit row (V), most likely first, equal logits by id."""
    x = np.asarray(logits, dtype=np.float32)
    ids = np.arange(x.size)
    order = np.lexsort((ids, -x.astype(np.float64)))  # last key first: logit desc, then id
    k = min(TOP_MAX, x.size) if temperature > 0 else 1
    if top_k > 0:
        k = min(k, top_k)
    return order[:k]


def distribution(logits, temperature: float, top_p: float, top_k: int = 0,
                 min_p: float = 0.0) -> Distribution:
    """The definition's distribution over the candidates of a logit row."""
    x = np.asarray(logits, dtype=np.float32).astype(np.float64)
    ids = candidates(x, temperature, top_k)
    if temperature <= 0:
        return Distribution(ids, np.ones(1), 1, np.ones(1), np.inf)
    z = x[ids] / temperature
    w = np.exp(z - z.max())
    mass = np.cumsum(w / w.sum())
    if top_p >= 1:
        n, margin = ids.size, np.inf
    else:
        n = int(np.clip(np.searchsorted(mass, top_p, side="left") + 1, 1, ids.size))
        margin = float(np.min(np.abs(mass[:-1] - top_p))) if ids.size > 1 else np.inf
    if min_p > 0:
        ratio = w / w.max()  # q_i / max q
        n = min(n, max(1, int(np.count_nonzero(ratio >= min_p))))
        margin = min(margin, float(np.min(np.abs(ratio - min_p))))
    q = np.zeros(ids.size)
    q[:n] = w[:n] / w[:n].sum()
    cum = np.cumsum(w[:n]) / np.sum(w[:n])
    cum[-1] = 1.0
    return Distribution(ids, q, n, cum, margin)


def draw_positions(d: Distribution, u: np.ndarray, eps: float = 0.0):
    """For each u: the position (in candidate order) the definition draws, and the lowest and
    highest positions a draw within eps of u could give (equal to it but near a boundary)."""
    side = dict(side="right")
    pos = np.searchsorted(d.cum, u, **side)
    lo = np.searchsorted(d.cum, u - eps, **side)
    hi = np.minimum(np.searchsorted(d.cum, u + eps, **side), d.n_kept - 1)
    return pos, lo, hi
