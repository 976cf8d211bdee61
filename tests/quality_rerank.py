#!/usr/bin/env python3
"""Rerank quality by gold position: synthetic multi-document QA about fictional entities (so
the answer can only come from the documents), K documents with the one gold document at a
chosen position, scored by /rerank with each method. Prints Recall@1 and Recall@3 per method
and gold position.

  tests/quality_rerank.py --model MODEL.gguf --k 10 20 [--questions 5] [--positions 1 5 10]
  tests/quality_rerank.py --url http://127.0.0.1:8080 [--key KEY] ...

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


def make_case(rnd, k, gold_pos):
    """K documents (gold at 1-based gold_pos) and the question about the gold one."""
    tmpl_doc, tmpl_q, _ = rnd.choice(TEMPLATES)
    docs, gold_q = [], None
    for i in range(k):
        f = dict(thing=rnd.choice(THINGS), place=name(rnd, 3), person=f"{name(rnd)} {name(rnd)}",
                 other=name(rnd, 3), year=rnd.randint(1100, 1900))
        docs.append(tmpl_doc.format(**f))
        if i == gold_pos - 1:
            gold_q = tmpl_q.format(**f)
    return docs, gold_q


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
    a = ap.parse_args()
    if not a.model and not a.url:
        ap.error("give --model or --url")
    proc, url = (start_daemon(a.model, a.build) if a.model else (None, a.url))
    headers = {"Authorization": f"Bearer {a.key}"} if a.key else {}
    try:
        model = requests.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        print(f"model {model}, {a.questions} questions per cell, seed {a.seed}")
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
