#!/usr/bin/env python3
"""Attention captures for scoring research and profile fitting, computed with the numpy oracle
(tests/oracle/model.py, float32) on prompts tokenized by fitmd itself (/rerank with
`return_tokens`, so ids and document spans are exactly the server's).

For one dataset item (tests/quality/dataset.py) and one window size W (0 = all documents in
one prompt), every prompt of the item is captured in one oracle pass, and one more pass per
reference:

  main        the prompt (documents of the group, the query in both places)
  null_suffix the same prompt with only the trailing query replaced by "N/A"; it continues the
              main pass's KV cache from the end of the documents (only the suffix is computed)
  null_query  the prompt built for the query "N/A" (both places), a full pass

For each pass, the attention probabilities of every layer and head are kept for three row
groups, averaged over the group's rows: `last` (the last prompt token), `question` (the
trailing query's tokens: the tokens where the main and null_suffix prompts differ) and
`suffix` (every token after the last document), as float16 arrays rows (3, L, H, T) over all
T keys, with the document spans. Stored per item as one .npz in a cache folder, so analysis
(tools/fit_profile.py) never recomputes a pass.

    python3 tools/scoring_capture.py --model M.gguf --split dev --cache DIR [--limit N]
        [--variants plain hard] [--k 10 20] [--windows 0 5] [--groups 0-19]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys
import time

import numpy as np
import requests

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "quality"))
from oracle.model import Model, KVCache  # noqa: E402
import dataset  # noqa: E402
from bench_rerank import start_daemon  # noqa: E402

ROW_GROUPS = ("last", "question", "suffix")
NULL = "N/A"


def tokenize(url: str, query: str, docs: list) -> tuple:
    """(ids, spans) of fitmd's rerank prompt for this query and documents."""
    r = requests.post(url + "/rerank", timeout=600, json={
        "query": query, "documents": docs, "method": "attention", "return_tokens": True})
    if r.status_code != 200:
        sys.exit(f"/rerank -> {r.status_code}: {r.text[:300]}")
    t = r.json()["tokens"]
    return [int(i) for i in t["prompt"]], [tuple(s) for s in t["spans"]]


def question_span(ids: list, null_ids: list, start: int) -> tuple:
    """[s, e) of the tokens of ids after `start` that differ from null_ids (same prefix up to
    start): the trailing query's tokens."""
    a, b = ids[start:], null_ids[start:]
    p = 0
    while p < min(len(a), len(b)) and a[p] == b[p]:
        p += 1
    s = 0
    while s < min(len(a), len(b)) - p and a[-1 - s] == b[-1 - s]:
        s += 1
    return start + p, len(ids) - s


def row_groups(model: Model, T: int, rows: list, qspan: tuple, doc_end: int) -> np.ndarray:
    """(3, L, H, T) float16 from model.attn captured for `rows` (absolute positions)."""
    A = np.stack([a for a in model.attn])  # (L, H, R, T)
    rows = np.asarray(rows)
    out = np.empty((3,) + A.shape[:2] + (T,), dtype=np.float32)
    out[0] = A[:, :, rows == T - 1, :].mean(axis=2)
    out[1] = A[:, :, (rows >= qspan[0]) & (rows < qspan[1]), :].mean(axis=2)
    out[2] = A[:, :, rows >= doc_end, :].mean(axis=2)
    return out.astype(np.float16)


def capture_prompt(model: Model, url: str, query: str, docs: list,
                   null_query: bool = True) -> dict:
    """Main, null_suffix and null_query passes of one prompt (see the module doc)."""
    ids, spans = tokenize(url, query, docs)
    nq_ids, nq_spans = tokenize(url, NULL, docs)
    doc_end = max(e for _, e in spans)
    # null_suffix: the main prompt up to the documents' end, then the N/A prompt's suffix.
    nq_end = max(e for _, e in nq_spans)
    ns_ids = ids[:doc_end] + nq_ids[nq_end:]
    qs = question_span(ids, ns_ids, doc_end)
    ns_qs = question_span(ns_ids, ids, doc_end)
    out = {"ids": np.array(ids), "spans": np.array(spans), "qspan": np.array(qs)}

    cache = model.new_cache()
    model.forward(ids[:doc_end], cache=cache, logits_rows=[doc_end - 1])
    for name, seq, qsp in (("main", ids, qs), ("null_suffix", ns_ids, ns_qs)):
        c = KVCache(model.hp.n_layer)
        c.k, c.v, c.n = list(cache.k), list(cache.v), cache.n
        rows = list(range(doc_end, len(seq)))
        model.forward(seq[doc_end:], cache=c, capture_rows=rows, logits_rows=[len(seq) - 1])
        out[name] = row_groups(model, len(seq), rows, qsp, doc_end)
    out["nq_spans"] = np.array(nq_spans)
    if not null_query:
        return out
    # null_query: the N/A prompt, its own spans; its question rows are the N/A span (the
    # tokens of its suffix that differ from the main prompt's suffix).
    nq_qs = question_span(nq_ids, nq_ids[:nq_end] + ids[doc_end:], nq_end)
    rows = list(range(nq_end, len(nq_ids)))
    model.forward(nq_ids, capture_rows=rows, logits_rows=[len(nq_ids) - 1])
    out["null_query"] = row_groups(model, len(nq_ids), rows, nq_qs, nq_end)
    return out


def windows(k: int, w: int) -> list:
    """Consecutive groups of near-equal size (sizes differ by at most 1), ceil(k / w) of them;
    w = 0: one group."""
    if w <= 0 or w >= k:
        return [list(range(k))]
    n = -(-k // w)
    base, extra = divmod(k, n)
    out, s = [], 0
    for g in range(n):
        size = base + (g < extra)
        out.append(list(range(s, s + size)))
        s += size
    return out


def capture_item(model: Model, url: str, item: dict, w: int, null_query: bool = True) -> dict:
    """Every group prompt of the item under window size w; keys prefixed g<i>_."""
    out = {}
    groups = windows(item["k"], w)
    out["groups"] = np.array([len(g) for g in groups])
    for gi, g in enumerate(groups):
        docs = [item["documents"][i] for i in g]
        for key, v in capture_prompt(model, url, item["query"], docs, null_query).items():
            out[f"g{gi}_{key}"] = v
    return out


def load_model(path: str) -> Model:
    m = Model.load(path, dtype=np.float32)
    m.head = lambda x: np.zeros((x.shape[0], 1), np.float32)  # logits are never read here
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--split", default="dev")
    ap.add_argument("--cache", required=True)
    ap.add_argument("--variants", nargs="+", default=["plain", "hard"])
    ap.add_argument("--k", type=int, nargs="+", default=[10, 20])
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 5])
    ap.add_argument("--groups", default="0-19", help="question groups, e.g. 0-19")
    ap.add_argument("--positions", type=int, nargs="+", help="gold positions (default all)")
    ap.add_argument("--no-null-query", action="store_true",
                    help="skip the null_query pass (evaluating a recipe that does not use it)")
    a = ap.parse_args()
    g0, g1 = (int(x) for x in a.groups.split("-"))
    cache = pathlib.Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    items = [it for it in dataset.load(a.split)
             if it["variant"] in a.variants and it["k"] in a.k
             and g0 <= dataset.group(it) <= g1
             and (not a.positions or it["gold_pos"] in a.positions)]
    # Breadth first: every cell gets its first groups before any gets more.
    items.sort(key=lambda it: (dataset.group(it), a.k.index(it["k"]),
                               a.variants.index(it["variant"]), it["gold_pos"]))
    model = load_model(a.model)
    # SIGTERM ends the run through `finally`, so the fitmd it started goes with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    proc, url = start_daemon(a.model, a.build, [])
    try:
        for it in items:
            for w in a.windows:
                if w and w >= it["k"]:
                    continue
                path = cache / f"{it['id']}-w{w}.npz"
                if path.exists():
                    continue
                t = time.time()
                np.savez_compressed(path, **capture_item(model, url, it, w, not a.no_null_query))
                print(f"{path.name}: {time.time() - t:.1f} s", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
