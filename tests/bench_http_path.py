#!/usr/bin/env python3
"""What the HTTP path costs per request, apart from inference: requests per second of GET
/health and of a one-document /rerank on kept-alive connections and on a new connection per
request (Connection: close), for fitmd and, given --baseline, another fitmd binary (e.g. a
build of an earlier commit) on the same model, same run. Prints the figures and each one's
ratio to the baseline's; asserts nothing about speed.

  tests/bench_http_path.py --model MODEL.gguf [--fitmd build/src/fitmd]
      [--baseline OTHER/fitmd] [--clients 4] [--seconds 5]

Each client is a thread with a raw socket (no HTTP library in the measured loop)."""
import argparse
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary, model):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    proc = subprocess.Popen([binary, f"--model={model}", "--host=127.0.0.1", f"--port={port}",
                             "--log_level=warn"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if s.recv(100).startswith(b"HTTP/1.1 200"):
                    return proc, port
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"{binary} did not become healthy")


def read_one(s, buf):
    """Reads one Content-Length framed response from s; returns the bytes left over."""
    while b"\r\n\r\n" not in buf:
        b = s.recv(65536)
        if not b:
            raise ConnectionError("closed")
        buf += b
    head, _, rest = buf.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head[:100])
    n = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
    while len(rest) < n:
        b = s.recv(65536)
        if not b:
            raise ConnectionError("closed")
        rest += b
    return rest[n:]


def client(port, request, keep_alive, until, counts, i):
    n = 0
    s = None
    buf = b""
    while time.time() < until:
        if s is None:
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(request)
        buf = read_one(s, buf)
        n += 1
        if not keep_alive:
            s.close()
            s, buf = None, b""
    if s:
        s.close()
    counts[i] = n


def rate(port, request, keep_alive, clients, seconds):
    counts = [0] * clients
    until = time.time() + seconds
    t0 = time.time()
    ts = [threading.Thread(target=client, args=(port, request, keep_alive, until, counts, i))
          for i in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts) / (time.time() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--fitmd", default=str(ROOT / "build" / "src" / "fitmd"))
    ap.add_argument("--baseline")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5)
    a = ap.parse_args()
    body = json.dumps({"query": "q", "documents": ["a short document"]}).encode()
    rerank = (b"POST /rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    cases = [("GET /health, keep-alive", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", True),
             ("GET /health, new connection each", b"GET /health HTTP/1.1\r\nHost: x\r\n"
              b"Connection: close\r\n\r\n", False),
             ("POST /rerank K=1, keep-alive", rerank, True),
             ("POST /rerank K=1, new connection each",
              rerank.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n"), False)]
    binaries = [("fitmd", a.fitmd)] + ([("baseline", a.baseline)] if a.baseline else [])
    results = {}
    for name, binary in binaries:
        proc, port = start(binary, a.model)
        try:
            for label, req, ka in cases:
                results[(name, label)] = rate(port, req, ka, a.clients, a.seconds)
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"{a.clients} clients, {a.seconds:.0f} s per row; requests/s")
    print(f"{'case':42s} {'fitmd':>10s}" + (f" {'baseline':>10s} {'ratio':>7s}" if a.baseline
                                            else ""))
    for label, _, _ in cases:
        line = f"{label:42s} {results[('fitmd', label)]:10.1f}"
        if a.baseline:
            b = results[("baseline", label)]
            line += f" {b:10.1f} {results[('fitmd', label)] / b:7.3f}"
        print(line)
    ka, close = results[("fitmd", cases[0][0])], results[("fitmd", cases[1][0])]
    print(f"fitmd: a new connection per /health costs {ka / close:.2f}x keep-alive's time")


if __name__ == "__main__":
    main()
