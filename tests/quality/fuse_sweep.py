#!/usr/bin/env python3
"""Method fused's choices (fuse_layers, fuse_weight) on the quality sets, from one request per
item and layer set: `fused` with fuse_weight 0 returns each document's query-likelihood score
(its mean log-probability: relevance_score) and its attention (the query's rows on the
document in fuse_layers), so every weight is recomputed here without another request. Also
the recipe fused had before (query likelihood + w x z(calibrated_attention) of `calibrated`
with windows of 1), from one `calibrated` request per item, for comparison.

Prints Recall@1 / Recall@3 / n per (variant, K) for query likelihood alone, each layer set at
each weight, each layer set's attention alone, and the old recipe at each weight; the gold is
first in every item (every method here scores each document alone, so its position does not
change the ranking). --json keeps the raw scores, --show reads such files back (several: one
table over all of them). --fit W fits fused's fuse_scale and fuse_bias (relevance_score =
sigmoid(fuse_scale x score + fuse_bias), score = query likelihood + W x z(attention of
--fit-layers)) by logistic regression of "is the gold" on the scores of the --show files
(tools/fit_profile.py's, which fits the profile's score_scale and score_bias), and
prints how well the fitted probabilities match the gold rate in each file (--check files
too: the test split).

    tests/quality/fuse_sweep.py --model M.gguf --split dev --groups 40 --k 10 \\
        --variants traps traps_pronoun --layers 0 0,1,2 --json out.json
    tests/quality/fuse_sweep.py --show out.json [more.json ...]
    tests/quality/fuse_sweep.py --show dev.json dev2.json --fit 0.02 --check test.json
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import types

import quality as Q

WEIGHTS = (0.02, 0.05, 0.1, 0.2, 0.5)


def zscores(xs: list) -> list:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
    return [(x - m) / sd if sd > 0 else 0.0 for x in xs]


def measure(a) -> list:
    """One row per item: its variant, K, gold index, query likelihood's mean log-probabilities,
    the attention of each layer set and calibrated_attention (windows of 1)."""
    load = Q.dataset.load
    # the trap splits without a committed plain/hard file of their own (dev2)
    Q.dataset.load = lambda split, *x: load(split, *x) if split in ("dev", "test") else []
    items = Q.select(types.SimpleNamespace(split=a.split, variants=a.variants, k=a.k,
                                           groups=a.groups, first_only=True))
    p, url = Q.start_daemon(a.model, a.build, [f"--threads={a.threads}"])
    rows = []
    try:
        for it in items:
            k = len(it["documents"])
            row = {"variant": it["variant"], "k": k, "gold": it["gold_pos"] - 1, "att": {}}
            for spec in a.layers:
                layers = [int(x) for x in spec.split(",")]
                js, _ = Q.post_rerank(url, {}, it, {"method": "fused", "fuse_weight": 0,
                                                    "fuse_layers": layers})
                if isinstance(js, str):
                    sys.exit(js)
                got = {x["index"]: x for x in js["results"]}
                row["ql"] = [got[i]["relevance_score"] for i in range(k)]
                row["att"][spec] = [got[i]["attention"] for i in range(k)]
            js, _ = Q.post_rerank(url, {}, it, {"method": "calibrated", "window": 1})
            if isinstance(js, str):
                sys.exit(js)
            got = {x["index"]: x for x in js["results"]}
            row["cal"] = [got[i]["calibrated_attention"] for i in range(k)]
            rows.append(row)
    finally:
        p.terminate()
    return rows


def table(rows: list) -> str:
    cells = sorted({(r["variant"], r["k"]) for r in rows})
    specs = [("query likelihood", lambda r: r["ql"])]
    for spec in sorted({s for r in rows for s in r["att"]}):
        for w in WEIGHTS:
            specs.append((f"L{spec} w {w}", lambda r, s=spec, w=w:
                          [q + w * z for q, z in zip(r["ql"], zscores(r["att"][s]))]))
        specs.append((f"L{spec} attention alone", lambda r, s=spec: r["att"][s]))
    for w in WEIGHTS:
        specs.append((f"calibrated w1, w {w}", lambda r, w=w:
                      [q + w * z for q, z in zip(r["ql"], zscores(r["cal"]))]))
    out = ["| scores | " + " | ".join(f"{v} K={k}" for v, k in cells) + " | all |",
           "|---" * (len(cells) + 2) + "|"]
    for name, f in specs:
        line, t1, tn = [], 0, 0
        for v, k in cells:
            r1 = r3 = n = 0
            for r in (r for r in rows if (r["variant"], r["k"]) == (v, k)):
                s = f(r)
                order = sorted(range(len(s)), key=lambda i: (-s[i], i))
                r1 += order[0] == r["gold"]
                r3 += r["gold"] in order[:3]
                n += 1
            line.append(f"{r1} / {r3} / {n}")
            t1, tn = t1 + r1, tn + n
        out.append(f"| {name} | " + " | ".join(line) + f" | {t1} / {tn} |")
    return "\n".join(out)


def fused_scores(r: dict, w: float, layers: str) -> list:
    return [q + w * z for q, z in zip(r["ql"], zscores(r["att"][layers]))]


def calibration(rows: list, w: float, layers: str, scale: float, bias: float) -> str:
    """Fitted probability against the gold rate, in bins of the probability."""
    bins = [[0, 0.0, 0] for _ in range(5)]  # documents, summed probability, golds
    for r in rows:
        for i, s in enumerate(fused_scores(r, w, layers)):
            p = 1 / (1 + math.exp(-(scale * s + bias)))
            c = bins[min(int(p * 5), 4)]
            c[0], c[1], c[2] = c[0] + 1, c[1] + p, c[2] + (i == r["gold"])
    return ", ".join(f"[{i / 5:.1f}, {(i + 1) / 5:.1f}): n {n} mean p {sp / n:.3f} gold {g / n:.3f}"
                     for i, (n, sp, g) in enumerate(bins) if n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--build", default="build")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--split", default="dev", choices=("dev", "dev2", "test"))
    ap.add_argument("--groups", type=int, default=10)
    ap.add_argument("--k", type=int, nargs="+", default=[10])
    ap.add_argument("--variants", nargs="+", default=["plain", "hard", "traps", "traps_untitled"])
    ap.add_argument("--layers", nargs="+", default=["0"],
                    help="fuse_layers sets, each comma-separated")
    ap.add_argument("--json", help="write the raw scores here")
    ap.add_argument("--show", nargs="+", help="print the table of these --json files")
    ap.add_argument("--fit", type=float, metavar="W",
                    help="fit fuse_scale and fuse_bias for fuse_weight W on the --show files")
    ap.add_argument("--fit-layers", default="0", help="the fuse_layers set of --fit")
    ap.add_argument("--check", nargs="+", default=[], help="--json files to check the fit on")
    a = ap.parse_args()
    if a.show:
        rows = [r for f in a.show for r in json.load(open(f))["rows"]]
    else:
        if not a.model:
            ap.error("--model is required unless --show")
        rows = measure(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"argv": sys.argv[1:], "rows": rows}, f)
    if a.fit is None:
        print(table(rows))
        return 0
    xs, ys = [], []
    for r in rows:
        s = fused_scores(r, a.fit, a.fit_layers)
        xs += s
        ys += [float(i == r["gold"]) for i in range(len(s))]
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
    import fit_profile  # the profile's own fit of score_scale and score_bias
    scale, bias = fit_profile.fit_logistic(list(zip(xs, ys)))
    print(f"fuse_scale = {scale:.6g}\nfuse_bias = {bias:.6g}")
    for f in (a.show or []) + a.check:
        print(f"{f}: " + calibration(json.load(open(f))["rows"], a.fit, a.fit_layers, scale, bias))
    return 0


if __name__ == "__main__":
    sys.exit(main())
