#!/usr/bin/env python3
"""Fit a scoring profile (docs/scoring-profile.md) for one model on the dev split.

Attention statistics come from the numpy oracle (tests/oracle/model.py, float32) through
tools/scoring_capture.py, which caches one .npz per (item, window size); this script only
reads those captures. It

  1. measures, per (layer, head) and row group (last | question | suffix), how well the
     attention mass a document receives separates the gold document from the others:
     AUC over all (gold, other) pairs of the same item, for the raw attention and for each
     reference (null_query, null_suffix) in each form (difference, log_ratio);
  2. picks the heads: the (layer, head) pairs whose AUC, under the best row group and
     reference, is at least --min-auc, at most --max-heads of them;
  3. evaluates every option set of the spec (rows, aggregate, skip_first, sink_factor,
     reference, form, window) on those heads: Recall@1/@3 per (variant, K, gold position);
  4. chooses the option set with the best mean Recall@3 over the middle and last cells (ties:
     Recall@1 at the middle), fits score_scale and score_bias of relevance_score =
     sigmoid(scale * rel_scaled + bias) by logistic regression (gold = 1, others = 0), and
     writes the profile with the model's identity keys from the GGUF.

    python3 tools/fit_profile.py --model M.gguf --cache CACHE --capture 0-49 --out PROFILE
        [--layers 5 11 17] [--report FILE]
  (--capture runs tools/scoring_capture.py first; without it only the cache is read)

With --daemon OPTIONS the options are given (chosen on the dev split with
tests/quality/quality.py, docs/scoring-profile.md) and no capture is needed: fitmd itself
(build/src/fitmd, started with no profile) scores the dev items of --groups with those
options, and only score_scale and score_bias are fitted, on its rel_scaled values:

    python3 tools/fit_profile.py --model M.gguf --daemon '{"window": 5, ...}' --groups 20
        --out PROFILE
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import re
import shlex
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "quality"))
from oracle import gguf_reader  # noqa: E402
import dataset  # noqa: E402
from profile_file import profile_keys  # noqa: E402

ROWS = {"last": 0, "question": 1, "suffix": 2}
EPS = 1e-9
ID_RE = re.compile(r"^(dev|test)-(plain|hard)-k(\d+)-g(\d+)-p(\d+)-w(\d+)\.npz$")


# ---- captures ----------------------------------------------------------------------------

def load_captures(cache: pathlib.Path, split: str = "dev") -> dict:
    """{(variant, k, group, pos): {window: npz}} for the split's captures in cache."""
    out: dict = {}
    for p in sorted(cache.glob(f"{split}-*.npz")):
        m = ID_RE.match(p.name)
        if not m:
            continue
        _, variant, k, g, pos, w = m.groups()
        out.setdefault((variant, int(k), int(g), int(pos)), {})[int(w)] = dict(np.load(p))
    return out


def doc_masses(att, spans, skip_first=0, keep=None):
    """mass (L, H, K) of att (L, H, T) over each span, after dropping its first skip_first
    tokens and, when keep is given, the tokens whose keep[k] mask (over the span) is False;
    with counts (K,) of the tokens counted."""
    L, H, _ = att.shape
    mass = np.zeros((L, H, len(spans)))
    count = np.zeros(len(spans))
    for k, (s, e) in enumerate(spans):
        s2 = min(s + skip_first, e - 1)
        a = att[:, :, s2:e].astype(np.float64)
        if keep is not None:
            m = keep[k][s2 - s:]
            a = a[:, :, m]
        mass[:, :, k] = a.sum(axis=2)
        count[k] = a.shape[2]
    return mass, count


def sink_masks(ref_att, ref_spans, heads_idx, sink_factor, skip_first):
    """Per span, a bool mask over its tokens: False where the reference attention (averaged
    over the selected heads) exceeds sink_factor x the span's mean reference attention."""
    out = []
    for s, e in ref_spans:
        a = ref_att[heads_idx[0], heads_idx[1], s:e].astype(np.float64).mean(axis=0)
        if sink_factor <= 0:
            out.append(np.ones(e - s, bool))
            continue
        s2 = min(skip_first, e - s - 1)
        mean = a[s2:].mean() if e - s > s2 else a.mean()
        out.append(a <= sink_factor * mean)
    return out


def visible(spans, T: int, swa, n_swa: int, layer: int) -> np.ndarray:
    """(K,) whether layer sees each whole span from the last rows (all rows lie at the end)."""
    if not swa[layer] or n_swa <= 0:
        return np.ones(len(spans), bool)
    return np.array([(T - 1) - s < n_swa for s, _ in spans])


def score_prompt(cap: dict, g: int, opts: dict, heads: list, swa, n_swa: int) -> np.ndarray:
    """rel (n_docs of group g,) under opts for one captured prompt, before the window merge
    (multiply by the group's size for rel_scaled)."""
    r = ROWS[opts["rows"]]
    main = cap[f"g{g}_main"][r]
    spans = [tuple(x) for x in cap[f"g{g}_spans"]]
    T = main.shape[-1]
    ref_name = opts["reference"]
    li = np.array([h[0] for h in heads])
    hi = np.array([h[1] for h in heads])
    if ref_name == "none":
        ref, ref_spans = None, None
    elif ref_name == "null_suffix":
        ref, ref_spans = cap[f"g{g}_null_suffix"][r], spans
    elif ref_name == "null_query":
        ref, ref_spans = cap[f"g{g}_null_query"][r], [tuple(x) for x in cap[f"g{g}_nq_spans"]]
    else:
        raise ValueError(ref_name)
    keep = None
    ref_keep = None
    if ref is not None and opts["sink_factor"] > 0:
        ref_keep = sink_masks(ref, ref_spans, (li, hi), opts["sink_factor"], opts["skip_first"])
        keep = ref_keep
    A, n = doc_masses(main, spans, opts["skip_first"], keep)
    vis = np.stack([visible(spans, T, swa, n_swa, l) for l in range(len(swa))])  # (L, K)
    sel = np.zeros(A.shape[:2], bool)
    sel[li, hi] = True

    def agg(mass, cnt):
        v = mass / np.maximum(cnt, 1) if opts["aggregate"] == "mean" else mass
        w = sel[:, :, None] & vis[:, None, :]
        tot = (v * w).sum(axis=(0, 1))
        num = w.sum(axis=(0, 1))
        return np.where(num > 0, tot / np.maximum(num, 1), 0.0)
    a = agg(A, n)
    if ref is None:
        return a
    B, m = doc_masses(ref, ref_spans, opts["skip_first"], ref_keep)
    b = agg(B, m)
    if opts["form"] == "log_ratio":
        return np.log(a + EPS) - np.log(b + EPS)
    return a - b


def score_item(caps: dict, opts: dict, heads: list, swa, n_swa: int):
    """rel_scaled (K,) for one item under opts (window merge of the spec), or None when the
    window's capture is missing."""
    cap = caps.get(opts["window"])
    if cap is None:
        return None
    sizes = cap["groups"]
    out = []
    for g, n in enumerate(sizes):
        out.append(score_prompt(cap, g, opts, heads, swa, n_swa) * n)
    return np.concatenate(out)


# ---- metrics -----------------------------------------------------------------------------

def recall(scores: np.ndarray, gold: int, k: int) -> bool:
    order = np.argsort(-scores, kind="stable")
    return gold in order[:k]


def auc(pos: list, neg: list) -> float:
    pos, neg = np.asarray(pos), np.asarray(neg)
    if not len(pos) or not len(neg):
        return float("nan")
    gt = (pos[:, None] > neg[None, :]).mean()
    eq = (pos[:, None] == neg[None, :]).mean()
    return float(gt + 0.5 * eq)


def head_auc(caps_by_item: dict, swa, n_swa: int, L: int, H: int) -> dict:
    """{(rows, reference, form): (L, H) AUC} of single heads (mass sum, no skipping)."""
    out = {}
    for rows, ref, form in itertools.product(ROWS, ("none", "null_query", "null_suffix"),
                                             ("difference", "log_ratio")):
        if ref == "none" and form == "log_ratio":
            continue
        pos = [[[] for _ in range(H)] for _ in range(L)]
        neg = [[[] for _ in range(H)] for _ in range(L)]
        for key, caps in caps_by_item.items():
            gold = key[3] - 1
            for l in range(L):
                for h in range(H):
                    o = dict(rows=rows, reference=ref, form=form, aggregate="sum",
                             skip_first=0, sink_factor=0, window=0)
                    s = score_item(caps, o, [(l, h)], swa, n_swa)
                    if s is None:
                        continue
                    pos[l][h].append(s[gold])
                    neg[l][h].extend(np.delete(s, gold))
        out[(rows, ref, form)] = np.array([[auc(pos[l][h], neg[l][h]) for h in range(H)]
                                           for l in range(L)])
    return out


def evaluate(caps_by_item: dict, opts: dict, heads: list, swa, n_swa: int) -> dict:
    """{(variant, k, pos): (n, R@1, R@3)} plus the (rel_scaled, label) pairs for calibration."""
    cells: dict = {}
    pairs = []
    for key, caps in caps_by_item.items():
        variant, k, _, pos = key
        s = score_item(caps, opts, heads, swa, n_swa)
        if s is None:
            continue
        c = cells.setdefault((variant, k, pos), [0, 0, 0])
        c[0] += 1
        c[1] += recall(s, pos - 1, 1)
        c[2] += recall(s, pos - 1, 3)
        pairs.extend((float(v), int(i == pos - 1)) for i, v in enumerate(s))
    return {"cells": {k: (n, r1 / n, r3 / n) for k, (n, r1, r3) in cells.items()},
            "pairs": pairs}


def objective(cells: dict) -> tuple:
    """(mean R@3 over middle and last cells, mean R@1 over middle cells, mean R@1 overall)."""
    mid_last = [v[2] for (var, k, p), v in cells.items() if p != 1]
    mid = [v[1] for (var, k, p), v in cells.items() if p not in (1, k)]
    r1 = [v[1] for v in cells.values()]
    f = lambda x: float(np.mean(x)) if x else 0.0  # noqa: E731
    return (round(f(mid_last), 4), round(f(mid), 4), round(f(r1), 4))


def simplicity(o: dict) -> float:
    """Tie-break between option sets of equal quality: fewer forward tokens first (no
    reference, then null_suffix's suffix-only pass, then null_query's full pass; windows add
    prompts), then fewer knobs away from zero."""
    cost = {"none": 0, "null_suffix": 1, "null_query": 2}[o["reference"]]
    cost += 0.5 * (o["window"] > 0)
    cost += 0.1 * (o["skip_first"] > 0) + 0.1 * (o["sink_factor"] > 0)
    cost += 0.05 * (o["form"] != "difference") + 0.05 * (o["rows"] != "question")
    return -cost


def fit_logistic(pairs: list, iters: int = 500, ridge: float = 1.0) -> tuple:
    """(scale, bias) of sigmoid(scale * x + bias) by Newton's method on the log-likelihood
    with an L2 penalty `ridge` on the slope (finite when the classes separate), x
    standardised for the fit and mapped back."""
    x = np.array([p[0] for p in pairs])
    y = np.array([p[1] for p in pairs], dtype=np.float64)
    mu, sd = x.mean(), x.std() or 1.0
    z = (x - mu) / sd
    w = np.zeros(2)
    X = np.stack([z, np.ones_like(z)], axis=1)
    for _ in range(iters):
        p = 1 / (1 + np.exp(-np.clip(X @ w, -500, 500)))
        g = X.T @ (y - p) - np.array([ridge * w[0], 0.0])
        Hm = X.T @ (X * (p * (1 - p))[:, None]) + np.diag([ridge, 1e-9])
        step = np.linalg.solve(Hm, g)
        w += step
        if np.abs(step).max() < 1e-10:
            break
    scale = w[0] / sd
    return float(scale), float(w[1] - scale * mu)


# ---- identity ----------------------------------------------------------------------------

def identity(model: str) -> dict:
    g = gguf_reader.read(model)
    arch = g.get("general.architecture")
    return {"profile_version": 1, "model_architecture": arch,
            "model_name": g.get("general.name", "") or "",
            "model_layers": int(g.get(f"{arch}.block_count")),
            "model_embd": int(g.get(f"{arch}.embedding_length")),
            "model_heads": int(g.get(f"{arch}.attention.head_count")),
            "model_vocab": len(g.get("tokenizer.ggml.tokens")),
            "model_file_bytes": os.path.getsize(model)}


def swa_of(model: str):
    sys.path.insert(0, str(ROOT / "tests"))
    from oracle.model import hparams_from_gguf
    hp = hparams_from_gguf(gguf_reader.read(model))
    return hp, list(hp.swa_layers), hp.n_swa


def fmt_value(v) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


ANSWER_KEYS = ("calibrate", "reorder", "reorder_placement")


def parse_answer(text: str) -> dict:
    """--answer's JSON (the /answer request fields of ANSWER_KEYS), checked before any fitting
    runs; {} when not given."""
    answer = json.loads(text) if text else {}
    bad = set(answer) - set(ANSWER_KEYS) if isinstance(answer, dict) else {"(not an object)"}
    if bad:
        sys.exit(f"--answer: unknown field(s) {sorted(bad)}; known: {list(ANSWER_KEYS)}")
    return answer


def answer_lines(answer: dict, reorder_follows: bool = False) -> list:
    """A profile's /answer defaults (answer_<key> = value), from parse_answer's dict;
    reorder_follows: the reorder was set to rerank_method after that choice."""
    if not answer:
        return []
    lines = ["", "# /answer defaults for requests that leave them out (the request fields of "
                 "the same names, chosen with tests/quality/quality.py --answer on the dev split)"]
    if reorder_follows:
        lines.append("# answer_reorder: since chosen, rerank_method's, the default ranking")
    for k in ANSWER_KEYS:
        if k in answer:
            v = answer[k]
            lines.append(f"answer_{k} = {str(v).lower() if isinstance(v, bool) else v}")
    return lines


def write_profile(path: pathlib.Path, ident: dict, prov: dict, opts: dict, heads: list,
                  scale: float, bias: float, answer: dict = None, chosen: dict = None):
    """chosen: what was chosen after the fit, on the dev splits with tests/quality/quality.py
    and tests/quality/fuse_sweep.py (docs/rerank-results.md, docs/scoring.md): rerank_method
    (/rerank's method for requests that name none), fuse_weight (method fused's w),
    answer_reorder (/answer's reorder, over the fit's) and answer_top_n (how many of the
    reordered documents /answer's prompt keeps), fuse_scale and fuse_bias (fused's
    relevance_score = sigmoid(fuse_scale x score + fuse_bias), fitted by
    tests/quality/fuse_sweep.py --fit)."""
    n_head = ident["model_heads"]
    lines = ["# fitm scoring profile: written by tools/fit_profile.py (docs/scoring-profile.md)",
             "# identity: fitmd refuses this profile for any other model"]
    lines += [f"{k} = {fmt_value(v)}" for k, v in ident.items()]
    lines += ["", "# provenance"]
    lines += [f"{k} = {fmt_value(v)}" for k, v in prov.items()]
    lines += ["", "# scoring options (the /rerank request fields of the same names)"]
    for k in OPTION_KEYS:
        lines.append(f"{k} = {fmt_value(opts[k])}")
    if "head_query" in opts:  # not a choice of the oracle path: the query there
        lines.append(f"head_query = {fmt_value(opts['head_query'])}")
    lines.append("layers = " + ",".join(str(l) for l in sorted({h[0] for h in heads})))
    if len(heads) != len({h[0] for h in heads}) * n_head:
        lines.append("heads = " + ",".join(f"{l}:{h}" for l, h in heads))
    lines += ["", "# relevance_score = sigmoid(score_scale * rel_scaled + score_bias)",
              f"score_scale = {scale:.6g}", f"score_bias = {bias:.6g}"]
    if "temperature" in opts:  # weight = softmax(rel_scaled / temperature), for /answer
        lines.append(f"temperature = {fmt_value(float(opts['temperature']))}")
    if chosen:
        lines += ["", "# /rerank's method for requests that name none, and fused's weight (chosen on the plain, hard",
                  "# and trap dev splits, docs/scoring.md); its fuse_layers are the built-in 0",
                  f"rerank_method = {chosen['rerank_method']}",
                  f"fuse_weight = {fmt_value(float(chosen['fuse_weight']))}"]
        if "fuse_scale" in chosen:
            lines += ["# fused's relevance_score = sigmoid(fuse_scale x score + fuse_bias), fitted on the dev",
                      "# splits (tests/quality/fuse_sweep.py --fit)",
                      f"fuse_scale = {fmt_value(float(chosen['fuse_scale']))}",
                      f"fuse_bias = {fmt_value(float(chosen['fuse_bias']))}"]
        if "answer_reorder" in chosen:
            answer = {**(answer or {}), "reorder": chosen["answer_reorder"]}
    lines += answer_lines(answer, bool(chosen and "answer_reorder" in chosen))
    if chosen and "answer_top_n" in chosen:
        lines += ["# answer_top_n: chosen after the fit, on the trap dev splits (docs/answer-results.md)",
                  f"answer_top_n = {int(chosen['answer_top_n'])}"]
    lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def read_profile(path: str) -> tuple:
    """(options, heads) from a profile file (the option keys this tool writes)."""
    kv = profile_keys(path)
    opts = {k: kv[k] for k in ("rows", "aggregate", "reference", "form")}
    opts.update({k: float(kv[k]) if k == "sink_factor" else int(kv[k])
                 for k in ("skip_first", "sink_factor", "window")})
    if "heads" in kv:
        heads = [tuple(int(x) for x in p.split(":")) for p in kv["heads"].split(",")]
    else:
        heads = [(int(l), h) for l in kv["layers"].split(",")
                 for h in range(int(kv["model_heads"]))]
    return opts, heads


# ---- the daemon's scores -----------------------------------------------------------------

def command_line(a) -> str:
    """This run's command as a shell would take it, the model's path written MODEL."""
    return shlex.join(["tools/fit_profile.py"] + ["MODEL" if x == a.model else x
                                                  for x in sys.argv[1:]])


OPTION_KEYS = ("rows", "aggregate", "skip_first", "sink_factor", "reference", "form", "window")


def daemon_fit(a) -> int:
    """Fits score_scale / score_bias on fitmd's own rel_scaled for the given options (see the
    module doc) and writes the profile with them."""
    import requests
    from quality import select, start_daemon
    from scoring_capture import windows
    opts = json.loads(a.daemon)
    missing = [k for k in OPTION_KEYS + ("layers",) if k not in opts]
    if missing:
        sys.exit(f"--daemon: give every option ({', '.join(missing)} missing)")
    items = select(a)
    proc, url = start_daemon(a.model, a.build, ["--profile=none"])
    pairs, cells = [], {}
    try:
        for it in items:
            body = dict(opts, query=it["query"], documents=it["documents"], top_n=it["k"])
            r = requests.post(url + "/rerank", json=body, timeout=3600)
            if r.status_code != 200:
                sys.exit(f"/rerank -> {r.status_code}: {r.text[:300]}")
            res = r.json()["results"]
            size = {i: len(g) for g in windows(it["k"], opts["window"]) for i in g}
            for d in res:
                pairs.append((d["calibrated_attention"] * size[d["index"]],
                              int(d["index"] == it["gold_index"])))
            order = [d["index"] for d in res]
            c = cells.setdefault((it["variant"], it["k"], it["gold_pos"]), [0, 0, 0])
            c[0] += 1
            c[1] += order[0] == it["gold_index"]
            c[2] += it["gold_index"] in order[:3]
    finally:
        proc.terminate()
        proc.wait(60)
    scale, bias = fit_logistic(pairs)
    ident = identity(a.model)
    heads = [(l % ident["model_layers"], h) for l in opts["layers"]
             for h in range(ident["model_heads"])]
    cmd = command_line(a)
    metrics = {k: (n, r1 / n, r3 / n) for k, (n, r1, r3) in cells.items()}
    prov = {"fitted_on": f"tests/quality/data/{a.split}.jsonl, {len(items)} items "
                         f"(groups 0-{a.groups - 1}); scores from fitmd; {cmd}",
            "fitted_metrics": f"{a.split}: " + cells_md(metrics)}
    print(f"{len(items)} items: score_scale {scale:.6g}, score_bias {bias:.6g}")
    print(cells_md(metrics))
    if a.out:
        write_profile(pathlib.Path(a.out), ident, prov, opts, heads, scale, bias, a.answer,
                      json.loads(a.chosen) if a.chosen else None)
        print(f"wrote {a.out}")
    return 0


# ---- main --------------------------------------------------------------------------------

GRID = dict(rows=["last", "question", "suffix"], aggregate=["sum", "mean"],
            skip_first=[0, 2], sink_factor=[0, 4], reference=["none", "null_query",
                                                               "null_suffix"],
            form=["difference", "log_ratio"], window=[0, 5])


def grid(windows_present: set):
    keys = list(GRID)
    for vals in itertools.product(*(GRID[k] for k in keys)):
        o = dict(zip(keys, vals))
        if o["reference"] == "none" and (o["form"] == "log_ratio" or o["sink_factor"]):
            continue
        if o["window"] not in windows_present:
            continue
        yield o


def cells_md(cells: dict) -> str:
    return "; ".join(f"{v} K{k} p{p}: n={n} R@1 {r1:.2f} R@3 {r3:.2f}"
                     for (v, k, p), (n, r1, r3) in sorted(cells.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache", help="tools/scoring_capture.py's folder")
    ap.add_argument("--daemon", metavar="OPTIONS",
                    help="JSON of every scoring option: fit only score_scale/score_bias, on "
                         "fitmd's own scores (see the module doc)")
    ap.add_argument("--groups", type=int, default=20, help="with --daemon: dev groups used")
    ap.add_argument("--build", default=str(ROOT / "build"), help="with --daemon: fitmd's build")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--out", help="profile file to write")
    ap.add_argument("--answer", metavar="JSON",
                    help="/answer defaults to write into the profile, as /answer request "
                         "fields: calibrate, reorder, reorder_placement")
    ap.add_argument("--chosen", metavar="JSON",
                    help="choices made after the fit to write into the profile: rerank_method, "
                         "fuse_weight, fuse_scale, fuse_bias, answer_reorder (over --answer's "
                         "reorder), answer_top_n")
    ap.add_argument("--report", help="write the measurements as JSON here")
    ap.add_argument("--min-auc", type=float, default=0.75)
    ap.add_argument("--max-heads", type=int, default=12)
    ap.add_argument("--evaluate", metavar="PROFILE",
                    help="only report the profile's options on the split's captures (use "
                         "once on the test split)")
    ap.add_argument("--capture", metavar="GROUPS",
                    help="first run tools/scoring_capture.py for these groups (e.g. 0-49); "
                         "items already in the cache are kept")
    ap.add_argument("--variants", nargs="+", default=["plain", "hard"])
    ap.add_argument("--k", type=int, nargs="+", default=[10, 20])
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 5])
    ap.add_argument("--layers", type=int, nargs="+",
                    help="use every head of these layers instead of selecting heads by AUC")
    a = ap.parse_args()
    a.answer = parse_answer(a.answer)
    if a.daemon:
        return daemon_fit(a)
    if not a.cache:
        sys.exit("--cache is needed (or --daemon)")
    if a.capture:
        import subprocess
        cmd = [sys.executable, str(ROOT / "tools" / "scoring_capture.py"), "--model", a.model,
               "--split", a.split, "--cache", a.cache, "--groups", a.capture,
               "--variants", *a.variants, "--k", *map(str, a.k),
               "--windows", *map(str, a.windows)]
        if subprocess.run(cmd).returncode:
            sys.exit("capture failed")
    hp, swa, n_swa = swa_of(a.model)
    caps = load_captures(pathlib.Path(a.cache), a.split)
    if not caps:
        sys.exit(f"no {a.split} captures in {a.cache}")
    print(f"{len(caps)} captured {a.split} items")
    if a.evaluate:
        opts, heads = read_profile(a.evaluate)
        ev = evaluate(caps, opts, heads, swa, n_swa)
        pos = [v for v, l in ev["pairs"] if l]
        neg = [v for v, l in ev["pairs"] if not l]
        print(f"{a.evaluate} on {a.split}: AUC {auc(pos, neg):.3f}; " + cells_md(ev["cells"]))
        return 0
    aucs = head_auc(caps, swa, n_swa, hp.n_layer, hp.n_head)
    best_cfg = max(aucs, key=lambda c: np.nanmean(np.sort(aucs[c].ravel())[-8:]))
    table = aucs[best_cfg]
    print("per-head AUC, best rows/reference/form =", best_cfg)
    for l in range(hp.n_layer):
        print(f"  layer {l:2d} {'local ' if swa[l] else 'global'} " +
              " ".join(f"{x:.2f}" for x in table[l]))
    ranked = sorted(((float(table[l, h]), l, h) for l in range(hp.n_layer)
                     for h in range(hp.n_head) if not np.isnan(table[l, h])), reverse=True)
    heads = [(l, h) for v, l, h in ranked if v >= a.min_auc][:a.max_heads]
    if not heads:
        heads = [(l, h) for _, l, h in ranked[:4]]
    if a.layers:
        heads = [(l % hp.n_layer, h) for l in a.layers for h in range(hp.n_head)]
    heads.sort()
    print("heads:", heads)
    windows_present = set()
    for c in caps.values():
        windows_present |= set(c)
    results = []
    for o in grid(windows_present):
        ev = evaluate(caps, o, heads, swa, n_swa)
        results.append((objective(ev["cells"]) + (simplicity(o),), o, ev))
    results.sort(key=lambda r: r[0], reverse=True)
    for obj, o, ev in results[:15]:
        print(obj, json.dumps(o), "\n    ", cells_md(ev["cells"]))
    obj, best, ev = results[0]
    scale, bias = fit_logistic(ev["pairs"])
    n = len(caps)
    if a.report:
        pathlib.Path(a.report).write_text(json.dumps({
            "head_auc": {"/".join(k): v.tolist() for k, v in aucs.items()},
            "heads": heads,
            "results": [{"objective": r[0], "options": r[1],
                         "cells": {"/".join(map(str, k)): v for k, v in r[2]["cells"].items()}}
                        for r in results]}, indent=1))
    if a.out:
        cmd = command_line(a)
        prov = {"fitted_on": f"tests/quality/data/{a.split}.jsonl, {n} captured items "
                             f"({', '.join(sorted({f'{v} K{k}' for v, k, _, _ in caps}))}); "
                             f"numpy oracle float32; {cmd}",
                "fitted_metrics": f"{a.split}: " + cells_md(ev["cells"])}
        write_profile(pathlib.Path(a.out), identity(a.model), prov, best, heads, scale, bias,
                      a.answer, json.loads(a.chosen) if a.chosen else None)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
