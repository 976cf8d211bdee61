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
--concurrency N also measures N clients at once (requests/s over the batch).

  tests/bench_rerank.py --model MODEL.gguf --baseline OTHER_BUILD [--k 20] [--repeat 5]

compares this build's scored methods (the default, fused, and its query_likelihood part, and
relevance) with another build's, side by side: two daemons on the same model, their requests
interleaved so both see the same load; mean latency of each and the ratio, the CPU seconds
each daemon spent per request (steadier than latency on a shared machine), and the bytes of
logits the scored rows send from the backend to the host: a whole row of V floats each where
the rows leave the backend, n_pick doubles each where their log-probabilities are computed
there (query_likelihood's rows: K times its question's tokens; relevance: K rows of the
answer ids; fused: query_likelihood's).

  tests/bench_rerank.py --model MODEL.gguf --lanes 1 4 8 [--logit-rows 256] [--k 20]

compares daemons of this build that differ only in rerank_lanes (and logit_rows when given)
the same way, side by side and interleaved, also counting each request's engine steps
(batched forward calls, from /metrics) and its forward tokens; the first side is the
reference the others' scores are checked against."""
import argparse
import concurrent.futures as cf
import os
import pathlib
import random
import re
import signal
import statistics
import subprocess
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


RESTRICT = " We can get the answer to this question in the given documents."
ANSWERS = ((" Yes", "Yes", " yes", "yes"), (" No", "No", " no", "no"))  # relevance's picks


def cpu_seconds(proc):
    """User + system CPU time the process has used so far (Linux /proc): on a shared machine a
    request's CPU seconds move far less with the load than its wall time."""
    fields = pathlib.Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vocab_size(build, model):
    out = subprocess.run([str(pathlib.Path(build) / "src" / "fitm"), "inspect", model],
                         capture_output=True, text=True, check=True).stdout
    return int(re.search(r"vocab=(\d+)", out).group(1))


def scored_rows(url, headers, query, k, method):
    """(rows, picks per row) of one /rerank's scored logit rows."""
    def ids(text):
        r = requests.post(url + "/tokenize", json={"content": text, "add_special": False},
                          headers=headers)
        return r.json()["tokens"]

    if method == "relevance":  # the first token of each spelling, deduplicated per answer
        return k, sum(len({ids(w)[0] for w in words}) for words in ANSWERS)
    return k * len(ids(" " + query + RESTRICT)), 1


def steps(url):
    """The engine's batched forward steps so far (/metrics fitm_batch_steps_total)."""
    m = re.search(r"^fitm_batch_steps_total (\d+)", requests.get(url + "/metrics").text, re.M)
    return int(m.group(1))


def compare(a, headers, sides):
    """Daemons side by side on one model, sides = [(label, build, extra fitmd args)]: the
    first is the reference (ratios and scores against it)."""
    procs, urls = [], []
    try:
        for _, build, extra in sides:
            p, u = start_daemon(a.model, build, extra)
            procs.append(p)
            urls.append(u)
        V = vocab_size(a.build, a.model)
        what = " against ".join(f"{n} ({b} {' '.join(x)})" for n, b, x in sides)
        print(f"{what}, {a.repeat} requests each, interleaved; V = {V}\n")
        print(f"{'K':>3} {'method':<17} {'side':<14} {'mean s':>8} {'ref/this':>8} "
              f"{'cpu s':>7} {'steps':>6} {'fwd tok':>8} {'rows':>5} {'bytes before':>13} "
              f"{'bytes now':>10}")
        n = len(sides)
        for k in a.k:
            docs = make_docs(k, a.doc_words, seed=k)
            base = {"query": "Which document mentions the copper lantern by the harbor?",
                    "documents": docs}
            for name, extra in (("fused (default)", {}),
                                ("query_likelihood", {"method": "query_likelihood"}),
                                ("relevance", {"method": "relevance"})):
                body = {**base, **extra}
                for u in urls:
                    one(u, headers, body)  # warm-up
                times, cpu, nsteps = [[] for _ in range(n)], [[] for _ in range(n)], [0] * n
                scores, fwd = [None] * n, [0] * n
                for r in range(a.repeat):  # each side first in turn, round by round
                    for i in [(r + j) % n for j in range(n)]:
                        c0, s0 = cpu_seconds(procs[i]), steps(urls[i])
                        dt, j = one(urls[i], headers, body)
                        cpu[i].append(cpu_seconds(procs[i]) - c0)
                        nsteps[i] = steps(urls[i]) - s0  # the same every time
                        times[i].append(dt)
                        scores[i] = [(d["index"], d["relevance_score"]) for d in j["results"]]
                        fwd[i] = j["usage"]["forward_tokens"]
                m = [statistics.mean(t) for t in times]
                mc = [statistics.mean(c) for c in cpu]
                rows, picks = scored_rows(urls[0], headers, base["query"], k, extra.get("method"))
                for i in range(n):
                    same = "" if i == 0 else \
                        "same scores" if scores[i] == scores[0] else "SCORES DIFFER"
                    print(f"{k:>3} {name:<17} {sides[i][0]:<14} {m[i]:>8.3f} {m[0] / m[i]:>7.2f}x "
                          f"{mc[i]:>7.2f} {nsteps[i]:>6} {fwd[i]:>8} {rows:>5} "
                          f"{rows * V * 4:>13} {rows * picks * 8:>10}  {same}")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(60)


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
    ap.add_argument("--baseline", help="another build directory to compare the scored methods "
                    "with, side by side (needs --model)")
    ap.add_argument("--lanes", type=int, nargs="+", help="daemons of this build with these "
                    "rerank_lanes, side by side (needs --model)")
    ap.add_argument("--logit-rows", type=int, default=0,
                    help="with --lanes: every daemon's logit_rows (0: by the backend)")
    a = ap.parse_args()
    if not a.model and not a.url:
        ap.error("give --model or --url")
    headers = {"Authorization": f"Bearer {a.key}"} if a.key else {}
    if a.baseline or a.lanes:
        if not a.model:
            ap.error("--baseline and --lanes need --model")
        rows = [f"--logit_rows={a.logit_rows}"] if a.logit_rows else []
        sides = [("this", a.build, []), ("base", a.baseline, [])] if a.baseline else \
            [(f"lanes {n}", a.build, [f"--rerank_lanes={n}"] + rows) for n in a.lanes]
        compare(a, headers, sides)
        return
    proc = None
    url = a.url
    if a.model:
        proc, url = start_daemon(a.model, a.build, [])
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
                        ("calibrated", {"method": "calibrated"}),
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
                    calibrated = {**base, "method": "calibrated"}
                    list(ex.map(lambda _: one(url, headers, calibrated), range(a.concurrency)))
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
