"""The position methods in the C forward (docs/position-methods.md) against the numpy oracle
(tests/oracle/position.py) on generated models of each architecture: MoICE with random routers
(docs/moice.md), Ms-PoE with the C's head ranks checked against the oracle's, captures and the
intervention on the mixed attention, prefix reuse and branches, the identity sidecar, and a
mismatched sidecar refused; Attention Buckets (one cache pass per bucket, aggregated at the
output) against the oracle's buckets_forward."""
import subprocess

import numpy as np
import pytest

from oracle import calib, gguf_write
from oracle import model as om
from oracle import moice_sidecar as ms
from oracle import position as po
from test_model import Tool, model_tool, rel_l2, random_ids  # noqa: F401 (fixture)

ARCHS = ("llama", "qwen2", "gemma3")
LOGIT_TOL = 1e-4  # relative L2 of logits (float32 C against float64 oracle)
MASS_TOL = 2e-5   # absolute, span masses and probabilities (or 4x the plain model's own error
                  # on the same rows, on the oracle's sharper tiny models)


class PosTool(Tool):
    """model_tool with the position methods enabled (and a sidecar when given)."""

    def __init__(self, exe, model, outdir, moice=None, extra=()):
        super().__init__(exe, model, outdir)
        self.moice = moice
        self.extra = list(extra)

    def extra_args(self):
        return ["--positions"] + (["--moice", str(self.moice)] if self.moice else []) + \
            self.extra


@pytest.fixture(scope="module")
def models(fitm_bin, tmp_path_factory):
    """arch -> a `fitm mkmodel` F32 model with enough layers for Ms-PoE (which skips two), and
    ("tiny", arch) -> one from the oracle's own writer (gguf_write.tiny_model: head dim 8,
    GQA 4/2, gemma3 with a 4-token window every layer but each third)."""
    d = tmp_path_factory.mktemp("posmodels")
    out = {}
    for arch in ARCHS:
        p = d / f"{arch}.gguf"
        extra = [] if arch == "gemma3" else ["--layers", "4"]
        subprocess.run([str(fitm_bin), "mkmodel", "--arch", arch, "--seed", "11", "-o", str(p),
                        "-q"] + extra, check=True)
        out[arch] = p
        t = d / f"tiny-{arch}.gguf"
        gguf_write.tiny_model(t, arch, seed=4, n_layer=4, n_vocab=96)
        out[("tiny", arch)] = t
    return out


SOURCES = [a for a in ARCHS] + [("tiny", a) for a in ARCHS]


def _id(x):
    return "-".join(x) if isinstance(x, tuple) else x


def sidecar(path, model_path, layers, factors, top_k, seed, base_of=None, scale=2.0):
    """A sidecar with random routers on `layers`, expert bases = the layer's base x factors.
    scale: of the router weights; large enough that the routing differs from row to row, and
    small enough that float32 rounding of q does not swing the router's softmax (the oracle's
    tiny models have larger queries: 0.5 there)."""
    m = om.Model.load(model_path)
    base = ms.base_identity(model_path)
    bases = {l: [m.hp.rope_for(l)[0] * f for f in factors] for l in layers}
    if base_of:
        base.update(base_of)
    ms.write(path, base, bases, ms.random_routers(base, bases, seed, scale=scale), top_k,
             train={"seed": seed, "data": "random routers for tests"})
    return path


def routed_layers(arch, L):
    # gemma3: local and global layers (5 for mkmodel's pattern 6; 2 for tiny_model's 3)
    return [l for l in (1, 2, 5, 6) if l < L] if arch in ("gemma3", ("tiny", "gemma3")) \
        else [1, 2, 3]


@pytest.mark.parametrize("arch", SOURCES, ids=_id)
def test_moice_vs_oracle(models, model_tool, tmp_path, arch):
    path = models[arch]
    m = om.Model.load(path)
    L, V = m.hp.n_layer, m.hp.n_vocab
    sc = sidecar(tmp_path / "r.moice", path, routed_layers(arch, L), (1.0, 1.75, 2.0, 2.5),
                 top_k=2, seed=3, scale=0.5 if isinstance(arch, tuple) else 2.0)
    T = 40
    ids = random_ids(V, T, seed=9)
    rows, spans = [30, 39], [(2, 10), (10, 25), (25, 33)]
    alpha = [0.5, 0.2, 0.3]
    iv = dict(iv_spans=spans, iv_alpha=alpha, iv_from=33, iv_layers=list(range(L)))
    t = PosTool(model_tool, path, tmp_path, moice=sc)
    t.kv("a", T)
    t.run("a", 0, ids, logits=T, out="mo", rows=rows, spans=spans, probs=True, pos="moice")
    t.kv("b", T)
    t.run("b", 0, ids, logits=T, out="iv", rows=rows, probs=True, post=True, pos="moice", **iv)
    t.kv("c", T)
    t.run("c", 0, ids, logits=T, out="none", rows=rows, probs=True, pos="none")
    t.go()

    # the plain model's own float32 error on these rows sets the scale of the tolerance
    m.forward(ids, capture_rows=rows)
    plain_err = np.max(np.abs(t.probs("none", len(rows), T) -
                              np.stack(m.attn).transpose(2, 0, 1, 3)))
    tol = max(MASS_TOL, 4 * plain_err)
    mo = po.MoICE(ms.read(sc))
    want = m.forward(ids, capture_rows=rows, position=mo)
    want_p = np.stack(m.attn).transpose(2, 0, 1, 3)  # (rows, L, H, T)
    got = t.logits("mo")
    assert rel_l2(got, want) <= LOGIT_TOL
    assert rel_l2(t.logits("none"), want) > 10 * LOGIT_TOL  # the method changes the output
    assert np.max(np.abs(t.probs("mo", len(rows), T) - want_p)) <= tol
    want_m = np.stack([[[[want_p[r, l, h, s:e].sum() for s, e in spans] for h in range(m.hp.n_head)]
                        for l in range(L)] for r in range(len(rows))])
    assert np.max(np.abs(t.mass("mo", len(rows), len(spans)) - want_m)) <= tol
    # top-k: every routed layer's rows use exactly k experts
    for l, w in mo.weights.items():
        assert np.all((w > 0).sum(axis=-1) == 2)

    # the Eq. 5 intervention acts on the mixed attention A
    hook = calib.make_hook(spans, np.array(alpha), list(range(L)), first_row=33)
    want_iv = m.forward(ids, capture_rows=rows, intervene=hook, position=po.MoICE(ms.read(sc)))
    want_ivp = np.stack(m.attn).transpose(2, 0, 1, 3)
    assert rel_l2(t.logits("iv"), want_iv) <= LOGIT_TOL
    assert np.max(np.abs(t.probs("iv", len(rows), T) - want_ivp)) <= tol


@pytest.mark.parametrize("arch", SOURCES, ids=_id)
def test_ms_poe_vs_oracle(models, model_tool, tmp_path, arch):
    path = models[arch]
    m = om.Model.load(path)
    V = m.hp.n_vocab
    T = 48
    ids = random_ids(V, T, seed=4)
    rows, spans = [20, 47], [(1, 9), (9, 30)]
    t = PosTool(model_tool, path, tmp_path)
    t.kv("a", T)
    t.run("a", 0, ids, logits=T, out="p", rows=rows, spans=spans, probs=True, pos="ms_poe")
    t.kv("b", T)
    t.run("b", 0, ids, logits=T, out="none", rows=rows, probs=True)
    t.go()
    m.forward(ids, capture_rows=rows)
    plain_p = np.stack(m.attn).transpose(2, 0, 1, 3)
    tol = max(MASS_TOL, 4 * np.max(np.abs(t.probs("none", len(rows), T) - plain_p)))

    ranks = po.ms_poe_ranks(m, po.ms_poe_calib_ids(V))
    assert np.array_equal(np.array(t.info["ms_poe_ranks"]), ranks)
    want = m.forward(ids, capture_rows=rows, position=po.MsPoE(m, ranks))
    want_p = np.stack(m.attn).transpose(2, 0, 1, 3)
    assert rel_l2(t.logits("p"), want) <= LOGIT_TOL
    assert rel_l2(t.logits("none"), want) > 10 * LOGIT_TOL
    assert np.max(np.abs(t.probs("p", len(rows), T) - want_p)) <= tol
    # the first two layers are plain
    assert np.max(np.abs(want_p[:, :2] - plain_p[:, :2])) <= 1e-12


@pytest.mark.parametrize("arch", ARCHS)
def test_moice_identity_is_plain_bit_for_bit(models, model_tool, tmp_path, arch):
    """One expert equal to each layer's own base, weight 1: the plain model, exactly."""
    path = models[arch]
    m = om.Model.load(path)
    L, V = m.hp.n_layer, m.hp.n_vocab
    sc = sidecar(tmp_path / "id.moice", path, list(range(L)), (1.0,), top_k=1, seed=5)
    T = 36
    ids = random_ids(V, T, seed=2)
    rows = [35]
    t = PosTool(model_tool, path, tmp_path, moice=sc)
    for name, pos in (("m", "moice"), ("n", "none")):
        t.kv(name, T)
        t.run(name, 0, ids, logits=T, out=name, rows=rows, probs=True, pos=pos)
    t.kv("d", T)  # a decode step too (the STEP path)
    t.run("d", 0, ids[:-1], pos="moice")
    t.run("d", T - 1, ids[-1:], logits=1, out="dm", pos="moice")
    t.kv("e", T)
    t.run("e", 0, ids[:-1])
    t.run("e", T - 1, ids[-1:], logits=1, out="dn")
    t.go()
    assert t.logits("m").tobytes() == t.logits("n").tobytes()
    assert t.probs("m", 1, T).tobytes() == t.probs("n", 1, T).tobytes()
    assert t.logits("dm").tobytes() == t.logits("dn").tobytes()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ("moice", "ms_poe"))
def test_prefix_reuse_and_branches(models, model_tool, tmp_path, arch, method):
    """A pass split at s, and a branch at s over a prefix cache, give the full pass's rows."""
    path = models[arch]
    m = om.Model.load(path)
    sc = sidecar(tmp_path / "r.moice", path, routed_layers(arch, m.hp.n_layer),
                 (1.0, 1.8, 2.25), top_k=2, seed=8)
    T, s = 40, 23
    ids = random_ids(m.hp.n_vocab, T, seed=12)
    t = PosTool(model_tool, path, tmp_path, moice=sc)
    t.kv("full", T)
    t.run("full", 0, ids, logits=T - s, out="full", rows=[T - 1], spans=[(0, 10)],
          pos=method)
    t.kv("split", T)
    t.run("split", 0, ids[:s], pos=method)
    t.run("split", s, ids[s:], logits=T - s, out="split", rows=[T - 1], spans=[(0, 10)],
          pos=method)
    t.kv("br", T)
    t.rebase("br", s)
    t.run("br", s, ids[s:], prefix="split", logits=T - s, out="br", rows=[T - 1],
          spans=[(0, 10)], pos=method)
    t.go()
    full = t.logits("full")
    assert t.logits("split").tobytes() == full.tobytes()
    assert t.logits("br").tobytes() == full.tobytes()
    for x in ("split", "br"):
        assert t.mass(x, 1, 1).tobytes() == t.mass("full", 1, 1).tobytes()


def test_sidecar_refused_when_mismatched(models, model_tool, tmp_path):
    path = models["llama"]
    bad_hash = sidecar(tmp_path / "h.moice", path, [1], (1.0, 2.0), 1, 1,
                       base_of={"sha256": "0" * 64})
    r = PosTool(model_tool, path, tmp_path, moice=bad_hash).go(check=False)
    assert r.returncode == 1 and "base.sha256" in r.stderr
    other = models["qwen2"]
    wrong_arch = sidecar(tmp_path / "a.moice", other, [1], (1.0, 2.0), 1, 1)
    r = PosTool(model_tool, path, tmp_path, moice=wrong_arch).go(check=False)
    assert r.returncode == 1 and "base.architecture" in r.stderr
    # same architecture, other shapes: a tiny model with 3 layers
    tiny = tmp_path / "tiny.gguf"
    gguf_write.tiny_model(tiny, "llama", n_layer=3)
    shapes = sidecar(tmp_path / "s.moice", tiny, [1], (1.0, 2.0), 1, 1)
    r = PosTool(model_tool, path, tmp_path, moice=shapes).go(check=False)
    assert r.returncode == 1 and "base.block_count" in r.stderr


def test_moice_without_sidecar_refused(models, model_tool, tmp_path):
    path = models["llama"]
    t = PosTool(model_tool, path, tmp_path)
    t.kv("a", 8)
    t.run("a", 0, [1, 2, 3], pos="moice")
    r = t.go(check=False)
    assert r.returncode != 0 and "sidecar" in r.stderr


# ---- Attention Buckets ----------------------------------------------------------------------


def _stack(attn):
    return np.stack(attn).transpose(2, 0, 1, 3)  # (rows, L, H, S)


@pytest.mark.parametrize("arch", SOURCES, ids=_id)
def test_buckets_vs_oracle(models, model_tool, tmp_path, arch):
    """All 7 buckets: logits = log p^ (alpha-weighted mean of the passes' distributions), the
    captured probabilities and span masses = the passes' mean, and the Eq. 5 intervention
    inside each pass."""
    path = models[arch]
    m = om.Model.load(path)
    L, V = m.hp.n_layer, m.hp.n_vocab
    T = 40
    ids = random_ids(V, T, seed=21)
    rows, spans = [30, 39], [(2, 10), (10, 25), (25, 33)]
    alpha = [0.5, 0.2, 0.3]
    iv = dict(iv_spans=spans, iv_alpha=alpha, iv_from=33, iv_layers=list(range(L)))
    t = PosTool(model_tool, path, tmp_path)
    for name in ("b", "biv"):
        t.kv(name, T)
        t.passes(name, len(po.BUCKET_FACTORS))
    t.run("b", 0, ids, logits=T, out="b", rows=rows, spans=spans, probs=True,
          pos="attention_buckets")
    t.run("biv", 0, ids, logits=T, out="biv", rows=rows, probs=True, post=True,
          pos="attention_buckets", **iv)
    t.kv("n", T)
    t.run("n", 0, ids, logits=T, out="n", rows=rows, probs=True)
    t.go()

    m.forward(ids, capture_rows=rows)
    tol = max(MASS_TOL, 4 * np.max(np.abs(t.probs("n", len(rows), T) - _stack(m.attn))))
    want, want_a = po.buckets_forward(m, ids, capture_rows=rows)
    want_p = _stack(want_a)
    assert rel_l2(t.logits("b"), want) <= LOGIT_TOL
    # the aggregate is a distribution, and not the plain model's
    assert np.allclose(np.exp(t.logits("b").astype(np.float64)).sum(-1), 1.0, atol=1e-5)
    assert rel_l2(t.logits("b"), np.log(om.softmax(t.logits("n").astype(np.float64)))) \
        > 10 * LOGIT_TOL
    assert np.max(np.abs(t.probs("b", len(rows), T) - want_p)) <= tol
    want_m = np.stack([[[[want_p[r, l, h, s:e].sum() for s, e in spans]
                         for h in range(m.hp.n_head)] for l in range(L)]
                       for r in range(len(rows))])
    assert np.max(np.abs(t.mass("b", len(rows), len(spans)) - want_m)) <= tol

    hook = calib.make_hook(spans, np.array(alpha), list(range(L)), first_row=33)
    want_iv, want_iva = po.buckets_forward(m, ids, capture_rows=rows, intervene=hook)
    assert rel_l2(t.logits("biv"), want_iv) <= LOGIT_TOL
    assert np.max(np.abs(t.probs("biv", len(rows), T) - _stack(want_iva))) <= tol


@pytest.mark.parametrize("arch", ARCHS)
def test_one_bucket_is_plain(models, model_tool, tmp_path, arch):
    """A bucket set of one factor 1: the plain model's attention bit for bit (prefill and
    decode), and its distribution as the logits (log-softmax of the plain logits)."""
    path = models[arch]
    V = om.Model.load(path).hp.n_vocab
    T = 36
    ids = random_ids(V, T, seed=2)
    rows = [30]
    t = PosTool(model_tool, path, tmp_path)
    for name, pos in (("b", "attention_buckets"), ("n", "none")):
        t.kv(name, T)
        if pos != "none":
            t.passes(name, 1)
        t.run(name, 0, ids[:-1], logits=T - 1, out=name, rows=rows, spans=[(0, 9)], probs=True,
              pos=pos)
        t.run(name, T - 1, ids[-1:], logits=1, out="d" + name, rows=[T - 1], probs=True,
              pos=pos)
    t.go()
    assert t.probs("b", 1, 31).tobytes() == t.probs("n", 1, 31).tobytes()
    assert t.mass("b", 1, 1).tobytes() == t.mass("n", 1, 1).tobytes()
    assert t.probs("db", 1, T).tobytes() == t.probs("dn", 1, T).tobytes()
    for b, n in (("b", "n"), ("db", "dn")):
        plain = t.logits(n).astype(np.float64)
        want = plain - plain.max(-1, keepdims=True)
        want -= np.log(np.exp(want).sum(-1, keepdims=True))
        assert np.max(np.abs(t.logits(b) - want)) <= 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_buckets_prefix_reuse_branches_and_groups(models, model_tool, tmp_path, arch):
    """Per pass, a split pass and a branch over a prefix give the full pass's rows; a forward
    whose call limit splits the 7 passes into several groups gives the same bits."""
    path = models[arch]
    m = om.Model.load(path)
    T, s = 40, 23
    ids = random_ids(m.hp.n_vocab, T, seed=12)
    out = {}
    for batch in (512, 40):
        t = PosTool(model_tool, path, tmp_path, extra=["--batch", str(batch)])
        for name in ("full", "split", "br"):
            t.kv(name, T)
            t.passes(name, 7)
        kw = dict(logits=T - s, rows=[T - 1], spans=[(0, 10)], pos="attention_buckets")
        t.run("full", 0, ids, out=f"full{batch}", **kw)
        t.run("split", 0, ids[:s], pos="attention_buckets")
        t.run("split", s, ids[s:], out=f"split{batch}", **kw)
        t.rebase("br", s)
        t.run("br", s, ids[s:], prefix="split", out=f"br{batch}", **kw)
        t.go()
        for x in ("full", "split", "br"):
            out[x, batch] = (t.logits(f"{x}{batch}").tobytes(), t.mass(f"{x}{batch}", 1, 1))
    for key, (lg, ms_) in out.items():
        assert lg == out["full", 512][0], key
        assert ms_.tobytes() == out["full", 512][1].tobytes(), key


def test_bucket_passes_grow_keeping_their_rows(models, model_tool, tmp_path):
    """Passes made smaller than the cache and grown after a run keep the rows they held (the
    reranker grows its own cache's passes to each request's prompt)."""
    path = models["gemma3"]
    T = 40
    ids = random_ids(om.Model.load(path).hp.n_vocab, T, seed=5)
    t = PosTool(model_tool, path, tmp_path)
    t.kv("full", T)
    t.passes("full", 7)
    t.run("full", 0, ids, logits=1, out="full", rows=[T - 1], spans=[(0, 12)],
          pos="attention_buckets")
    t.kv("g", T)
    t.passes("g", 7, 12)
    t.run("g", 0, ids[:12], pos="attention_buckets")
    t.passes("g", 7, T)
    t.run("g", 12, ids[12:], logits=1, out="g", rows=[T - 1], spans=[(0, 12)],
          pos="attention_buckets")
    t.go()
    assert t.logits("g").tobytes() == t.logits("full").tobytes()
    assert t.mass("g", 1, 1).tobytes() == t.mass("full", 1, 1).tobytes()
    # a pass too short for the call is refused, not overrun
    t.kv("s", T)
    t.passes("s", 7, 8)
    t.run("s", 0, ids[:12], pos="attention_buckets")
    r = t.go(check=False)
    assert r.returncode != 0 and "exceed" in r.stderr


def test_buckets_refused_without_passes_in_prefix(models, model_tool, tmp_path):
    path = models["llama"]
    t = PosTool(model_tool, path, tmp_path)
    t.kv("p", 8)
    t.run("p", 0, [1, 2, 3])
    t.kv("br", 8)
    t.passes("br", 3)
    t.rebase("br", 3)
    t.run("br", 3, [4, 5], prefix="p", pos="attention_buckets")
    r = t.go(check=False)
    assert r.returncode != 0 and "prefix cache holds 1 passes" in r.stderr


def test_inspect_shows_sidecar(fitm_bin, models, tmp_path):
    path = models["gemma3"]
    sc = sidecar(tmp_path / "i.moice", path, [1, 5], (1.0, 2.0, 2.5), top_k=2, seed=1)
    r = subprocess.run([str(fitm_bin), "inspect", str(sc)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    base = ms.base_identity(path)
    assert "MoICE sidecar:  valid" in r.stdout
    assert f"base sha256:  {base['sha256']}" in r.stdout
    assert f"gemma3, {base['block_count']} layers" in r.stdout
    assert "experts:      3 per routed layer, top_k 2" in r.stdout
    assert "routed layers: 2 of" in r.stdout
    assert "random routers for tests" in r.stdout
    # a broken sidecar is reported, not shown
    raw = bytearray(sc.read_bytes())
    bad = tmp_path / "bad.moice"
    bad.write_bytes(raw.replace(b"fitm-moice.top_k", b"fitm-moice.top_q"))
    r = subprocess.run([str(fitm_bin), "inspect", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "top_k" in r.stderr


# ---- the oracle's own checks -----------------------------------------------------------------


def test_oracle_buckets_and_identities(models):
    m = om.Model.load(models[("tiny", "qwen2")])
    ids = random_ids(m.hp.n_vocab, 12, seed=3)
    plain = m.forward(ids, capture_rows=[11])
    plain_a = [a.copy() for a in m.attn]
    # one bucket of factor 1 is the plain model; the aggregate of one pass is its log-softmax
    lg, at = po.buckets_forward(m, ids, factors=(1.0,), capture_rows=[11])
    assert np.allclose(lg, np.log(om.softmax(plain)), atol=1e-12)
    assert all(np.array_equal(a, b) for a, b in zip(at, plain_a))
    # two passes: alpha-weighted by each row's max probability, by hand
    other = m.forward(ids, position=po.Bucket(2.0))
    assert np.max(np.abs(other - plain)) > 1e-3
    p1, p2 = om.softmax(plain), om.softmax(other)
    a1, a2 = p1.max(-1, keepdims=True), p2.max(-1, keepdims=True)
    lg2, _ = po.buckets_forward(m, ids, factors=(1.0, 2.0))
    assert np.allclose(np.exp(lg2), (a1 * p1 + a2 * p2) / (a1 + a2), atol=1e-12)
    # Ms-PoE with every ratio 1 is the plain model; MoICE with N = 1 at the own base too
    mp = po.MsPoE(m, np.zeros((m.hp.n_layer, m.hp.n_head), dtype=np.int64))
    mp.ratios[:] = 1.0
    assert np.allclose(m.forward(ids, position=mp), plain, atol=1e-10)
