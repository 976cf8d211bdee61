"""Third-party clients pointed at fitmd, unchanged, with their defaults (only base_url and the API
key set): the `cohere` SDK (v1 Client -> /v1/rerank, v2 ClientV2 -> /v2/rerank), LangChain's and
LlamaIndex's CohereRerank, a Jina-style and a TEI-style request, and the `openai` SDK. Each must
parse fitm's responses and give the same order and scores as a plain HTTP call. The snippets in
README.md are these tests' calls."""
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


def plain_docs(daemon, docs):
    r = requests.post(daemon.url("/rerank"), json={"query": QUERY, "documents": docs},
                      headers={"Authorization": f"Bearer {KEY}"})
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


def test_other_model_names_are_served(daemon):
    """A client's own default model name is answered by the served model (strict_model off)."""
    cohere = pytest.importorskip("cohere")
    r = cohere.ClientV2(api_key=KEY, base_url=daemon.base).rerank(
        model="rerank-v3.5", query=QUERY, documents=DOCS, top_n=10)
    assert [(x.index, x.relevance_score) for x in r.results] == plain(daemon, 4)
    raw = requests.post(daemon.url("/rerank"), json={"query": QUERY, "documents": DOCS,
                        "model": "rerank-v3.5"}, headers={"Authorization": f"Bearer {KEY}"})
    assert raw.status_code == 200 and raw.json()["model"] == "fitm-test"


def test_strict_model(tmp_path):
    cohere = pytest.importorskip("cohere")
    model = tmp_path / "m.gguf"
    subprocess.run([str(build_dir() / "src" / "fitm"), "mkmodel", "--arch", "llama", "--seed", "2",
                    "-q", "-o", str(model)], check=True)
    d = Daemon(build_dir() / "src" / "fitmd", model, tmp_path, model_name="fitm-test",
               strict_model="true")
    try:
        with pytest.raises(Exception) as e:
            cohere.ClientV2(api_key="none", base_url=d.base).rerank(
                model="rerank-v3.5", query=QUERY, documents=DOCS)
        assert "404" in str(e.value)
        r = cohere.ClientV2(api_key="none", base_url=d.base).rerank(
            model="fitm-test", query=QUERY, documents=DOCS)
        assert len(r.results) == 4
    finally:
        assert d.terminate() == 0


def test_langchain_cohere_rerank(daemon):
    pytest.importorskip("langchain_cohere")
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    # Two documents and LangChain's default top_n = 3: clipped, not refused.
    reranker = CohereRerank(cohere_api_key=KEY, base_url=daemon.base,
                            model="rerank-english-v3.0")
    docs = [Document(page_content=t) for t in DOCS[:2]]
    out = reranker.compress_documents(docs, QUERY)
    want = plain_docs(daemon, DOCS[:2])
    assert [(d.page_content, d.metadata["relevance_score"]) for d in out] == \
        [(DOCS[i], s) for i, s in want]


def test_llamaindex_cohere_rerank(daemon):
    pytest.importorskip("llama_index.postprocessor.cohere_rerank")
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.postprocessor.cohere_rerank import CohereRerank

    # LlamaIndex's defaults: model "rerank-english-v3.0", top_n 2.
    reranker = CohereRerank(api_key=KEY, base_url=daemon.base)
    nodes = [NodeWithScore(node=TextNode(text=t)) for t in DOCS]
    out = reranker.postprocess_nodes(nodes, query_str=QUERY)
    assert [(n.node.get_content(), n.score) for n in out] == \
        [(DOCS[i], s) for i, s in plain(daemon, 2)]


def test_jina_style_request(daemon):
    r = requests.post(daemon.url("/v1/rerank"), headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "jina-reranker-v2-base-multilingual", "query": QUERY,
                            "documents": DOCS, "top_n": 10, "return_documents": True})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert [(x["index"], x["relevance_score"]) for x in res] == plain(daemon, 4)
    assert [x["document"]["text"] for x in res] == [DOCS[x["index"]] for x in res]
    assert r.json()["model"] == "fitm-test" and r.json()["usage"]["total_tokens"] > 0


def test_tei_style_request(daemon):
    r = requests.post(daemon.url("/rerank"), headers={"Authorization": f"Bearer {KEY}"},
                      json={"query": QUERY, "texts": DOCS, "raw_scores": False,
                            "return_text": True, "truncate": True})
    assert r.status_code == 200, r.text
    res = r.json()
    assert isinstance(res, list)
    assert [(x["index"], x["score"]) for x in res] == plain(daemon, 4)
    assert [x["text"] for x in res] == [DOCS[x["index"]] for x in res]


def openai_client(daemon):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key=KEY)


def test_openai_sdk_chat(daemon):
    client = openai_client(daemon)
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": QUERY}]
    r = client.chat.completions.create(model="gpt-4o-mini", messages=msgs, max_tokens=8,
                                       temperature=0, seed=7)
    text = r.choices[0].message.content
    assert r.model == "fitm-test" and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Streamed: the same text in pieces, then usage when asked for.
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model="gpt-4o-mini", messages=msgs,
                                                max_tokens=8, temperature=0, seed=7,
                                                stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == text
    assert usage.completion_tokens == r.usage.completion_tokens


def test_openai_sdk_completions_and_documents(daemon):
    client = openai_client(daemon)
    r = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="The capital of",
                                  max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens >= 1
    assert isinstance(r.choices[0].text, str)
    # Retrieved documents in the extension field: the calibrated answer and its weights.
    r = client.chat.completions.create(model="gpt-4o-mini", max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": QUERY}],
                                       extra_body={"documents": DOCS})
    docs = r.model_extra["documents"]
    assert sorted(d["index"] for d in docs) == [0, 1, 2, 3]
    assert abs(sum(d["weight"] for d in docs) - 1) < 1e-6


def test_openai_sdk_context_overflow(daemon):
    """A prompt over the context raises the SDK's BadRequestError with OpenAI's code at
    create(), streamed or not (a stream used to start with 200 and fail mid-iteration), and
    models.retrieve finds the served model."""
    openai = pytest.importorskip("openai")
    client = openai_client(daemon)
    msgs = [{"role": "user", "content": "golf hotel " * 3000}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=msgs, max_tokens=2,
                                           stream=stream)
        assert e.value.code == "context_length_exceeded", e.value
    assert client.models.retrieve("fitm-test").id == "fitm-test"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_readme_snippets(daemon, capsys):
    """README.md's client snippets, run as they stand (only the URL and key replaced), give
    what plain HTTP calls give."""
    from conftest import ROOT
    text = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) == 5
    for mod in ("cohere", "langchain_cohere", "llama_index.postprocessor.cohere_rerank",
                "openai"):
        pytest.importorskip(mod)
    ns = {}
    for b in blocks:
        exec(b.replace("http://localhost:8080", daemon.base).replace('"my-key"', repr(KEY)), ns)
    docs = ns["documents"]
    assert ns["query"] == QUERY and docs == DOCS[:3]
    want = plain_docs(daemon, docs)
    assert [(r.index, r.relevance_score) for r in ns["ranked"]] == want[:2]
    assert [(d.page_content, d.metadata["relevance_score"]) for d in ns["kept"]] == \
        [(docs[i], s) for i, s in want]
    assert [(n.node.get_content(), n.score) for n in ns["nodes"]] == \
        [(docs[i], s) for i, s in want[:2]]
    assert ns["reply"].model == "fitm-test" and ns["reply"].usage.completion_tokens >= 1
    grounded = requests.post(daemon.url("/answer"), headers={"Authorization": f"Bearer {KEY}"},
                             json={"query": QUERY, "documents": docs, "max_tokens": 32}).json()
    assert ns["grounded"].choices[0].message.content == grounded["answer"]
    assert [d["weight"] for d in ns["grounded"].model_extra["documents"]] == \
        [d["weight"] for d in grounded["documents"]]
    out = capsys.readouterr().out
    assert str([(r.index, r.relevance_score) for r in ns["ranked"]]) in out
