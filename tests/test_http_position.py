"""position_method on /rerank and /answer through the real fitmd (docs/position-methods.md): each
method answers on a generated model with a MoICE sidecar of random routers, the response says
which method ran, the methods change the scores, the server default applies to requests that
name none, moice without a sidecar is a 400 naming the field, attention_buckets runs every
rerank method and /answer (streamed too) and is a 422 on the CUDA backend, and a sidecar made
for another model stops fitmd at start with the field that differs. The numerics are checked
against the oracle in test_position_methods.py."""
import json
import subprocess

import pytest
import requests

from conftest import build_dir
from oracle import model as om
from oracle import moice_sidecar as ms
from test_http import Daemon, assert_error, docs, fitmd_bin, free_port, post  # noqa: F401

QUERY = "where is the golf hotel"
METHODS = ("none", "moice", "ms_poe", "attention_buckets")


@pytest.fixture(scope="module")
def model4(tmp_path_factory):
    """A 4-layer llama (Ms-PoE leaves the first two layers plain) and a sidecar for it."""
    d = tmp_path_factory.mktemp("pos")
    p = d / "m.gguf"
    subprocess.run([str(build_dir() / "src" / "fitm"), "mkmodel", "--arch", "llama", "--type",
                    "F32", "--seed", "3", "--layers", "4", "-q", "-o", str(p)], check=True)
    m = om.Model.load(p)
    base = ms.base_identity(p)
    bases = {l: [m.hp.rope_base * f for f in (1.0, 1.8, 2.5)] for l in (1, 2, 3)}
    sc = d / "m.moice"
    ms.write(sc, base, bases, ms.random_routers(base, bases, 7, scale=2.0), 2,
             train={"seed": 7, "data": "random routers for tests"})
    return p, sc


@pytest.fixture(scope="module")
def daemon(fitmd_bin, model4, tmp_path_factory):  # noqa: F811
    d = Daemon(fitmd_bin, model4[0], tmp_path_factory.mktemp("log"), api_keys="test-key-1",
               moice=model4[1])
    yield d
    assert d.terminate() == 0, d.log_text()


def rerank_body(**extra):
    b = {"query": QUERY, "documents": docs(4, 10) + ["the golf hotel is by the lake"],
         "method": "attention", "layers": [2, 3]}  # Ms-PoE changes layers >= 2
    b.update(extra)
    return b


def test_rerank_each_method(daemon):
    scores = {}
    for m in METHODS:
        r = post(daemon, rerank_body(position_method=m))
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["meta"]["position_method"] == m
        scores[m] = sorted((x["index"], x["relevance_score"]) for x in j["results"])
    assert scores["moice"] != scores["none"]
    assert scores["ms_poe"] != scores["none"]
    assert scores["attention_buckets"] != scores["none"]
    # the default is the server's (none here), and asking again gives the same scores
    r = post(daemon, rerank_body())
    assert r.json()["meta"]["position_method"] == "none"
    assert sorted((x["index"], x["relevance_score"]) for x in r.json()["results"]) == \
        scores["none"]
    r = post(daemon, rerank_body(position_method="moice"))
    assert sorted((x["index"], x["relevance_score"]) for x in r.json()["results"]) == \
        scores["moice"]


def test_rerank_calibrated_with_moice(daemon):
    r = post(daemon, rerank_body(method="calibrated", position_method="moice"))
    assert r.status_code == 200, r.text
    assert r.json()["meta"]["position_method"] == "moice"


def _scores(r):
    assert r.status_code == 200, r.text
    return sorted((x["index"], x["relevance_score"]) for x in r.json()["results"])


@pytest.mark.parametrize("method", ("calibrated", "paper", "query_likelihood",
                                    "attention_sort"))
def test_buckets_every_rerank_method(daemon, method):
    """Calibrated (with its reference passes), paper, query_likelihood (on the aggregated
    log p^) and attention_sort all run with buckets, and the buckets change their scores."""
    body = rerank_body(method=method)
    if method == "paper":
        body.pop("layers")
    got = post(daemon, dict(body, position_method="attention_buckets"))
    assert got.json()["meta"]["position_method"] == "attention_buckets"
    assert _scores(got) != _scores(post(daemon, dict(body, position_method="none")))
    # the same request again gives the same scores (the bucket caches hold no stale rows)
    assert _scores(post(daemon, dict(body, position_method="attention_buckets"))) == \
        _scores(got)


def test_buckets_answer_streams_and_changes_the_answer(daemon):
    b = {"query": QUERY, "documents": docs(3, 8) + ["golf hotel"], "max_tokens": 8,
         "position_method": "attention_buckets", "ignore_eos": True}
    plain = post(daemon, b, path="/answer")
    assert plain.status_code == 200, plain.text
    pj = plain.json()
    assert pj["meta"]["position_method"] == "attention_buckets"
    assert pj["usage"]["completion_tokens"] == 8
    with post(daemon, dict(b, stream=True), path="/answer", stream=True) as r:
        assert r.status_code == 200
        ev = [ln[6:].decode() for ln in r.iter_lines() if ln.startswith(b"data: ")]
    assert ev[-1] == "[DONE]"
    assert "".join(json.loads(e)["delta"] for e in ev[:-2]) == pj["answer"]
    # the calibrated weights of the documents come from the rerank under the same method
    none = post(daemon, dict(b, position_method="none"), path="/answer").json()
    assert [d["weight"] for d in none["documents"]] != [d["weight"] for d in pj["documents"]]


def test_answer_each_method(daemon):
    outs = {}
    for m in METHODS:
        r = post(daemon, {"query": QUERY, "documents": docs(3, 8) + ["golf hotel"],
                          "max_tokens": 6, "position_method": m}, path="/answer")
        assert r.status_code == 200, r.text
        assert r.json()["meta"]["position_method"] == m
        outs[m] = r.json()
    assert all(o["usage"]["completion_tokens"] >= 1 for o in outs.values())


def test_bad_position_methods(daemon):
    r = post(daemon, rerank_body(position_method="sideways"))
    assert_error(r, 400, mentions="position_method")
    r = post(daemon, rerank_body(position_method=3))
    assert_error(r, 400, mentions="position_method")


def test_moice_without_sidecar_is_400_and_default(fitmd_bin, model4, tmp_path):  # noqa: F811
    d = Daemon(fitmd_bin, model4[0], tmp_path, api_keys="test-key-1", position_method="ms_poe")
    try:
        r = post(d, rerank_body(position_method="moice"))
        assert_error(r, 400, mentions="position_method")
        r = post(d, {"query": QUERY, "documents": docs(2, 5), "max_tokens": 2,
                     "position_method": "moice"}, path="/answer")
        assert_error(r, 400, mentions="position_method")
        r = post(d, rerank_body())
        assert r.status_code == 200 and r.json()["meta"]["position_method"] == "ms_poe"
    finally:
        assert d.terminate() == 0, d.log_text()


def test_buckets_as_the_server_default(fitmd_bin, model4, tmp_path):  # noqa: F811
    d = Daemon(fitmd_bin, model4[0], tmp_path, api_keys="test-key-1",
               position_method="attention_buckets")
    try:
        r = post(d, rerank_body())
        assert r.status_code == 200, r.text
        assert r.json()["meta"]["position_method"] == "attention_buckets"
        r = post(d, rerank_body(position_method="none"))
        assert r.json()["meta"]["position_method"] == "none"
    finally:
        assert d.terminate() == 0, d.log_text()


def test_mismatched_sidecar_stops_fitmd(fitmd_bin, model4, tmp_path):  # noqa: F811
    p, _ = model4
    m = om.Model.load(p)
    base = ms.base_identity(p)
    base["sha256"] = "ab" * 32
    bases = {1: [m.hp.rope_base, m.hp.rope_base * 2]}
    bad = tmp_path / "bad.moice"
    ms.write(bad, base, bases, ms.random_routers(base, bases, 1), 1)
    r = subprocess.run([str(fitmd_bin), f"--model={p}", f"--moice={bad}",
                        f"--port={free_port()}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2  # a configuration error: restarting cannot fix it
    assert "base.sha256" in r.stdout + r.stderr
    r = subprocess.run([str(fitmd_bin), f"--model={p}", "--position_method=moice",
                        f"--port={free_port()}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "moice" in r.stdout + r.stderr


def test_cuda_backend_runs_position_methods(fitmd_bin, model4, tmp_path):  # noqa: F811
    """The CUDA backend runs every position method (build/tests/fitmd_cuda_emu, the emulated
    device): its attention takes the mixture (moice, ms_poe) and sums the passes' captures
    (attention_buckets); /rerank gives the CPU daemon's scores within float rounding, and
    scores that differ from none's."""
    from test_http_cuda_emu import OPTS, start
    emu = build_dir() / "tests" / "fitmd_cuda_emu"
    if not emu.exists():
        pytest.skip(f"{emu} not built")
    p, sc = model4
    g = start(emu, p, tmp_path, backend="cuda", moice=sc, **OPTS)
    c = Daemon(fitmd_bin, p, tmp_path, api_keys="test-key-1", moice=sc)
    try:
        got = {}
        for m in ("none", "moice", "ms_poe", "attention_buckets"):
            per = []
            for d in (c, g):
                r = post(d, rerank_body(position_method=m))
                assert r.status_code == 200, r.text
                assert r.json()["meta"]["position_method"] == m
                per.append(sorted((x["index"], x["relevance_score"]) for x in r.json()["results"]))
            (ic, sc_c), (ig, sc_g) = zip(*per[0]), zip(*per[1])
            assert ic == ig
            assert max(abs(a - b) for a, b in zip(sc_c, sc_g)) < 1e-3, (m, per)
            got[m] = sc_g
        assert max(abs(a - b) for a, b in zip(got["ms_poe"], got["none"])) > 1e-3
        assert max(abs(a - b) for a, b in zip(got["moice"], got["none"])) > 1e-3
        assert max(abs(a - b) for a, b in zip(got["attention_buckets"], got["none"])) > 1e-3
    finally:
        assert g.terminate() == 0, g.log_text()
        assert c.terminate() == 0, c.log_text()
