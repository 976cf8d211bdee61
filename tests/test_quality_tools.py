"""The quality sets and the pure parts of the quality and profile tools: the committed sets
equal a fresh generation, the splits are disjoint, every item is answerable from its gold
document only by name, and BM25, the Wilson interval, AUC, the window split and the logistic
fit agree with independent computations; the look-alike sets (lookalikes.py) are fixed, with
one gold per question, and their table counts R@1 and MRR as defined."""
import json
import math
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "quality"))
sys.path.insert(0, str(ROOT / "tools"))
import dataset  # noqa: E402
import quality  # noqa: E402


@pytest.fixture(scope="module")
def splits():
    return {s: dataset.load(s) for s in ("dev", "test")}


def test_committed_sets_match_the_generator():
    r = subprocess.run([sys.executable, str(ROOT / "tests/quality/dataset.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_cells_and_items(splits):
    for split, items in splits.items():
        cells = {}
        for it in items:
            cells[(it["variant"], it["k"], it["gold_pos"])] = \
                cells.get((it["variant"], it["k"], it["gold_pos"]), 0) + 1
            docs = it["documents"]
            assert len(docs) == it["k"] and it["gold_index"] == it["gold_pos"] - 1
            gold = docs[it["gold_index"]]
            assert it["answer"] in gold["text"]
            # the question names the gold entity, and no other document has that title
            assert gold["title"] in it["query"]
            assert sum(d["title"] == gold["title"] for d in docs) == 1
            # the asked attribute's value is unique to the gold document among documents
            # that state it for another entity (years, products, rivers, professions)
            if it["attribute"] in ("year", "product", "river", "profession"):
                assert sum(it["answer"] in d["text"] for d in docs) == 1
        assert set(cells.values()) == {dataset.GROUPS}
        assert set(cells) == {(v, k, p) for v in dataset.VARIANTS for k in dataset.KS
                              for p in dataset.positions(k)}


def test_hard_distractors_share_a_name_part(splits):
    for it in splits["dev"] + splits["test"]:
        if it["variant"] != "hard":
            continue
        gold = it["documents"][it["gold_index"]]["title"]
        parts = set(gold.split()) if it["kind"] != "town" else None
        for d in it["documents"]:
            if d["title"] == gold:
                continue
            if parts is not None:
                assert parts & set(d["title"].split()), (gold, d["title"])
            else:  # towns: stem + suffix; share either the start or the end
                assert any(gold.startswith(d["title"][:n]) and gold[n:] != d["title"][n:]
                           or gold.endswith(d["title"][-n:])
                           for n in range(3, len(d["title"]))), (gold, d["title"])


def test_splits_are_disjoint(splits):
    def names(items):
        return {d["title"] for it in items for d in it["documents"]}
    assert not names(splits["dev"]) & names(splits["test"])
    tmpl = lambda items: {(it["query"].replace(it["documents"][it["gold_index"]]["title"],  # noqa
                                               "{}")) for it in items}
    assert not tmpl(splits["dev"]) & tmpl(splits["test"])


def test_positions_are_paired(splits):
    by = {}
    for it in splits["dev"]:
        by.setdefault(it["id"].rsplit("-p", 1)[0], []).append(it)
    for group in by.values():
        assert len({it["query"] for it in group}) == 1
        others = {tuple(d["title"] for i, d in enumerate(it["documents"])
                        if i != it["gold_index"]) for it in group}
        assert len(others) == 1


def test_extra_positions_move_only_the_gold(splits):
    class A:
        split, variants, k, groups, positions = "dev", ["hard"], [10], 2, [3, 5, 8, 12]
    its = quality.select(A)
    extra = [it for it in its if it["gold_pos"] not in dataset.positions(10)]
    assert sorted({it["gold_pos"] for it in extra}) == [3, 8]  # 5 is the middle; 12 > K
    firsts = {it["id"].rsplit("-p", 1)[0]: it for it in its if it["gold_pos"] == 1}
    assert len(extra) == 2 * len(firsts) == 4
    for it in extra:
        src = firsts[it["id"].rsplit("-p", 1)[0]]
        p = it["gold_pos"]
        assert it["documents"][p - 1] == src["documents"][0] and it["gold_index"] == p - 1
        assert it["documents"][:p - 1] + it["documents"][p:] == src["documents"][1:]
        assert it["query"] == src["query"] and it["answer"] == src["answer"]
    res = {"m": {("hard", 10, p): quality.Cell() for p in (1, 3, 5, 8, 10)}}
    assert quality.cell_positions(res, "hard", 10) == [1, 3, 5, 8, 10]
    # a run without the extra positions keeps its row, with its cells where they are
    old = quality.Cell()
    old.n, old.r1, old.r3, old.fwd, old.prompt = 2, 1, 2, 400, 400
    res["old"] = {("hard", 10, p): old for p in dataset.positions(10)}
    row = quality.table(res, "hard", 10, False).splitlines()[-1].split(" | ")
    assert row[0] == "| `old`" and row[3] == row[5] == "–" and row[2].startswith("0.50 (")


def test_bm25_matches_the_formula():
    docs = [{"title": "a", "text": "b b c"}, {"title": "x", "text": "y"},
            {"title": "c", "text": "c b"}]
    got = quality.bm25("b c", docs)
    toks = [["a", "b", "b", "c"], ["x", "y"], ["c", "c", "b"]]
    avg = sum(map(len, toks)) / 3

    def idf(w):
        n = sum(w in t for t in toks)
        return math.log(1 + (3 - n + 0.5) / (n + 0.5))
    want = []
    for t in toks:
        s = 0
        for w in ("b", "c"):
            f = t.count(w)
            s += idf(w) * f * 2.2 / (f + 1.2 * (0.25 + 0.75 * len(t) / avg)) if f else 0
        want.append(s)
    assert np.allclose(got, want)
    assert got[1] == 0


def test_wilson_interval():
    lo, hi = quality.wilson(5, 10)
    assert abs(lo - 0.2366) < 1e-4 and abs(hi - 0.7634) < 1e-4
    lo, hi = quality.wilson(0, 50)
    assert lo == 0 and abs(hi - 0.0713) < 1e-3
    # coverage close to 95% on simulated draws
    rnd = random.Random(3)
    cover = 0
    for _ in range(2000):
        k = sum(rnd.random() < 0.3 for _ in range(50))
        lo, hi = quality.wilson(k, 50)
        cover += lo <= 0.3 <= hi
    assert 0.92 < cover / 2000 < 0.98


def test_windows_auc_and_logistic_fit():
    import fit_profile
    import scoring_capture
    for k in range(1, 25):
        for w in range(0, 12):
            g = scoring_capture.windows(k, w)
            assert sum(g, []) == list(range(k))
            sizes = [len(x) for x in g]
            assert max(sizes) - min(sizes) <= 1
            assert len(g) == (1 if w <= 0 or w >= k else -(-k // w))
    assert fit_profile.auc([2, 3], [1, 0]) == 1.0
    assert fit_profile.auc([1], [1]) == 0.5
    assert fit_profile.auc([0], [1, 2]) == 0.0
    rnd = np.random.default_rng(4)
    x = rnd.normal(0, 1, 20000)
    p = 1 / (1 + np.exp(-(3.0 * x - 1.0)))
    y = rnd.random(20000) < p
    scale, bias = fit_profile.fit_logistic(list(zip(x.tolist(), y.astype(int).tolist())))
    assert abs(scale - 3.0) < 0.2 and abs(bias + 1.0) < 0.1


def test_shipped_profile_is_what_the_writer_writes(tmp_path):
    """The shipped profile is tools/fit_profile.py's output for the fitted numbers it records
    and the --daemon and --answer arguments of the command in its fitted_on; a bad --answer
    stops the tool before any fitting."""
    import re
    import fit_profile
    shipped = ROOT / "config" / "profiles" / "gemma3-270m-q4km.profile"
    kv = fit_profile.profile_keys(shipped)
    texts = ("model_architecture", "model_name")
    ident = {k: kv[k] if k in texts else int(kv[k]) for k in
             ("profile_version", "model_architecture", "model_name", "model_layers",
              "model_embd", "model_heads", "model_vocab", "model_file_bytes")}
    opts = json.loads(re.search(r"--daemon '(\{.*?\})'", kv["fitted_on"]).group(1))
    answer = fit_profile.parse_answer(re.search(r"--answer '(\{.*?\})'",
                                                kv["fitted_on"]).group(1))
    heads = [(l, h) for l in opts["layers"] for h in range(ident["model_heads"])]
    out = tmp_path / "p.profile"
    fit_profile.write_profile(out, ident, {k: kv[k] for k in ("fitted_on", "fitted_metrics")},
                              opts, heads, float(kv["score_scale"]), float(kv["score_bias"]),
                              answer, {k: kv[k] for k in ("rerank_method", "fuse_weight",
                                                          "fuse_scale", "fuse_bias",
                                                          "answer_reorder", "answer_top_n")})
    assert out.read_text() == shipped.read_text()
    assert (kv["answer_reorder"], kv["answer_reorder_placement"], kv["answer_calibrate"]) == \
        ("fused", "last", "false")
    assert (kv["rerank_method"], kv["fuse_weight"], kv["answer_top_n"]) == ("fused", "0.02", "3")
    with pytest.raises(SystemExit, match="unknown field"):
        fit_profile.parse_answer('{"reorder": "calibrated", "stream": true}')


def test_table_rows_and_rejected_methods():
    ok, bad = quality.Cell(), quality.Cell()
    ok.n, ok.r1, ok.r3, ok.fwd, ok.prompt, ok.wall = 4, 1, 3, 800, 400, 2.0
    bad.error = "HTTP 422: unknown method"
    res = {"good": {("plain", 10, p): ok for p in dataset.positions(10)},
           "new": {("plain", 10, p): bad for p in dataset.positions(10)}}
    t = quality.table(res, "plain", 10, False).splitlines()
    assert len(t) == 4
    assert t[2].count("0.25 (") == 3 and t[2].count("0.75 (") == 3
    assert "200 (2.00×)" in t[2] and "| 500 |" in t[2]
    assert "not run: HTTP 422: unknown method" in t[3]
    assert quality.parse_spec('x={"method": "calibrated", "rows": "question"}') == \
        ("x", {"method": "calibrated", "rows": "question"})
    assert quality.parse_spec("bm25") == ("bm25", {})
    assert quality.parse_spec("paper") == ("paper", {"method": "paper"})


def test_runs_merge_into_one_report(tmp_path):
    """Two runs' JSON files (different methods, different n) render as one report that names
    both runs; a method with the same cell in both is refused, one with other cells (another K)
    is one row."""
    def run_file(name, label, n, r1, k=10):
        c = quality.Cell()
        c.n, c.r1, c.r3, c.fwd, c.prompt, c.wall = n, r1, n, 100 * n, 50 * n, 1.0
        res = {label: {("plain", k, p): c for p in dataset.positions(k)}}
        meta = {"cmd": f"python3 tests/quality/quality.py --method {label}", "split": "test",
                "groups": n, "model": "m", "machine": "cpu", "daemon_args": [],
                "max_tokens": 16, "date": "d"}
        path = tmp_path / name
        path.write_text(json.dumps({"meta": meta, "specs": {"rerank": [[label, {}]],
                                                             "answer": []},
                                    "rerank": quality.dump(res), "answer": {}}))
        assert quality.undump(quality.dump(res))[label][("plain", k, dataset.positions(k)[1])].r1 == r1
        return str(path)

    a, b = run_file("a.json", "one", 4, 1), run_file("b.json", "two", 8, 8)
    md = tmp_path / "out.md"
    r = subprocess.run([sys.executable, str(ROOT / "tests/quality/quality.py"), "--merge", a, b,
                        "--variants", "plain", "--k", "10", "--markdown", str(md)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = md.read_text()
    assert "| `one` | 4 | 0.25 (" in text and "| `two` | 8 | 1.00 (" in text
    assert "--method one" in text and "--method two" in text
    r = subprocess.run([sys.executable, str(ROOT / "tests/quality/quality.py"), "--merge", a, a,
                        "--markdown", str(md)], capture_output=True, text=True)
    assert r.returncode != 0 and "in two runs" in r.stderr
    c = run_file("c.json", "one", 6, 6, k=20)
    r = subprocess.run([sys.executable, str(ROOT / "tests/quality/quality.py"), "--merge", a, c,
                        "--variants", "plain", "--k", "10", "20", "--markdown", str(md)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = md.read_text()
    assert text.count("- `one`:") == 1
    assert "| `one` | 4 | 0.25 (" in text and "| `one` | 6 | 1.00 (" in text
    # --intro goes before the tables; a (variant, K) no run measured gets no section
    intro = tmp_path / "intro.md"
    intro.write_text("## Where each method fails\n\nWords.\n")
    r = subprocess.run([sys.executable, str(ROOT / "tests/quality/quality.py"), "--merge", a,
                        "--variants", "plain", "hard", "--k", "10", "--intro", str(intro),
                        "--markdown", str(md)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = md.read_text()
    assert text.index("## Where each method fails") < text.index("## plain, K = 10")
    assert "## hard" not in text


def test_verbose_names_the_documents_above_a_missed_gold(capsys, monkeypatch):
    """--verbose prints, for each /rerank that does not rank the gold document first, the
    titles ranked above it in order (a stand-in server that ranks the documents in reverse)."""
    import argparse
    monkeypatch.setattr(quality, "rank", lambda url, headers, it, label, fields: (
        list(range(len(it["documents"])))[::-1], 0, 0, 0.0))
    a = argparse.Namespace(split="test", variants=["hard"], k=[10], groups=4, positions=None,
                           verbose=True)
    res = quality.run(a, None, None, [("rev", {})], False)
    out = capsys.readouterr().out
    misses = 0
    for it in quality.select(a):
        K, g = len(it["documents"]), it["gold_index"]
        line = [ln for ln in out.splitlines() if f"[rev {it['id']}]" in ln]
        if g == K - 1:
            assert not line
            continue
        misses += 1
        titles = [it["documents"][i]["title"] for i in range(K - 1, g, -1)]
        assert len(line) == 1 and line[0].endswith(f"ranked {K - g}, after {titles}")
    assert misses > 0
    assert sum(c.n - c.r1 for c in res["rev"].values()) == misses


# ---- the trap sets (tests/quality/traps.py) ----------------------------------------------

import traps  # noqa: E402


@pytest.fixture(scope="module")
def trap_splits():
    return {s: traps.items(s, 12) for s in ("dev", "dev2", "test")}


def test_trap_sets_are_deterministic(trap_splits):
    assert traps.items("dev", 12) == trap_splits["dev"]
    assert traps.items("dev", 12, seed=traps.SEED + 1) != trap_splits["dev"]
    # fewer groups are a prefix of more: --groups N takes the first N
    assert traps.items("test", 3, variants=("traps",), ks=(10,)) == \
        [it for it in trap_splits["test"] if it["variant"] == "traps" and it["k"] == 10
         and quality.dataset.group(it) < 3]


def test_trap_splits_are_disjoint(trap_splits):
    def words(items):
        return {w for it in items for d in it["documents"]
                for w in quality.words(d["title"] + " " + d["text"])}

    def questions(items):
        return {it["query"].replace(it["entity"], "{}") for it in items}
    names = lambda items: {it["entity"] for it in items}  # noqa: E731
    test = trap_splits["test"]
    for dev in (trap_splits["dev"], trap_splits["dev2"]):  # the splits that choose, and test
        assert not names(dev) & names(test)
        assert not questions(dev) & questions(test)
        # no name, place, profession or prize word is shared: only function words, "named"
        # (the namesake and place forms) and years
        shared = {w for w in words(dev) & words(test) if not w.isdigit()}
        assert shared <= {"a", "an", "and", "as", "for", "had", "he", "in", "named", "never",
                          "of", "she", "that", "the", "to", "was", "where", "who"}, shared


def test_trap_items_carry_the_traps(trap_splits):
    cells = {}
    for split, items in trap_splits.items():
        for it in items:
            key = (split, it["variant"], it["k"], it["gold_pos"])
            cells[key] = cells.get(key, 0) + 1
            docs, x, gi = it["documents"], it["entity"], it["gold_index"]
            assert len(docs) == it["k"] and gi == it["gold_pos"] - 1
            assert x in it["query"] and x in docs[gi]["text"]
            # the answer is in the gold document only
            assert [i for i, d in enumerate(docs) if it["answer"] in d["text"]] == [gi]
            assert len(it["traps"]) == traps.N_TRAPS[it["variant"]] == len(set(it["forms"]))
            assert gi not in it["traps"]
            asked = {"dev": {"city": "born", "year": "born", "profession": "worked as",
                             "prize": "awarded"},
                     "dev2": {"city": "born", "year": "born", "profession": "earned a livelihood",
                              "prize": "honoured"},
                     "test": {"city": "came into the world", "year": "came into the world",
                              "profession": "by trade", "prize": "received"}}[split][
                         it["attribute"]]
            for i, d in enumerate(docs):
                named = x in d["text"]
                # exactly the traps name the asked person besides the gold document
                assert named == (i in it["traps"] or i == gi), (i, d)
                if i in it["traps"]:
                    assert asked in d["text"].lower(), d
                titled = it["variant"] == "traps"
                assert bool(d["title"]) == titled
                if titled and i != gi:
                    assert d["title"] != x
            if titled:
                assert docs[gi]["title"] == x
    assert set(cells.values()) == {12}
    assert set(cells) == {(s, v, k, p) for s in ("dev", "dev2", "test") for v in traps.VARIANTS
                          for k in traps.KS for p in traps.positions(k)}
    # every form and every attribute occurs in each split
    for items in trap_splits.values():
        assert {f for it in items for f in it["forms"]} == set(traps.FORMS)
        assert {it["attribute"] for it in items} == set(traps.ATTRIBUTES)


def test_trap_variants_reach_the_quality_tool(monkeypatch):
    a = quality.argparse.Namespace(split="dev", variants=["plain", "traps_untitled"],
                                   k=[10], groups=2, positions=None)
    its = quality.select(a)
    assert {it["variant"] for it in its} == {"plain", "traps_untitled"}
    assert sum(it["variant"] == "traps_untitled" for it in its) == 2 * 3
    it = next(it for it in its if it["variant"] == "traps_untitled")
    t = it["traps"][0]
    assert quality.doc_label(it, t).startswith(f"[{it['forms'][0]}] ")


def test_fuse_sweep_recomputes_each_weight(tmp_path):
    """fuse_sweep's table ranks by QL + w x z(attention) from the stored scores: a question
    whose gold has the lower likelihood but the higher attention is lost by query likelihood
    and by small weights, won by large ones and by attention alone; --show reads the runs."""
    import fuse_sweep
    k = 4
    # gold (index 0) is 0.1 below the best likelihood; its attention is the highest
    row = {"variant": "traps", "k": k, "gold": 0, "ql": [-1.1, -1.0, -2.0, -2.5],
           "att": {"0": [0.9, 0.1, 0.2, 0.3]}, "cal": [0.0, 0.0, 0.0, 0.0]}
    # z of the gold's attention is about 1.7 and of the likelihood leader's -0.9: the gold
    # wins once w x 2.6 > 0.1, between w 0.02 and 0.05
    table = fuse_sweep.table([row])
    got = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in table.splitlines()[2:]}
    assert got["query likelihood"] == "0 / 1 / 1"
    assert got["L0 w 0.02"] == "0 / 1 / 1" and got["L0 w 0.05"] == "1 / 1 / 1"
    assert got["L0 attention alone"] == "1 / 1 / 1"
    assert got["calibrated w1, w 0.5"] == "0 / 1 / 1"  # no calibrated spread: QL's order
    p = tmp_path / "run.json"
    p.write_text(json.dumps({"argv": [], "rows": [row, dict(row, gold=1)]}))
    out = subprocess.run([sys.executable, str(ROOT / "tests/quality/fuse_sweep.py"), "--show",
                          str(p)], capture_output=True, text=True, check=True).stdout
    assert "| query likelihood | 1 / 2 / 2 | 1 / 2 |" in out, out


def test_fused_sigmoid_is_the_dev_fit():
    """fused's relevance_score = sigmoid(fuse_scale x score + fuse_bias): the shipped profile's
    and the built-in (score.h) fuse_scale and fuse_bias are fuse_sweep.py --fit 0.02 on the
    dev runs kept in docs/quality-runs; the fit's probabilities track the test split's gold
    rate (each bin within 0.15)."""
    import re
    runs = ROOT / "docs" / "quality-runs"
    out = subprocess.run([sys.executable, str(ROOT / "tests/quality/fuse_sweep.py"), "--show",
                          str(runs / "dev_fuse_sweep.json"), str(runs / "dev2_fuse_sweep.json"),
                          "--fit", "0.02", "--check", str(runs / "test_fuse_sweep_k10.json")],
                         capture_output=True, text=True, check=True).stdout
    fit = dict(re.findall(r"^(fuse_scale|fuse_bias) = (\S+)$", out, re.M))
    kv = fit_profile_keys(ROOT / "config" / "profiles" / "gemma3-270m-q4km.profile")
    header = (ROOT / "src" / "pipeline" / "score.h").read_text()
    for key, macro in (("fuse_scale", "FITM_FUSE_SCALE"), ("fuse_bias", "FITM_FUSE_BIAS")):
        assert fit[key] == kv[key], (key, fit, kv[key])
        assert re.search(rf"#define {macro} (\S+)", header).group(1) == fit[key]
    test_line = next(l for l in out.splitlines() if l.startswith(str(runs / "test_fuse_sweep")))
    for mean_p, gold in re.findall(r"mean p ([0-9.]+) gold ([0-9.]+)", test_line):
        assert abs(float(mean_p) - float(gold)) < 0.15, test_line


def fit_profile_keys(path):
    import fit_profile
    return fit_profile.profile_keys(path)


# ---- the look-alike sets (tests/quality/lookalikes.py) -----------------------------------

import lookalikes  # noqa: E402


@pytest.fixture(scope="module")
def lookalike_items():
    return lookalikes.items()


def test_lookalike_sets_are_deterministic(lookalike_items):
    """The same seed gives the same items, pinned by a digest (the sets are a fixed resource:
    a change to the generator that moves any item fails here); another seed gives others;
    a split or a kind asked alone is the same items as taken from the whole."""
    import hashlib
    assert lookalikes.items() == lookalike_items
    assert hashlib.sha256(json.dumps(lookalike_items, sort_keys=True).encode()).hexdigest() == \
        "d2fa4629375cf87bf8a3181e554d67ec2ea7ff47c8231fc982b130c11eef001c"
    assert lookalikes.items(seed=lookalikes.SEED + 1) != lookalike_items
    for split in ("dev", "test"):
        assert lookalikes.items(split) == [it for it in lookalike_items if it["split"] == split]
    assert lookalikes.items("test", kinds=("temporal",)) == \
        [it for it in lookalike_items if it["split"] == "test" and it["kind"] == "temporal"]


def test_lookalike_items_have_one_gold(lookalike_items):
    roles = {"same_entity": set(lookalikes.SAME_ENTITY),
             "similar_name": {name for name, _ in lookalikes.LOOKALIKES}}
    counts = {"temporal": {"other_year": 6, "same_year_other_fact": 2,
                           "other_entity_same_year": 1},
              "paraphrase": {"echo": 1, "stuffed": 4, "relative": 1, "other_person": 3}}
    cells = {}
    for it in lookalike_items:
        kind, docs, g = it["kind"], it["documents"], it["gold_index"]
        i = int(it["id"].rsplit("-", 1)[1])
        cells[(kind, it["split"])] = cells.get((kind, it["split"]), 0) + 1
        assert it["id"] == f"{kind}-{i}" and it["split"] == ("dev" if i < 20 else "test")
        assert len(docs) == lookalikes.K == len(it["roles"]) == len(set(docs))
        assert [j for j, r in enumerate(it["roles"]) if r == "gold"] == [g]
        # the asked value is stated by the gold and by no other document of the item
        assert [j for j, d in enumerate(docs) if it["answer"] in d] == [g], it["id"]
        assert it["entity"] in it["query"] and it["entity"] in docs[g]
        others = [r for j, r in enumerate(it["roles"]) if j != g]
        if kind in roles:  # one distractor per other attribute / look-alike form
            assert len(set(others)) == len(others) and set(others) <= roles[kind]
            assert it["attribute"] not in others
        else:
            assert {r: others.count(r) for r in others} == counts[kind]
        if kind == "same_entity":
            assert all(it["entity"] in d for d in docs)
        if kind == "paraphrase":  # the echo quotes the question; the gold does not
            assert it["query"] in docs[it["roles"].index("echo")]
            assert it["query"] not in docs[g]
    assert cells == {(k, s): 20 for k in lookalikes.KINDS for s in ("dev", "test")}
    # the gold is at a random position: every position occurs
    assert {it["gold_index"] for it in lookalike_items} == set(range(lookalikes.K))


def test_lookalike_splits_are_disjoint(lookalike_items):
    dev = [it for it in lookalike_items if it["split"] == "dev"]
    test = [it for it in lookalike_items if it["split"] == "test"]
    for key in ("id", "query", "entity"):
        assert not {it[key] for it in dev} & {it[key] for it in test}, key
    assert not {d for it in dev for d in it["documents"]} & \
        {d for it in test for d in it["documents"]}


def test_lookalike_table_and_pairwise(monkeypatch):
    """R@1 and MRR on hand-made scores (ties count against the gold), the pairwise losses by
    role, a rejected method's row, and the server's results read back by document index."""
    its = [{"id": "a", "kind": "temporal", "gold_index": 0, "roles": ["gold", "x", "y"]},
           {"id": "b", "kind": "temporal", "gold_index": 1, "roles": ["x", "gold", "y"]},
           {"id": "c", "kind": "paraphrase", "gold_index": 2, "roles": ["x", "x", "gold"]}]
    # ranks: a 1; b 3 (tied with y, below x); c 2
    got = {"a": [3.0, 2.0, 1.0], "b": [5.0, 1.0, 1.0], "c": [0.0, 4.0, 2.0]}
    t = lookalikes.table(its, {"m": got, "bad": {"error": "HTTP 422: no"}}).splitlines()
    assert t[0] == "| method | temporal R@1 / MRR | paraphrase R@1 / MRR | ALL R@1 / MRR |"
    # temporal: ranks 1 and 3; paraphrase: rank 2
    assert t[2] == "| `m` | 1/2 0.67 | 0/1 0.50 | 1/3 0.61 |"
    assert t[3].startswith("| `bad` | not run: HTTP 422: no |")
    assert t[3].count("|") == t[0].count("|")
    pw = lookalikes.pairwise(its, got).splitlines()[2:]
    assert pw == ["| temporal | x | 1/2 | 0.50 |", "| temporal | y | 1/2 | 0.50 |",
                  "| paraphrase | x | 1/2 | 0.50 |"]
    assert lookalikes.rank_of([1.0, 1.0, 1.0], 1) == 3
    # a server that answers in its own order, index by index; bm25 is computed here
    it = lookalikes.items("dev", kinds=("temporal",))[0]
    monkeypatch.setattr(lookalikes.quality, "post_rerank", lambda url, headers, item, fields: (
        {"results": [{"index": j, "relevance_score": j / 10} for j in (2, 0, 1, *range(3, 10))]},
        0.0))
    assert lookalikes.scores(None, {}, it, "m", {}) == [j / 10 for j in range(10)]
    assert lookalikes.scores(None, {}, it, "bm25", {}) == \
        quality.bm25(it["query"], [{"text": d} for d in it["documents"]])


def test_lookalike_show_needs_no_server():
    r = subprocess.run([sys.executable, str(ROOT / "tests/quality/lookalikes.py"), "--show", "1",
                        "--split", "dev"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("== ")] == \
        [f"{k}-0" for k in lookalikes.KINDS]
    assert r.stdout.count("\n  * ") == 4
