"""Soak: FITM_SOAK_S seconds of mixed load against one fitmd (normal and streamed requests,
clients that leave mid-request, bodies and heads that trickle), then SIGTERM. Reports lost responses
(a request sent before the SIGTERM that got no HTTP answer), duplicated ones (a request id
answered twice in the log) and RSS drift; the first two must be 0.

Not in the default run: `FITM_SOAK_S=300 python3 -m pytest -q -s tests/test_resilience_soak.py`."""
import concurrent.futures as cf
import json
import os
import random
import re
import signal
import socket
import threading
import time

import pytest
import requests

from test_http import AUTH, KEY, Daemon, docs, fitmd_bin, models  # noqa: F401 (fixtures)

SOAK_S = float(os.environ.get("FITM_SOAK_S", "0"))


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def connect(d):
    """A connection to d; None once it stopped listening (a client scheduled after the
    SIGTERM: the pool runs its queued clients late)."""
    try:
        return socket.create_connection(("127.0.0.1", d.port), timeout=10)
    except ConnectionRefusedError:
        return None


def leave_mid_request(d, rid):
    body = json.dumps({"query": "golf", "documents": docs(6, 40)}).encode()
    s = connect(d)
    if s is None:
        return
    with s:
        s.sendall(b"POST /rerank HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nX-Request-Id: " + rid.encode()
                  + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(random.uniform(0, 0.3))


def trickle(d, rid):
    body = b'{"query":"q","documents":["a"]}'
    s = connect(d)
    if s is None:
        return
    with s:
        s.sendall(b"POST /rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-Request-Id: " + rid.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body))
        try:
            for c in body:
                s.sendall(bytes([c]))
                time.sleep(0.3)
        except OSError:
            pass  # cut with 408: what should happen


def slow_head(d, rid):
    """Trickles its request head: the gate cuts it at http_header_timeout_s."""
    head = (b"POST /rerank HTTP/1.1\r\nHost: x\r\nX-Request-Id: " + rid.encode()
            + b"\r\nContent-Type: application/json\r\n\r\n")
    s = connect(d)
    if s is None:
        return
    with s:
        try:
            for c in head:
                s.sendall(bytes([c]))
                time.sleep(0.1)
        except OSError:
            pass  # cut with 408: what should happen


@pytest.mark.skipif(SOAK_S <= 0, reason="soak: set FITM_SOAK_S (seconds) to run it")
def test_soak(fitmd_bin, models, tmp_path):  # noqa: F811
    d = Daemon(fitmd_bin, models["small"], tmp_path, api_keys=KEY, http_receive_timeout_s=2,
               http_header_timeout_s=2,
               queue_depth=32, http_threads=8, drain_timeout_ms=60000)
    rng = random.Random(11)
    outcome, lock = {}, threading.Lock()
    sigterm_at = [None]

    def normal(i):
        rid = f"soak-{i}"
        t = time.time()
        try:
            if i % 3 == 0:
                with requests.post(d.url("/answer"), json={"query": "golf", "documents": docs(3, 8),
                                   "max_tokens": 8, "stream": True}, headers={**AUTH,
                                   "X-Request-Id": rid}, stream=True, timeout=120) as r:
                    body = r.content
                    got = r.status_code if r.status_code != 200 or b"[DONE]" in body else -1
            else:
                r = requests.post(d.url("/rerank"), json={"query": "golf", "documents": docs(4, 10)},
                                  headers={**AUTH, "X-Request-Id": rid}, timeout=120)
                got = r.status_code
        except requests.RequestException:
            got = None
        with lock:
            outcome[rid] = (t, got)

    for _ in range(5):  # warm up before the first RSS reading
        requests.post(d.url("/rerank"), json={"query": "golf", "documents": docs(4, 10)},
                      headers=AUTH, timeout=120)
    rss0 = rss_kib(d.proc.pid)
    end = time.time() + SOAK_S
    with cf.ThreadPoolExecutor(16) as ex:
        futs, i = [], 0
        while time.time() < end:
            k = rng.random()
            if k < 0.7:
                futs.append(ex.submit(normal, i))
            elif k < 0.9:
                futs.append(ex.submit(leave_mid_request, d, f"gone-{i}"))
            elif k < 0.95:
                futs.append(ex.submit(trickle, d, f"slow-{i}"))
            else:
                futs.append(ex.submit(slow_head, d, f"head-{i}"))
            i += 1
            time.sleep(rng.uniform(0, 0.05))
            futs = [f for f in futs if not f.done()]
        rss1 = rss_kib(d.proc.pid)
        sigterm_at[0] = time.time()
        d.proc.send_signal(signal.SIGTERM)
        for f in futs:
            f.result()
    assert d.proc.wait(120) == 0
    d.log.close()
    sent_before = {rid: got for rid, (t, got) in outcome.items() if t < sigterm_at[0] - 0.5}
    lost = [rid for rid, got in sent_before.items() if got in (None, -1)]
    ids = re.findall(r"req=(\S+) msg=\"\w+ \S+ -> \d+", d.log_text())
    dup = sorted({x for x in ids if ids.count(x) > 1 and x.startswith(("soak-", "gone-"))})
    codes = {}
    for got in sent_before.values():
        codes[got] = codes.get(got, 0) + 1
    print(f"\nsoak {SOAK_S:.0f} s: {len(outcome)} requests {codes}, lost {len(lost)}, "
          f"duplicated {len(dup)}, RSS {rss0} -> {rss1} KiB ({(rss1 - rss0) / rss0:+.1%})")
    assert not lost, lost[:10]
    assert not dup, dup[:10]
