"""/rerank against the independent numpy oracle: for a request answered by the real daemon
(with return_tokens), the oracle recomputes every score from the returned prompt ids, spans,
question spans, dummy ids and null prompts with its own forward pass (tests/oracle/calib:
score_documents for method paper, score_options for the scoring options of `calibrated` and
`attention`), and the daemon's numbers must agree. The options expected are written here from
the spec (built-in defaults overlaid by the request), not read back from the response.
Runs on generated llama, qwen2 and gemma3 models; the gemma3 model has a short sliding window
so some documents fall outside the local layers' view. Each model twice: the daemon's cache of
F32 values against the exact oracle, and its cache of fp16 values (the CPU's default) against
the oracle with keys and values rounded to float16 as that cache holds them. Documents are
fresh random words on every run (the seed is in the failure message).

Tolerances, derived from float32: the daemon computes attention in float32 (softmax over at
most a few hundred keys, sums over at most a few dozen rows and tokens), so A and A_ref agree
to rtol 2e-4. rel inherits delta = 2e-4 (|A| + |A_ref|) (difference) or 2e-4 x 2 (log_ratio,
A / (A + eps) <= 1); rel_scaled n x that; weight, to first order, w (exp(2 max delta / t) - 1);
relevance_score score_scale x delta / 4 (the sigmoid's slope is at most 1/4)."""
import math
import re
import subprocess

import numpy as np
import pytest
import requests

from conftest import build_dir
from oracle import calib
from oracle import model as om
from test_http import WORDS, Daemon

CASES = {
    "llama": ["--arch", "llama", "--type", "F32"],
    "gemma3": ["--arch", "gemma3", "--type", "F32", "--swa", "48", "--layers", "6", "--dim", "128",
               "--heads", "2", "--kv-heads", "1", "--head-dim", "64", "--ff", "256"],
    "qwen2": ["--arch", "qwen2", "--type", "F32"],
}
RTOL = 2e-4
# An fp16 cache: the oracle rounds K and V to float16 as the daemon does, but a value that
# float32 and float64 put on either side of a rounding midpoint lands one fp16 ulp (2^-10
# relative) apart, and such flips move A. Measured (gemma3, rows last, layers [0, -1]): at
# worst 1.5e-3 relative over 92 requests, where the unrounded oracle is up to 4.5e-3 away;
# llama and qwen2 1.8e-5 (unrounded 1.7e-4). So 5e-3: fp16's precision, end to end (the
# kernels' exactness on fp16 values is test_backend_ops's).
RTOL_HALF = 5e-3


# /rerank lanes of the served daemons: its windows are scored on lanes of their own (a lane's
# first window computes its prompt afresh), against the oracle's windows one by one.
LANES = 3


@pytest.fixture(scope="module", params=[(a, kv) for a in sorted(CASES) for kv in ("f32", "f16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def served(request, tmp_path_factory):
    arch, kv = request.param
    d = tmp_path_factory.mktemp(f"{arch}-{kv}")
    path = d / "m.gguf"
    subprocess.run([str(build_dir() / "src" / "fitm"), "mkmodel", "--seed", "3", "-q", "-o",
                    str(path)] + CASES[arch], check=True)
    daemon = Daemon(build_dir() / "src" / "fitmd", path, d, kv_cache_type=kv, rerank_lanes=LANES)
    daemon.model_path = path
    model = om.Model.load(path)
    model.kv_half = kv == "f16"
    yield daemon, model, arch
    assert daemon.terminate() == 0


# float32 bound on an attention mass A (relative): unit roundoff u = 2^-24 times the longest
# chain of float32 accumulations behind it, n ~ 6 layers x (a 256-long dot product + a 300-key
# softmax sum) ~ 3300, gamma_n = n u ~ 2e-4 (measured: 7e-6 at worst). ATOL_A only for A ~ 0.
RTOL_A, ATOL_A = 2e-4, 1e-12
def random_request(seed: int, K: int = 6):
    rng = np.random.default_rng(seed)
    words = lambda n: " ".join(rng.choice(WORDS, size=n))  # noqa: E731
    documents = [{"text": words(int(rng.integers(4, 12))), "title": words(1)} for _ in range(K)]
    return words(5), documents


def builtin(L: int) -> dict:
    """The built-in scoring defaults (score.h) for a model of L layers."""
    first, n = math.floor(L * 5 / 18), max(1, math.floor(L * 3 / 18 + 0.5))
    return {"rows": "question", "layers": [min(first + i, L - 1) for i in range(n)],
            "heads": None, "aggregate": "sum", "skip_first": 0, "reference": "null_suffix",
            "dummy_source": "fixed", "form": "difference", "head_query": "query",
            "sink_factor": 0.0, "window": 0,
            "temperature": 0.05, "score_scale": 20.0, "score_bias": 0.0}


VARIANTS = [
    ("calibrated", {}),
    ("calibrated", {"reference": "null_query"}),
    ("calibrated", {"rows": "last", "reference": "dummy", "aggregate": "mean", "layers": [0, -1]}),
    ("calibrated", {"reference": "null_suffix", "rows": "suffix"}),
    ("calibrated", {"reference": "null_suffix", "prefix_reuse": False}),
    ("calibrated", {"reference": "both", "dummy_source": "documents", "form": "log_ratio"}),
    ("calibrated", {"window": 4, "reference": "dummy", "dummy": "lima lima"}),
    ("calibrated", {"window": 2, "rows": "suffix", "temperature": 0.5, "score_scale": 3.0,
                    "score_bias": -0.5}),
    ("calibrated", {"sink_factor": 1.5, "skip_first": 2, "aggregate": "mean"}),
    ("calibrated", {"heads": [[0, 1], [-1, 0]], "reference": "none"}),
    ("calibrated", {"head_query": "null", "window": 1, "reference": "null_query"}),
    ("calibrated", {"head_query": "null", "reference": "null_suffix", "window": 2}),
    ("attention", {"rows": "last"}),
]


def shared_head(a: list, b: list) -> int:
    """The number of leading ids prompts a and b have in common. A window group continues
    the cache the group before it left from there, short of its last document's end (every
    scored row lies after it; the caller caps it)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_forward(groups, reference: str, reuse: bool = True, lanes: int = 1) -> int:
    """The forward tokens of the groups' passes on `lanes` lanes (rerank_lanes): lane l takes
    the groups [l G / n, (l + 1) G / n), n = min(lanes, G), and its first group computes its
    prompt from row 0 instead of continuing the group before it."""
    total = 0
    prev = []
    n = min(lanes, len(groups))
    firsts = {l * len(groups) // n for l in range(n)}
    for i, g in enumerate(groups):
        if i in firsts:
            prev = []
        T, spans = len(g["prompt"]), g["spans"]
        total += T - (min(shared_head(prev, g["prompt"]), spans[-1][1]) if reuse else 0)
        prev = g["prompt"]
        if reference in ("dummy", "both"):
            total += sum(T - (s if reuse else 0) for s, _ in spans)
        if reference in ("null_query", "both"):
            total += len(g["null_prompt"])
        if reference == "null_suffix":
            total += len(g["null_prompt"]) - (spans[-1][1] if reuse else 0)
    return total


def check_structure(j, o, K, model):
    tok = j["tokens"]
    groups = tok["groups"]
    starts = calib.window_groups(K, o["window"])
    assert [g["first_document"] for g in groups] == starts[:-1]
    assert [len(g["spans"]) for g in groups] == [b - a for a, b in zip(starts, starts[1:])]
    bodies = {}
    for g in groups:
        ids = g["prompt"]
        for j_, (s, e) in enumerate(g["spans"]):
            bodies[g["first_document"] + j_] = ids[s:e]
        q0, q1 = g["question"]
        assert g["spans"][-1][1] < q0 < q1 < len(ids)
        if "null_prompt" in g:  # the same documents, the query replaced
            n = g["null_prompt"]
            assert [n[s:e] for s, e in g["null_spans"]] == [ids[s:e] for s, e in g["spans"]]
            assert n[g["null_question"][0]:g["null_question"][1]] != ids[q0:q1]
            # the question spans hold exactly the query and "N/A": what follows them is the
            # same in both prompts, and (null_suffix) so is everything before them
            nq0, nq1 = g["null_question"]
            assert n[nq1:] == ids[q1:]
            # Before the documents: the query, or (head_query null) "N/A" as in the whole
            # null_query prompt
            if o["reference"] in ("null_query", "both"):
                same = n[:g["null_spans"][0][0]] == ids[:g["spans"][0][0]]
                assert same == (o["head_query"] == "null")
            if o["reference"] == "null_suffix":
                end = g["spans"][-1][1]
                assert n[:end] == ids[:end]
                assert n[:nq0] == ids[:q0]
    if o["reference"] in ("dummy", "both"):
        for g in groups:
            for j_, (s, e) in enumerate(g["spans"]):
                d = g["dummies"][j_]
                assert len(d) == e - s
                if o["dummy_source"] == "documents":
                    k = g["first_document"] + j_
                    assert d == calib.documents_dummy([bodies[i] for i in range(K)], k, e - s)
    return groups


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_options_match_oracle(served, variant):
    daemon, model, arch = served
    rtol = RTOL_HALF if model.kv_half else RTOL
    method, extra = VARIANTS[variant]
    seed = int(np.random.SeedSequence().entropy % 2**32)
    query, documents = random_request(seed)
    K = len(documents)
    body = {"query": query, "documents": documents, "method": method, "return_tokens": True,
            **extra}
    r = requests.post(daemon.url("/rerank"), json=body, timeout=300)
    assert r.status_code == 200, r.text
    j = r.json()
    L = model.hp.n_layer
    o = builtin(L)
    o.update({k: v for k, v in extra.items() if k in o})
    if "temperature" in extra and "score_scale" not in extra:
        o["score_scale"] = 20.0  # the server's stays: relevance_score does not follow t
    if method == "attention":
        o["reference"] = "none"
    meta = j["meta"]
    for key in ("rows", "aggregate", "skip_first", "reference", "form", "head_query", "window",
                "temperature", "score_scale", "score_bias", "sink_factor"):
        assert meta[key] == o[key], (key, meta[key], o[key])
    want_layers = sorted({h[0] % L for h in o["heads"]} if o["heads"] else
                         {l % L for l in o["layers"]})
    assert meta["layers"] == want_layers
    groups = check_structure(j, o, K, model)
    assert j["usage"]["forward_tokens"] == expected_forward(
        groups, o["reference"], extra.get("prefix_reuse", True), LANES), seed

    ref = calib.score_options(model, groups, o, K)
    got = sorted(j["results"], key=lambda x: x["index"])
    A = np.array([x["attention"] for x in got])
    R = np.array([x["dummy_attention"] for x in got])
    np.testing.assert_allclose(A, ref["A"], rtol=rtol, atol=1e-9, err_msg=f"seed {seed}")
    if o["reference"] != "none":
        np.testing.assert_allclose(R, ref["A_ref"], rtol=rtol, atol=1e-9, err_msg=f"seed {seed}")
        delta = (2 * rtol if o["form"] == "log_ratio"
                 else rtol * (np.abs(ref["A"]) + np.abs(ref["A_ref"]))) + 1e-9
        rel = np.array([x["calibrated_attention"] for x in got])
        np.testing.assert_array_less(np.abs(rel - ref["rel"]), delta + 1e-12, f"seed {seed}")
    else:
        delta = rtol * np.abs(ref["A"]) + 1e-9
        if o["form"] == "log_ratio":
            delta = np.full(K, rtol + 1e-9)
    n_max = max(len(g["spans"]) for g in groups)
    d_scaled = float(np.max(delta)) * n_max
    w = np.array([x["weight"] for x in got])
    w_tol = ref["weight"] * (math.exp(2 * d_scaled / o["temperature"]) - 1) + 1e-12
    np.testing.assert_array_less(np.abs(w - ref["weight"]), w_tol, f"seed {seed}")
    score = np.array([x["relevance_score"] for x in got])
    if method == "attention":
        np.testing.assert_allclose(score, ref["A"], rtol=rtol, atol=1e-9)
    else:
        s_tol = abs(o["score_scale"]) * d_scaled / 4 + 1e-12
        np.testing.assert_array_less(np.abs(score - ref["relevance"]), s_tol, f"seed {seed}")
    order = [x["index"] for x in j["results"]]
    assert [x["relevance_score"] for x in j["results"]] == sorted(score, reverse=True)
    assert sorted(order) == list(range(K))
    if arch == "gemma3":
        # a window of 48 tokens: the first documents are outside the local layers' view
        assert len(groups[0]["prompt"]) - 1 - groups[0]["spans"][0][0] >= 48 or o["window"]


PAPER = [{}, {"temperature": 1e-3, "dummy": "lima lima"}, {"layers": [0, -1]}]


@pytest.mark.parametrize("variant", range(len(PAPER)))
def test_paper_matches_oracle(served, variant):
    """Method paper: today's recipe (last row, K dummy passes, mean, difference, alpha =
    softmax(rel / t)) recomputed by calib.score_documents."""
    daemon, model, arch = served
    rtol_a = RTOL_HALF if model.kv_half else RTOL_A
    extra = PAPER[variant]
    query, documents = random_request(int(np.random.SeedSequence().entropy % 2**32))
    body = {"query": query, "documents": documents, "method": "paper", "return_tokens": True,
            **extra}
    r = requests.post(daemon.url("/rerank"), json=body, timeout=300)
    assert r.status_code == 200, r.text
    j = r.json()
    tok = j["tokens"]
    spans = [tuple(s) for s in tok["spans"]]
    L = model.hp.n_layer
    layers = None if "layers" not in extra else sorted({l % L for l in extra["layers"]})
    assert j["meta"]["layers"] == (layers or calib.default_score_layers(model.hp))
    t = extra.get("temperature", 5e-5)
    assert j["meta"]["temperature"] == t and j["meta"]["rows"] == "last"
    ref = calib.score_documents(model, tok["prompt"], spans, tok["dummies"], t=t, layers=layers)
    by_index = sorted(j["results"], key=lambda x: x["index"])
    A = np.array([x["attention"] for x in by_index])
    np.testing.assert_allclose(A, ref["A"], rtol=rtol_a, atol=ATOL_A)
    A_dum = np.array([x["dummy_attention"] for x in by_index])
    np.testing.assert_allclose(A_dum, ref["A_dum"], rtol=rtol_a, atol=ATOL_A)
    # rel = A - A_dum: the daemon's own difference (to JSON's printed digits), and the
    # oracle's rel within the sum of the two attentions' bounds.
    rel = np.array([x["calibrated_attention"] for x in by_index])
    assert (np.abs(rel - (A - A_dum)) <= 1e-12 * (np.abs(A) + np.abs(A_dum))).all()
    eps = rtol_a * (np.abs(ref["A"]) + np.abs(ref["A_dum"])) + 2 * ATOL_A
    assert (np.abs(rel - ref["rel"]) <= eps).all(), (rel, ref["rel"], eps)
    # alpha = softmax(rel / t): d log alpha_k = (d rel_k - sum_j alpha_j d rel_j) / t, so
    # |d log alpha_k| <= 2 max(eps) / t.
    alpha = np.array([x["relevance_score"] for x in by_index])
    tol = ref["alpha"] * np.expm1(2 * eps.max() / t) + 1e-12
    assert (np.abs(alpha - ref["alpha"]) <= tol).all(), (alpha, ref["alpha"], tol)
    assert abs(alpha.sum() - 1) <= 1e-12
    np.testing.assert_allclose([x["weight"] for x in by_index], alpha, rtol=0, atol=0)
    T = len(tok["prompt"])
    assert j["usage"]["forward_tokens"] == T + sum(T - s for s, _ in spans)
    if arch == "gemma3":
        # a window of 48 tokens: the first documents are outside the local layers' view
        assert len(tok["prompt"]) - 1 - spans[0][0] >= 48


RESTRICT = " We can get the answer to this question in the given documents."


def tokenize(path, text: str, *flags) -> list:
    """The ids `fitm tokenize` gives text with flags (the prompt pieces' own encodings)."""
    out = subprocess.run([str(build_dir() / "src" / "fitm"), "tokenize", "-m", str(path),
                          *flags, "--", text], check=True, capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def ql_prompt(path, text: str, query: str) -> tuple:
    """Query likelihood's prompt for one document as docs/scoring.md writes it: BOS, the text,
    "\\n\\nQuestion:", " {query}" + RESTRICT. (ids, the document's span, the first id of the
    question, the question's leading ids that " {query}" alone also begins with)."""
    head = tokenize(path, "")
    body = tokenize(path, text, "--no-bos")
    sep = tokenize(path, "\n\nQuestion:", "--no-bos", "--continuation")
    q = tokenize(path, f" {query}{RESTRICT}", "--no-bos", "--continuation")
    alone = tokenize(path, f" {query}", "--no-bos", "--continuation")
    n_query = shared_head(q, alone)
    ids = head + body + sep + q
    return ids, (len(head), len(head) + len(body)), len(ids) - len(q), n_query


def ql_oracle(daemon, model, text: str, query: str, layers: list) -> tuple:
    """The oracle's query likelihood of text: (the question's mean log-probability, the mean
    attention its query's rows pay the text over every head of layers, the ids fed)."""
    ids, (s, e), q0, n_query = ql_prompt(daemon.model_path, text, query)
    assert n_query > 0
    fed = ids[:-1]  # the question's last id is predicted, never fed
    rows = list(range(q0, q0 + n_query))
    logits = model.forward(fed, capture_rows=rows, logits_rows=list(range(q0 - 1, len(fed))))
    logits = logits.astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    lp = np.mean(logits[np.arange(len(logits)), ids[q0:]] - logz)
    P = np.stack(model.attn, axis=0)  # (L, H, rows, T)
    return lp, P[layers, :, :, s:e].sum(-1).mean(), len(fed)


def fused_score(got: list, fa: float, fb: float) -> np.ndarray:
    """fused's score of each result, from relevance_score = sigmoid(fa x score + fb): compared
    as the score, since a generated model's scores put relevance_score near 0, where an
    absolute tolerance would accept any score."""
    r = np.array([x["relevance_score"] for x in got], dtype=np.float64)
    return (np.log(r) - np.log1p(-r) - fb) / fa


@pytest.mark.parametrize("extra", [{}, {"fuse_weight": 0.7, "fuse_layers": [0, -1]}],
                         ids=["defaults", "weight-layers"])
def test_fused_matches_oracle(served, extra):
    """Method fused: per document one query-likelihood prompt, the mean log-probability of its
    question and the attention its query's rows pay to the document (the mean over those rows
    and every head of the fuse layers of the mass on the document's tokens) recomputed by the
    oracle's forward pass; score = that log-probability + w x the z-score of the attention,
    relevance_score = sigmoid(fuse_scale x score + fuse_bias), meta's (the built-in ones)."""
    daemon, model, arch = served
    rtol_a = RTOL_HALF if model.kv_half else RTOL_A
    seed = int(np.random.SeedSequence().entropy % 2**32)
    query, documents = random_request(seed)
    body = {"query": query, "documents": documents, "method": "fused", **extra}
    r = requests.post(daemon.url("/rerank"), json=body, timeout=300)
    assert r.status_code == 200, r.text
    j = r.json()
    L, H = model.hp.n_layer, model.hp.n_head
    layers = sorted({l % L for l in extra.get("fuse_layers", [0])})
    w = extra.get("fuse_weight", 0.02)
    assert (j["meta"]["method"], j["meta"]["layers"], j["meta"]["fuse_weight"]) == \
        ("fused", layers, w), seed
    got = sorted(j["results"], key=lambda x: x["index"])
    A, lp, forward = [], [], 0
    for d in documents:
        p_lp, p_a, p_fed = ql_oracle(daemon, model, d["text"], query, layers)
        lp.append(p_lp)
        A.append(p_a)
        forward += p_fed
    np.testing.assert_allclose([x["attention"] for x in got], A, rtol=rtol_a, atol=ATOL_A,
                               err_msg=f"seed {seed}")
    # The score: the oracle's mean log-probability plus w x the z-score of the daemon's own
    # attention (its rounding is the line above's). float32 logits of about 10 agree to 1e-4
    # absolute; an fp16 cache's rounding flips (RTOL_HALF above) move them up to 1e-3.
    a = np.array([x["attention"] for x in got])
    z = (a - a.mean()) / a.std() if a.std() > 0 else np.zeros_like(a)
    fa, fb = j["meta"]["fuse_scale"], j["meta"]["fuse_bias"]
    assert (fa, fb) == (3.06908, 6.35162), seed  # the built-in fit (no profile here)
    np.testing.assert_allclose(fused_score(got, fa, fb), np.array(lp) + w * z,
                               rtol=0, atol=1e-3 if model.kv_half else 1e-4,
                               err_msg=f"seed {seed}")
    assert all(x["calibrated_attention"] == 0 and x["dummy_attention"] == 0 for x in got)
    assert [x["index"] for x in j["results"]] == \
        sorted(range(len(got)), key=lambda i: (-got[i]["relevance_score"], i))
    assert j["usage"]["forward_tokens"] == forward


def test_fused_sentences_matches_oracle(served):
    """passages = sentences: a document of three sentences or more scores the best mean
    log-probability over its whole text and its first sentence joined by a space to each
    later one (sentences split here after ".", "!" or "?" and whitespace), each its own
    oracle prompt; fused's attention is the whole text's; every passage's fed ids count."""
    daemon, model, arch = served
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    query, _ = random_request(seed)
    words = lambda n: " ".join(rng.choice(WORDS, size=n))  # noqa: E731
    ends = [".", "!", "?"]
    gaps = [" ", "  ", "\n"]
    documents = ["".join(words(int(rng.integers(2, 5))) + ends[int(rng.integers(0, 3))] +
                         (gaps[int(rng.integers(0, 3))] if i < n - 1 else "") for i in range(n))
                 for n in (1, 2, 3, 4, 5)]
    body = {"query": query, "documents": documents, "method": "fused", "passages": "sentences"}
    r = requests.post(daemon.url("/rerank"), json=body, timeout=300)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["meta"]["passages"] == "sentences", seed
    got = sorted(j["results"], key=lambda x: x["index"])
    A, lp, forward = [], [], 0
    for text in documents:
        sents = [x for x in re.split(r"(?<=[.!?])\s+", text) if x]
        passages = [text] + ([sents[0] + " " + x for x in sents[1:]] if len(sents) >= 3 else [])
        scored = [ql_oracle(daemon, model, p, query, [0]) for p in passages]
        lp.append(max(x[0] for x in scored))
        A.append(scored[0][1])
        forward += sum(x[2] for x in scored)
    assert j["usage"]["forward_tokens"] == forward, seed
    rtol_a = RTOL_HALF if model.kv_half else RTOL_A
    np.testing.assert_allclose([x["attention"] for x in got], A, rtol=rtol_a, atol=ATOL_A,
                               err_msg=f"seed {seed}")
    a = np.array([x["attention"] for x in got])
    z = (a - a.mean()) / a.std() if a.std() > 0 else np.zeros_like(a)
    fa, fb = j["meta"]["fuse_scale"], j["meta"]["fuse_bias"]
    np.testing.assert_allclose(fused_score(got, fa, fb), np.array(lp) + 0.02 * z,
                               rtol=0, atol=1e-3 if model.kv_half else 1e-4,
                               err_msg=f"seed {seed}")
