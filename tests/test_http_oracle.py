"""/rerank against the independent numpy oracle: for a request answered by the real daemon
(with return_tokens), the oracle recomputes A, A_dum, rel and alpha from the returned prompt
ids, spans and dummy ids with its own forward pass (tests/oracle/calib.score_documents), and
the daemon's numbers must agree. Runs on generated llama and gemma3 models; the gemma3 model
has a short sliding window so some documents fall outside the local layers' view."""
import subprocess

import numpy as np
import pytest
import requests

from conftest import build_dir
from oracle import calib
from oracle import model as om
from test_http import Daemon, docs

CASES = {
    "llama": ["--arch", "llama", "--type", "F32"],
    "gemma3": ["--arch", "gemma3", "--type", "F32", "--swa", "48", "--layers", "6", "--dim", "128",
               "--heads", "2", "--kv-heads", "1", "--head-dim", "64", "--ff", "256"],
    "qwen2": ["--arch", "qwen2", "--type", "F32"],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    path = d / "m.gguf"
    subprocess.run([str(build_dir() / "src" / "fitm"), "mkmodel", "--seed", "3", "-q", "-o",
                    str(path)] + CASES[request.param], check=True)
    daemon = Daemon(build_dir() / "src" / "fitmd", path, d)
    yield daemon, om.Model.load(path), request.param
    assert daemon.terminate() == 0


# float32 bound on an attention mass A (relative): unit roundoff u = 2^-24 times the longest
# chain of float32 accumulations behind it, n ~ 6 layers x (a 256-long dot product + a 300-key
# softmax sum) ~ 3300, gamma_n = n u ~ 2e-4 (measured: 7e-6 at worst). ATOL_A only for A ~ 0.
RTOL_A, ATOL_A = 2e-4, 1e-12

VARIANTS = [
    ("calibrated", {}),
    ("calibrated", {"temperature": 1e-3, "dummy": "lima lima"}),
    ("calibrated", {"layers": [0, -1]}),
    ("attention", {}),
]


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_scores_match_oracle(served, variant):
    daemon, model, arch = served
    method, extra = VARIANTS[variant]
    body = {"query": "where is the golf hotel", "documents": docs(5, 9) + [{"text": "golf hotel",
            "title": "Golf"}], "method": method, "return_tokens": True, **extra}
    r = requests.post(daemon.url("/rerank"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    j = r.json()
    tok = j["tokens"]
    spans = [tuple(s) for s in tok["spans"]]
    L = model.hp.n_layer
    layers = None if "layers" not in extra else sorted({l % L for l in extra["layers"]})
    if layers is None:
        assert j["meta"]["layers"] == calib.default_score_layers(model.hp)
    else:
        assert j["meta"]["layers"] == layers
    dummies = tok["dummies"] if method == "calibrated" else [tok["prompt"][s:e] for s, e in spans]
    ref = calib.score_documents(model, tok["prompt"], spans, dummies,
                                t=j["meta"].get("temperature", calib.DEFAULT_T), layers=layers)
    by_index = sorted(j["results"], key=lambda x: x["index"])
    A = np.array([x["attention"] for x in by_index])
    np.testing.assert_allclose(A, ref["A"], rtol=RTOL_A, atol=ATOL_A)
    if method == "calibrated":
        A_dum = np.array([x["dummy_attention"] for x in by_index])
        np.testing.assert_allclose(A_dum, ref["A_dum"], rtol=RTOL_A, atol=ATOL_A)
        # rel = A - A_dum: the daemon's own difference (to JSON's printed digits), and the
        # oracle's rel within the sum of the two attentions' bounds.
        rel = np.array([x["calibrated_attention"] for x in by_index])
        assert (np.abs(rel - (A - A_dum)) <= 1e-12 * (np.abs(A) + np.abs(A_dum))).all()
        eps = RTOL_A * (np.abs(ref["A"]) + np.abs(ref["A_dum"])) + 2 * ATOL_A
        assert (np.abs(rel - ref["rel"]) <= eps).all(), (rel, ref["rel"], eps)
        # alpha = softmax(rel / t): d log alpha_k = (d rel_k - sum_j alpha_j d rel_j) / t, so
        # |d log alpha_k| <= 2 max(eps) / t.
        alpha = np.array([x["relevance_score"] for x in by_index])
        t = j["meta"]["temperature"]
        tol = ref["alpha"] * np.expm1(2 * eps.max() / t) + 1e-12
        assert (np.abs(alpha - ref["alpha"]) <= tol).all(), (alpha, ref["alpha"], tol)
        assert abs(alpha.sum() - 1) <= 1e-12
        T = len(tok["prompt"])
        assert j["usage"]["forward_tokens"] == T + sum(T - s for s, _ in spans)
    else:
        np.testing.assert_allclose([x["relevance_score"] for x in by_index], ref["A"], rtol=2e-4)
    if arch == "gemma3":
        # a window of 48 tokens: the first documents are outside the local layers' view
        assert len(tok["prompt"]) - 1 - spans[0][0] >= 48
