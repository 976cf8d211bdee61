#!/usr/bin/env python3
"""A body flooded with JSON keys against the rest of the service: one POST /rerank whose body
holds --keys unknown keys (200,000 by default: 2.2 MB, under max_body_bytes) while a small
/rerank is sent again and again beside it. Prints how long the flood took to be answered (and
with what status), and the small request's latency alone and while the flood was in flight
(median and max), for fitmd and, given --baseline, another fitmd binary (e.g. a build of an
earlier commit) on the same model, same run. Asserts nothing about speed.

  tests/bench_json_flood.py --model MODEL.gguf [--fitmd build/src/fitmd]
      [--baseline OTHER/fitmd] [--keys 200000]"""
import argparse
import http.client
import json
import pathlib
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from bench_http_path import start  # noqa: E402  (a fitmd on a free port, once healthy)
SMALL = json.dumps({"query": "what is golf", "documents": ["golf is a sport", "a fox"]})


def get(port, method, path, body=None, timeout=300):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status, r
    finally:
        c.close()


def small_latency(port, timeout=300):
    """Seconds the small /rerank took; None when it got no answer within timeout."""
    t = time.perf_counter()
    try:
        st, _ = get(port, "POST", "/rerank", SMALL, timeout=timeout)
    except TimeoutError:
        return None
    assert st == 200, st
    return time.perf_counter() - t


def run(binary, model, keys, timeout):
    proc, port = start(binary, model)
    try:
        for _ in range(3):  # warm-up
            small_latency(port)
        alone = [small_latency(port) for _ in range(20)]
        body = ("{" + ",".join(f'"k{i}":1' for i in range(keys))
                + ',"query":"q","documents":["a"]}').encode()
        got = {}

        def flood():
            t = time.perf_counter()
            try:
                got["status"] = get(port, "POST", "/rerank", body, timeout=timeout)[0]
            except TimeoutError:
                got["status"] = None
            got["s"] = time.perf_counter() - t

        th = threading.Thread(target=flood)
        th.start()
        during = []
        while th.is_alive() or len(during) < 5:
            during.append(small_latency(port, timeout))
        th.join()
        return {"bytes": len(body), "flood_status": got["status"], "flood_s": got["s"],
                "alone": alone, "during": during}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            print(f"{binary} did not stop within 60 s of SIGTERM: killed", file=sys.stderr)
            proc.kill()
            proc.wait()


def show(name, r, timeout):
    a, d = r["alone"], [x for x in r["during"] if x is not None]
    lost = len(r["during"]) - len(d)
    flood = (f"answered {r['flood_status']} in {r['flood_s']:.3f} s" if r["flood_status"]
             else f"not answered within {timeout:.0f} s")
    beside = (f"median {statistics.median(d) * 1e3:.1f} ms (max {max(d) * 1e3:.1f}, "
              f"{len(d)} requests)" if d else "none answered")
    print(f"{name}: {r['bytes'] / 1e6:.1f} MB flood {flood}; small /rerank alone median "
          f"{statistics.median(a) * 1e3:.1f} ms (max {max(a) * 1e3:.1f}), beside the flood "
          f"{beside}{f', {lost} not answered within {timeout:.0f} s' if lost else ''}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--fitmd", default=str(ROOT / "build" / "src" / "fitmd"))
    ap.add_argument("--baseline")
    ap.add_argument("--keys", type=int, default=200000)
    ap.add_argument("--timeout", type=float, default=120,
                    help="seconds any one request may take before it counts as not answered")
    a = ap.parse_args()
    this = run(a.fitmd, a.model, a.keys, a.timeout)
    show("this", this, a.timeout)
    sys.stdout.flush()
    if a.baseline:
        base = run(a.baseline, a.model, a.keys, a.timeout)
        show("baseline", base, a.timeout)
        print(f"flood time ratio this/baseline {this['flood_s'] / base['flood_s']:.4f}"
              f"{' (the baseline at its timeout: at most this)' if not base['flood_status'] else ''}")


if __name__ == "__main__":
    main()
