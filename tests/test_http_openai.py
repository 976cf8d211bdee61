"""fitmd's OpenAI routes (POST /v1/chat/completions, /v1/completions) and its Kubernetes drain,
end to end on a generated model (no chat template: the raw transcript prompt).

References are independent of the routes under test: the transcript fitm documents for a model
without a chat template is sent to /v1/completions as a plain prompt, and its token count is
`fitm tokenize`'s; a chat with documents is compared with /answer given the same question and
documents. Streams are compared with the whole response."""
import datetime
import json
import signal
import subprocess
import threading
import time

import pytest
import requests

from test_http import (AUTH, Daemon, assert_error, build_dir, docs, post, slow_body,
                       spec_validator)

DOCS = ["alpha bravo charlie delta echo", "golf hotel india juliet kilo",
        "lima mike november oscar papa"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = tmp_path_factory.mktemp("oai") / "m.gguf"
    subprocess.run([str(build_dir() / "src" / "fitm"), "mkmodel", "--arch", "llama", "--seed",
                    "3", "-q", "-o", str(p)], check=True)
    return p


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    d = Daemon(build_dir() / "src" / "fitmd", model, tmp_path_factory.mktemp("log"),
               api_keys="test-key-1", model_name="tiny")
    yield d
    assert d.terminate() == 0, d.log_text()


def chat(d, **body):
    return post(d, body, path="/v1/chat/completions")


def complete(d, **body):
    return post(d, body, path="/v1/completions")


def sse(r):
    """The data payloads of an event stream, [DONE] last."""
    assert r.headers["Content-Type"] == "text/event-stream"
    text = r.content.decode("utf-8")  # SSE is UTF-8 (requests would guess Latin-1)
    out = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


def n_tokens(model, text):
    p = subprocess.run([str(build_dir() / "src" / "fitm"), "tokenize", "-m", str(model), text],
                       capture_output=True, text=True, check=True)
    return len(p.stdout.split())


def test_chat_is_the_transcript_for_a_model_without_template(daemon, model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "what is "},
                                         {"type": "text", "text": "golf"}]}]
    r = chat(daemon, messages=msgs, max_tokens=6, temperature=0, model="gpt-4o")
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["object"] == "chat.completion" and j["model"] == "tiny"
    assert j["id"].startswith("chatcmpl-")
    transcript = "system: Be brief.\nuser: hi there\nassistant: hello\nuser: what is golf\n" \
                 "assistant:"
    ref = complete(daemon, prompt=transcript, max_tokens=6, temperature=0).json()
    assert j["choices"][0]["message"] == {"role": "assistant",
                                          "content": ref["choices"][0]["text"]}
    assert j["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
    assert j["usage"]["prompt_tokens"] == n_tokens(model, transcript) == \
        ref["usage"]["prompt_tokens"]
    assert j["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"] >= 1
    assert "documents" not in j


def test_completions_shape_and_seed(daemon, model):
    a = complete(daemon, prompt=["once upon a time"], max_tokens=5, seed=11, temperature=1.5)
    b = complete(daemon, prompt="once upon a time", max_tokens=5, seed=11, temperature=1.5)
    assert a.status_code == 200, a.text
    ja, jb = a.json(), b.json()
    assert ja["object"] == "text_completion" and ja["id"].startswith("cmpl-")
    assert ja["choices"][0]["text"] == jb["choices"][0]["text"]  # same seed, same draw
    assert ja["usage"]["prompt_tokens"] == n_tokens(model, "once upon a time")
    u = ja["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_stream_matches_whole(daemon):
    body = dict(messages=[{"role": "user", "content": "tell me about lima"}], max_tokens=10,
                temperature=0)
    whole = chat(daemon, **body).json()
    events = sse(chat(daemon, stream=True, stream_options={"include_usage": True}, **body))
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"]
               for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finals = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == \
        whole["choices"][0]["finish_reason"]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    # Completions stream: text pieces, no usage chunk unless asked.
    ref = complete(daemon, prompt="golf", max_tokens=6, temperature=0).json()
    events = sse(complete(daemon, prompt="golf", max_tokens=6, temperature=0, stream=True))
    assert "".join(e["choices"][0]["text"] for e in events) == ref["choices"][0]["text"]
    assert all("usage" not in e for e in events)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/answer"])
def test_stream_refused_before_its_first_event_is_an_http_error(daemon, path):
    """A streamed request the engine refuses before any event (its prompt over the context) is
    answered with the HTTP error a plain request gets, not a 200 whose stream holds the error:
    OpenAI clients raise it at create(), not mid-iteration. On the OpenAI routes that error is
    OpenAI's (400 context_length_exceeded, which LangChain's ContextOverflowError looks for),
    on /answer fitm's (422 limit_exceeded). A stream that starts still answers 200."""
    long = "golf hotel " * 3000
    body = ({"messages": [{"role": "user", "content": long}]} if "chat" in path
            else {"prompt": long} if path == "/v1/completions"
            else {"query": long, "documents": DOCS})
    for stream in (False, True):
        r = post(daemon, {**body, "max_tokens": 2, "stream": stream}, path=path)
        if path.startswith("/v1/"):
            assert_error(r, 400, "context_length_exceeded", "over the context")
        else:
            assert_error(r, 422, "limit_exceeded", "over the context")
    ok = ({"messages": [{"role": "user", "content": "golf"}]} if "chat" in path
          else {"prompt": "golf"} if path == "/v1/completions"
          else {"query": "golf", "documents": DOCS})
    r = post(daemon, {**ok, "max_tokens": 2, "stream": True}, path=path)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


def test_usage_never_exceeds_the_context(model, tmp_path):
    """prompt_tokens + completion_tokens stays within the context (as OpenAI counts it): a
    prompt one token short of it gets one token, and one that fills it is refused with
    context_length_exceeded (it used to get one more token, total = context + 1)."""
    d = Daemon(build_dir() / "src" / "fitmd", model, tmp_path, ctx_size=48)
    try:
        words, used = 1, 0
        while used < 47:  # grow the prompt until it is one token short of the context
            r = complete(d, prompt="golf " * words, max_tokens=1)
            if r.status_code != 200:
                break
            used = r.json()["usage"]["prompt_tokens"]
            words += 1
        assert used == 47, (words, used, r.text)
        r = complete(d, prompt="golf " * (words - 1), max_tokens=8, ignore_eos=True)
        u = r.json()["usage"]
        assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (47, 1, 48), u
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = complete(d, prompt="golf " * words, max_tokens=1)
        assert_error(r, 400, "context_length_exceeded", "over the context")
    finally:
        assert d.terminate() == 0


def test_stop_string(daemon):
    ref = complete(daemon, prompt="india", max_tokens=12, temperature=0).json()
    text = ref["choices"][0]["text"]
    if len(text) < 4:
        pytest.skip("the model's answer is too short to cut")
    stop = text[2:4]
    r = complete(daemon, prompt="india", max_tokens=12, temperature=0, stop=[stop]).json()
    assert r["choices"][0]["text"] == text[:text.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_stop_at_the_start_streams_empty_content(daemon):
    # No token comes before the stop: the one chunk carries the role and content "", as the
    # whole response's message does, not a delta without content.
    msgs = [{"role": "user", "content": "india"}]
    whole = chat(daemon, messages=msgs, max_tokens=8, temperature=0, seed=3).json()
    text = whole["choices"][0]["message"]["content"]
    if not text:
        pytest.skip("the model said nothing to stop at")
    body = dict(messages=msgs, max_tokens=8, temperature=0, seed=3, stop=[text[0]])
    assert chat(daemon, **body).json()["choices"][0]["message"]["content"] == ""
    events = [e for e in sse(chat(daemon, stream=True, **body)) if e["choices"]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_documents_give_the_calibrated_answer(daemon):
    q = "what is golf"
    r = chat(daemon, messages=[{"role": "system", "content": "ignored with documents"},
                               {"role": "user", "content": q}],
             documents=DOCS, max_tokens=6, temperature=0, seed=5)
    assert r.status_code == 200, r.text
    j = r.json()
    ref = post(daemon, {"query": q, "documents": DOCS, "max_tokens": 6, "temperature": 0,
                        "seed": 5}, path="/answer").json()
    assert j["choices"][0]["message"]["content"] == ref["answer"]
    assert j["documents"] == ref["documents"]
    assert j["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    # calibrate false: uniform weights; reorder moves the positions.
    j = chat(daemon, messages=[{"role": "user", "content": q}], documents=DOCS, max_tokens=2,
             calibrate=False, reorder="calibrated").json()
    assert [d["weight"] for d in j["documents"]] == pytest.approx([1 / 3] * 3)
    assert sorted(d["position"] for d in j["documents"]) == [0, 1, 2]
    # Streamed with documents: the weights ride on the final chunk.
    events = sse(complete(daemon, prompt=q, documents=DOCS, max_tokens=3, temperature=0,
                          stream=True))
    assert [e for e in events if "documents" in e][0]["documents"] == \
        post(daemon, {"query": q, "documents": DOCS, "max_tokens": 3},
             path="/answer").json()["documents"]


@pytest.mark.parametrize("path,body,status,mentions", [
    ("/v1/chat/completions", {"messages": []}, 400, "'messages'"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "'messages[0].role'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400,
     "'messages[0].content'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 422, "'messages[0].content'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400,
     "'n'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "temperature": 2.5}, 400, "'temperature'"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}],
                              "documents": ["d"]}, 400, "user message"),
    # a blank question is refused as /answer's 'query' is
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"},
                                           {"role": "user", "content": " \n"}],
                              "documents": ["d"]}, 400, "the last user message is empty"),
    ("/v1/completions", {"prompt": "   ", "documents": ["d"]}, 400, "'prompt' is empty"),
    ("/v1/completions", {"prompt": "x", "seed": 2 ** 53}, 400, "'seed'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "stream_options": 1}, 400, "'stream_options'"),
    ("/v1/completions", {"prompt": 5}, 400, "'prompt'"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "'prompt'"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "'max_tokens'"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "'stop[0]'"),
    # The options of the calibrated answer are checked with or without documents.
    ("/v1/completions", {"prompt": "x", "max_tokens_per_doc": 0}, 400, "'max_tokens_per_doc'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "intervention_layers": ""}, 400, "'intervention_layers'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "calibrate": "yes"}, 400, "'calibrate'"),
    ("/v1/completions", {"prompt": "x", "reorder": "best"}, 400, "'reorder'"),
    ("/v1/completions", {"prompt": "x", "calibration": {"layers": "all"}}, 400,
     "'calibration.layers'"),
])
def test_validation(daemon, path, body, status, mentions):
    assert_error(post(daemon, body, path=path), status, mentions=mentions)
    assert daemon.healthy()


def test_responses_follow_the_spec(daemon):
    check = spec_validator()
    msgs = [{"role": "user", "content": "golf"}]
    for path, base in (("/v1/chat/completions", {"messages": msgs}),
                       ("/v1/completions", {"prompt": "golf"})):
        check(path, "post", post(daemon, {**base, "max_tokens": 3}, path=path))
        check(path, "post", post(daemon, {**base, "max_tokens": 3, "documents": DOCS}, path=path))
        check(path, "post", post(daemon, {**base, "stream": True, "max_tokens": 2}, path=path))
        check(path, "post", post(daemon, {**base, "n": 3}, path=path))
        check(path, "post", requests.post(daemon.url(path), json=base, timeout=30))


def test_auth_and_metrics(daemon):
    r = requests.post(daemon.url("/v1/chat/completions"),
                      json={"messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert_error(r, 401)
    m = requests.get(daemon.url("/metrics"), timeout=30).text
    assert 'fitm_requests_total{route="chat_completions",code="200"}' in m
    assert 'fitm_requests_total{route="completions",code="200"}' in m


# ---- drain as Kubernetes expects ---------------------------------------------------------------

def test_drain_keeps_listening(tmp_path):
    """SIGTERM with a request in flight: /health answers 503 "draining" (never a refused
    connection) until the process exits, new inference gets 503 + Retry-After, the request in
    flight finishes with 200, the exit status is 0."""
    fitm = build_dir() / "src" / "fitm"
    model = tmp_path / "long.gguf"
    subprocess.run([str(fitm), "mkmodel", "--arch", "llama", "--type", "F32", "--seed", "1",
                    "-q", "-o", str(model), "--ctx", "4096"], check=True)
    d = Daemon(build_dir() / "src" / "fitmd", model, tmp_path, drain_timeout_ms=60000)
    result, polls = {}, []
    t = threading.Thread(target=lambda: result.setdefault(
        "r", requests.post(d.url("/rerank"), json={**slow_body(), "documents": docs(8, 120)},
                           timeout=300)))
    t.start()
    d.wait_running()
    d.proc.send_signal(signal.SIGTERM)
    refused = None
    while d.proc.poll() is None:
        try:
            r = requests.get(d.url("/health"), timeout=10)
            polls.append((r.status_code, r.json()["status"], t.is_alive()))
        except requests.ConnectionError:
            if d.proc.poll() is None and t.is_alive():
                refused = time.time()
            break
        if [p[1] for p in polls].count("draining") == 2:
            late = requests.post(d.url("/v1/completions"), json={"prompt": "x"}, timeout=10)
            assert_error(late, 503)
            assert late.headers["Retry-After"] == "1"
            assert "draining" in late.json()["error"]["message"]
        time.sleep(0.02)
    t.join(300)
    assert d.proc.wait(60) == 0
    d.log.close()
    # The server logs a request's line before it counts the request done, and closes its
    # listener only once none is open; the client's thread may still be reading the answer
    # when a poll is refused. So a refusal counts only if it came before the server logged
    # the answer (one clock; the log truncates to the millisecond, hence 5 ms).
    if refused is not None:
        line = next(l for l in d.log_text().splitlines() if "POST /rerank -> 200" in l)
        answered = datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00"))
        assert refused >= answered.timestamp() - 0.005, \
            f"refused while the request was in flight ({answered.timestamp() - refused:.3f} s)"
    # The first polls may land before the signal is handled; from the first "draining" on,
    # every answer is 503 draining, at least some while the request was still running.
    first = next(i for i, p in enumerate(polls) if p[1] == "draining")
    assert all(p[:2] == (200, "ok") for p in polls[:first]), polls
    assert all(p[:2] == (503, "draining") for p in polls[first:]), polls
    assert len(polls) - first >= 3 and polls[first][2], (polls, d.log_text())
    assert result["r"].status_code == 200, result["r"].text
    assert "draining" in d.log_text() and "stopped" in d.log_text()
