"""`fitm pull` and fitmd's model_url (src/base/download.c) against a local HTTP server with the
faults of real networks: a connection cut mid-file, a server without Range support, a wrong
checksum, a 404, a stalled transfer, the file changing between attempts, a file larger than the
disk, a pull interrupted and resumed by a second process. The file is never under its final
name until it is complete and verified; the SHA-256 is compared with Python's hashlib.

The server (FaultServer) serves one file per path, each with a fault plan, and records every
request's Range and If-Range headers so the tests can check what the client asked for."""
import hashlib
import http.server
import os
import re
import subprocess
import threading
import time

import pytest
import requests

from conftest import build_dir


class FaultServer(http.server.ThreadingHTTPServer):
    """127.0.0.1 on a free port. files: path -> dict(data, etag, plan) where plan holds:
    cut_first: int (the first N responses stop after half the body and close),
    stall_first: int (the first N responses send half the body, then hang),
    no_range: bool (Range ignored: always 200 with the whole file),
    status: int (answer this status with a short body), swap_after: bytes (after the first
    response the file becomes these bytes with a new ETag), fake_length: int (Content-Length
    claimed, no body)."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.files = {}
        self.log = []  # (path, range, if_range)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def url(self, path):
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def requests_for(self, path):
        return [r for r in self.log if r[0] == path]


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        srv = self.server
        f = srv.files.get(self.path)
        rng, if_range = self.headers.get("Range"), self.headers.get("If-Range")
        with srv.lock:
            srv.log.append((self.path, rng, if_range))
            n = len(srv.requests_for(self.path))
        if f is None or f.get("status"):
            code = f["status"] if f else 404
            body = b"no such file\n"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if f.get("fake_length"):
            self.send_response(200)
            self.send_header("Content-Length", str(f["fake_length"]))
            self.send_header("ETag", f["etag"])
            self.end_headers()
            self.wfile.flush()
            srv.stop.wait(30)
            return
        data, etag = f["data"], f["etag"]
        start = 0
        m = re.fullmatch(r"bytes=(\d+)-", rng or "")
        if m and not f.get("no_range") and (if_range is None or if_range == etag):
            start = int(m.group(1))
        body = data[start:]
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", etag)
        if not f.get("no_range"):
            self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if "swap_after" in f and n == 1:  # the next request sees a new file
            f["data"], f["etag"] = f.pop("swap_after"), '"v2"'
        if n <= f.get("cut_first", 0):
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        if n <= f.get("stall_first", 0):
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            srv.stop.wait(30)
            self.close_connection = True
            return
        # in pieces, so progress has something to report
        for i in range(0, len(body), 65536):
            self.wfile.write(body[i:i + 65536])
            if f.get("throttle"):
                time.sleep(f["throttle"])


@pytest.fixture
def server():
    s = FaultServer()
    yield s
    s.stop.set()
    s.shutdown()
    s.server_close()


@pytest.fixture(scope="module")
def fitm():
    p = build_dir() / "src" / "fitm"
    if not p.exists():
        pytest.fail(f"{p} not built")
    return p


def pull(fitm, url, out, *args, timeout=60):
    return subprocess.run([str(fitm), "pull", url, "-o", str(out), "--backoff-ms", "50", *args],
                          capture_output=True, text=True, timeout=timeout)


def serve(server, path, data, **plan):
    server.files[path] = dict(data=data, etag='"v1"', **plan)
    return server.url(path)


def no_partial(out):
    return not out.exists() and not out.with_name(out.name + ".part").exists()


def test_clean_pull_verifies_the_checksum(fitm, server, tmp_path):
    data = os.urandom(300_000)
    out = tmp_path / "m.gguf"
    r = pull(fitm, serve(server, "/m", data), out, "--sha256", hashlib.sha256(data).hexdigest())
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == data
    assert not (tmp_path / "m.gguf.part").exists() and not (tmp_path / "m.gguf.part.meta").exists()
    # not a terminal: progress comes as log lines, the last at 100%
    assert re.search(r"pull: 100% \(.* of .*\) at .*/s", r.stderr), r.stderr


def test_cut_mid_file_resumes_with_range_and_if_range(fitm, server, tmp_path):
    data = os.urandom(400_000)
    out = tmp_path / "m.gguf"
    r = pull(fitm, serve(server, "/m", data, cut_first=2), out, "--sha256",
             hashlib.sha256(data).hexdigest())
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == data
    log = server.requests_for("/m")
    assert len(log) == 3, log
    assert log[0][1] is None
    assert log[1][1] == f"bytes={len(data) // 2}-" and log[1][2] == '"v1"', log
    assert log[2][1] == f"bytes={len(data) // 2 + (len(data) - len(data) // 2) // 2}-", log
    assert "retry 1 of 5" in r.stderr


def test_server_without_range_support_starts_over(fitm, server, tmp_path):
    data = os.urandom(300_000)
    out = tmp_path / "m.gguf"
    r = pull(fitm, serve(server, "/m", data, cut_first=1, no_range=True), out, "--sha256",
             hashlib.sha256(data).hexdigest())
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == data
    assert "starting over" in r.stderr


def test_wrong_checksum_leaves_nothing(fitm, server, tmp_path):
    data = os.urandom(200_000)
    out = tmp_path / "m.gguf"
    wrong = hashlib.sha256(data + b"x").hexdigest()
    r = pull(fitm, serve(server, "/m", data), out, "--sha256", wrong)
    assert r.returncode == 1
    assert "sha256 mismatch" in r.stderr and wrong in r.stderr
    assert hashlib.sha256(data).hexdigest() in r.stderr  # what it got, from our own SHA-256
    assert no_partial(out) and not (tmp_path / "m.gguf.part.meta").exists()


def test_malformed_checksum_is_a_usage_error(fitm, server, tmp_path):
    r = pull(fitm, serve(server, "/m", b"abc"), tmp_path / "m", "--sha256", "abc")
    assert r.returncode == 2 and "64 hexadecimal digits" in r.stderr
    assert server.log == []


def test_404_fails_at_once(fitm, server, tmp_path):
    out = tmp_path / "m.gguf"
    r = pull(fitm, server.url("/missing"), out)
    assert r.returncode == 1
    assert "HTTP 404" in r.stderr and "/missing" in r.stderr
    assert len(server.log) == 1  # not retried: it will not appear
    assert no_partial(out)


def test_server_error_is_retried_then_reported(fitm, server, tmp_path):
    out = tmp_path / "m.gguf"
    r = pull(fitm, serve(server, "/m", b"x", status=503), out, "--retries", "2")
    assert r.returncode == 1 and "HTTP 503" in r.stderr
    assert len(server.log) == 3
    assert no_partial(out)


def test_stalled_transfer_is_aborted_and_resumed(fitm, server, tmp_path):
    data = os.urandom(300_000)
    out = tmp_path / "m.gguf"
    t0 = time.monotonic()
    r = pull(fitm, serve(server, "/m", data, stall_first=1), out, "--stall-timeout", "1",
             "--sha256", hashlib.sha256(data).hexdigest())
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == data
    assert "stalled" in r.stderr
    log = server.requests_for("/m")
    assert len(log) == 2 and log[1][1] == f"bytes={len(data) // 2}-"
    assert time.monotonic() - t0 < 25  # the 30 s hang was cut short, not waited out


def test_stall_every_time_gives_up_and_keeps_the_part_file(fitm, server, tmp_path):
    data = os.urandom(100_000)
    out = tmp_path / "m.gguf"
    r = pull(fitm, serve(server, "/m", data, stall_first=99), out, "--stall-timeout", "1",
             "--retries", "1")
    assert r.returncode == 1 and "stalled" in r.stderr
    assert not out.exists()
    part = tmp_path / "m.gguf.part"
    kept = part.read_bytes()  # kept for the next run to resume: a prefix of the file
    assert len(kept) == len(data) * 3 // 4 and data.startswith(kept)  # half, then half the rest


def test_changed_file_between_attempts_is_not_spliced(fitm, server, tmp_path):
    old, new = os.urandom(300_000), os.urandom(320_000)
    out = tmp_path / "m.gguf"
    r = pull(fitm, serve(server, "/m", old, cut_first=1, swap_after=new), out, "--sha256",
             hashlib.sha256(new).hexdigest())
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == new
    log = server.requests_for("/m")
    assert log[1][1] == f"bytes={len(old) // 2}-" and log[1][2] == '"v1"'  # If-Range: old ETag
    assert "starting over" in r.stderr


def test_second_process_resumes_the_first_ones_part_file(fitm, server, tmp_path):
    data = os.urandom(300_000)
    url = serve(server, "/m", data, cut_first=1)
    out = tmp_path / "m.gguf"
    r = pull(fitm, url, out, "--retries", "0")
    assert r.returncode == 1 and not out.exists()
    assert (tmp_path / "m.gguf.part").stat().st_size == len(data) // 2
    r = pull(fitm, url, out, "--sha256", hashlib.sha256(data).hexdigest())
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == data
    assert server.requests_for("/m")[1][1:] == (f"bytes={len(data) // 2}-", '"v1"')
    # a .part file of unknown origin (no meta naming this URL) is not trusted
    (tmp_path / "n.gguf.part").write_bytes(b"garbage" * 100)
    r = pull(fitm, url, tmp_path / "n.gguf")
    assert r.returncode == 0 and (tmp_path / "n.gguf").read_bytes() == data
    assert server.requests_for("/m")[2][1] is None


def test_secrets_in_the_url_stay_out_of_the_log_and_the_meta_file(fitm, server, tmp_path):
    """A URL's user:password and signed query are secrets (pre-signed S3/GCS links): the log
    lines and errors show the URL without them, and the resume file keeps a digest of it (on
    f93cfae all three held the whole URL); resuming still works."""
    data = os.urandom(200_000)
    url = serve(server, "/m?X-Signature=S3CRETSIG", data, cut_first=1).replace(
        "http://", "http://alice:PASSW0RD@")
    out = tmp_path / "m.gguf"
    r = pull(fitm, url, out, "--retries", "0")
    assert r.returncode == 1, r.stderr
    assert "127.0.0.1" in r.stderr and "***@" in r.stderr and "/m?..." in r.stderr, r.stderr
    meta = (tmp_path / "m.gguf.part.meta").read_text()
    for secret in ("PASSW0RD", "S3CRETSIG", "alice"):
        assert secret not in r.stderr and secret not in meta, (secret, r.stderr, meta)
    r = pull(fitm, url, out, "--sha256", hashlib.sha256(data).hexdigest())
    assert r.returncode == 0 and out.read_bytes() == data, r.stderr
    assert "resuming at byte" in r.stderr and "S3CRETSIG" not in r.stderr, r.stderr
    assert server.requests_for("/m?X-Signature=S3CRETSIG")[-1][1] == f"bytes={len(data) // 2}-"


def test_file_larger_than_the_disk_is_refused_before_writing(fitm, server, tmp_path):
    out = tmp_path / "m.gguf"
    r = pull(fitm, serve(server, "/m", b"", fake_length=1 << 60), out)
    assert r.returncode == 1
    assert "not enough disk space" in r.stderr
    assert len(server.log) == 1  # not retried
    assert no_partial(out)


def test_unknown_scheme_and_bad_flags(fitm, tmp_path):
    r = subprocess.run([str(fitm), "pull", "ftp://x/y", "-o", str(tmp_path / "a")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "ftp://x/y" in r.stderr
    r = subprocess.run([str(fitm), "pull", "http://x/y"], capture_output=True, text=True)
    assert r.returncode == 2 and "-o FILE" in r.stderr
    r = subprocess.run([str(fitm), "pull", "http://x/y", "-o", "z", "--retries", "many"],
                       capture_output=True, text=True)
    assert r.returncode == 2


# ---- fitmd's model_url -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_bytes(fitm, tmp_path_factory):
    p = tmp_path_factory.mktemp("m") / "small.gguf"
    subprocess.run([str(fitm), "mkmodel", "--arch", "llama", "--type", "F32", "--seed", "1", "-q",
                    "-o", str(p)], check=True)
    return p.read_bytes()


def start_fitmd(model, url, sha, logf):
    from test_http import free_port
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    args = [str(build_dir() / "src" / "fitmd"), f"--model={model}", f"--model_url={url}",
            f"--model_sha256={sha}", "--host=127.0.0.1", f"--port={port}"]
    return subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env), port


def test_fitmd_downloads_its_model_reporting_progress_in_health(server, model_bytes, tmp_path):
    # cut once (so the resume path runs in the daemon too), then throttled so /health is seen
    url = serve(server, "/model.gguf", model_bytes, cut_first=1, throttle=0.05)
    model = tmp_path / "model.gguf"
    with open(tmp_path / "log", "w+") as logf:
        proc, port = start_fitmd(model, url, hashlib.sha256(model_bytes).hexdigest(), logf)
        try:
            seen = set()
            deadline = time.time() + 120
            while time.time() < deadline:
                assert proc.poll() is None, (tmp_path / "log").read_text()
                try:
                    h = requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
                except requests.ConnectionError:
                    time.sleep(0.05)
                    continue
                if h.status_code == 200:
                    break
                assert h.json()["status"] == "loading"
                m = re.fullmatch(r"downloading (\d+)%", h.json()["message"])
                if m:
                    seen.add(int(m.group(1)))
                    assert not model.exists()  # never the final name before it is whole
                time.sleep(0.05)
            assert h.status_code == 200, (tmp_path / "log").read_text()
            assert seen and min(seen) < 100, seen
            assert model.read_bytes() == model_bytes
            assert len(server.requests_for("/model.gguf")) == 2
        finally:
            proc.terminate()
            assert proc.wait(30) == 0


def test_fitmd_refuses_a_model_with_the_wrong_checksum(server, model_bytes, tmp_path):
    url = serve(server, "/model.gguf", model_bytes)
    model = tmp_path / "model.gguf"
    with open(tmp_path / "log", "w+") as logf:
        proc, _ = start_fitmd(model, url, "0" * 64, logf)
        assert proc.wait(60) == 1
        logf.seek(0)
        log = logf.read()
    assert "sha256 mismatch" in log
    assert no_partial(model)
