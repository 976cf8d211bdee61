"""POST /answer end to end: the real fitmd on generated models. Checks request validation (4xx
naming the field), that calibrate:false + reorder:none generates exactly what `fitm generate`
does greedily for the same prompt ids, that the stream concatenates to the non-streamed
answer, that a client leaving mid-stream frees the engine, sampling reproducible from the seed,
stop strings, and the intervention against the numpy oracle (calib.make_hook, same alpha, same
prompt ids -> the same greedy ids on an F32 model).

No assertion depends on wall-clock speed."""
import json
import re
import signal
import socket
import subprocess

import numpy as np
import pytest
import requests

from conftest import build_dir
from oracle import calib
from oracle import model as om
from test_http import AUTH, Daemon, assert_error, docs, fitmd_bin, models, post  # noqa: F401

QUERY = "where is the golf hotel"
# /rerank's prompt as the answer template: on it the random "small" model emits no EOS within
# 400 tokens, which the streaming tests below rely on (the built-in template's worked examples
# make it stop early).
RERANK_FRAME = (r"Write a high-quality answer for the given question using only the provided "
                r"search results (some of which might be irrelevant).\n\nQuestion: {question}"
                r"\n\n{documents}\nQuestion: {question}\nAnswer:")


@pytest.fixture(scope="module")
def daemon(fitmd_bin, models, tmp_path_factory):  # noqa: F811
    d = Daemon(fitmd_bin, models["small"], tmp_path_factory.mktemp("log"), api_keys="test-key-1",
               answer_template=RERANK_FRAME,
               max_documents=16, max_body_bytes=65536, max_answer_tokens=400, http_threads=4,
               queue_depth=4)
    yield d
    assert d.terminate() == 0, d.log_text()


def answer(d, body, **kw):
    return post(d, body, path="/answer", **kw)


def body(**extra):
    b = {"query": QUERY, "documents": docs(3, 8) + [{"text": "golf hotel", "title": "Golf"}],
         "max_tokens": 10}
    b.update(extra)
    return b


def sse_events(resp):
    """The data payloads of an SSE response, in order."""
    out = []
    for line in resp.iter_lines(decode_unicode=False):
        if line.startswith(b"data: "):
            out.append(line[6:].decode("utf-8"))
    return out


@pytest.mark.parametrize("bad,mentions", [
    ({"query": 3}, "'query'"),
    ({"documents": []}, "'documents'"),
    ({"max_tokens": 0}, "'max_tokens'"),
    ({"max_tokens": "many"}, "'max_tokens'"),
    ({"stop": 5}, "'stop'"),
    ({"stop": ["ok", ""]}, "'stop[1]'"),
    ({"stop": ["s"] * 9}, "'stop'"),
    ({"temperature": -1}, "'temperature'"),
    ({"temperature": "hot"}, "'temperature'"),
    ({"top_p": 0}, "'top_p'"),
    ({"top_p": 1.5}, "'top_p'"),
    ({"seed": -1}, "'seed'"),
    ({"seed": 1.5}, "'seed'"),
    ({"calibrate": "yes"}, "'calibrate'"),
    ({"calibration": 3}, "'calibration'"),
    ({"calibration": {"temperature": 0}}, "'calibration.temperature'"),
    ({"calibration": {"layers": [1, "x"]}}, "'calibration.layers[1]'"),
    ({"calibration": {"dummy": ""}}, "'calibration.dummy'"),
    ({"reorder": "sideways"}, "'reorder'"),
    ({"reorder": 1}, "'reorder'"),
    ({"reorder_placement": "middle"}, "'reorder_placement'"),
    ({"reorder_placement": True}, "'reorder_placement'"),
    ({"top_n": -2}, "'top_n'"),
    ({"top_n": 1.5}, "'top_n'"),
    ({"top_n": "2"}, "'top_n'"),
    ({"intervention_layers": []}, "'intervention_layers'"),
    ({"stream": "yes"}, "'stream'"),
    ({"model": 7}, "'model'"),
])
def test_validation(daemon, bad, mentions):
    b = body(**bad)
    r = answer(daemon, b)
    assert_error(r, 400, mentions=mentions)
    assert daemon.healthy()


def test_validation_other(daemon):
    b = body()
    del b["query"]
    assert_error(answer(daemon, b), 400, mentions="'query'")
    assert_error(answer(daemon, "{not json"), 400, code="invalid_json")
    assert_error(answer(daemon, body(intervention_layers=[99])), 400,
                 mentions="intervention_layers[0]")
    assert_error(answer(daemon, body(documents=["d"] * 17)), 422, mentions="documents")
    assert_error(post(daemon, body(), headers={"Authorization": "Bearer nope"}, path="/answer"),
                 401)
    r = requests.get(daemon.url("/answer"), headers=AUTH, timeout=30)
    assert_error(r, 405)


def test_response_shape(daemon):
    r = answer(daemon, body(return_tokens=True))
    assert r.status_code == 200, r.text
    j = r.json()
    assert {"id", "model", "answer", "finish_reason", "documents", "usage", "meta"} <= set(j)
    assert j["finish_reason"] in ("stop", "length")
    assert [d["index"] for d in j["documents"]] == [0, 1, 2, 3]
    assert sorted(d["position"] for d in j["documents"]) == [0, 1, 2, 3]
    assert abs(sum(d["weight"] for d in j["documents"]) - 1) < 1e-6
    u = j["usage"]
    assert u["completion_tokens"] == len(j["tokens"]["completion"]) <= 10
    assert u["prompt_tokens"] == len(j["tokens"]["prompt"])
    # The calibrated scoring (K reference passes) and the generation are all counted.
    assert u["forward_tokens"] > u["prompt_tokens"] + u["completion_tokens"] - 1
    assert set(j["meta"]["timings_ms"]) >= {"queue", "rank", "prefill", "decode", "first_token",
                                            "total"}
    # max_tokens over the server's max_answer_tokens (400) is refused, naming the limit.
    r = answer(daemon, body(max_tokens=1000, stop=None))
    assert r.status_code == 400 and "max_answer_tokens" in r.json()["error"]["message"], r.text


def test_uncalibrated_equals_fitm_generate(daemon, models):  # noqa: F811
    r = answer(daemon, body(calibrate=False, return_tokens=True, max_tokens=16))
    assert r.status_code == 200, r.text
    j = r.json()
    assert all(d["position"] == d["index"] for d in j["documents"])
    prompt = j["tokens"]["prompt"]
    out = subprocess.run([str(build_dir() / "src" / "fitm"), "generate", "-m",
                          str(models["small"]), "--ids", "-n", "16", "-t", "2", "--prompt-ids",
                          ",".join(map(str, prompt))], check=True, capture_output=True, text=True)
    assert [int(x) for x in out.stdout.split()] == j["tokens"]["completion"]


def test_stream_concatenates_to_answer(daemon):
    for extra in ({}, {"calibrate": False}, {"temperature": 0.9, "top_p": 0.8, "seed": 11},
                  {"reorder": "attention"}):
        plain = answer(daemon, body(max_tokens=20, **extra))
        assert plain.status_code == 200, plain.text
        with answer(daemon, body(max_tokens=20, stream=True, **extra), stream=True) as r:
            assert r.status_code == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            ev = sse_events(r)
        assert ev[-1] == "[DONE]"
        final = json.loads(ev[-2])
        deltas = [json.loads(e)["delta"] for e in ev[:-2]]
        assert all(deltas)
        pj = plain.json()
        assert "".join(deltas) == pj["answer"]
        assert final["finish_reason"] == pj["finish_reason"]
        assert final["usage"]["completion_tokens"] == pj["usage"]["completion_tokens"]
        assert final["documents"] == pj["documents"]


def test_reorder_placement_last_reverses_the_order(daemon):
    """reorder_placement "last" puts the documents in the reverse of "first"'s order: the most
    relevant next to the question. Both report where each document went."""
    got = {}
    for placement in ("first", "last"):
        r = answer(daemon, body(max_tokens=4, reorder="attention", reorder_placement=placement))
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["meta"]["reorder_placement"] == placement
        got[placement] = {d["index"]: d["position"] for d in j["documents"]}
    K = len(got["first"])
    assert K > 2 and sorted(got["first"].values()) == list(range(K))
    assert all(got["last"][i] == K - 1 - p for i, p in got["first"].items())
    plain = answer(daemon, body(max_tokens=4)).json()
    assert plain["meta"]["reorder_placement"] == "first"


def test_ignore_eos_generates_past_the_end(daemon):
    """ignore_eos: the answer goes on past an end-of-generation token to max_tokens, and up to
    that token it is the answer that stopped there. Random models stop early often; the test
    looks for a question on which this one does."""
    for i in range(24):
        b = body(query=f"{QUERY} {i}", calibrate=False, return_tokens=True, max_tokens=400)
        j = answer(daemon, b).json()
        n = j["usage"]["completion_tokens"]
        if j["finish_reason"] == "stop" and n < 380:
            break
    else:
        pytest.fail("no question ended with an end-of-generation token")
    k = answer(daemon, dict(b, ignore_eos=True, max_tokens=n + 20)).json()
    assert k["finish_reason"] == "length" and k["usage"]["completion_tokens"] == n + 20
    # the stopped answer's ids end with the EOS token; the continued one holds it there too
    assert k["tokens"]["completion"][:n] == j["tokens"]["completion"][:n]
    assert k["meta"]["seed"] is not None
    r = answer(daemon, body(ignore_eos="yes"))
    assert_error(r, 400, mentions="'ignore_eos'")


def test_sampling_reproducible_from_seed(daemon):
    b = body(temperature=1.5, top_p=0.95, max_tokens=24, calibrate=False, return_tokens=True)
    a1 = answer(daemon, dict(b, seed=7)).json()
    a2 = answer(daemon, dict(b, seed=7)).json()
    assert a1["tokens"]["completion"] == a2["tokens"]["completion"]
    assert a1["meta"]["seed"] == 7
    others = [answer(daemon, dict(b, seed=s)).json()["tokens"]["completion"] for s in (8, 9, 10)]
    assert any(o != a1["tokens"]["completion"] for o in others)
    # An unseeded request reports its seed, and replaying it gives the same answer.
    a3 = answer(daemon, b).json()
    a4 = answer(daemon, dict(b, seed=a3["meta"]["seed"])).json()
    assert a3["answer"] == a4["answer"]


def test_stop_string_not_returned(daemon):
    full = answer(daemon, body(max_tokens=24, calibrate=False)).json()
    text = full["answer"]
    cut = next((i for i in range(3, len(text)) if text[i].isalpha()), None)
    if cut is None:
        pytest.skip("the generated model's answer has no letter to stop at")
    stop = text[cut:cut + 2]
    first = text.find(stop)
    r = answer(daemon, body(max_tokens=24, calibrate=False, stop=["\u00e9\u00e9\u00e9", stop]))
    j = r.json()
    assert j["answer"] == text[:first]
    assert j["finish_reason"] == "stop"
    with answer(daemon, body(max_tokens=24, calibrate=False, stop=stop, stream=True),
                stream=True) as s:
        ev = sse_events(s)
    assert "".join(json.loads(e)["delta"] for e in ev[:-2]) == text[:first]


def queue_idle(d):
    m = requests.get(d.url("/metrics"), timeout=30).text
    vals = {}
    for line in m.splitlines():
        for k in ("fitm_queue_depth", "fitm_inflight_requests"):
            if line.startswith(k + " "):
                vals[k] = float(line.split()[1])
    return vals.get("fitm_queue_depth") == 0 and vals.get("fitm_inflight_requests") == 0


def test_disconnect_mid_stream_frees_engine(daemon):
    """A client that reads one event and hangs up: the generation (400 tokens otherwise) stops,
    the engine goes idle, and the next request is served. Checked by order, not by time: the
    engine runs one job at a time, so the follow-up's answer proves the slot was freed, and
    the completion-token counter shows the cancelled job stopped early."""
    def completion_total():
        for line in requests.get(daemon.url("/metrics"), timeout=30).text.splitlines():
            if line.startswith("fitm_completion_tokens_total "):
                return float(line.split()[1])
        return 0.0
    full = answer(daemon, body(max_tokens=400, calibrate=False)).json()
    assert full["finish_reason"] == "length"  # no EOS: only the disconnect can end it early
    before = completion_total()
    b = json.dumps(body(max_tokens=400, calibrate=False, stream=True)).encode()
    s = socket.create_connection(("127.0.0.1", daemon.port), timeout=60)
    s.sendall(b"POST /answer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key-1\r\n"
              b"Content-Type: application/json\r\nContent-Length: " + str(len(b)).encode() +
              b"\r\n\r\n" + b)
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    s.close()
    r = answer(daemon, body(max_tokens=4, calibrate=False), timeout=120)
    assert r.status_code == 200, r.text
    for _ in range(200):
        if queue_idle(daemon):
            break
    assert queue_idle(daemon)
    # The cancelled stream's tokens are not counted (it failed), only the follow-up's.
    assert completion_total() - before <= 4
    ended = re.findall(r"answer stream ended \(cancelled\) after (\d+) tokens", daemon.log_text())
    assert ended and int(ended[-1]) < 400, daemon.log_text()


def test_top_n_keeps_the_best(daemon):
    """top_n keeps the n most relevant documents of the reorder, in the reorder's order (the best
    where reorder_placement puts it), and the rest have no place, weight or span. The answer is
    the one of a request that sends only those documents, in that order, with no reorder: the
    same prompt, ids, answer and weights (the intervention's too, scored on the kept ones)."""
    b = body(documents=docs(6, 8) + [{"text": "golf hotel", "title": "Golf"}])
    ranked = [x["index"] for x in post(daemon, {"query": QUERY, "documents": b["documents"],
                                                 "method": "attention"}).json()["results"]]
    for placement, calibrate in (("first", False), ("last", False), ("last", True)):
        r = answer(daemon, {**b, "reorder": "attention", "reorder_placement": placement,
                            "top_n": 3, "calibrate": calibrate, "return_tokens": True})
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["meta"]["top_n"] == 3
        kept = ranked[:3] if placement == "first" else ranked[:3][::-1]
        pos = {d["index"]: d["position"] for d in j["documents"]}
        assert [i for p, i in sorted((p, i) for i, p in pos.items() if p is not None)] == kept
        left = [d for d in j["documents"] if d["position"] is None]
        assert len(left) == len(b["documents"]) - 3
        assert all(d["weight"] == 0 for d in left)
        assert all(j["tokens"]["spans"][d["index"]] is None for d in left)
        assert abs(sum(d["weight"] for d in j["documents"]) - 1) < 1e-6
        alone = answer(daemon, {**b, "documents": [b["documents"][i] for i in kept],
                                "reorder": "none", "calibrate": calibrate,
                                "return_tokens": True}).json()
        assert j["tokens"]["prompt"] == alone["tokens"]["prompt"]
        assert j["tokens"]["completion"] == alone["tokens"]["completion"]
        assert j["answer"] == alone["answer"]
        assert [j["documents"][i]["weight"] for i in kept] == \
            [d["weight"] for d in alone["documents"]]
    # Without a reorder: the first n as sent; top_n at or over K keeps every document.
    j = answer(daemon, {**b, "reorder": "none", "top_n": 2}).json()
    assert [d["position"] for d in j["documents"]] == [0, 1] + [None] * (len(b["documents"]) - 2)
    for n in (0, 50):  # 0: every document, as a number at or over K
        j = answer(daemon, {**b, "reorder": "none", "top_n": n}).json()
        assert [d["position"] for d in j["documents"]] == list(range(len(b["documents"])))
        assert j["meta"]["top_n"] == n


@pytest.fixture(scope="module")
def oracle_served(fitmd_bin, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("oracle")
    path = d / "m.gguf"
    subprocess.run([str(build_dir() / "src" / "fitm"), "mkmodel", "--seed", "3", "-q", "-o",
                    str(path), "--arch", "llama", "--type", "F32"], check=True)
    # /rerank's prompt as the answer template, so the scoring pass's rows are the answer
    # prompt's rows and the prefill starts exactly at the end of the documents. One /rerank
    # lane, as an /answer's ranking has, so a /rerank's forward tokens are its scoring's.
    daemon = Daemon(fitmd_bin, path, d, answer_template=RERANK_FRAME, rerank_lanes=1)
    yield daemon, om.Model.load(path)
    assert daemon.terminate() == 0


def oracle_greedy(model, ids, n, hook=None, stop_ids=()):
    """Greedy ids as Model.generate, and the logits row that chose each of them."""
    cache = model.new_cache()
    logits = model.forward(ids, intervene=hook, logits_rows=[len(ids) - 1], cache=cache)[0]
    out, rows = [], []
    while len(out) < n:
        out.append(int(np.argmax(logits)))
        rows.append(logits)
        if out[-1] in stop_ids:
            break
        logits = model.forward(out[-1:], intervene=hook, logits_rows=[cache.n], cache=cache)[0]
    return out, np.array(rows)


@pytest.mark.parametrize("extra", [{}, {"intervention_layers": [0, -1]},
                                   {"reorder": "attention"},
                                   {"reorder": "calibrated", "calibration": {"window": 1}}])
def test_intervention_matches_oracle(oracle_served, extra):
    """The daemon's greedy ids are the oracle's with calib.make_hook (the intervention on every
    row from the end of the last document, in the chosen layers), and calibrate:false gives the
    oracle's ids without it. With the null_suffix reference the scoring leaves the prompt's rows
    up to the end of the documents in the cache, so every row from there on is computed once
    with the intervention: usage.forward_tokens counts exactly the scoring passes (as /rerank
    reports them for the same documents), the prefill from the end of the last document and one
    row per further token, so an intervention starting one row late shows there even where the
    ids do not move (the daemon returns no logits to compare; the oracle's logits show, below,
    that the hook changes every step's logits)."""
    daemon, model = oracle_served
    calibration = {"reference": "null_suffix", **extra.get("calibration", {})}
    b = {"query": QUERY, "documents": docs(4, 7) + [{"text": "golf hotel", "title": "Golf"}],
         "max_tokens": 16, "return_tokens": True, **extra, "calibration": calibration}
    r = requests.post(daemon.url("/answer"), json=b, timeout=300)
    assert r.status_code == 200, r.text
    j = r.json()
    tok = j["tokens"]
    L = model.hp.n_layer
    layers = ([l % L for l in extra["intervention_layers"]] if "intervention_layers" in extra
              else list(range(L // 2, L)))
    pos = sorted(range(len(j["documents"])), key=lambda k: j["documents"][k]["position"])
    spans = [tuple(tok["spans"][k]) for k in pos]
    alpha = np.array([j["documents"][k]["weight"] for k in pos], dtype=np.float32)
    hook = calib.make_hook(spans, alpha, layers)
    eos = [int(model.hp.eos_id)] if getattr(model.hp, "eos_id", None) is not None else []
    n = len(tok["completion"])
    want, rows = oracle_greedy(model, tok["prompt"], n, hook, eos)
    assert want == tok["completion"]
    # the answer prompt's rows the cache already holds: the scoring left the whole prompt up
    # to the end of the documents there
    T, cached = len(tok["prompt"]), max(e for _, e in spans)

    def rerank(documents, method):
        body = {"query": QUERY, "documents": documents, "method": method, **calibration,
                "return_tokens": True}
        rr = requests.post(daemon.url("/rerank"), json=body, timeout=300)
        assert rr.status_code == 200, rr.text
        return rr.json()

    ordered = [b["documents"][k] for k in pos]
    if calibration.get("window") == 1 and extra.get("reorder") == "calibrated":
        # every document scored alone: the reorder's scores are the reordered prompt's, and
        # no second scoring runs
        first = rerank(b["documents"], "calibrated")
        scoring = first["usage"]["forward_tokens"]
        w = {x["index"]: x["weight"] for x in first["results"]}
        assert [j["documents"][k]["weight"] for k in range(len(w))] == \
            pytest.approx([w[k] for k in range(len(w))], rel=1e-6)
        assert pos == [x["index"] for x in first["results"]]  # most relevant first
        # the cache holds the last document's own prompt: only their common head is reused
        last = first["tokens"]["groups"][-1]["prompt"]
        cached = next(i for i, (x, y) in enumerate(zip(last, tok["prompt"])) if x != y)
    else:
        scoring = rerank(ordered, "calibrated")["usage"]["forward_tokens"]
    if "reorder" in extra and extra["reorder"] != "calibrated":
        # one attention pass over the documents in request order first
        scoring += rerank(b["documents"], extra["reorder"])["usage"]["forward_tokens"]
    assert j["usage"]["forward_tokens"] == scoring + (T - cached) + (n - 1), j["usage"]

    # calibrate:false is the oracle without the hook, on the same prompt ids (before any
    # reorder: that needs the calibrated scores), and the hook moves every step's logits far
    # beyond float32 noise (max |difference| > 1e-2, noise ~1e-5): the two are told apart.
    plain = requests.post(daemon.url("/answer"), json=dict(b, calibrate=False), timeout=300).json()
    ptok = plain["tokens"]
    assert ptok["prompt"] == tok["prompt"] or "reorder" in extra
    free, _ = oracle_greedy(model, ptok["prompt"], len(ptok["completion"]), None, eos)
    assert free == ptok["completion"]
    if "reorder" not in extra:
        # the /rerank calls above left this plain prompt's rows in the cache (rows computed
        # under an intervention never count as reusable), so only the last prompt row is
        # recomputed, for its logits
        assert plain["usage"]["forward_tokens"] == 1 + len(free) - 1
    cache = model.new_cache()
    seq = list(tok["prompt"])
    unhooked = [model.forward(seq, logits_rows=[T - 1], cache=cache)[0]]
    for t in tok["completion"][:-1]:
        unhooked.append(model.forward([t], logits_rows=[cache.n], cache=cache)[0])
    diff = np.abs(np.array(unhooked) - rows).max(axis=1)
    assert (diff > 1e-2).all(), diff


GEN_CASES = {
    "gemma3-Q4_K": ["--arch", "gemma3", "--type", "Q4_K"],
    "qwen2-Q8_0": ["--arch", "qwen2", "--type", "Q8_0"],
}


@pytest.mark.parametrize("case", sorted(GEN_CASES))
def test_uncalibrated_equals_fitm_generate_quantized(fitmd_bin, tmp_path, case):  # noqa: F811
    """The same on quantized weights, where the batch (prefill) and step (decode) paths round
    differently: /answer must use the same path for each row as `fitm generate`."""
    path = tmp_path / "m.gguf"
    fitm = str(build_dir() / "src" / "fitm")
    subprocess.run([fitm, "mkmodel", "--seed", "5", "-q", "-o", str(path)] + GEN_CASES[case],
                   check=True)
    d = Daemon(fitmd_bin, path, tmp_path)
    try:
        for extra in ({}, {"reorder": "attention"}):
            b = body(calibrate=False, return_tokens=True, max_tokens=12, **extra)
            r = requests.post(d.url("/answer"), json=b, timeout=300)
            assert r.status_code == 200, r.text
            j = r.json()
            out = subprocess.run([fitm, "generate", "-m", str(path), "--ids", "-n", "12", "-t", "2",
                                  "--prompt-ids", ",".join(map(str, j["tokens"]["prompt"]))],
                                 check=True, capture_output=True, text=True)
            assert [int(x) for x in out.stdout.split()] == j["tokens"]["completion"]
    finally:
        assert d.terminate() == 0


def metric(d, name):
    for line in requests.get(d.url("/metrics"), timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_metrics(daemon):
    answer(daemon, body(max_tokens=3, calibrate=False))
    m = requests.get(daemon.url("/metrics"), timeout=30).text
    assert 'fitm_requests_total{route="answer",code="200"}' in m
    assert metric(daemon, "fitm_completion_tokens_total") >= 1
    assert metric(daemon, "fitm_time_to_first_token_seconds_count") >= 1
    assert 'fitm_time_to_first_token_seconds_bucket{le="+Inf"}' in m


def test_abuse_then_still_serves(daemon):
    assert_error(answer(daemon, '{"query": "q", "documents": ["' + "x" * 70000 + '"]}'), 413)
    assert_error(answer(daemon, b'{"query": "\xff", "documents": ["a"]}'), 400)
    assert_error(answer(daemon, body(stop="\u00e9" * 300)), 400, mentions="'stop'")
    r = post(daemon, json.dumps(body()), path="/v1/answer",
             headers={"Content-Type": "text/plain"})
    assert_error(r, 415)
    r = answer(daemon, body(max_tokens=2, stream=True))  # read whole, not streamed: fine too
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert answer(daemon, body(max_tokens=2)).status_code == 200


def test_sigterm_mid_stream_finishes_it(fitmd_bin, models, tmp_path):  # noqa: F811
    """SIGTERM while a stream is being generated: the daemon drains, the stream still ends
    with its final event and [DONE], and the daemon exits 0."""
    d = Daemon(fitmd_bin, models["small"], tmp_path, drain_timeout_ms=60000,
               answer_template=RERANK_FRAME,
               max_answer_tokens=300)
    try:
        with requests.post(d.url("/answer"), json=body(max_tokens=300, calibrate=False,
                                                       stream=True), stream=True,
                           timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith(b"data: "))
            assert b"delta" in first
            d.proc.send_signal(signal.SIGTERM)
            rest = [line[6:].decode() for line in lines if line.startswith(b"data: ")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["finish_reason"] == "length"
        assert d.proc.wait(60) == 0, d.log_text()
    finally:
        d.kill()
