#!/usr/bin/env python3
"""/rerank latency and throughput, and the cost of calibration as ratios measured in one run:

  calibrated / attention            what calibration (the default: one null-query pass) costs
                                    over one plain pass
  paper / paper-no-reuse            what KV prefix reuse saves for the paper's K dummy passes
                                    (prefix_reuse: false recomputes every reference prompt)

Documents are synthetic, about --doc-words words each (roughly 100 tokens at the default).

  tests/bench_rerank.py --model MODEL.gguf [--k 10 20] [--repeat 3]   starts its own fitmd
  tests/bench_rerank.py --url http://127.0.0.1:8080 [--key KEY] ...   uses a running one

Requests are sequential (the engine runs one at a time), so throughput = 1 / mean latency;
--concurrency N also measures N clients at once (requests/s over the batch)."""
import argparse
import concurrent.futures as cf
import os
import pathlib
import random
import signal
import statistics
import sys
import time

import requests

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "quality"))
from quality import start_daemon  # noqa: E402  (the quality tool's: one daemon starter)

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB = ("river stone market winter lantern copper harbor meadow signal orchard ledger falcon "
         "quarry violet engine summit basket thunder garden pillar canyon velvet anchor "
         "compass ember glacier island jacket kettle ladder marble needle ocean pepper quartz "
         "saddle timber umbrella valley whistle yarrow zephyr").split()


def make_docs(k, words, seed):
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(VOCAB) for _ in range(words)) + "." for _ in range(k)]


def one(url, headers, body):
    t = time.perf_counter()
    r = requests.post(url + "/rerank", json=body, headers=headers, timeout=3600)
    dt = time.perf_counter() - t
    if r.status_code != 200:
        sys.exit(f"/rerank -> {r.status_code}: {r.text[:300]}")
    return dt, r.json()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--url")
    ap.add_argument("--key")
    ap.add_argument("--build", default=os.environ.get("FITM_BUILD_DIR", str(ROOT / "build")))
    ap.add_argument("--k", type=int, nargs="+", default=[10, 20])
    ap.add_argument("--doc-words", type=int, default=75)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=0)
    a = ap.parse_args()
    if not a.model and not a.url:
        ap.error("give --model or --url")
    proc = None
    url = a.url
    if a.model:
        proc, url = start_daemon(a.model, a.build, [])
    headers = {"Authorization": f"Bearer {a.key}"} if a.key else {}
    try:
        model = requests.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        print(f"model {model}, {a.repeat} sequential requests per row\n")
        print(f"{'K':>3} {'variant':<22} {'T':>6} {'fwd tok':>8} {'mean s':>8} {'p50 s':>8} "
              f"{'req/s':>7} {'fwd tok/s':>9}")
        for k in a.k:
            docs = make_docs(k, a.doc_words, seed=k)
            base = {"query": "Which document mentions the copper lantern by the harbor?",
                    "documents": docs}
            variants = [("attention (1 pass)", {"method": "attention"}),
                        ("calibrated", {}),
                        ("paper", {"method": "paper"}),
                        ("paper, no reuse", {"method": "paper", "prefix_reuse": False})]
            one(url, headers, {**base, "method": "attention"})  # warm-up
            mean = {}
            for name, extra in variants:
                times, j = [], None
                for _ in range(a.repeat):
                    dt, j = one(url, headers, {**base, **extra})
                    times.append(dt)
                m = statistics.mean(times)
                mean[name] = m
                u = j["usage"]
                print(f"{k:>3} {name:<22} {u['prompt_tokens']:>6} {u['forward_tokens']:>8} "
                      f"{m:>8.3f} {statistics.median(times):>8.3f} {1 / m:>7.3f} "
                      f"{u['forward_tokens'] / m:>9.0f}")
            if a.concurrency:
                t = time.perf_counter()
                with cf.ThreadPoolExecutor(a.concurrency) as ex:
                    list(ex.map(lambda _: one(url, headers, base), range(a.concurrency)))
                dt = time.perf_counter() - t
                print(f"{k:>3} {'calibrated x' + str(a.concurrency) + ' concurrent':<22} "
                      f"{'':>6} {'':>8} {dt:>8.3f} {'':>8} {a.concurrency / dt:>7.3f}")
            print(f"    ratios at K={k}: calibrated / attention = "
                  f"{mean['calibrated'] / mean['attention (1 pass)']:.2f}x, "
                  f"paper no-reuse / paper = "
                  f"{mean['paper, no reuse'] / mean['paper']:.2f}x\n")
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
