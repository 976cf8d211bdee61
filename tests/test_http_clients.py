"""Third-party rerank clients pointed at fitmd, unchanged: the `cohere` SDK (v1 Client ->
/v1/rerank, v2 ClientV2 -> /v2/rerank) must parse fitm's responses and give the same order and
scores as a plain HTTP call."""
import subprocess

import pytest
import requests

from test_http import Daemon, build_dir

KEY = "client-key"
DOCS = ["Carson City is the capital city of the American state of Nevada.",
        "Washington, D.C. is the capital of the United States.",
        "Capital punishment has existed in the United States since before it was a country.",
        "The golf hotel has a lima bean garden."]
QUERY = "What is the capital of the United States?"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = tmp_path_factory.mktemp("clients")
    model = d / "m.gguf"
    subprocess.run([str(build_dir() / "src" / "fitm"), "mkmodel", "--arch", "llama", "--seed", "2",
                    "-q", "-o", str(model)], check=True)
    daemon = Daemon(build_dir() / "src" / "fitmd", model, d, api_keys=KEY, model_name="fitm-test")
    yield daemon
    assert daemon.terminate() == 0


def plain(daemon, top_n):
    r = requests.post(daemon.url("/rerank"), json={"query": QUERY, "documents": DOCS,
                      "top_n": top_n}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    return [(x["index"], x["relevance_score"]) for x in r.json()["results"]]


def test_cohere_v1_client(daemon):
    cohere = pytest.importorskip("cohere")
    c = cohere.Client(api_key=KEY, base_url=daemon.base)
    r = c.rerank(model="fitm-test", query=QUERY, documents=DOCS, top_n=3, return_documents=True)
    assert [(x.index, x.relevance_score) for x in r.results] == plain(daemon, 3)
    assert [x.document.text for x in r.results] == [DOCS[x.index] for x in r.results]


def test_cohere_v2_client(daemon):
    cohere = pytest.importorskip("cohere")
    c = cohere.ClientV2(api_key=KEY, base_url=daemon.base)
    r = c.rerank(model="fitm-test", query=QUERY, documents=DOCS, top_n=2)
    assert [(x.index, x.relevance_score) for x in r.results] == plain(daemon, 2)


def test_cohere_client_errors(daemon):
    cohere = pytest.importorskip("cohere")
    with pytest.raises(Exception) as e:
        cohere.ClientV2(api_key="wrong", base_url=daemon.base).rerank(
            model="fitm-test", query=QUERY, documents=DOCS)
    assert "401" in str(e.value)
    with pytest.raises(Exception) as e:
        cohere.ClientV2(api_key=KEY, base_url=daemon.base).rerank(
            model="rerank-v3.5", query=QUERY, documents=DOCS)
    assert "404" in str(e.value)
