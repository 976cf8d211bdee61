"""fitmd under the faults of issue 11, against the real daemon on 127.0.0.1: ambiguous HTTP
framing (request smuggling), bodies where none belongs, clients that leave while their job runs.

Each smuggling case carries a hidden second request ("GET /nope") after what a lenient server
would take as the end of the first; the daemon must answer exactly once, with a JSON error and
Connection: close, so the hidden request is never served."""
import json
import re
import socket
import time

import pytest
import requests

from test_http import AUTH, KEY, Daemon, docs, fitmd_bin, models  # noqa: F401 (fixtures)

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


def post_raw(framing: bytes, body: bytes = b"") -> bytes:
    return b"POST /rerank HTTP/1.1\r\nHost: x\r\n" + HEAD + framing + b"\r\n" + body


@pytest.mark.parametrize("name,data,status,mentions", [
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
])
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
