"""fitmd under the faults of issue 11, against the real daemon on 127.0.0.1: ambiguous HTTP
framing (request smuggling), bodies where none belongs, clients that leave while their job runs.

Each smuggling case carries a hidden second request ("GET /nope") after what a lenient server
would take as the end of the first; the daemon must answer exactly once, with a JSON error and
Connection: close, so the hidden request is never served."""
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
import requests

from test_http import AUTH, KEY, Daemon, docs, fitmd_bin, free_port, models  # noqa: F401 (fixtures)

BODY = b'{"query":"q","documents":["a"]}'
HEAD = b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
HIDDEN = b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def daemon(fitmd_bin, models, tmp_path_factory):  # noqa: F811
    d = Daemon(fitmd_bin, models["small"], tmp_path_factory.mktemp("log"), api_keys=KEY)
    yield d
    assert d.terminate() == 0, d.log_text()


def exchange(d, data: bytes, wait=10.0) -> bytes:
    """Sends data and reads until the server closes; a silent open connection fails."""
    with socket.create_connection(("127.0.0.1", d.port), timeout=wait) as s:
        s.sendall(data)
        out = b""
        while (b := s.recv(65536)):
            out += b
        return out


def responses(out: bytes):
    """[(status, headers, body)] of every response in out (Content-Length framed)."""
    got = []
    while out:
        head, sep, rest = out.partition(b"\r\n\r\n")
        assert sep, out
        lines = head.decode("latin-1").split("\r\n")
        m = re.match(r"HTTP/1\.1 (\d{3}) ", lines[0])
        assert m, lines[0]
        hdr = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:])}
        n = int(hdr.get("content-length", "0"))
        got.append((int(m.group(1)), hdr, rest[:n]))
        out = rest[n:]
    return got


def trickle(s, data: bytes, pause: float) -> bytes:
    """Sends data a byte every `pause` seconds until the server answers or closes; what it
    answered so far (b"" when it never did)."""
    out = b""
    for c in data:
        try:
            s.sendall(bytes([c]))
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(pause)
        s.setblocking(False)
        try:
            out += s.recv(65536)
        except BlockingIOError:
            pass
        s.setblocking(True)
        if out:
            break
    return out


def post_raw(framing: bytes, body: bytes = b"") -> bytes:
    return b"POST /rerank HTTP/1.1\r\nHost: x\r\n" + HEAD + framing + b"\r\n" + body


FRAMING_CASES = [
    ("CL and TE", post_raw(b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
                           b"0\r\n\r\n" + HIDDEN), 400, "together"),
    ("two CL", post_raw(b"Content-Length: %d\r\nContent-Length: %d\r\n" % (len(BODY), len(BODY)),
                        BODY + HIDDEN), 400, "more than one Content-Length"),
    ("space before colon", post_raw(b"Content-Length : %d\r\n" % len(BODY), BODY + HIDDEN), 400,
     "not a token"),
    ("TE Chunked", post_raw(b"Transfer-Encoding: Chunked\r\n", b"0\r\n\r\n" + HIDDEN), 501,
     "chunked"),
    ("TE xchunked", post_raw(b"Transfer-Encoding: xchunked\r\n", b"0\r\n\r\n" + HIDDEN), 501,
     "chunked"),
    ("TE gzip, chunked", post_raw(b"Transfer-Encoding: gzip, chunked\r\n", b"0\r\n\r\n" + HIDDEN),
     501, "chunked"),
    ("two TE", post_raw(b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
                        b"0\r\n\r\n" + HIDDEN), 501, "chunked"),
    ("no Host", b"GET /health HTTP/1.1\r\n\r\n" + HIDDEN, 400, "Host"),
    ("two Hosts", b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n" + HIDDEN, 400, "Host"),
    ("GET with a body", b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello" + HIDDEN,
     400, "no request body"),
    ("GET chunked", b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"5\r\nhello\r\n0\r\n\r\n" + HIDDEN, 400, "no request body"),
    ("HTTP/1.0 chunked", b"POST /rerank HTTP/1.0\r\n" + HEAD + b"Transfer-Encoding: chunked\r\n"
     b"\r\n%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n" + HIDDEN, 400, "HTTP/1.0"),
]


@pytest.mark.parametrize("name,data,status,mentions", FRAMING_CASES)
def test_ambiguous_framing_is_refused_and_closes(daemon, name, data, status, mentions):
    got = responses(exchange(daemon, data))
    assert len(got) == 1, (name, got)  # the hidden request was not answered
    code, hdr, body = got[0]
    assert code == status, (name, body)
    assert hdr["connection"].lower() == "close"
    assert hdr["content-type"].startswith("application/json")
    e = json.loads(body)["error"]
    assert mentions in e["message"], e
    assert e["code"] in ("bad_framing", "not_implemented")
    assert daemon.healthy()


def test_well_framed_requests_still_pipeline(daemon):
    """The checks refuse only what is ambiguous: a chunked POST, an HTTP/1.0 request without
    Host and a GET with Content-Length: 0 are served, and keep-alive still works."""
    chunk = b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n"
    data = (post_raw(b"Transfer-Encoding: chunked\r\n", chunk)
            + b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
            + b"GET /health HTTP/1.0\r\n\r\n")
    got = responses(exchange(daemon, data))
    assert [g[0] for g in got] == [200, 200, 200], got
    assert json.loads(got[0][2])["results"][0]["index"] == 0


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
def test_a_body_on_a_method_the_route_does_not_take(daemon, chunked):
    """PUT with a body: one 405 naming the route's methods, its body never read as a request,
    the connection closed (on 63e420b the gate answered 400 "takes no request body")."""
    if chunked:
        framing = b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n"
    else:
        framing = b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
    got = responses(exchange(daemon, b"PUT /v1/rerank HTTP/1.1\r\nHost: x\r\n" + HEAD + framing
                             + HIDDEN))
    assert len(got) == 1, got
    status, hdr, body = got[0]
    assert status == 405 and hdr["allow"] == "POST, OPTIONS", got
    assert json.loads(body)["error"]["code"] == "method_not_allowed"


def test_leading_crlf_split_after_its_cr(daemon):
    """A keep-alive client's CRLF before a request (RFC 9112 2.2) may arrive split between two
    segments: the gate waits for the LF after a lone CR instead of refusing the connection."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as s:
        s.sendall(b"\r")
        time.sleep(0.3)  # the gate peeks the lone CR first (together, the two pass as well)
        s.sendall(b"\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        out = b""
        while (b := s.recv(65536)):
            out += b
    assert [g[0] for g in responses(out)] == [200], out[:200]


# ---- heads libmicrohttpd 0.9.75 would answer itself ---------------------------------------------
# On main these get HTML bodies, a status line and headers sent twice, or no reply at all; the
# gate (src/server/gate.c) answers each with the documented JSON error and Connection: close.

HEAD_CASES = [
    ("CL -1", post_raw(b"Content-Length: -1\r\n", BODY + HIDDEN), 400, "bad_framing",
     "Content-Length"),
    ("CL abc", post_raw(b"Content-Length: abc\r\n", BODY + HIDDEN), 400, "bad_framing",
     "Content-Length"),
    ("CL +N", post_raw(b"Content-Length: +%d\r\n" % len(BODY), BODY + HIDDEN), 400,
     "bad_framing", "Content-Length"),
    ("CL over 2^64", post_raw(b"Content-Length: 18446744073709551617\r\n", BODY + HIDDEN), 413,
     "body_too_large", "Content-Length"),
    ("garbage request line", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n", 400,
     "bad_framing", "request line"),
    ("no version", b"GET /health\r\n\r\n" + HIDDEN, 400, "bad_framing", "request line"),
    ("URI too long", b"GET /" + b"a" * 40000 + b" HTTP/1.1\r\nHost: x\r\n\r\n" + HIDDEN, 414,
     "uri_too_long", "request target"),
    ("headers too large", b"GET /health HTTP/1.1\r\nHost: x\r\n"
     + b"X-Pad: %s\r\n" % (b"a" * 1000) * 40 + b"\r\n" + HIDDEN, 431, "headers_too_large",
     "request head"),
    ("many fields", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 400 + b"\r\n" + HIDDEN,
     431, "headers_too_large", "header fields"),
    ("CL and a space", post_raw(b"Content-Length: %d \r\n" % len(BODY), BODY + HIDDEN), 400,
     "bad_framing", "Content-Length"),
    ("CL and a tab", post_raw(b"Content-Length: %d\t\r\n" % len(BODY), BODY + HIDDEN), 400,
     "bad_framing", "Content-Length"),
    ("encoded NUL", b"GET /metrics%00x HTTP/1.1\r\nHost: x\r\n\r\n" + HIDDEN, 400,
     "bad_framing", "%00"),
    ("HTTP/2.0", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n" + HIDDEN, 505,
     "http_version_not_supported", "version"),
    ("HTTP/1.2", b"GET /health HTTP/1.2\r\nHost: x\r\n\r\n" + HIDDEN, 505,
     "http_version_not_supported", "version"),
]


@pytest.mark.parametrize("name,data,status,code,mentions", HEAD_CASES)
def test_bad_heads_get_one_json_error(daemon, name, data, status, code, mentions):
    got = responses(exchange(daemon, data))
    assert len(got) == 1, (name, got)  # once, and the hidden request was not answered
    st, hdr, body = got[0]
    assert st == status, (name, body)
    assert hdr["connection"].lower() == "close"
    assert hdr["content-type"].startswith("application/json"), (name, body[:200])
    e = json.loads(body)["error"]
    assert e["code"] == code and mentions in e["message"], e
    assert daemon.healthy()


GOOD = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
# Every bad head above, each with the error code it must get.
LATER_CASES = ([(n, d, st, ("not_implemented" if st == 501 else "bad_framing"), m)
                for n, d, st, m in FRAMING_CASES] + HEAD_CASES)


def read_response(s) -> bytes:
    """One Content-Length framed response from s (the connection stays open)."""
    out = b""
    while b"\r\n\r\n" not in out:
        b = s.recv(65536)
        assert b, out
        out += b
    head, _, rest = out.partition(b"\r\n\r\n")
    n = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
    while len(rest) < n:
        b = s.recv(65536)
        assert b, out
        rest += b
    assert len(rest) == n, out  # nothing more was sent
    return out


def expect_refusal(got, name, status, code, mentions):
    st, hdr, body = got
    assert st == status, (name, body[:300])
    assert hdr.get("connection", "").lower() == "close", (name, hdr)
    assert hdr["content-type"].startswith("application/json"), (name, body[:200])
    e = json.loads(body)["error"]
    assert e["code"] == code and mentions in e["message"], (name, e)


def refused_after_a_good_request(port, data, pipelined):
    """GOOD then data on one kept-alive connection (after GOOD's answer, or sent with it):
    every response the server sent until it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        if pipelined:
            s.sendall(GOOD + data)
            out = b""
        else:
            s.sendall(GOOD)
            out = read_response(s)
            s.sendall(data)
        while (b := s.recv(65536)):
            out += b
    return responses(out)


@pytest.mark.parametrize("pipelined", [False, True], ids=["after its answer", "pipelined"])
@pytest.mark.parametrize("name,data,status,code,mentions", LATER_CASES)
def test_bad_head_later_on_a_kept_alive_connection(daemon, name, data, status, code, mentions,
                                                   pipelined):
    """Every request on a connection gets the same strict check, not only its first: a bad
    head sent after a good request on a kept-alive connection (once it was answered, or
    pipelined behind it) gets the JSON error and Connection: close after the good request's
    answer, and the hidden request behind it is not served. On a40b401 only the first head
    passed the gate: libmicrohttpd answered these (HTML, or its status line twice) or served
    the hidden request."""
    got = refused_after_a_good_request(daemon.port, data, pipelined)
    assert len(got) == 2, (name, got)
    st, hdr, body = got[0]
    assert st == 200 and json.loads(body)["status"] == "ok", got[0]
    assert hdr.get("connection", "").lower() != "close", hdr  # kept alive for the next
    expect_refusal(got[1], name, status, code, mentions)
    assert daemon.healthy()
    assert "GET /nope" not in daemon.log_text()  # the hidden request never reached a route


def test_keep_alive_still_serves_many_requests(daemon):
    """Well-formed clients keep their connection: 50 requests, POSTs and GETs, on one."""
    post = post_raw(b"Content-Length: %d\r\n" % len(BODY), BODY)
    chunk = b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\nX-Trailer: t\r\n\r\n"
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as s:
        for i in range(50):
            s.sendall([GOOD, post, post_raw(b"Transfer-Encoding: chunked\r\n", chunk)][i % 3])
            (st, hdr, body), = responses(read_response(s))
            assert st == 200, body
            assert hdr.get("connection", "").lower() != "close"


def test_random_pipelines_stay_in_step(daemon):
    """Random kept-alive pipelines of GETs, Content-Length POSTs and chunked POSTs (random
    chunk sizes, extensions and trailers), sent in random fragments: the gate must find every
    head where libmicrohttpd does, so each request is answered once, in order, with its own
    id and its own result."""
    import random
    rng = random.Random(0x9a7e)
    for round_ in range(4):
        data, want = b"", []
        for i in range(rng.randint(5, 15)):
            rid = b"p%d-%d" % (round_, i)
            kind = rng.choice(["get", "cl", "chunked"])
            if kind == "get":
                data += b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: " + rid + b"\r\n\r\n"
                want.append((rid, None))
                continue
            doc = "".join(rng.choice("abc de\r\n0;:") for _ in range(rng.randint(1, 60)))
            body = json.dumps({"query": "q", "documents": [doc]}).encode()
            head = b"POST /rerank HTTP/1.1\r\nHost: x\r\n" + HEAD + b"X-Request-Id: " + rid + b"\r\n"
            if kind == "cl":
                data += head + b"Content-Length: %d\r\n\r\n" % len(body) + body
            else:
                chunks, at = b"", 0
                while at < len(body):
                    n = rng.randint(1, 40)
                    ext = rng.choice([b"", b";a=b", b';name="v"'])
                    chunks += b"%x" % len(body[at:at + n]) + ext + b"\r\n" + body[at:at + n] + b"\r\n"
                    at += n
                trailer = rng.choice([b"", b"X-Sum: 1\r\n"])
                data += head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n" + trailer + b"\r\n"
            want.append((rid, doc))
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=60) as s:
            at = 0
            while at < len(data):
                n = rng.randint(1, 300)
                s.sendall(data[at:at + n])
                at += n
            out = b""
            while len(responses_so_far := _complete(out)) < len(want):
                b = s.recv(65536)
                assert b, (round_, len(responses_so_far), out[-300:])
                out += b
        got = responses(out)
        assert len(got) == len(want)
        for (rid, doc), (st, hdr, body) in zip(want, got):
            assert st == 200 and hdr["x-request-id"] == rid.decode(), (rid, st, body[:200])
            if doc is not None:
                assert json.loads(body)["results"][0]["index"] == 0


def _complete(out: bytes):
    """The complete responses at the start of out."""
    got = []
    while b"\r\n\r\n" in out:
        head, _, rest = out.partition(b"\r\n\r\n")
        n = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
        if len(rest) < n:
            break
        got.append(head)
        out = rest[n:]
    return got


class RawResponse:
    """One raw response in the shape test_http.spec_validator checks."""

    def __init__(self, got):
        self.status_code, hdr, self.content = got
        self.headers = requests.structures.CaseInsensitiveDict(hdr)

    def json(self):
        return json.loads(self.content)


def test_every_route_s_refusals_are_in_the_spec(daemon):
    """Each route of openapi/openapi.yaml, sent each head the gate refuses and the wrong
    method: the status is one the spec lists for that route, with its JSON error body and
    headers (a40b401's spec had no 413 on GET routes, no 405 on /v1/rerank and /v2/rerank)."""
    yaml = pytest.importorskip("yaml")
    from test_http import ROOT, spec_validator
    check = spec_validator()
    spec = yaml.safe_load((ROOT / "openapi" / "openapi.yaml").read_text())
    auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
    seen = set()
    for path, ops in spec["paths"].items():
        for method in ops:
            m = method.upper().encode()
            line = m + b" " + path.encode()
            other = b"GET" if method == "post" else b"POST"
            cases = [
                line + b" HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                line + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 18446744073709551617\r\n\r\n",
                line + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n",
                line + b" HTTP/2.0\r\nHost: x\r\n\r\n",
                line + b"?" + b"q" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                line + b" HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: %s\r\n" % (b"a" * 1000) * 20 + b"\r\n",
            ]
            if method != "options":  # the wrong method (OPTIONS has none: any other is
                # another operation of the path); without a body its 405 keeps the connection
                cases.append(other + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth
                             + b"Content-Type: application/json\r\nContent-Length: 0\r\n"
                             + b"Connection: close\r\n\r\n")
            if method == "get":
                cases.append(line + b" HTTP/1.1\r\nHost: x\r\n" + auth
                             + b"Content-Length: 5\r\n\r\nhello")
            cases.append(line + b" HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\n\r\n")
            for data in cases:
                got = responses(exchange(daemon, data))
                assert len(got) == 1, (path, data[:80], got)
                check(path, method, RawResponse(got[0]))
                seen.add(got[0][0])
    assert seen == {400, 405, 413, 414, 417, 431, 501, 505}, seen


def test_trickled_headers_are_cut_with_408(fitmd_bin, models, tmp_path):  # noqa: F811
    """A request head sent a byte at a time, each well within the idle timeout, is cut once
    http_header_timeout_s has passed; a connection that sends nothing is closed then too (on
    main both are held for as long as the client likes: there is no header deadline)."""
    d = Daemon(fitmd_bin, models["small"], tmp_path, http_header_timeout_s=1,
               http_idle_timeout_s=30)
    try:
        with socket.create_connection(("127.0.0.1", d.port), timeout=10) as quiet, \
                socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:
            start = time.time()
            s.sendall(b"GET /health HTTP/1.1\r\n")
            out = trickle(s, b"X-Slow: " + b"a" * 40, 0.1)
            assert out, "the trickled head was not cut"
            s.settimeout(10)
            try:
                while (b := s.recv(65536)):
                    out += b
            except ConnectionResetError:
                pass
            assert time.time() - start < 3.5
            (code, hdr, body), = responses(out)
            assert code == 408 and hdr["connection"] == "close", out
            assert json.loads(body)["error"]["code"] == "request_timeout"
            quiet.settimeout(5)
            assert quiet.recv(100) == b""  # closed without a word, not held
        assert d.healthy()
    finally:
        assert d.terminate() == 0


def test_out_of_descriptors_pauses_accepting_and_recovers(fitmd_bin, models, tmp_path):  # noqa: F811
    """With the process out of file descriptors, the gate pauses accepting (one warning per
    pause, not a spin on the still-readable listening socket: a spin logs thousands) and serves
    again once connections close."""
    import resource
    d = Daemon(fitmd_bin, models["small"], tmp_path, http_header_timeout_s=30)
    held = []
    try:
        fds = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        soft, hard = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (fds + 4, hard))
        for _ in range(12):
            held.append(socket.create_connection(("127.0.0.1", d.port), timeout=10))
        time.sleep(1.0)
        warnings = d.log_text().count("cannot accept a connection")
        assert 1 <= warnings <= 30, warnings
        for s in held:
            s.close()
        held = []
        resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                if d.healthy():
                    break
            except requests.ConnectionError:
                time.sleep(0.1)
        assert d.healthy()
    finally:
        for s in held:
            s.close()
        assert d.terminate() == 0


def test_bodies_held_in_all_are_bounded(fitmd_bin, models, tmp_path):  # noqa: F811
    """Connections that each send most of a large body and hold it are bounded together, not
    each alone: once the bodies held reach 64 MiB (4 x max_body_bytes when that is more) the
    next body is read and dropped and answered 503 with Retry-After; once they are gone a body
    is taken again (on f93cfae 512 such connections held 2 GiB, past the shipped pod's
    limit)."""
    d = Daemon(fitmd_bin, models["small"], tmp_path, http_receive_timeout_s=120)
    size = 4 << 20  # the default max_body_bytes
    head = (f"POST /rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    held = []
    try:
        for _ in range(16):  # 16 x (4 MiB - 64): just under the budget
            s = socket.create_connection(("127.0.0.1", d.port), timeout=30)
            s.sendall(head + b" " * (size - 64))
            held.append(s)
        time.sleep(0.5)  # every byte read
        with socket.create_connection(("127.0.0.1", d.port), timeout=30) as s:
            s.sendall(head + b" " * size)
            out = b""
            while b"\r\n\r\n" not in out:
                out += s.recv(65536)
        assert out.startswith(b"HTTP/1.1 503"), out[:300]
        assert b"retry-after" in out.lower() and b"request bodies" in out, out[:600]
        for s in held:
            s.close()
        held = []
        time.sleep(0.3)
        body = json.dumps({"query": "q", "documents": ["a"], "pad": " " * (size - 200)})
        r = requests.post(d.url("/rerank"), data=body,
                          headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 200, r.text[:300]
    finally:
        for s in held:
            s.close()
        assert d.terminate() == 0


# ---- clients that leave, and shutdown ------------------------------------------------------

def slow_rerank():
    """Thousands of forward tokens: a job that runs long enough for its client to leave."""
    return {"query": "what is golf", "documents": docs(8, 50), "prefix_reuse": False}


def abandon(d, path, body, rid, read_first=False):
    """Sends body, waits until the engine runs it (or the stream's headers came), then leaves."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", d.port), timeout=30) as s:
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + HEAD
                  + b"X-Request-Id: " + rid.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(data)
                  + data)
        if read_first:
            assert s.recv(100).startswith(b"HTTP/1.1 200")
        deadline = time.time() + 30
        while not d.running() and time.time() < deadline:
            time.sleep(0.01)


@pytest.fixture
def long_daemon(fitmd_bin, models, tmp_path):  # noqa: F811
    d = Daemon(fitmd_bin, models["long"], tmp_path, api_keys=KEY, queue_depth=2)
    yield d
    if d.proc.poll() is None:
        assert d.terminate() == 0, d.log_text()


@pytest.mark.parametrize("path,extra,read_first", [
    ("/rerank", {}, False),
    ("/answer", {"max_tokens": 200}, False),
    ("/answer", {"max_tokens": 200, "stream": True}, True),
])
def test_abandoned_job_is_cancelled_not_200(long_daemon, path, extra, read_first):
    """The job of a client that left stops at the next forward call and is counted as 499
    (never sent), with a log line saying why; on main it ran to the end and logged 200."""
    d = long_daemon
    abandon(d, path, {**slow_rerank(), **extra}, "gone-1", read_first)
    m = d.wait_log(r"req=gone-1 msg=\"POST \S+ -> (\d+)")
    assert m.group(1) == "499", d.log_text()[-2000:]
    # A stream's 499 is logged when a write fails; the job stops at its next step, after.
    d.wait_log(r"req=gone-1 msg=\"(job cancelled: the client disconnected"
                 r"|answer stream ended \(cancelled\))")
    route = path.strip("/")
    assert f'fitm_requests_total{{route="{route}",code="499"}} 1' in requests.get(
        d.url("/metrics")).text
    assert d.healthy()


def test_abandoned_jobs_do_not_fill_the_queue(long_daemon):
    """Three abandoned requests with queue_depth 2: once they are cancelled, a fresh request
    is served (on main they kept the engine busy, then the queue full)."""
    d = long_daemon
    for i in range(3):
        abandon(d, "/rerank", slow_rerank(), f"gone-{i}")
    for i in range(3):
        d.wait_log(rf"req=gone-{i} msg=\"POST /rerank -> 499")
    r = requests.post(d.url("/rerank"), json={"query": "q", "documents": ["a"]}, headers=AUTH,
                      timeout=120)
    assert r.status_code == 200, r.text


def test_shutdown_cancels_with_its_own_reason(fitmd_bin, models, tmp_path):  # noqa: F811
    """A job stopped by SIGTERM past drain_timeout_ms says 'cancelled' and 'shutting down'
    (on main: deadline_exceeded)."""
    d = Daemon(fitmd_bin, models["long"], tmp_path, api_keys=KEY, drain_timeout_ms=0)
    got = {}

    def run():
        got["r"] = requests.post(d.url("/rerank"), json=slow_rerank(), headers=AUTH, timeout=120)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 30
    while not d.running() and time.time() < deadline:
        time.sleep(0.01)
    d.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert d.proc.wait(60) == 0
    d.log.close()
    r = got["r"]
    assert r.status_code == 503, r.text
    e = r.json()["error"]
    assert e["code"] == "cancelled" and "shutting down" in e["message"], e


# ---- connection hygiene ------------------------------------------------------------------------

def health_from(d, source: str) -> int:
    """GET /health over a connection from the loopback address source; the status code."""
    with socket.create_connection(("127.0.0.1", d.port), timeout=10, source_address=(source, 0)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        out = b""
        while (b := s.recv(65536)):
            out += b
    return int(out.split(b" ", 2)[1])


def accepted_connection(d, source="127.0.0.1", wait_s=10.0):
    """A keep-alive connection the daemon has certainly accepted: it answered a request on it.
    A refused one is tried again for up to wait_s: the Daemon's own readiness probes (from
    127.0.0.1) count against the limits until the server has seen them closed, which under
    ASan can take a moment after the client closed them."""
    deadline = time.time() + wait_s
    while True:
        s = socket.create_connection(("127.0.0.1", d.port), timeout=10, source_address=(source, 0))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            got = s.recv(65536)
        except ConnectionResetError:
            got = b""
        if got.startswith(b"HTTP/1.1 200"):
            return s
        s.close()
        assert time.time() < deadline, got
        time.sleep(0.05)


def test_trickled_body_is_cut_with_408(fitmd_bin, models, tmp_path):  # noqa: F811
    """A body sent a byte at a time, each well within the idle timeout, is cut once
    http_receive_timeout_s has passed (on main it is held for as long as it trickles)."""
    d = Daemon(fitmd_bin, models["small"], tmp_path, api_keys=KEY, http_receive_timeout_s=1,
               http_idle_timeout_s=30)
    try:
        with socket.create_connection(("127.0.0.1", d.port), timeout=30) as s:
            s.sendall(post_raw(b"Content-Length: %d\r\n" % len(BODY)))
            out = trickle(s, BODY[:-1], 0.2)
            s.settimeout(10)
            while (b := s.recv(65536)):
                out += b
        code, hdr, body = responses(out)[0]
        assert code == 408 and hdr["connection"] == "close", out
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert d.healthy()
    finally:
        assert d.terminate() == 0


def test_one_address_cannot_take_every_connection(fitmd_bin, models, tmp_path):  # noqa: F811
    """With max_connections_per_client 4, a fifth connection from 127.0.0.1 is refused while
    /health from another loopback address (127.0.0.2) is answered (on main the fifth is
    accepted, and such a flood from one address starves everyone)."""
    d = Daemon(fitmd_bin, models["small"], tmp_path, max_connections_per_client=4)
    held = []
    try:
        for _ in range(4):
            held.append(accepted_connection(d))
        with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                got = s.recv(100)
            except ConnectionResetError:
                got = b""
            assert got == b"", got
        assert health_from(d, "127.0.0.2") == 200
    finally:
        for s in held:
            s.close()
        assert d.terminate() == 0



def test_probe_port_answers_while_connections_are_exhausted(fitmd_bin, models, tmp_path):  # noqa: F811
    """With every main-port connection taken (max_connections 4, from several addresses),
    /health and /metrics on probe_port still answer; inference routes do not exist there
    (on main there is no probe_port: probes queue behind the flood)."""
    probe = free_port()
    d = Daemon(fitmd_bin, models["small"], tmp_path, api_keys=KEY, max_connections=4,
               probe_port=probe)
    held = []
    try:
        for i in range(4):
            held.append(accepted_connection(d, f"127.0.0.{i + 2}"))
        with pytest.raises((requests.ConnectionError, requests.Timeout)):  # not accepted
            requests.get(d.url("/health"), timeout=3)
        base = f"http://127.0.0.1:{probe}"
        r = requests.get(base + "/health", timeout=5)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert requests.get(base + "/metrics", timeout=5).status_code == 200
        r = requests.post(base + "/rerank", json={"query": "q", "documents": ["a"]},
                          headers=AUTH, timeout=5)
        assert r.status_code == 404
    finally:
        for s in held:
            s.close()
        assert d.terminate() == 0

def trickling(port, n, sources):
    """n connections to port, spread over the loopback addresses `sources`, each having sent
    the start of a request head and holding it open (a slow-client flood)."""
    held = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10,
                                     source_address=(sources[i % len(sources)], 0))
        s.sendall(b"GET /health HTTP/1.1\r\nX-Slow: a")
        held.append(s)
    return held


def get_health(port, timeout=5):
    return requests.get(f"http://127.0.0.1:{port}/health", timeout=timeout)


def test_probe_port_answers_while_the_main_port_trickles(fitmd_bin, models, tmp_path):  # noqa: F811
    """Every main-port connection held by a client trickling its head: /health on probe_port
    is answered at once, and the main port itself again once http_header_timeout_s cut the
    flood with 408s."""
    probe = free_port()
    d = Daemon(fitmd_bin, models["small"], tmp_path, max_connections=8,
               max_connections_per_client=8, probe_port=probe, http_header_timeout_s=3)
    held = []
    try:
        # The start-up probes' connections are counted until the gate has seen them close.
        time.sleep(1.0)
        held = trickling(d.port, 8, ["127.0.0.2", "127.0.0.3"])
        time.sleep(0.5)
        with pytest.raises((requests.ConnectionError, requests.Timeout)):  # all taken
            get_health(d.port, timeout=1)
        r = get_health(probe)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        for s in held:
            s.settimeout(10)
            (code, hdr, body), = responses(s.recv(65536))
            assert code == 408 and hdr["connection"] == "close"
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                if get_health(d.port, timeout=1).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):
                time.sleep(0.1)
        assert get_health(d.port).status_code == 200
    finally:
        for s in held:
            s.close()
        assert d.terminate() == 0


def test_main_port_answers_while_the_probe_port_trickles(fitmd_bin, models, tmp_path):  # noqa: F811
    """The probe listener's own budget (64 connections, 16 per address) taken by trickling
    clients: the main port still answers, and the probe port's flood is cut with 408 after
    http_header_timeout_s (on a40b401 the probe port had no header deadline: a trickling
    client kept its connection for as long as it sent a byte per 10 s)."""
    probe = free_port()
    d = Daemon(fitmd_bin, models["small"], tmp_path, probe_port=probe, http_header_timeout_s=2)
    held = []
    try:
        held = trickling(probe, 64, [f"127.0.0.{i}" for i in range(2, 6)])
        time.sleep(0.5)
        assert get_health(d.port).status_code == 200
        start = time.time()
        for s in held:
            s.settimeout(10)
            (code, hdr, body), = responses(s.recv(65536))
            assert code == 408 and hdr["connection"] == "close"
            assert json.loads(body)["error"]["code"] == "request_timeout"
        assert time.time() - start < 6
        assert get_health(probe).status_code == 200
    finally:
        for s in held:
            s.close()
        assert d.terminate() == 0


@pytest.mark.parametrize("pipelined", [None, False, True],
                         ids=["first", "after an answer", "pipelined"])
@pytest.mark.parametrize("name,data,status,code,mentions", [
    c for c in LATER_CASES if c[0] in ("CL and TE", "two CL", "TE xchunked", "no Host",
                                       "GET with a body", "CL abc", "garbage request line",
                                       "URI too long", "HTTP/2.0")])
def test_probe_port_refuses_bad_heads(fitmd_bin, models, tmp_path_factory, probe_daemon, name,
                                      data, status, code, mentions, pipelined):
    """The probe listener checks every request head as the main port does (on a40b401 it had
    no gate: libmicrohttpd's HTML, doubled status lines, or the hidden request served)."""
    port = probe_daemon
    if pipelined is None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(data)
            out = b""
            while (b := s.recv(65536)):
                out += b
        got = responses(out)
        assert len(got) == 1, (name, got)
        expect_refusal(got[0], name, status, code, mentions)
        return
    got = refused_after_a_good_request(port, data, pipelined)
    assert len(got) == 2 and got[0][0] == 200, (name, got)
    expect_refusal(got[1], name, status, code, mentions)


@pytest.fixture(scope="module")
def probe_daemon(fitmd_bin, models, tmp_path_factory):  # noqa: F811
    probe = free_port()
    d = Daemon(fitmd_bin, models["small"], tmp_path_factory.mktemp("probe"), api_keys=KEY,
               probe_port=probe)
    yield probe
    assert get_health(probe).status_code == 200
    assert d.terminate() == 0, d.log_text()

# ---- strict JSON ---------------------------------------------------------------------------------

def post_body(d, raw: bytes, path="/rerank"):
    return requests.post(d.url(path), data=raw, timeout=120,
                         headers={**AUTH, "Content-Type": "application/json"})


@pytest.mark.parametrize("path,raw,mentions", [
    ("/rerank", b'{"query":"q","documents":["abc\\u0000SECRET"]}', "'documents[0]' contains a NUL"),
    ("/rerank", b'{"query":"q","documents":["abc\x00SECRET"]}', "'documents[0]' contains a NUL byte"),
    ("/rerank", b'{"query":"q\\u0000x","documents":["a"]}', "'query' contains a NUL"),
    ("/rerank", b'{"query":"q","documents":[{"text":"a","te\\u0000xt":"b"}]}',
     "an object key contains a NUL character (\\u0000) (at byte 41) in 'documents[0]'"),
    ("/rerank", b'{"query":"q","documents":["a"],"query":"other"}', "duplicate key 'query'"),
    ("/rerank", b'{"query":"q","documents":[{"text":"a","text":"b"}]}',
     "duplicate key 'text' in 'documents[0]'"),
    # The full path of the field, through arrays and objects, whatever the spacing.
    ("/rerank", b'{"query":"q", "documents": [ "a" , {"title": "t, [x]", "text": "b"},'
                b' {"title":"u", "text":"c\\u0000d"}]}', "'documents[2].text' contains a NUL"),
    ("/rerank", b'{"query":"q","documents":["a",{"text":"b","title":"x","title":"y"}]}',
     "duplicate key 'title' in 'documents[1]'"),
    ("/answer", b'{"query":"q","documents":["a"],"calibration":{"layers":[1],"layers":[2]}}',
     "duplicate key 'layers' in 'calibration'"),
    ("/answer", b'{"query":"q","documents":["a"],"stop":["x","y\\u0000"]}',
     "'stop[1]' contains a NUL"),
    ("/answer", b'{"query":"q","documents":["a"],"seed":9007199254740993}', "'seed'"),
    ("/answer", b'{"query":"q","documents":["a"],"seed":9007199254740992}', "2^53"),
])
def test_json_that_cjson_would_bend_is_refused(daemon, path, raw, mentions):
    """On main each was accepted: the document cut at the NUL, the first duplicate kept, the
    seed rounded to 2^53."""
    r = post_body(daemon, raw, path)
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert mentions in e["message"], e
    # a raw NUL is a control character the grammar refuses; the rest it allows
    assert e["code"] == ("invalid_json" if b"\x00" in raw else "invalid_value"), e


def test_strict_json_keeps_what_is_exact(daemon):
    """A backslash before u0000 that is itself escaped is text, not NUL; the largest exact seed
    is accepted and reported as sent."""
    r = post_body(daemon, b'{"query":"q","documents":["a\\\\u0000b"]}')
    assert r.status_code == 200, r.text
    r = post_body(daemon, b'{"query":"q","documents":["a"],"seed":9007199254740991,'
                          b'"max_tokens":1}', "/answer")
    assert r.status_code == 200, r.text
    assert r.json()["meta"]["seed"] == 9007199254740991


def test_too_many_api_keys_is_a_startup_error(fitmd_bin, models):  # noqa: F811
    keys = ",".join(f"key-{i}" for i in range(33))
    p = subprocess.run([str(fitmd_bin), f"--model={models['small']}", "--host=127.0.0.1",
                        f"--port={free_port()}", f"--api_keys={keys}"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2  # a configuration error, found before the model loads
    assert "api_keys lists more than 32 keys" in p.stdout + p.stderr


# ---- the model file under the mapping -----------------------------------------------------------

def own_model(models, tmp_path, name="long"):  # noqa: F811
    p = tmp_path / "model.gguf"
    p.write_bytes(models[name].read_bytes())
    return p


def test_health_fails_when_the_model_file_changes(fitmd_bin, models, tmp_path):  # noqa: F811
    """Rewritten in place (same bytes, new mtime): /health turns 503 and says why (on main it
    stayed 200 while answers could silently change)."""
    model = own_model(models, tmp_path, "small")
    d = Daemon(fitmd_bin, model, tmp_path)
    try:
        data = model.read_bytes()
        with open(model, "r+b") as f:
            f.write(data)
        st = model.stat()
        os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
        r = requests.get(d.url("/health"), timeout=10)
        assert r.status_code == 503, r.text
        assert "model file changed" in r.json()["message"]
        assert r.headers["Retry-After"] == "1"  # as every 503 (openapi's info)
        assert "fitm_model_ready 0" in requests.get(d.url("/metrics"), timeout=10).text
    finally:
        assert d.terminate() == 0


def test_truncated_model_file_is_a_logged_fatal_error(fitmd_bin, models, tmp_path):  # noqa: F811
    """Truncated while serving: the next request faults (SIGBUS) and the log says what
    happened (on main the process died without a line)."""
    model = own_model(models, tmp_path)
    d = Daemon(fitmd_bin, model, tmp_path)
    try:
        os.truncate(model, 4096)
        with pytest.raises(requests.ConnectionError):
            requests.post(d.url("/rerank"), json={"query": "q", "documents": ["a b c"]},
                          timeout=60)
        assert d.proc.wait(30) == -signal.SIGBUS
        assert "SIGBUS" in d.log_text() and "model file was truncated" in d.log_text()
    finally:
        d.kill()


def test_model_load_copy_survives_the_file_changing(fitmd_bin, models, tmp_path):  # noqa: F811
    """model_load=copy (llama.cpp's --no-mmap) reads the weights into private memory: the file
    truncated and rewritten under it changes nothing; answers stay the same and /health ok."""
    model = own_model(models, tmp_path)
    d = Daemon(fitmd_bin, model, tmp_path, model_load="copy")
    try:
        body = {"query": "golf", "documents": docs(3, 6)}
        before = requests.post(d.url("/rerank"), json=body, timeout=120).json()["results"]
        os.truncate(model, 4096)
        model.write_bytes(b"\0" * 8192)
        after = requests.post(d.url("/rerank"), json=body, timeout=120).json()["results"]
        assert after == before
        assert d.healthy()
    finally:
        assert d.terminate() == 0


# ---- what operators and attackers send (issue 42) -------------------------------------------

def start_fitmd(fitmd_bin, model, log, **opts):  # noqa: F811
    """fitmd started without waiting for it to be healthy (its model may never load)."""
    args = [str(fitmd_bin), f"--model={model}", "--host=127.0.0.1", f"--port={free_port()}"]
    args += [f"--{k}={v}" for k, v in opts.items()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_for(path, pattern, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if re.search(pattern, path.read_text()):
            return
        time.sleep(0.05)
    pytest.fail(f"no {pattern!r} in the log:\n{path.read_text()[-3000:]}")


def test_sighup_is_logged_and_serving_goes_on(fitmd_bin, models, tmp_path):  # noqa: F811
    """SIGHUP (logrotate, `systemctl reload`) while streams run: logged, every stream ends
    with [DONE], fitmd serves on and still drains on SIGTERM (on 5f0f007 it died of the
    signal, exit 129, cutting the streams)."""
    d = Daemon(fitmd_bin, models["long"], tmp_path, api_keys=KEY)
    got = []

    def stream():
        r = requests.post(d.url("/answer"), headers=AUTH, timeout=120, stream=True,
                          json={"query": "q", "documents": docs(4, 30), "max_tokens": 512,
                                "ignore_eos": True, "stream": True})
        got.append((r.status_code, r.content))

    # streams long enough (seconds here) to be seen in flight and to take the signals
    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    d.wait_running()
    for _ in range(2):
        d.proc.send_signal(signal.SIGHUP)
        time.sleep(0.2)
    for t in threads:
        t.join(120)
    assert d.proc.poll() is None, d.log_text()[-2000:]
    assert len(got) == 3 and all(st == 200 and b"data: [DONE]" in body for st, body in got), got
    d.wait_log(r"SIGHUP: nothing to reload")
    assert d.healthy()
    assert d.terminate() == 0, d.log_text()


def flood(n_keys: int, tail: str = "") -> bytes:
    return ("{" + ",".join(f'"k{i}":1' for i in range(n_keys)) + tail
            + ',"query":"q","documents":["a"]}').encode()


def test_key_flood_is_refused_and_duplicates_found_in_linear_time(daemon):
    """200,000 unknown keys (2.3 MB): 400 naming max_json_members at once (on 5f0f007 the
    quadratic duplicate check took 45 s here and answered 200). Under the bound, a key repeated
    at the end of 60,000 is still found, and 60,000 distinct keys are accepted."""
    hdr = {**AUTH, "Content-Type": "application/json"}
    r = requests.post(daemon.url("/rerank"), data=flood(200000), headers=hdr, timeout=30)
    assert r.status_code == 400 and "max_json_members" in r.json()["error"]["message"], r.text
    r = requests.post(daemon.url("/rerank"), data=flood(60000, ',"k7":2'), headers=hdr,
                      timeout=30)
    assert r.status_code == 400 and "duplicate key 'k7'" in r.json()["error"]["message"], r.text
    r = requests.post(daemon.url("/rerank"), data=flood(60000), headers=hdr, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw", [b'{"query":"q","documents":["a"],"top_n":NaN}',
                                 b'{"query":"\\ud800","documents":["a"]}',
                                 b"[" * 2000 + b"]" * 2000,
                                 b'{"query":"q","documents":["a"]} {}',
                                 # what cJSON parses and RFC 8259 does not
                                 b'{"query":"q","documents":["a"],"top_n":01}',
                                 b'{"query":"q","documents":["a"],"top_n":-01}',
                                 b'{"query":"q","documents":["a"],"top_n":1.}',
                                 b'{"query":"q","documents":["a"],"temperature":1.e-3}',
                                 b'{"query":"q","documents":["a\x01b"]}',
                                 b'{"query":"q\tq","documents":["a"]}'],
                         ids=["NaN", "lone surrogate", "nested 2000 deep", "trailing data",
                              "leading zero", "negative leading zero", "bare point",
                              "point before exponent", "raw control character", "raw tab"])
def test_malformed_json_is_invalid_json(daemon, raw):
    r = post_body(daemon, raw)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def test_json_numbers_and_escapes_that_are_json_are_accepted(daemon):
    r = post_body(daemon, b'{"query":"q\\t\\u0001","documents":["a"],"top_n":1e0,'
                          b'"temperature":0.5E-1}')
    assert r.status_code == 200, r.text
    r = post_body(daemon, b'{"query":"q","documents":["a"],"top_n":10E-1,"temperature":-0.0}')
    assert r.status_code == 400 and "'temperature' = -0" in r.json()["error"]["message"], r.text


def test_max_json_members_counts_every_key_and_element(fitmd_bin, models, tmp_path):  # noqa: F811
    """{"query", "documents": [n strings]} holds n + 2 members (keys and elements, nested
    ones too): with max_json_members = 40 one over is refused, the bound itself accepted."""
    d = Daemon(fitmd_bin, models["small"], tmp_path, api_keys=KEY, max_json_members=40)
    for n, want in ((38, 200), (39, 400)):
        body = {"query": "q, \"[not\", {a, member}", "documents": [f"d{i}, ]" for i in range(n)]}
        r = requests.post(d.url("/rerank"), json=body, headers=AUTH, timeout=60)
        assert r.status_code == want, (n, r.text)
    nested = {"query": "q", "documents": [{"text": "a", "title": "t"}] * 12}  # 2 + 12 * 3
    nested["documents"].append({"text": "b"})  # + 2: 40
    assert requests.post(d.url("/rerank"), json=nested, headers=AUTH, timeout=60).status_code == 200
    nested["documents"][-1]["title"] = "u"  # 41
    assert requests.post(d.url("/rerank"), json=nested, headers=AUTH, timeout=60).status_code == 400
    assert d.terminate() == 0


def test_non_regular_model_path_is_refused_at_once(fitmd_bin, models, tmp_path):  # noqa: F811
    """A FIFO as the model: fitmd says it is not a regular file and exits 1 before listening;
    fitm inspect too (on 5f0f007 both blocked in open() for good)."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    log = tmp_path / "fitmd.log"
    with open(log, "w") as f:
        p = start_fitmd(fitmd_bin, fifo, f)
        try:
            assert p.wait(30) == 1
        finally:
            p.kill()
    assert "not a regular file" in log.read_text(), log.read_text()
    fitm = fitmd_bin.parent / "fitm"
    p = subprocess.run([str(fitm), "inspect", "-m", str(fifo)], capture_output=True, timeout=30)
    assert p.returncode == 1 and b"not a regular file (a FIFO)" in p.stderr, p.stderr


def test_drain_deadline_holds_while_the_model_loads(fitmd_bin, models, tmp_path):  # noqa: F811
    """A load that never returns (its profile a FIFO nobody writes): SIGTERM still ends fitmd
    once drain_timeout_ms passed, exit 1 with a log line (on 5f0f007 it waited for the load
    for good)."""
    fifo = tmp_path / "scoring.profile"
    os.mkfifo(fifo)
    log = tmp_path / "fitmd.log"
    with open(log, "w") as f:
        p = start_fitmd(fitmd_bin, models["small"], f, profile=fifo, drain_timeout_ms=500)
        try:
            wait_for(log, r"listening on")
            time.sleep(0.5)
            p.send_signal(signal.SIGTERM)
            assert p.wait(30) == 1
        finally:
            p.kill()
    assert "the model is still loading after 500 ms" in log.read_text(), log.read_text()


CHUNKED = (b"POST /rerank HTTP/1.1\r\nHost: x\r\n" + HEAD
           + b"Transfer-Encoding: chunked\r\n\r\n")
FRAMING_ERRORS = [
    ("chunk size zz", CHUNKED + b"zz\r\n", 400, "not hex digits"),
    ("chunk size of 17 digits", CHUNKED + b"1" + b"0" * 16 + b"\r\n", 400, "16 hex digits"),
    ("chunk size 2^63", CHUNKED + b"7fffffffffffffff\r\n", 413, "over any body"),
    ("chunk over max_body_bytes", CHUNKED + b"10001\r\n" + b"a" * 100, 413, "65536 bytes"),
    ("chunks adding up past it", CHUNKED + b"8000\r\n" + b"a" * 0x8000 + b"\r\n8001\r\n", 413,
     "65536 bytes"),
    ("200 KB chunk extension", CHUNKED + b"5;" + b"x" * 200000 + b"\r\n", 400, "extension"),
    ("no CRLF after chunk data", CHUNKED + b"5\r\nhelloXX", 400, "not followed by CRLF"),
    ("unknown Expect", b"POST /rerank HTTP/1.1\r\nHost: x\r\n" + HEAD
     + b"Expect: 200-ok\r\nContent-Length: 2\r\n\r\n{}", 417, "100-continue"),
]


@pytest.fixture(scope="module")
def small_body_daemon(fitmd_bin, models, tmp_path_factory):  # noqa: F811
    d = Daemon(fitmd_bin, models["small"], tmp_path_factory.mktemp("log"), api_keys=KEY,
               max_body_bytes=65536, http_idle_timeout_s=2)
    yield d
    assert d.terminate() == 0, d.log_text()


@pytest.mark.parametrize("name,data,status,mentions", FRAMING_ERRORS,
                         ids=[c[0] for c in FRAMING_ERRORS])
def test_framing_errors_get_a_status_before_the_close(small_body_daemon, name, data, status,
                                                      mentions):
    """Each framing error inside a body is answered with its status (RFC 9112: 400, 413 for a
    body over the limit, 417 for an Expect the server cannot meet) and Connection: close,
    before the close (on 5f0f007: a silent close, at once or at the idle timeout)."""
    t0 = time.time()
    got = responses(exchange(small_body_daemon, data, wait=20))
    assert len(got) == 1, (name, got)
    st, hdr, body = got[0]
    assert st == status and hdr["connection"] == "close", (name, st, hdr)
    assert mentions in json.loads(body)["error"]["message"], (name, body)
    assert time.time() - t0 < 1.5, "answered at once, not at the idle timeout"


def test_expect_100_continue_without_a_body_gets_408(small_body_daemon):
    """Expect: 100-continue, then no body: 100 Continue, then 408 once nothing came for
    http_idle_timeout_s (on 5f0f007: 100, then a silent close)."""
    data = (b"POST /rerank HTTP/1.1\r\nHost: x\r\n" + HEAD
            + b"Expect: 100-continue\r\nContent-Length: 40\r\n\r\n")
    out = exchange(small_body_daemon, data, wait=20)
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), out
    got = responses(out[len(b"HTTP/1.1 100 Continue\r\n\r\n"):])
    assert [g[0] for g in got] == [408], got
    assert "stopped arriving" in json.loads(got[0][2])["error"]["message"]


def test_max_tokens_over_the_limit_is_refused(daemon):
    """max_tokens over max_answer_tokens (512 by default) is refused naming the limit, not
    lowered in silence; the limit itself is accepted (on 5f0f007 513 gave 200, and 0 was said
    to be out of [1, 2147483647])."""
    q = {"query": "q", "documents": ["a"]}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("/answer", {**q, "max_tokens": 513}),
                       ("/v1/chat/completions", {**chat, "max_tokens": 513}),
                       ("/v1/chat/completions", {**chat, "max_completion_tokens": 513}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 513})):
        r = requests.post(daemon.url(path), json=body, headers=AUTH, timeout=60)
        assert r.status_code == 400, (path, r.text)
        assert "max_answer_tokens" in r.text and "512" in r.text, r.text
    r = requests.post(daemon.url("/answer"), json={**q, "max_tokens": 0}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "1 to 512" in r.text and "2147483647" not in r.text, r.text
    r = requests.post(daemon.url("/answer"), json={**q, "max_tokens": 512, "temperature": 0},
                      headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"50256": -100}), ("logit_bias", "not an object"),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("functions", [{"name": "f"}]), ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}), ("response_format", {"type": "json_schema"}),
    ("response_format", "json"), ("logprobs", True), ("top_logprobs", 3), ("best_of", 2),
    ("presence_penalty", 0.5), ("frequency_penalty", -1), ("echo", True), ("suffix", " end"),
    ("repetition_penalty", 1.1), ("top_k", 65), ("top_k", -2), ("top_k", 2.5), ("min_p", 1.5),
    ("min_p", -0.1), ("min_p", "0.1"),
])
def test_unsupported_openai_fields_are_refused(daemon, field, value):
    """A field this server cannot honour is refused with 400 naming it, on both OpenAI routes
    (on 5f0f007: 200 as if honoured)."""
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
        r = requests.post(daemon.url(path), json={**body, field: value}, headers=AUTH, timeout=60)
        assert r.status_code == 400, (path, field, r.text)
        assert f"'{field}'" in r.json()["error"]["message"], r.text


def test_openai_fields_that_ask_for_nothing_are_accepted(daemon):
    harmless = {"logit_bias": {}, "tools": [], "functions": None, "tool_choice": "none",
                "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": 0,
                "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False,
                "suffix": None, "repetition_penalty": 1, "top_k": -1, "min_p": 0}
    r = requests.post(daemon.url("/v1/chat/completions"), json={**CHAT, **harmless}, headers=AUTH,
                      timeout=60)
    assert r.status_code == 200, r.text


def test_top_k_and_min_p_cut_the_candidates(daemon):
    """top_k 1, or min_p 1 on a row without tied maxima, keep the first candidate alone: the
    sampled text is greedy's, whatever the seed (on b88e680 both were ignored); top_k 64 is
    every candidate, so the draw is the plain one of that seed; over 64 is refused, saying
    why."""
    body = {"prompt": "once upon a time", "max_tokens": 8}
    greedy = complete(daemon, **body, temperature=0).json()["choices"][0]["text"]
    for seed in (1, 2, 3):
        for cut in ({"top_k": 1}, {"min_p": 1.0}):
            r = complete(daemon, **body, temperature=1.5, seed=seed, **cut)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == greedy, (seed, cut)
        plain = complete(daemon, **body, temperature=1.5, seed=seed).json()
        r = complete(daemon, **body, temperature=1.5, seed=seed, top_k=64, min_p=0).json()
        assert r["choices"][0]["text"] == plain["choices"][0]["text"]
    # /answer takes them too
    q = {"query": "hi", "documents": ["a", "b"], "max_tokens": 4, "temperature": 2.0, "seed": 5}
    a = requests.post(daemon.url("/answer"), json={**q, "top_k": 1}, headers=AUTH, timeout=60)
    g = requests.post(daemon.url("/answer"), json={**q, "temperature": 0}, headers=AUTH,
                      timeout=60)
    assert a.status_code == 200 and a.json()["answer"] == g.json()["answer"], a.text
    r = complete(daemon, **body, temperature=1.0, top_k=100)
    assert r.status_code == 400 and "64 most likely" in r.json()["error"]["message"], r.text


def complete(daemon, **body):
    return requests.post(daemon.url("/v1/completions"), json=body, headers=AUTH, timeout=60)


def security_headers_of(hdr, page=False):
    hdr = {k.lower(): v for k, v in hdr.items()}
    assert hdr.get("x-content-type-options") == "nosniff", hdr
    assert hdr.get("x-frame-options") == "DENY", hdr
    csp = hdr.get("content-security-policy", "")
    assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp, hdr
    return csp


def test_every_response_carries_the_security_headers(daemon):
    """The playground (with its own policy: scripts inline, calls to this origin only), JSON
    answers and errors, a stream, and the gate's own refusals all carry nosniff, DENY and a
    Content-Security-Policy (on 5f0f007 none of them did)."""
    r = requests.get(daemon.url("/"), timeout=10)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    csp = security_headers_of(r.headers, page=True)
    assert "connect-src 'self'" in csp and "script-src 'unsafe-inline'" in csp
    for r in (requests.get(daemon.url("/health"), timeout=10),
              requests.get(daemon.url("/nope"), timeout=10),
              requests.post(daemon.url("/rerank"), json={"query": "q", "documents": ["a"]},
                            headers=AUTH, timeout=60),
              requests.post(daemon.url("/answer"), headers=AUTH, timeout=60,
                            json={"query": "q", "documents": ["a"], "max_tokens": 2,
                                  "stream": True})):
        assert r.status_code in (200, 404), r.text
        security_headers_of(r.headers)
    for data in (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                 CHUNKED + b"zz\r\n"):
        (st, hdr, _), = responses(exchange(daemon, data))
        assert st == 400
        security_headers_of(hdr)


def test_stalled_stream_reader_is_cut_after_the_idle_timeout(fitmd_bin, models, tmp_path):  # noqa: F811
    """A client that reads nothing of a long stream: its connection is closed
    http_idle_timeout_s after it last took a byte, and its job stops (on 5f0f007 the socket
    stayed open for good: the stream resumed whenever the client read again)."""
    d = Daemon(fitmd_bin, models["long"], tmp_path, api_keys=KEY, http_idle_timeout_s=2,
               max_answer_tokens=4096)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                       "ignore_eos": True, "stream": True, "temperature": 0}).encode()
    s = socket.socket()
    # A small window and segment size keep the server's socket buffers for this connection
    # small (on loopback they grow with the segment size), so the stream outgrows them.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    s.connect(("127.0.0.1", d.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + HEAD
              + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    d.wait_log(r"took none of its answer for 2000 ms", timeout=120)
    s.settimeout(20)
    out = b""
    try:
        while (b := s.recv(65536)):
            out += b
    except ConnectionResetError:
        pass
    s.close()
    assert out.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in out, out[-300:]
    d.wait_log(r"POST /v1/chat/completions -> 499")
    assert d.terminate() == 0
