"""tools/moice_train.py on tiny generated models: the router gradient against finite
differences, training lowers the held-out loss below the untrained routers', the same seed gives
the same sidecar bytes, the sidecar reads back, and the training text shares no name with the
quality sets (docs/moice-training.md)."""
import json
import pathlib
import random
import re
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

autograd = pytest.importorskip("autograd")  # tests/requirements.txt installs it

import moice_train as mt  # noqa: E402
from oracle import gguf_write, moice_sidecar  # noqa: E402


def tiny(path, seed=3, arch="gemma3", n_layer=2, rope_base=10000.0):
    gguf_write.tiny_model(path, arch, seed=seed, n_layer=n_layer, n_embd=32, n_head=4,
                          n_head_kv=2, head_dim=8, n_ff=48, n_vocab=64, n_swa=16,
                          swa_pattern=2, rope_base=rope_base)
    return str(path)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_router_gradient_matches_finite_differences(tmp_path, arch):
    fz = mt.Frozen(tiny(tmp_path / "m.gguf", seed=5, arch=arch), np.float64)
    bases = {il: [10000.0, 3.0, 40.0] for il in range(fz.hp.n_layer)}
    routers = mt.init_routers(fz.hp, sorted(bases), 3, seed=7, dtype=np.float64)
    vec, keys = mt.flatten(routers)
    ids, lf = mt.token_batch(64, 11, 1, 24, 8)[0]

    def f(flat):
        return mt.total_loss(fz, mt.unflatten(flat, keys), bases, 2, ids, lf)[0]

    val, grad = autograd.value_and_grad(f)(vec)
    assert np.isfinite(val) and np.any(grad != 0)
    rng = np.random.default_rng(0)
    eps = 1e-6
    checked = 0
    for i in rng.choice(vec.size, 40, replace=False):
        up, dn = vec.copy(), vec.copy()
        up[i] += eps
        dn[i] -= eps
        # the top-k choice is piecewise constant: skip weights whose nudge flips a selection
        sel = [mt.topk_mask(np.asarray(r), 2) for r in
               mt.forward_loss(fz, mt.unflatten(up, keys), bases, 2, ids, lf)[1]]
        sel0 = [mt.topk_mask(np.asarray(r), 2) for r in
                mt.forward_loss(fz, mt.unflatten(dn, keys), bases, 2, ids, lf)[1]]
        if any(np.any(a != b) for a, b in zip(sel, sel0)):
            continue
        fd = (f(up) - f(dn)) / (2 * eps)
        assert abs(fd - grad[i]) <= 1e-5 + 1e-4 * abs(fd), (i, fd, grad[i])
        checked += 1
    assert checked >= 20


def test_identity_with_own_base_and_one_expert(tmp_path):
    """N = 1 with the layer's own base gives the plain oracle model's loss."""
    from oracle import model as omodel
    path = tiny(tmp_path / "m.gguf", seed=2)
    fz = mt.Frozen(path, np.float64)
    ids, lf = mt.token_batch(64, 4, 1, 30, 10)[0]
    hp = fz.hp
    bases = {il: [hp.rope_for(il)[0]] for il in range(hp.n_layer)}
    routers = mt.init_routers(hp, sorted(bases), 1, seed=1, dtype=np.float64)
    lm, _ = mt.forward_loss(fz, routers, bases, 1, ids, lf)
    logits = omodel.Model.load(path).forward(ids)
    z = logits[lf - 1: -1]
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    want = np.mean(lse - z[np.arange(z.shape[0]), ids[lf:]])
    assert abs(lm - want) < 1e-9 * max(1.0, abs(want))


def test_training_lowers_held_out_loss_and_is_deterministic(tmp_path):
    # llama: an untied head keeps the random model's logits moderate (a tiny gemma3's tied,
    # sqrt(C)-scaled embeddings give ~30 nats of loss that no router can move); a small RoPE
    # base makes the searched bases differ within 40 positions
    path = tiny(tmp_path / "m.gguf", seed=3, arch="llama", rope_base=8.0)
    args = ["--model", path, "--data", "tokens", "--seq-len", "40", "--loss-len", "12",
            "--steps", "40", "--lr", "0.05", "--train-seqs", "8", "--held-seqs", "6",
            "--search-seqs", "2", "--experts", "3", "--top-k", "2", "--seed", "4",
            "--dtype", "float64", "--bases", "global=8,2,40"]
    out1, out2 = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert mt.main(args + ["--out", str(out1)]) == 0
    assert mt.main(args + ["--out", str(out2)]) == 0
    assert out1.read_bytes() == out2.read_bytes()

    sc = moice_sidecar.read(out1)
    assert sc.base == moice_sidecar.base_identity(path)
    assert sc.top_k == 2 and sc.layers == [0, 1]
    for il in sc.layers:
        assert sc.bases[il].tolist() == [8.0, 2.0, 40.0]
    assert sc.train["steps"] == 40 and sc.train["seed"] == 4
    # the held-out LM loss after training, measured afresh from the file, is below the
    # untrained routers' (same seed, same initialisation)
    fz = mt.Frozen(path, np.float64)
    held = mt.token_batch(64, 4 * 1000 + 3, 6, 40, 12)
    bases = {il: [float(x) for x in sc.bases[il]] for il in sc.layers}
    trained = {il: tuple(np.asarray(a, np.float64) for a in sc.routers[il]) for il in sc.layers}
    untrained = mt.init_routers(fz.hp, sc.layers, 3, seed=4, dtype=np.float64)
    lm_t, _ = mt.evaluate(fz, trained, bases, 2, held)
    lm_u, _ = mt.evaluate(fz, untrained, bases, 2, held)
    assert lm_t < lm_u
    assert sc.train["held_lm_final"] == pytest.approx(lm_t, rel=1e-5)
    rows = list(open(str(out1) + ".csv"))
    assert rows[0].startswith("step,") and len(rows) == 42


def test_expert_set_search_keeps_the_own_base_first(tmp_path):
    fz = mt.Frozen(tiny(tmp_path / "m.gguf", seed=3), np.float64)
    kinds = mt.layer_kinds(fz.hp, "all")
    assert kinds == {"local": [0], "global": [1]}
    batch = mt.token_batch(64, 9, 2, 24, 8)
    grid = {"local": [5000.0, 10000.0, 20000.0], "global": [10000.0, 2.0, 50.0]}
    scores = mt.base_search(fz, batch, kinds, grid)
    assert [b for b, _ in scores["global"]] == grid["global"]
    assert all(np.isfinite(l) for _, l in scores["local"] + scores["global"])
    # the own base's single-base loss is the plain model's
    fz2 = mt.Frozen(tiny(tmp_path / "m.gguf", seed=3), np.float64)
    plain = np.mean([mt.forward_loss(fz2, {}, {}, 1, ids, lf)[0] for ids, lf in batch])
    assert dict(scores["global"])[10000.0] == pytest.approx(plain, rel=1e-12)
    picked = mt.pick_bases(10000.0, [(10000.0, 9.0), (2.0, 1.0), (50.0, 3.0), (7.0, 2.0)], 3)
    assert picked == [10000.0, 2.0, 7.0]


def test_ledger_names_are_not_in_the_quality_sets():
    qdir = ROOT / "tests" / "quality"
    sys.path.insert(0, str(qdir))
    import dataset
    quality_syl = set(dataset.SYLLABLES["dev"]) | set(dataset.SYLLABLES["test"])
    assert not quality_syl & set(mt.LEDGER_SYLLABLES)
    words = set()
    for split in ("dev", "test"):
        for line in open(qdir / "data" / f"{split}.jsonl"):
            words |= set(re.findall(r"[A-Z][a-z]+", json.dumps(json.loads(line))))
    rng = random.Random(0)
    names = {mt.ledger_name(rng) for _ in range(2000)}
    assert len(names) > 100 and not names & words
    ctx, qs = mt.generate_ledger(random.Random(1), 30, 10)
    assert not set(re.findall(r"[A-Z][a-z]+", ctx + qs)) & (words - {"The", "In", "It"})


def test_mdqa_summaries(tmp_path):
    """tests/quality/mdqa.py's accuracy, gap, token rates and report from recorded counts
    (the live run needs a fitmd with position_method; docs/moice-results.md)."""
    sys.path.insert(0, str(ROOT / "tests" / "quality"))
    import mdqa
    res = {}
    for method, accs in (("none", (9, 4, 7)), ("moice", (8, 8, 6))):
        res[method] = {}
        for cal in (False, True):
            for p, ok in zip((1, 5, 10), accs):
                c = mdqa.Cell()
                c.n, c.ok = 10, ok
                c.prompt, c.completion = 10 * 1000, 10 * 5
                c.prefill_ms = 10 * (500.0 if method == "none" else 1000.0)
                c.decode_ms = 10 * 40.0
                res[method][(cal, "plain", 10, p)] = c
    cells = [res["none"][(False, "plain", 10, p)] for p in (1, 5, 10)]
    assert mdqa.gap(cells) == pytest.approx(0.5)
    pre, dec = mdqa.rates(cells)
    assert pre == pytest.approx(2000.0) and dec == pytest.approx(100.0)
    js = tmp_path / "r.json"
    js.write_text(json.dumps({"meta": {"date": "d", "cmd": "c", "machine": "m", "split": "test",
                                       "model": "M", "max_tokens": 16},
                              "results": mdqa.dump(res),
                              "peak_rss_mib": {"none": 500.0, "moice": 530.0}}))
    md, png = tmp_path / "r.md", tmp_path / "r.png"
    try:
        import matplotlib  # noqa: F401  (optional: the plot is drawn only where it is installed)
        plot = ["--plot", str(png)]
    except ImportError:
        plot = []
    assert mdqa.main(["--merge", str(js), "--k", "10", "--markdown", str(md)] + plot) == 0
    text = md.read_text()
    assert "| `moice` | no | 10 | 0.80 (" in text and "| 0.20 | 1000 (0.50×) | 100 (1.00×) | " \
        "530 (+30) |" in text
    if plot:
        assert png.stat().st_size > 1000
