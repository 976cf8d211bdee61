"""fitm's sampler (src/pipeline/sample.c: the draw of /answer and the OpenAI routes) against the
independent reference of its definition (tests/oracle/sample.py; docs/design.md, Decoding),
through build/tests/sample_tool, which selects the candidates of a logit row as the forward
pass does (fitm_ops_topk) and draws as the decode step does.

* Exact draws: on seeded random rows (several temperatures, top_p values, vocabulary sizes,
  tied logits), every draw of many requests (one draw each, consecutive seeds) and of one long
  request (draws in a row) is the reference's, and the PRNG state afterwards is the
  reference's (one step per draw). A draw whose u lies within EPS of a boundary between two
  candidates may be either (floating point meets a real-valued definition only to rounding);
  such draws are counted and must stay rare.
* Distribution: over many seeds, the draws' frequencies pass Pearson's chi-square against the
  reference probabilities at ALPHA = 1e-6 per check (the seeds are fixed, so the test is
  deterministic: ALPHA is the probability that a correct sampler fails it for a fresh choice
  of seeds). The number of draws is chosen per row so that a sampler whose temperature is 10%
  off (0.9 t or 1.1 t) fails with probability at least 1 - BETA = 1 - 1e-6 (the power, from
  the non-central chi-square of tests/oracle/stats.py), and the reference's own draws at 0.9 t
  and 1.1 t from the same seeds are shown to fail it.
* The edge cases, by definition: temperature -> 0+ is greedy, a huge temperature is uniform
  over the 64 candidates, top_p = 1 keeps all 64, a tiny top_p keeps one, equal logits are
  ordered by id (in the selection and in the cut), greedy leaves the PRNG alone.
"""
import pathlib
import subprocess

import numpy as np
import pytest

from conftest import build_dir
from oracle import sample as ref
from oracle import stats

ALPHA = 1e-6   # false-failure probability of one chi-square check
BETA = 1e-6    # at most this probability of passing a sampler whose temperature is 10% off
EPS = 1e-12    # a draw this close to a boundary between two candidates may be either
N_EXACT = 20000


@pytest.fixture(scope="module")
def tool() -> pathlib.Path:
    p = build_dir() / "tests" / "sample_tool"
    if not p.exists():
        pytest.fail(f"{p} not built; run meson/ninja first (or set FITM_BUILD_DIR)")
    return p


def draw(tool, row, mode: str, seed: int, n: int, temperature: float, top_p: float,
         top_k: int = 0, min_p: float = 0.0):
    """sample_tool's draws (token ids) and its PRNG state afterwards."""
    text = " ".join(float(v).hex() for v in np.asarray(row, dtype=np.float32))
    cuts = [str(top_k), float(min_p).hex()] if top_k or min_p else []
    r = subprocess.run([str(tool), mode, str(seed), str(n), float(temperature).hex(),
                        float(top_p).hex(), *cuts], input=text, capture_output=True, text=True)
    assert r.returncode == 0, f"sample_tool: {r.stderr}"
    lines = r.stdout.split("\n")
    assert lines[n].startswith("state "), r.stdout[-200:]
    return np.array(lines[:n], dtype=np.int64), int(lines[n].split()[1], 16)


def reference(row, mode: str, seed: int, n: int, temperature: float, top_p: float,
              top_k: int = 0, min_p: float = 0.0):
    """The reference's distribution, u per draw and PRNG state afterwards."""
    d = ref.distribution(row, temperature, top_p, top_k, min_p)
    u, after = (ref.seeds_uniforms if mode == "seeds" else ref.stream_uniforms)(seed, n)
    return d, u, after


def positions(d: ref.Distribution, ids: np.ndarray) -> np.ndarray:
    """The candidate position of each drawn id (-1: not a candidate)."""
    where = {int(t): i for i, t in enumerate(d.ids)}
    return np.array([where.get(int(t), -1) for t in ids])


def check_exact(tool, row, mode, seed, n, t, top_p, top_k=0, min_p=0.0):
    """Every draw is the reference's (up to EPS at a boundary); returns the draws' positions."""
    got, state = draw(tool, row, mode, seed, n, t, top_p, top_k, min_p)
    d, u, after = reference(row, mode, seed, n, t, top_p, top_k, min_p)
    untouched = (seed + (n - 1 if mode == "seeds" else 0)) % 2**64  # greedy: the last seed
    assert state == (after if t > 0 else untouched), "the PRNG is not one step per draw"
    if t <= 0:
        assert (got == d.ids[0]).all()
        return np.zeros(n, dtype=np.int64)
    assert d.cut_margin > 1e-9, "top_p or min_p on a prefix boundary: choose another row"
    pos = positions(d, got)
    want, lo, hi = ref.draw_positions(d, u, EPS)
    bad = np.flatnonzero((pos < lo) | (pos > hi))
    assert bad.size == 0, (
        f"{bad.size} of {n} draws differ from the definition ({mode}, t {t}, top_p {top_p}, "
        f"top_k {top_k}, min_p {min_p}); "
        f"first at draw {bad[0]}: u {u[bad[0]]!r}, drew candidate {pos[bad[0]]}, "
        f"the definition says {want[bad[0]]} (q {d.q[:8].round(6).tolist()}...)")
    assert np.count_nonzero(lo != hi) <= max(2, n // 10000), "too many draws near a boundary"
    return pos


def row(kind: str, seed: int) -> np.ndarray:
    """A logit row (float32) of one of several shapes, fresh from a seeded generator."""
    g = np.random.default_rng(seed)
    if kind == "normal":    # a broad head: the 64 candidates span a few nats
        x = g.normal(0, 2.5, 5000)
    elif kind == "peaked":  # an LM-like head: a few likely tokens above a long tail
        x = g.normal(0, 1.0, 3000)
        x[g.choice(3000, 4, replace=False)] += [7.0, 5.5, 5.0, 3.0]
    elif kind == "small":   # a vocabulary below 64: every token a candidate
        x = g.normal(0, 1.5, 40)
    elif kind == "ties":    # logits on a coarse grid: ties inside the candidates, ids decide
        x = np.round(g.normal(0, 2.0, 800) * 2) / 2
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


EXACT = [("normal", 0.7, 1.0), ("normal", 0.7, 0.9), ("normal", 1.0, 0.5),
         ("normal", 4.0, 0.99), ("peaked", 0.3, 0.95), ("peaked", 1.5, 1.0),
         ("small", 2.0, 0.8), ("ties", 0.7, 0.9), ("ties", 0.05, 0.6)]


@pytest.mark.parametrize("mode", ["seeds", "stream"])
@pytest.mark.parametrize("case", range(len(EXACT)))
def test_exact_draws(tool, case, mode):
    kind, t, top_p = EXACT[case]
    x = row(kind, 100 + case)
    seed = (0x5EED << 40) + 977 * case + (mode == "stream")
    check_exact(tool, x, mode, seed, N_EXACT, t, top_p)


# top_k and min_p (vLLM's and llama.cpp's names), alone and with top_p
EXACT_CUTS = [("normal", 0.7, 1.0, 10, 0.0), ("normal", 1.5, 0.9, 40, 0.0),
              ("peaked", 1.0, 1.0, 0, 0.05), ("normal", 2.0, 0.95, 30, 0.2),
              ("ties", 0.7, 1.0, 5, 0.0), ("small", 3.0, 1.0, 0, 0.5)]


@pytest.mark.parametrize("mode", ["seeds", "stream"])
@pytest.mark.parametrize("case", range(len(EXACT_CUTS)))
def test_exact_draws_top_k_min_p(tool, case, mode):
    kind, t, top_p, top_k, min_p = EXACT_CUTS[case]
    x = row(kind, 400 + case)
    d = ref.distribution(x, t, top_p, top_k, min_p)
    full = ref.distribution(x, t, top_p)
    assert d.n_kept < full.n_kept, "the cut must keep fewer than top_p alone: choose another row"
    seed = (0x70C << 44) + 1009 * case + (mode == "stream")
    pos = check_exact(tool, x, mode, seed, N_EXACT, t, top_p, top_k, min_p)
    assert pos.max() == d.n_kept - 1  # the last kept candidate is drawn, none past it


def plan(x, t: float, top_p: float, top_k: int = 0, min_p: float = 0.0):
    """The number of draws n at which the chi-square check at ALPHA rejects a temperature 10%
    off with probability >= 1 - BETA, with its cells, critical value and power."""
    d0 = ref.distribution(x, t, top_p, top_k, min_p)
    for n in (2000 * 2**i for i in range(10)):
        cells = stats.bins(d0.q, n)
        crit = stats.chi2_isf(ALPHA, len(cells) - 1)
        power = 1.0
        for t_alt in (0.9 * t, 1.1 * t):
            q1 = ref.distribution(x, t_alt, top_p, top_k, min_p).q  # same candidates, order
            outside = q1[d0.q == 0].sum()
            if outside > 0:  # any such draw fails the check (its expected count is 0)
                power = min(power, 1 - (1 - outside) ** n)
            else:
                lam = stats.noncentrality(d0.q, q1, n, cells)
                power = min(power, 1 - stats.ncx2_cdf(crit, len(cells) - 1, lam))
        if power >= 1 - BETA:
            return d0, n, cells, crit, power
    raise AssertionError(f"no n up to 10^6 gives the power wanted at t {t}, top_p {top_p}")


def counts_of(pos: np.ndarray, k: int) -> np.ndarray:
    """Draws per candidate position (pos >= 0)."""
    return np.bincount(pos, minlength=k)


CHI2 = [("normal", 0.7, 1.0, 0, 0.0), ("normal", 0.7, 0.9, 0, 0.0), ("peaked", 0.7, 1.0, 0, 0.0),
        ("small", 2.0, 0.8, 0, 0.0), ("ties", 1.0, 0.95, 0, 0.0), ("normal", 1.2, 1.0, 20, 0.0),
        ("normal", 1.0, 1.0, 0, 0.1)]


@pytest.mark.parametrize("case", range(len(CHI2)))
def test_distribution_chi_square(tool, case):
    kind, t, top_p, top_k, min_p = CHI2[case]
    x = row(kind, 200 + case)
    d, n, cells, crit, power = plan(x, t, top_p, top_k, min_p)
    seed = (0xC41 << 44) + 1_000_003 * case
    ids, _ = draw(tool, x, "seeds", seed, n, t, top_p, top_k, min_p)  # by frequencies alone
    pos = positions(d, ids)
    k = d.ids.size
    got = stats.pearson(counts_of(pos, k), d.q, n, cells) if (pos >= 0).all() else np.inf
    assert got <= crit, (f"chi-square {got:.1f} > {crit:.1f} ({len(cells) - 1} df, "
                         f"{n} draws, t {t}, top_p {top_p})")
    # the same seeds drawn by the definition at a temperature 10% off fail the same bound
    u, _ = ref.seeds_uniforms(seed, n)
    for t_alt in (0.9 * t, 1.1 * t):
        alt = ref.distribution(x, t_alt, top_p, top_k, min_p)
        wrong = stats.pearson(counts_of(alt.cum.searchsorted(u, side="right"), k), d.q, n, cells)
        assert wrong > crit, (f"t {t_alt:.3f} instead of {t} passes ({wrong:.1f} <= {crit:.1f}, "
                              f"{n} draws, power {power:.8f})")


def test_chi_square_tails_match_numpy_draws():
    """tests/oracle/stats.py against numpy's own chi-square samplers (the power and the
    critical values above rest on them)."""
    g = np.random.default_rng(7)
    for df, lam, x in [(5, 0.0, 9.0), (40, 0.0, 60.0), (63, 3.0, 80.0), (30, 120.0, 140.0)]:
        s = g.noncentral_chisquare(df, lam, 200000) if lam else g.chisquare(df, 200000)
        mc = np.mean(s <= x)
        assert abs(stats.ncx2_cdf(x, df, lam) - mc) < 5 * np.sqrt(mc * (1 - mc) / s.size) + 1e-4
    assert abs(stats.chi2_isf(0.05, 1) - 3.841458820694124) < 1e-9
    assert abs(stats.chi2_isf(0.01, 10) - 23.209251158954356) < 1e-9


def test_reference_prng_is_published_splitmix64():
    out, _ = ref.splitmix64(np.array([0, 0x9E3779B97F4A7C15, 2 * 0x9E3779B97F4A7C15 % 2**64],
                                     dtype=np.uint64))
    assert [int(v) for v in out] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_greedy_is_the_first_maximum(tool):
    x = row("normal", 301)
    x[[17, 4, 2999]] = x.max() + 1  # three maxima: the lowest id wins
    got, state = draw(tool, x, "stream", 12345, 50, 0.0, 0.5)
    assert (got == 4).all() and state == 12345, "greedy must not touch the PRNG"
    check_exact(tool, x, "seeds", 1, 500, 0.0, 1.0)


def test_temperature_to_zero_is_greedy(tool):
    x = row("peaked", 302)
    top = np.sort(x)[::-1]
    assert top[0] - top[1] > 0.1
    for t in (1e-3, 1e-6, 1e-300):
        got, _ = draw(tool, x, "seeds", 77, 5000, t, 1.0)
        assert (got == np.argmax(x)).all(), f"t {t}"
    # tied maxima share the limit equally (softmax's), where greedy takes the lowest id
    x[[50, 9]] = x.max() + 2
    pos = check_exact(tool, x, "seeds", 78, 8000, 1e-4, 1.0)
    assert set(pos) == {0, 1} and abs(np.mean(pos) - 0.5) < 5 * 0.5 / np.sqrt(8000)


def test_high_temperature_is_uniform(tool):
    x = row("normal", 303)
    d = ref.distribution(x, 1e4, 1.0)
    assert d.n_kept == 64 and np.abs(d.q * 64 - 1).max() < 2e-3
    n = 64 * 2000
    pos = check_exact(tool, x, "seeds", 79, n, 1e4, 1.0)
    uniform = np.full(64, 1 / 64)
    cells = stats.bins(uniform, n)
    assert stats.pearson(counts_of(pos, 64), uniform, n, cells) <= stats.chi2_isf(ALPHA, 63)
    assert set(d.ids[pos]) == set(np.argsort(-x, kind="stable")[:64])


def test_top_p_one_keeps_all_64(tool):
    g = np.random.default_rng(304)
    x = g.normal(-20, 1, 1000).astype(np.float32)
    best = g.choice(1000, 64, replace=False)
    x[best[:63]] = 0.0
    x[best[63]] = -1.5  # the 64th candidate: mass e^-1.5 / (63 + e^-1.5) = 0.35%
    last = ref.distribution(x, 1.0, 1.0).q[63]
    assert ref.distribution(x, 1.0, 1.0).n_kept == 64
    assert ref.distribution(x, 1.0, 0.999).n_kept == 64
    assert ref.distribution(x, 1.0, 0.99).n_kept == 63
    n = 40000
    for top_p, keeps_last in ((1.0, True), (0.999, True), (0.99, False)):
        pos = check_exact(tool, x, "seeds", 80, n, 1.0, top_p)
        drawn = np.count_nonzero(pos == 63)
        if keeps_last:
            assert abs(drawn - n * last) < 6 * np.sqrt(n * last), (top_p, drawn, n * last)
        else:
            assert drawn == 0


def test_tiny_top_p_keeps_one(tool):
    x = row("normal", 305)
    for t in (0.7, 5.0, 1e4):
        got, _ = draw(tool, x, "seeds", 81, 5000, t, 1e-9)
        assert (got == np.argmax(x)).all(), f"t {t}"


def test_equal_logits_ordered_by_id(tool):
    x = np.full(300, 0.5, dtype=np.float32)  # every token tied: the candidates are ids 0..63
    n = 32 * 1000
    for top_p, kept in ((0.5, 32), (0.5 + 1e-6, 33), (1.0, 64)):
        got, _ = draw(tool, x, "seeds", 82, n, 0.8, top_p)
        assert set(got) == set(range(kept)), f"top_p {top_p}: {sorted(set(got))[-3:]}"
        c = np.bincount(got, minlength=kept)
        uniform = np.full(kept, 1 / kept)
        cells = stats.bins(uniform, n)
        assert stats.pearson(c, uniform, n, cells) <= stats.chi2_isf(ALPHA, kept - 1)
    # 100 tied maxima at scattered ids above the rest: the 64 lowest of those ids
    g = np.random.default_rng(306)
    x = g.normal(0, 1, 2000).astype(np.float32)
    tied = g.choice(2000, 100, replace=False)
    x[tied] = 9.0
    got, _ = draw(tool, x, "seeds", 83, 20000, 2.0, 1.0)
    assert set(got) == set(np.sort(tied)[:64])
    check_exact(tool, x, "stream", 84, 5000, 2.0, 0.7)
