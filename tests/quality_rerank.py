#!/usr/bin/env python3
"""Rerank quality by gold position: synthetic multi-document QA about fictional entities (so
the answer can only come from the documents), K documents with the one gold document at a
chosen position, scored by /rerank with each method. Prints Recall@1 and Recall@3 per method
and gold position.

With --answer, asks /answer instead (greedy, one line) in three modes: vanilla (calibrate
false), calibrated, and reorder by query_likelihood + calibrated; a case counts as answered
when the answer contains the gold person's name. Prints accuracy by gold position and, with
--plot FILE.png (needs matplotlib), draws accuracy against gold position, one line per mode
and K.

  tests/quality_rerank.py --model MODEL.gguf --k 10 20 [--questions 5] [--positions 1 5 10]
  tests/quality_rerank.py --url http://127.0.0.1:8080 [--key KEY] ...
  tests/quality_rerank.py --model MODEL.gguf --answer --k 10 20 [--plot docs/answer.png]

Each question has its own fictional entities; the distractors are documents of the same shape
about other entities, so only the entity names separate the gold document from the rest."""
import argparse
import random
import sys

import requests

from bench_rerank import start_daemon, ROOT  # noqa: E402  (same directory)

SYLL = "ka lo mi ra ven tor shi bel qua dre nim os tal fen gor wyn pel zar ith un".split()
THINGS = ["lighthouse", "observatory", "glassworks", "library", "bridge", "orchard guild",
          "clock tower", "river ferry", "salt mine", "weaving hall"]
TEMPLATES = [
    ("The {thing} of {place} was founded by {person} in the year {year}, after a long dispute "
     "with the neighbouring town of {other} over fishing rights and grain prices.",
     "Who founded the {thing} of {place}?", "{person}"),
    ("{person} is the current keeper of the {thing} of {place}; the previous keeper, {other}, "
     "retired in {year} and moved to the coast to write poetry.",
     "Who is the current keeper of the {thing} of {place}?", "{person}"),
]
METHODS = ["calibrated", "attention", "attention_sort", "query_likelihood", "relevance"]


def name(rnd, n=2):
    return "".join(rnd.choice(SYLL) for _ in range(n)).capitalize()


ANSWER_MODES = {
    "vanilla": {"calibrate": False},
    "calibrated": {},
    "reorder+calibrated": {"reorder": "query_likelihood"},
}


def make_case(rnd, k, gold_pos, with_answer=False):
    """K documents (gold at 1-based gold_pos) and the question about the gold one (and, with
    with_answer, the gold answer)."""
    tmpl_doc, tmpl_q, tmpl_a = rnd.choice(TEMPLATES)
    docs, gold_q, gold_a = [], None, None
    for i in range(k):
        f = dict(thing=rnd.choice(THINGS), place=name(rnd, 3), person=f"{name(rnd)} {name(rnd)}",
                 other=name(rnd, 3), year=rnd.randint(1100, 1900))
        docs.append(tmpl_doc.format(**f))
        if i == gold_pos - 1:
            gold_q = tmpl_q.format(**f)
            gold_a = tmpl_a.format(**f)
    return (docs, gold_q, gold_a) if with_answer else (docs, gold_q)


def run_answer(a, url, headers, model):
    """Accuracy by gold position for each /answer mode; returns {(mode, k): [(pos, acc)]}."""
    curves = {}
    for k in a.k:
        positions = a.positions or sorted({1, (k + 1) // 2, k})
        rnd = random.Random(a.seed * 1000 + k)
        cases = {p: [make_case(rnd, k, p, True) for _ in range(a.questions)] for p in positions}
        print(f"\nK = {k}: answer accuracy by gold position ({model})")
        print(f"{'mode':<20}" + "".join(f"{'pos ' + str(p):>10}" for p in positions))
        for mode, extra in ANSWER_MODES.items():
            cells = []
            for p in positions:
                ok = 0
                for docs, q, gold in cases[p]:
                    body = {"query": q, "documents": docs, "max_tokens": a.max_tokens,
                            "stop": ["\n"], **extra}
                    r = requests.post(url + "/answer", headers=headers, timeout=3600, json=body)
                    if r.status_code != 200:
                        sys.exit(f"/answer ({mode}) -> {r.status_code}: {r.text[:300]}")
                    got = r.json()["answer"]
                    ok += gold.lower() in got.lower()
                    if a.verbose:
                        print(f"  [{mode} K={k} pos={p}] gold {gold!r}: {got!r}", flush=True)
                cells.append(ok / len(cases[p]))
            curves[(mode, k)] = list(zip(positions, cells))
            print(f"{mode:<20}" + "".join(f"{c:>10.2f}" for c in cells), flush=True)
    if a.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for (mode, k), pts in curves.items():
            ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=f"{mode}, K={k}")
        ax.set_xlabel("gold document position (1-based)")
        ax.set_ylabel("answer accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"/answer by gold position: {model}, {a.questions} questions per point")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"plot: {a.plot}")
    return curves


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--url")
    ap.add_argument("--key")
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--k", type=int, nargs="+", default=[10, 20])
    ap.add_argument("--positions", type=int, nargs="+",
                    help="1-based gold positions (default: first, middle, last)")
    ap.add_argument("--questions", type=int, default=5, help="questions per (K, position)")
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--answer", action="store_true", help="score /answer instead of /rerank")
    ap.add_argument("--max-tokens", type=int, default=16, help="--answer: tokens per answer")
    ap.add_argument("--plot", help="--answer: write accuracy by position to this PNG")
    ap.add_argument("--verbose", action="store_true", help="--answer: print every answer")
    a = ap.parse_args()
    if not a.model and not a.url:
        ap.error("give --model or --url")
    proc, url = (start_daemon(a.model, a.build) if a.model else (None, a.url))
    headers = {"Authorization": f"Bearer {a.key}"} if a.key else {}
    try:
        model = requests.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        print(f"model {model}, {a.questions} questions per cell, seed {a.seed}")
        if a.answer:
            run_answer(a, url, headers, model)
            return
        for k in a.k:
            positions = a.positions or sorted({1, (k + 1) // 2, k})
            rnd = random.Random(a.seed * 1000 + k)
            cases = {p: [make_case(rnd, k, p) for _ in range(a.questions)] for p in positions}
            print(f"\nK = {k}: Recall@1 / Recall@3 by gold position")
            print(f"{'method':<18}" + "".join(f"{'pos ' + str(p):>14}" for p in positions))
            for m in a.methods:
                cells = []
                for p in positions:
                    r1 = r3 = 0
                    for docs, q in cases[p]:
                        r = requests.post(url + "/rerank", headers=headers, timeout=3600,
                                          json={"query": q, "documents": docs, "method": m})
                        if r.status_code != 200:
                            sys.exit(f"/rerank ({m}) -> {r.status_code}: {r.text[:300]}")
                        order = [x["index"] for x in r.json()["results"]]
                        r1 += order[0] == p - 1
                        r3 += (p - 1) in order[:3]
                    n = len(cases[p])
                    cells.append(f"{r1 / n:.2f} / {r3 / n:.2f}")
                print(f"{m:<18}" + "".join(f"{c:>14}" for c in cells), flush=True)
    finally:
        if proc:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
