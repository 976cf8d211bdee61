"""fitmd end to end: the real daemon on 127.0.0.1 with a generated model, driven over HTTP with
`requests` and raw sockets. Covers routes, auth, limits, every bad /rerank input, the response
shape and its arithmetic (forward_tokens = T + sum_k (T - s_k), alpha sums to 1), overload,
deadlines, malformed HTTP, slow clients and SIGTERM while a request runs. After each abuse the
daemon must still answer /health.

No assertion depends on wall-clock speed: slow requests are only used to make requests overlap."""
import concurrent.futures as cf
import gzip
import json
import math
import os
import pathlib
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
import requests

from conftest import ROOT, build_dir

KEY = "test-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 120):
    """Returns once base's /health answers 200; fails when proc exits first or timeout
    seconds pass."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}"
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{base} not healthy after {timeout} s")


class Daemon:
    """One fitmd process. opts become --name=value flags; FITM_* variables are cleared."""

    def __init__(self, binary, model, logdir: pathlib.Path, **opts):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = [str(binary), f"--model={model}", "--host=127.0.0.1", f"--port={self.port}"]
        args += [f"--{k}={v}" for k, v in opts.items()]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
        self.log_path = logdir / f"fitmd-{self.port}.log"
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 60
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"fitmd exited {self.proc.returncode}:\n{self.log_text()}")
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                self.kill()
                pytest.fail(f"fitmd did not become healthy:\n{self.log_text()}")
            time.sleep(0.05)

    def url(self, path: str) -> str:
        return self.base + path

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def wait_log(self, pattern: str, timeout: float = 120):
        """The first match of pattern in the log, waited for: the server logs a request once
        it has sent the response, so the line may follow the client's reading it."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(pattern, self.log_text())
            if m:
                return m
            time.sleep(0.05)
        pytest.fail(f"no log line matching {pattern!r}:\n{self.log_text()[-3000:]}")

    def running(self) -> bool:
        """Whether a request is in flight (per /metrics): one or more."""
        m = re.search(r"^fitm_inflight_requests (\d+)", requests.get(self.url("/metrics")).text,
                      re.M)
        return bool(m) and int(m.group(1)) > 0

    def wait_running(self, timeout=20):
        """Waits until a request is in flight; fails the test after timeout seconds."""
        deadline = time.time() + timeout
        while not self.running():
            if time.time() > deadline:
                pytest.fail(f"no request in flight after {timeout} s:\n{self.log_text()[-3000:]}")
            time.sleep(0.01)

    def healthy(self) -> bool:
        r = requests.get(self.url("/health"), timeout=10)
        return r.status_code == 200 and r.json()["status"] == "ok"

    def terminate(self, timeout=30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def fitmd_bin() -> pathlib.Path:
    p = build_dir() / "src" / "fitmd"
    if not p.exists():
        pytest.fail(f"{p} not built; run meson/ninja first (or set FITM_BUILD_DIR)")
    return p


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    fitm = build_dir() / "src" / "fitm"
    d = tmp_path_factory.mktemp("models")
    out = {}
    for name, extra in (("small", []), ("long", ["--ctx", "4096"])):
        p = d / f"{name}.gguf"
        subprocess.run([str(fitm), "mkmodel", "--arch", "llama", "--type", "F32", "--seed", "1",
                        "-q", "-o", str(p)] + extra, check=True)
        out[name] = p
    return out


@pytest.fixture(scope="module")
def daemon(fitmd_bin, models, tmp_path_factory):
    d = Daemon(fitmd_bin, models["small"], tmp_path_factory.mktemp("log"), api_keys=f"{KEY}, other-key",
               max_documents=16, max_body_bytes=65536, model_name="tiny-llama", http_threads=4)
    yield d
    assert d.terminate() == 0, d.log_text()


def post(d, body, headers=None, path="/rerank", timeout=120, **kw):
    h = dict(AUTH)
    h.update(headers or {})
    if isinstance(body, (dict, list)):
        return requests.post(d.url(path), json=body, headers=h, timeout=timeout, **kw)
    return requests.post(d.url(path), data=body, headers={"Content-Type": "application/json", **h},
                         timeout=timeout, **kw)


def docs(k, n, shift=0):
    return [" ".join(WORDS[(i + j + shift) % len(WORDS)] for j in range(n)) for i in range(k)]


def assert_error(r, status, code=None, mentions=None):
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    assert r.headers.get("X-Request-Id")
    e = r.json()["error"]
    assert set(e) == {"message", "type", "code"}
    assert isinstance(e["message"], str) and e["message"]
    if code:
        assert e["code"] == code, e
    if mentions:
        assert mentions in e["message"], e


# ---- routes ------------------------------------------------------------------------------------

def test_health_and_request_id(daemon):
    r = requests.get(daemon.url("/health"))
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert len(r.headers["X-Request-Id"]) >= 8
    r = requests.get(daemon.url("/health"), headers={"X-Request-Id": "my-trace-42"})
    assert r.headers["X-Request-Id"] == "my-trace-42"
    # probes are logged at debug; a route's request at info carries the client's id
    r = requests.get(daemon.url("/v1/models"), headers={"X-Request-Id": "my-trace-43", **AUTH})
    assert r.headers["X-Request-Id"] == "my-trace-43"
    daemon.wait_log(r"req=my-trace-43 ")


def test_models(daemon):
    r = requests.get(daemon.url("/v1/models"), headers=AUTH)
    assert r.status_code == 200
    m = r.json()["data"][0]
    assert m["id"] == "tiny-llama" and m["object"] == "model"
    assert m["architecture"] == "llama" and m["context_length"] == 1024
    # OpenAI's models.retrieve: the served model by its id, 404 for another, the key asked
    r = requests.get(daemon.url("/v1/models/tiny-llama"), headers=AUTH)
    assert r.status_code == 200 and r.json() == m
    assert_error(requests.get(daemon.url("/v1/models/gpt-4"), headers=AUTH), 404, "not_found",
                 "'gpt-4'")
    assert_error(requests.get(daemon.url("/v1/models/tiny-llama")), 401)


def test_openapi_served(daemon):
    r = requests.get(daemon.url("/openapi.yaml"), headers=AUTH)
    assert r.status_code == 200
    assert r.content == (ROOT / "openapi" / "openapi.yaml").read_bytes()


def test_auth(daemon):
    body = {"query": "q", "documents": ["a"]}
    assert_error(requests.post(daemon.url("/rerank"), json=body), 401, "unauthorized")
    assert_error(post(daemon, body, {"Authorization": "Bearer wrong"}), 401)
    assert_error(post(daemon, body, {"Authorization": "Basic dGVzdA=="}), 401)
    assert_error(requests.get(daemon.url("/v1/models")), 401)
    assert post(daemon, body, {"Authorization": "Bearer other-key"}).status_code == 200
    assert requests.get(daemon.url("/metrics")).status_code == 200
    assert requests.get(daemon.url("/health")).status_code == 200


def test_404_405(daemon):
    assert_error(requests.get(daemon.url("/nope"), headers=AUTH), 404, "not_found")
    assert_error(requests.post(daemon.url("/v3/rerank"), json={}, headers=AUTH), 404)
    r = requests.get(daemon.url("/rerank"), headers=AUTH)
    assert_error(r, 405, "method_not_allowed")
    assert r.headers["Allow"] == "POST, OPTIONS"  # every route answers OPTIONS (RFC 9110)
    r = requests.delete(daemon.url("/health"))
    assert_error(r, 405)
    assert r.headers["Allow"] == "GET, HEAD, OPTIONS"
    assert requests.options(daemon.url("/health")).headers["Allow"] == r.headers["Allow"]
    assert_error(requests.post(daemon.url("/metrics"), json={}), 405)
    # A method that may carry a body gets its 405 with it too (400 "takes no request body"
    # before: a body was refused on every method but POST).
    for method in ("PUT", "PATCH", "DELETE"):
        r = requests.request(method, daemon.url("/v1/rerank"), headers=AUTH,
                             json={"query": "q", "documents": ["a"]})
        assert_error(r, 405, "method_not_allowed")
        assert r.headers["Allow"] == "POST, OPTIONS"


def test_error_messages_are_utf8_whatever_the_client_sent(daemon):
    # Messages quote the client's path or field names; bytes that are not UTF-8, or a
    # character cut by the message's length limit, come back as U+FFFD in valid JSON.
    cases = [(requests.get(daemon.url("/%ff%fe"), headers=AUTH), 404),
             (requests.get(daemon.url("/" + "%C3%A9" * 100), headers=AUTH), 404),
             (post(daemon, b'{"query":"x","documents":["a"],"\xff":1,"\xff":2}'), 400),
             (post(daemon, b'{"query":"x","documents":["a"],"aggregate":"\xe9t\xe9"}'), 400)]
    for r, status in cases:
        assert r.status_code == status, r.content
        e = json.loads(r.content.decode("utf-8"))["error"]  # strict: bad bytes raise here
        assert e["message"] and e["code"]
    assert "\ufffd\ufffd" in json.loads(cases[0][0].content)["error"]["message"]
    assert "\u00e9" * 10 in json.loads(cases[1][0].content)["error"]["message"]


def test_415(daemon):
    r = requests.post(daemon.url("/rerank"), data="query=x", headers={
        **AUTH, "Content-Type": "application/x-www-form-urlencoded"})
    assert_error(r, 415, "unsupported_media_type")
    r = post(daemon, '{"query":"q","documents":["a"]}',
             {"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    # a compressed body is refused, not parsed as if it were the JSON (identity is no coding)
    r = post(daemon, gzip.compress(b'{"query":"q","documents":["a"]}'),
             {"Content-Encoding": "gzip"})
    assert_error(r, 415, "unsupported_media_type", "Content-Encoding")
    r = post(daemon, '{"query":"q","documents":["a"]}', {"Content-Encoding": "identity"})
    assert r.status_code == 200
    assert daemon.healthy()


def test_absolute_form_target(daemon):
    # RFC 9112 3.2.2: a server accepts `POST http://host/path` as `POST /path`
    body = b'{"query":"q","documents":["a","b"]}'
    for target in (b"http://x/rerank", b"HTTP://127.0.0.1:9/rerank"):
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=60) as s:
            s.sendall(b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                      + body)
            out = b""
            while (chunk := s.recv(65536)):
                out += chunk
        assert out.startswith(b"HTTP/1.1 200"), out[:300]
        assert json.loads(out.split(b"\r\n\r\n", 1)[1])["results"]


def test_413(daemon):
    big = '{"query":"q","documents":["' + "x" * 70000 + '"]}'
    assert_error(post(daemon, big), 413, "body_too_large")

    def chunks():  # no Content-Length: the cap is enforced while reading
        yield b'{"query":"q","documents":["'
        for _ in range(40):
            yield b"y" * 4096
        yield b'"]}'
    # The gate answers once the chunk sizes pass the cap, before the server's request
    # handling sees the rest (so without a request id), and closes.
    r = post(daemon, chunks())
    assert r.status_code == 413 and r.headers["Connection"] == "close", r.text
    assert r.json()["error"]["code"] == "body_too_large"
    assert daemon.healthy()


# ---- /rerank ----------------------------------------------------------------------------------

def test_rerank_shape_and_math(daemon):
    body = {"query": "what is golf", "documents": ["golf is a sport", {"text": "kilo lima",
            "title": "Kilo"}, "the echo of the hotel", "papa oscar"],
            "return_documents": True, "return_tokens": True, "model": "tiny-llama",
            "method": "paper"}
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = post(daemon, body, path=path)
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["id"] == r.headers["X-Request-Id"] and j["model"] == "tiny-llama"
        res = j["results"]
        assert sorted(x["index"] for x in res) == [0, 1, 2, 3]
        scores = [x["relevance_score"] for x in res]
        assert scores == sorted(scores, reverse=True)
        assert math.isclose(sum(scores), 1.0, rel_tol=1e-9)
        for x in res:
            assert x["position"] == x["index"]
            assert math.isclose(x["calibrated_attention"], x["attention"] - x["dummy_attention"],
                                rel_tol=1e-9, abs_tol=1e-15)
            d = body["documents"][x["index"]]
            assert x["document"] == (d if isinstance(d, dict) else {"text": d})
        # alpha = softmax(rel / t)
        t = j["meta"]["temperature"]
        assert t == 5e-5
        rel = [x["calibrated_attention"] / t for x in res]
        z = sum(math.exp(v - max(rel)) for v in rel)
        for x, v in zip(res, rel):
            assert math.isclose(x["relevance_score"], math.exp(v - max(rel)) / z, rel_tol=1e-6)
        # forward_tokens = T + sum_k (T - s_k): prefix reuse is visible
        tok = j["tokens"]
        T = len(tok["prompt"])
        assert j["usage"]["prompt_tokens"] == T
        assert j["usage"]["forward_tokens"] == T + sum(T - s for s, _ in tok["spans"])
        for (s, e), dummy in zip(tok["spans"], tok["dummies"]):
            assert 0 < s < e <= T and len(dummy) == e - s
        assert j["meta"]["method"] == "paper" and j["meta"]["layers"] == [0, 1]
        assert set(j["meta"]["timings_ms"]) == {"queue", "tokenize", "forward", "total"}


def test_prefix_reuse_is_exact(daemon):
    """Reference passes on a branch of the prompt's cache give the scores of full passes."""
    body = {"query": "golf", "documents": docs(5, 12) + ["golf hotel"], "return_tokens": True,
            "method": "paper"}
    a = post(daemon, body).json()
    b = post(daemon, {**body, "prefix_reuse": False}).json()
    T = a["usage"]["prompt_tokens"]
    assert b["usage"]["forward_tokens"] == 7 * T
    assert a["usage"]["forward_tokens"] == T + sum(T - s for s, _ in a["tokens"]["spans"])
    assert [x["index"] for x in a["results"]] == [x["index"] for x in b["results"]]
    for x, y in zip(a["results"], b["results"]):
        assert x == y  # bit-identical (DESIGN: a branch's rows are the full pass's rows)


def test_rerank_deterministic_and_order_independent_of_route(daemon):
    body = {"query": "alpha", "documents": docs(5, 12)}
    a, b = post(daemon, body).json(), post(daemon, body, path="/v2/rerank").json()
    assert a["results"] == b["results"]


def test_rerank_top_n_and_attention_method(daemon):
    body = {"query": "alpha", "documents": docs(6, 10), "top_n": 2}
    j = post(daemon, body).json()
    assert len(j["results"]) == 2 and "document" not in j["results"][0]
    full = post(daemon, {**body, "top_n": 6}).json()["results"]
    assert j["results"] == full[:2]
    j = post(daemon, {**body, "method": "attention", "top_n": 6}).json()
    assert j["meta"]["method"] == "attention"
    assert j["usage"]["forward_tokens"] == j["usage"]["prompt_tokens"]  # one pass
    for x in j["results"]:
        assert x["relevance_score"] == x["attention"] and x["dummy_attention"] == 0
    # The calibrated pass's A equals the attention method's A (same prompt, same pass).
    att = {x["index"]: x["attention"] for x in j["results"]}
    cal = post(daemon, {**body, "top_n": 6}).json()["results"]
    for x in cal:
        assert math.isclose(x["attention"], att[x["index"]], rel_tol=1e-6)


def test_rerank_options(daemon):
    base = {"query": "alpha", "documents": docs(4, 10), "method": "paper"}
    j = post(daemon, {**base, "layers": [-1]}).json()
    assert j["meta"]["layers"] == [1]
    j2 = post(daemon, {**base, "temperature": 1.0}).json()
    assert j2["meta"]["temperature"] == 1.0
    assert max(x["relevance_score"] for x in j2["results"]) < 0.3  # t = 1 flattens alpha
    j3 = post(daemon, {**base, "dummy": "zzz", "return_tokens": True}).json()
    j4 = post(daemon, {**base, "return_tokens": True}).json()
    assert j3["tokens"]["dummies"] != j4["tokens"]["dummies"]
    assert j3["tokens"]["prompt"] == j4["tokens"]["prompt"]
    # max_tokens_per_doc truncates every document's span
    j5 = post(daemon, {**base, "max_tokens_per_doc": 3, "return_tokens": True}).json()
    assert all(e - s <= 3 for s, e in j5["tokens"]["spans"])


def test_other_methods(daemon):
    body = {"query": "what is golf", "documents": docs(6, 10) + ["golf is a sport"]}
    j = post(daemon, {**body, "method": "attention_sort"}).json()
    assert j["meta"]["method"] == "attention_sort"
    res = j["results"]
    assert sorted(x["index"] for x in res) == list(range(7))
    assert sorted(x["position"] for x in res) == list(range(7))
    scores = [x["relevance_score"] for x in res]
    assert scores == sorted(scores, reverse=True) and min(scores) > 0
    for x in res:  # mass = per-token mean x tokens
        assert x["relevance_score"] >= x["attention"] > 0
    T = j["usage"]["prompt_tokens"]
    assert j["usage"]["forward_tokens"] == 3 * T  # three passes, same length
    for method in ("query_likelihood", "relevance"):
        j = post(daemon, {**body, "method": method}).json()
        assert j["meta"]["method"] == method
        res = j["results"]
        assert sorted(x["index"] for x in res) == list(range(7))
        assert all(0 < x["relevance_score"] <= 1 for x in res)
        assert all(x["attention"] == 0 and x["position"] == x["index"] for x in res)
        assert j["usage"]["forward_tokens"] > 7
        assert post(daemon, {**body, "method": method}).json()["results"] == res


def test_tei_shape(daemon):
    r = post(daemon, {"query": "alpha", "texts": ["alpha bravo", "kilo"], "return_text": True})
    assert r.status_code == 200
    j = r.json()
    assert isinstance(j, list) and {x["index"] for x in j} == {0, 1}
    assert all(set(x) == {"index", "score", "text"} for x in j)


BAD = [
    ("{", 400, "invalid_json", None),
    ('{"query":"q","documents":["a"]} trailing', 400, "invalid_json", None),
    ("", 400, "invalid_json", None),
    ("[]", 400, "invalid_value", "object"),
    ({"documents": ["a"]}, 400, "invalid_value", "'query'"),
    ({"query": 5, "documents": ["a"]}, 400, "invalid_value", "'query'"),
    ({"query": "", "documents": ["a"]}, 400, "invalid_value", "'query' is empty"),
    ({"query": " \n", "documents": ["a"]}, 400, "invalid_value", "'query' is empty"),
    ({"query": "q"}, 400, "invalid_value", "'documents'"),
    ({"query": "q", "documents": []}, 400, "invalid_value", "'documents' is empty"),
    ({"query": "q", "documents": "a"}, 400, "invalid_value", "'documents'"),
    ({"query": "q", "documents": ["a", 1]}, 400, "invalid_value", "'documents[1]'"),
    ({"query": "q", "documents": [{"title": "t"}]}, 400, "invalid_value", "'documents[0].text'"),
    ({"query": "q", "documents": [{"text": 3}]}, 400, "invalid_value", "'documents[0].text'"),
    ({"query": "q", "documents": [{"text": "a", "title": 3}]}, 400, "invalid_value",
     "'documents[0].title'"),
    ({"query": "q", "documents": ["a"] * 17}, 422, "limit_exceeded", "'documents'"),
    ({"query": "q", "documents": ["a"], "texts": ["b"]}, 400, "invalid_value", "'texts'"),
    ({"query": "q", "texts": [None]}, 400, "invalid_value", "'texts[0]'"),
    ({"query": "q", "documents": ["a", "b"], "top_n": 0}, 400, "invalid_value", "'top_n'"),
    ({"query": "q", "documents": ["a", "b"], "top_n": 1.5}, 400, "invalid_value", "'top_n'"),
    ({"query": "q", "documents": ["a", "b"], "top_n": "1"}, 400, "invalid_value", "'top_n'"),
    ({"query": "q", "documents": ["a"], "return_documents": "yes"}, 400, "invalid_value",
     "'return_documents'"),
    ({"query": "q", "documents": ["a"], "prefix_reuse": "no"}, 400, "invalid_value",
     "'prefix_reuse'"),
    ({"query": "q", "documents": ["a"], "return_tokens": 1}, 400, "invalid_value",
     "'return_tokens'"),
    ({"query": "q", "documents": ["a"], "max_tokens_per_doc": 0}, 400, "invalid_value",
     "'max_tokens_per_doc'"),
    ({"query": "q", "documents": ["a"], "method": "bogus"}, 400, "invalid_value", "'method'"),
    ({"query": "q", "documents": ["a"], "method": 3}, 400, "invalid_value", "'method'"),
    ({"query": "q", "documents": ["a"], "temperature": 0}, 400, "invalid_value", "'temperature'"),
    ({"query": "q", "documents": ["a"], "temperature": "hot"}, 400, "invalid_value",
     "'temperature'"),
    ({"query": "q", "documents": ["a"], "layers": "all"}, 400, "invalid_value", "'layers'"),
    ({"query": "q", "documents": ["a"], "layers": []}, 400, "invalid_value", "'layers'"),
    ({"query": "q", "documents": ["a"], "layers": [0, 2]}, 400, "invalid_value", "'layers[1]'"),
    ({"query": "q", "documents": ["a"], "layers": [-3]}, 400, "invalid_value", "'layers[0]'"),
    ({"query": "q", "documents": ["a"], "dummy": ""}, 400, "invalid_value", "'dummy'"),
    (b'{"query":"\xff\xfe","documents":["a"]}', 400, "invalid_value", "'query' is not valid UTF-8"),
    (b'{"query":"q","documents":["ok","\xc0\xaf"]}', 400, "invalid_value",
     "'documents[1]' is not valid UTF-8"),
    (b'{"query":"q","documents":[{"text":"\xed\xa0\x80"}]}', 400, "invalid_value",
     "'documents[0].text' is not valid UTF-8"),
    ({"query": "q", "documents": [" ".join(WORDS * 8)] * 16}, 422, "limit_exceeded", "context"),
]


@pytest.mark.parametrize("body,status,code,mentions", BAD, ids=range(len(BAD)))
def test_bad_rerank_input(daemon, body, status, code, mentions):
    assert_error(post(daemon, body), status, code, mentions)


def test_still_healthy_after_bad_inputs(daemon):
    assert daemon.healthy()
    assert post(daemon, {"query": "q", "documents": ["a"]}).status_code == 200


def test_concurrent_requests(daemon):
    bodies = [{"query": WORDS[i], "documents": docs(3, 8, i)} for i in range(16)]
    with cf.ThreadPoolExecutor(16) as ex:
        rs = list(ex.map(lambda b: post(daemon, b), bodies))
    assert [r.status_code for r in rs] == [200] * 16
    assert len({r.headers["X-Request-Id"] for r in rs}) == 16
    assert daemon.healthy()


def test_metrics(daemon):
    post(daemon, {"query": "q", "documents": ["a", "b"]})
    post(daemon, {"query": "q"})  # 400; the codes counted do not depend on other tests
    requests.get(daemon.url("/nope"), headers=AUTH)  # 404
    text = requests.get(daemon.url("/metrics")).text
    assert 'fitm_requests_total{route="rerank",code="200"}' in text
    assert 'fitm_requests_total{route="rerank",code="400"}' in text
    assert 'fitm_requests_total{route="other",code="404"}' in text
    assert 'fitm_request_duration_seconds_bucket{route="rerank",le="+Inf"}' in text
    assert "fitm_queue_depth 0" in text and "fitm_queue_capacity 64" in text
    assert "fitm_model_ready 1" in text
    vals = {l.split()[0]: float(l.split()[1]) for l in text.splitlines()
            if l and not l.startswith("#")}
    assert vals["fitm_forward_tokens_total"] > vals["fitm_prompt_tokens_total"] > 0


# ---- abuse over raw sockets ----------------------------------------------------------------------

def raw(d, data: bytes, wait=5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", d.port), timeout=wait) as s:
        s.sendall(data)
        out = b""
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                out += b
        except socket.timeout:
            pass
        return out


@pytest.mark.parametrize("data,status", [
    (b"GARBAGE\r\n\r\n", 400),  # not a request line (JSON: test_resilience.py)
    (b"GET / HTTP/9.9\r\n\r\n", 505),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Without Colon\r\n\r\n", 400),
    (b"POST /rerank HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400),
    (b"POST /rerank HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\n", 4),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 100000 + b"\r\n\r\n", 431),
    (b"\x00\x01\x02\xff" * 20000, 400),  # refused at its first byte, no request line
])
def test_malformed_http(daemon, data, status):
    """Each gets an error status (4: any 4xx) and a closed connection; never a hang or a 200."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while (b := s.recv(65536)):  # a timeout here (a silent, open connection) fails
            out += b
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", out)
    assert m and m.group(1).decode().startswith(str(status)), out[:80]
    # (most answered by the gate in front) an id as every answer has, and counted in /metrics
    head = out.split(b"\r\n\r\n")[0]
    assert re.search(rb"\r\nX-Request-Id: [0-9a-f]{16}(\r\n|$)", head), out[:300]
    code = m.group(1).decode()
    text = requests.get(daemon.url("/metrics")).text
    assert re.search(rf'fitm_requests_total{{route="[a-z_]+",code="{code}"}} [1-9]', text), code
    assert daemon.healthy()


def test_bodiless_refusals_and_preflights_keep_the_connection(daemon):
    """An OPTIONS preflight, a 404, a 405 and a 401 on requests without a body are answered on
    a kept-alive connection (a browser's preflight per request would otherwise cost a new
    connection each); the request after them on the same connection is served."""
    for first in (b"OPTIONS /rerank HTTP/1.1\r\nHost: x\r\n\r\n",
                  b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n",
                  b"DELETE /health HTTP/1.1\r\nHost: x\r\n\r\n",
                  b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"):
        then = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        out = raw(daemon, first + then)
        heads = re.findall(rb"HTTP/1\.1 (\d{3}) ", out)
        assert len(heads) == 2 and heads[-1] == b"200", out[:400]
        assert b"Connection: close" not in out.split(b"HTTP/1.1 200")[0], out[:400]


def test_keepalive_pipelined(daemon):
    req = (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
           b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    out = raw(daemon, req)
    assert out.count(b"HTTP/1.1 200") == 2


# ---- daemons with their own settings ------------------------------------------------------------

def slow_body():
    """About 2,000 prompt tokens and 9 passes: long enough for requests sent together to
    overlap, short enough to keep the suite quick."""
    return {"query": "what is golf", "documents": docs(8, 50)}


def test_slow_client_is_cut_and_others_served(fitmd_bin, models, tmp_path):
    d = Daemon(fitmd_bin, models["small"], tmp_path, http_idle_timeout_s=1)
    try:
        with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:
            s.sendall(b"POST /rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"query\"")
            assert d.healthy()  # served while the slow client holds its connection
            t0 = time.time()
            got = s.recv(1000)
            while got:  # the server closes the silent connection (maybe after a 408)
                got = s.recv(1000)
            assert time.time() - t0 < 9
        assert d.healthy()
    finally:
        assert d.terminate() == 0


def test_long_request_outlives_the_idle_timeout(fitmd_bin, models, tmp_path):
    """A connection waiting for its answer is not idle: the 1 s idle timeout must not cut a
    request the engine takes longer than that to answer."""
    d = Daemon(fitmd_bin, models["long"], tmp_path, http_idle_timeout_s=1)
    try:
        r = post(d, {"query": "golf", "documents": docs(8, 50), "prefix_reuse": False},
                 timeout=600)
        assert r.status_code == 200, r.text
        assert d.healthy()
    finally:
        assert d.terminate() == 0


def test_overload_gives_503_with_retry_after(fitmd_bin, models, tmp_path):
    d = Daemon(fitmd_bin, models["long"], tmp_path, queue_depth=1, http_threads=8)
    try:
        with cf.ThreadPoolExecutor(8) as ex:
            rs = list(ex.map(lambda _: post(d, slow_body()), range(8)))
        codes = [r.status_code for r in rs]
        assert codes.count(200) >= 1 and codes.count(503) >= 1, codes
        assert set(codes) <= {200, 503}, codes
        for r in rs:
            if r.status_code == 503:
                assert_error(r, 503, "unavailable", "queue is full")
                assert r.headers["Retry-After"] == "1"
        assert d.healthy()
        assert post(d, {"query": "q", "documents": ["a"]}).status_code == 200
    finally:
        assert d.terminate() == 0


def scrape(d) -> dict:
    """/metrics' unlabelled samples."""
    out = {}
    for line in requests.get(d.url("/metrics"), timeout=30).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def test_deadline(fitmd_bin, models, tmp_path):
    """A request whose deadline passes while it runs, and one whose deadline passes while it
    waits in the queue, get 503 deadline_exceeded with Retry-After, and the daemon serves on.
    The deadline is made to pass by stopping fitmd (SIGSTOP) for longer than
    request_timeout_ms once the first request is known to run (fitm_inflight_requests): a
    generation of thousands of tokens cannot finish between that scrape and the stop, so the
    outcome does not depend on how fast or loaded the machine is."""
    d = Daemon(fitmd_bin, models["long"], tmp_path, request_timeout_ms=3000, max_running=1,
               max_answer_tokens=3500)
    body = {"query": "what is golf", "documents": docs(2, 8), "max_tokens": 3500,
            "ignore_eos": True}
    try:
        with cf.ThreadPoolExecutor(2) as ex:
            rs = [ex.submit(post, d, body, path="/answer") for _ in range(2)]
            deadline = time.time() + 60
            while True:
                m = scrape(d)
                if m["fitm_inflight_requests"] >= 1 and m["fitm_queue_depth"] >= 1:
                    break
                assert not any(r.done() for r in rs), [r.result().text for r in rs if r.done()]
                assert time.time() < deadline, m
                time.sleep(0.002)
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(3.5)
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            rs = [r.result() for r in rs]
        for r in rs:
            assert_error(r, 503, None)
            assert r.json()["error"]["code"] == "deadline_exceeded", r.text
            assert "Retry-After" in r.headers
        assert d.healthy()
    finally:
        assert d.terminate() == 0


def test_sigterm_mid_request_finishes_it(fitmd_bin, models, tmp_path):
    d = Daemon(fitmd_bin, models["long"], tmp_path, drain_timeout_ms=60000)
    result = {}

    def client():
        result["r"] = post(d, slow_body())

    t = threading.Thread(target=client)
    t.start()
    deadline = time.time() + 20
    while time.time() < deadline:  # wait until the engine runs it
        m = requests.get(d.url("/metrics")).text
        if "fitm_inflight_requests 1" in m:
            break
        time.sleep(0.01)
    d.proc.send_signal(signal.SIGTERM)
    t.join(120)
    rc = d.proc.wait(60)
    d.log.close()
    assert rc == 0, d.log_text()
    r = result["r"]
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 8
    assert "draining" in d.log_text() and "stopped" in d.log_text()


def test_sigterm_drain_timeout_cancels(fitmd_bin, models, tmp_path):
    d = Daemon(fitmd_bin, models["long"], tmp_path, drain_timeout_ms=0)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", post(d, slow_body())))
    t.start()
    d.wait_running()
    d.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert d.proc.wait(60) == 0
    d.log.close()
    r = result["r"]
    assert r.status_code in (200, 503)  # 200 only if it finished in the instant before
    if r.status_code == 503:
        assert_error(r, 503)


def test_bad_model_is_a_clear_startup_error(fitmd_bin, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    port = free_port()
    p = subprocess.run([str(fitmd_bin), f"--model={bad}", f"--port={port}"], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 1
    assert str(bad) in p.stderr
    p = subprocess.run([str(fitmd_bin), f"--model={tmp_path / 'missing.gguf'}"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and "missing.gguf" in p.stderr


def test_config_errors_quote_the_value(fitmd_bin, tmp_path):
    p = subprocess.run([str(fitmd_bin), "--port", "99999"], capture_output=True, text=True)
    assert p.returncode == 2 and "'99999'" in p.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    env["FITM_QUEUE_DEPTH"] = "many"
    p = subprocess.run([str(fitmd_bin)], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "FITM_QUEUE_DEPTH" in p.stderr and "'many'" in p.stderr


def test_config_file_documents_every_option(fitmd_bin):
    """config/fitmd.conf is `fitmd --print-config` with the defaults: regenerate it with
    `fitmd --print-config > config/fitmd.conf` when the option table changes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    p = subprocess.run([str(fitmd_bin), "--print-config"], capture_output=True, text=True,
                       env=env, check=True)
    assert (ROOT / "config" / "fitmd.conf").read_text() == p.stdout
    help_text = subprocess.run([str(fitmd_bin), "--help"], capture_output=True, text=True).stdout
    for line in p.stdout.splitlines():
        if line and not line.startswith("#"):
            assert f"--{line.split(' = ')[0]}" in help_text


# ---- live responses against openapi/openapi.yaml -------------------------------------------------

def spec_validator():
    yaml = pytest.importorskip("yaml")
    jsonschema = pytest.importorskip("jsonschema")
    spec = yaml.safe_load((ROOT / "openapi" / "openapi.yaml").read_text())

    def to_json_schema(s):  # OpenAPI 3.0's `nullable` -> JSON Schema
        if isinstance(s, list):
            return [to_json_schema(x) for x in s]
        if not isinstance(s, dict):
            return s
        s = {k: to_json_schema(v) for k, v in s.items()}
        if s.pop("nullable", False):
            return {"anyOf": [s, {"type": "null"}]}
        return s

    root = to_json_schema(spec)

    def check(path, method, r):
        op = spec["paths"][path][method]
        resp = op["responses"].get(str(r.status_code))
        assert resp is not None, f"{method.upper()} {path} -> {r.status_code} is not in the spec"
        if "$ref" in resp:
            resp = spec["components"]["responses"][resp["$ref"].split("/")[-1]]
        for h in resp.get("headers", {}):
            assert h in r.headers or h.startswith("Access-Control-"), h
        if "content" not in resp:  # a documented empty answer (204)
            assert r.content == b"", r.content[:200]
            return
        ctype = r.headers["Content-Type"].split(";")[0]
        content = resp["content"]
        assert ctype in content, (ctype, list(content))
        if ctype == "application/json":
            schema = to_json_schema(content[ctype]["schema"])
            validator = jsonschema.Draft7Validator({**root, **schema})
            errors = list(validator.iter_errors(r.json()))
            assert not errors, errors[0]
    return check


def test_responses_follow_the_spec(daemon):
    check = spec_validator()
    good = {"query": "alpha", "documents": docs(3, 5) + [{"text": "x", "title": "T"}],
            "return_documents": True, "return_tokens": True, "top_n": 3}
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        check(path, "post", post(daemon, good, path=path))
        check(path, "post", post(daemon, {**good, "method": "attention"}, path=path))
        check(path, "post", post(daemon, {"query": "q", "texts": ["a", "b"]}, path=path))
    for body, *_ in BAD:
        check("/rerank", "post", post(daemon, body))
    check("/rerank", "post", requests.post(daemon.url("/rerank"), json=good))
    check("/rerank", "post", post(daemon, "x" * 70000))
    check("/rerank", "post", requests.post(daemon.url("/rerank"), data="a=b", headers={
        **AUTH, "Content-Type": "text/plain"}))
    check("/health", "get", requests.get(daemon.url("/health")))
    check("/metrics", "get", requests.get(daemon.url("/metrics")))
    check("/v1/models", "get", requests.get(daemon.url("/v1/models"), headers=AUTH))
    for name in ("tiny-llama", "another"):
        check("/v1/models/{id}", "get",
              requests.get(daemon.url(f"/v1/models/{name}"), headers=AUTH))
    check("/v1/models", "get", requests.get(daemon.url("/v1/models")))
    check("/openapi.yaml", "get", requests.get(daemon.url("/openapi.yaml"), headers=AUTH))


def test_health_503_while_loading(fitmd_bin, models, tmp_path):
    """The scoring profile is a FIFO: loading blocks in its open() until the test writes, so
    the server is up with the model still loading. Writing garbage then makes the load fail:
    the daemon exits 2 (a profile the model cannot take is a configuration error) and says
    why. (A model path that is a FIFO is refused before listening:
    test_resilience.py -k non_regular_model.)"""
    fifo = tmp_path / "m.profile"
    os.mkfifo(fifo)
    port = free_port()
    log = open(tmp_path / "fitmd.log", "w+")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    proc = subprocess.Popen([str(fitmd_bin), f"--model={models['small']}", f"--profile={fifo}",
                             f"--port={port}"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while True:
            try:
                r = requests.get(base + "/health", timeout=5)
                break
            except requests.ConnectionError:
                assert time.time() < deadline and proc.poll() is None
                time.sleep(0.05)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = requests.post(base + "/rerank", json={"query": "q", "documents": ["a"]})
        assert_error(r, 503, "unavailable", "loading")
        assert r.headers["Retry-After"] == "1"
        assert "fitm_model_ready 0" in requests.get(base + "/metrics").text
        try:
            with open(fifo, "wb") as f:
                f.write(b"not a gguf file at all")
        except BrokenPipeError:
            pass  # the loader may refuse the text and close the FIFO before (or while) we write
        assert proc.wait(30) == 2
        log.seek(0)
        assert str(fifo) in log.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_model_url_download(fitmd_bin, models, tmp_path):
    import functools
    import http.server
    src = tmp_path / "srv"
    src.mkdir()
    (src / "m.gguf").write_bytes(models["small"].read_bytes())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(src))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        dest = tmp_path / "dl" / "model.gguf"
        dest.parent.mkdir()
        d = Daemon(fitmd_bin, dest, tmp_path, model_url=url + "/m.gguf")
        try:
            assert dest.read_bytes() == models["small"].read_bytes()
            assert not (tmp_path / "dl" / "model.gguf.part").exists()
            assert post(d, {"query": "q", "documents": ["a", "b"]}).status_code == 200
        finally:
            assert d.terminate() == 0
        env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
        p = subprocess.run([str(fitmd_bin), f"--model={tmp_path / 'x.gguf'}",
                            f"--model-url={url}/missing.gguf", f"--port={free_port()}"],
                           capture_output=True, text=True, timeout=60, env=env)
        assert p.returncode == 1 and "missing.gguf" in p.stderr and "404" in p.stderr
        assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.part").exists()
    finally:
        httpd.shutdown()
