"""fitmd with the CUDA backend on the emulated device (build/tests/fitmd_cuda_emu: fitmd linked
against tests/cuda_emu, whose "GPU" runs the real kernels/*.cu on the CPU), against the CPU
fitmd on the same `fitm mkmodel` models:

- with gpu_weights f32, /rerank gives the same ranking, its attention masses within 2e-4 (the
  bound tests/test_backend_cuda.c derives for span masses), and /answer the same greedy answer
  and the same sampled answers for a given seed (temperature, top_p; also /v1/completions);
- with gpu_weights bf16 (the default: prompts multiply bfloat16 operands), the start-up log
  states the copies' memory and both checks, and /rerank's masses stay within 5e-2 (the
  bfloat16 bound of tests/test_backend_cuda.c), the ranking the same where the CPU's scores
  are further apart than that; /answer answers;
- backend selection: auto takes the device when it exists and passes the start-up check,
  else the CPU with one log line saying why; backend=cuda without a device, or failing the
  check, is a start-up error; a fitmd built without CUDA refuses backend=cuda;
- a launch failure while serving (cudaErrorLaunchFailure, which loses a real device's context)
  fails that request with a JSON 500, then /health says 503 with the reason and later requests
  get 503; the process stays up and stops cleanly.

The emulator's environment: FITM_CUDA_EMU_DEVICES (0: no device) and
FITM_CUDA_EMU_FAIL_LAUNCH_IF (a file whose existence fails the next launch)."""
import math
import os
import pathlib
import subprocess
import time

import pytest
import requests

from conftest import build_dir
from test_http import AUTH, Daemon, assert_error, docs, fitmd_bin, free_port  # noqa: F401
from test_http import post as http_post

QUERY = "where is the golf hotel"


def post(d, body, path="/rerank"):
    """A request with room for a slow machine: the emulated device runs each CUDA thread as a
    fiber, and a shared CI machine may give the daemon a fraction of a core."""
    return http_post(d, body, path=path, timeout=600)
MASS_ATOL = 2e-4
MASS_ATOL_BF16 = 5e-2


@pytest.fixture(scope="module")
def emu_bin() -> pathlib.Path:
    p = build_dir() / "tests" / "fitmd_cuda_emu"
    if not p.exists():
        pytest.skip(f"{p} not built (a CUDA build or no C++ compiler: the emulator is not built)")
    return p


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Float weights, so the CPU's decode steps (Q8 activations only for quantized weights)
    and the GPU's multiply the same numbers and greedy answers can be compared exactly; one
    quantized model for /rerank, whose BATCH path decodes the same weights on both. Narrow
    (C 64) and two layers deep: the emulator runs each CUDA thread as a fiber, about 1e4 times
    slower than the CPU backend. gemma3's two layers are local (window 16, prompts of 100+
    tokens), llama's global. gemma3_wide has 4,000 more (unused) tokens, so its logit rows
    are longer than FITM_CUDA_TOPK_CAP and the device selects a step's candidates in the
    three stages of kernels/topk.cu, not in one block."""
    fitm = build_dir() / "src" / "fitm"
    d = tmp_path_factory.mktemp("models")
    out = {}
    for name, arch, typ, extra in (("llama", "llama", "F16", 0), ("gemma3", "gemma3", "F32", 0),
                                   ("gemma3_wide", "gemma3", "F32", 4000),
                                   ("qwen2_q8", "qwen2", "Q8_0", 0)):
        p = d / f"{name}.gguf"
        subprocess.run([str(fitm), "mkmodel", "--arch", arch, "--type", typ, "--seed", "5",
                        "--layers", "2", "--dim", "64", "--heads", "2", "--head-dim", "32",
                        "--ff", "128", "--vocab-extra", str(extra), "-q", "-o", str(p)],
                       check=True)
        out[name] = p
    return out


def start(binary, model, logdir, env=None, **opts):
    """A started fitmd; env entries are set for it only."""
    args = [str(binary), f"--model={model}", "--host=127.0.0.1"]
    d = Daemon.__new__(Daemon)
    d.port = free_port()
    d.base = f"http://127.0.0.1:{d.port}"
    args += [f"--port={d.port}"] + [f"--{k}={v}" for k, v in opts.items()]
    e = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    e.update(env or {})
    d.log_path = logdir / f"fitmd-{d.port}.log"
    d.log = open(d.log_path, "w+")
    d.proc = subprocess.Popen(args, stdout=d.log, stderr=subprocess.STDOUT, env=e)
    deadline = time.time() + 120
    while True:
        if d.proc.poll() is not None:
            pytest.fail(f"fitmd exited {d.proc.returncode}:\n{d.log_text()}")
        try:
            if requests.get(d.base + "/health", timeout=2).status_code == 200:
                return d
        except requests.ConnectionError:
            pass
        if time.time() > deadline:
            d.kill()
            pytest.fail(f"fitmd did not become healthy:\n{d.log_text()}")
        time.sleep(0.05)


def start_fails(binary, model, env=None, **opts):
    """Runs a fitmd that must fail to start: (exit status, its output)."""
    args = [str(binary), f"--model={model}", "--host=127.0.0.1", f"--port={free_port()}"]
    args += [f"--{k}={v}" for k, v in opts.items()]
    e = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    e.update(env or {})
    p = subprocess.run(args, capture_output=True, text=True, env=e, timeout=120)
    return p.returncode, p.stdout + p.stderr


# A short answer frame: the built-in one's worked examples triple the prompt.
OPTS = dict(api_keys="test-key-1", max_documents=16, threads=1, request_timeout_ms=600000,
            answer_template=r"{documents}\nQuestion: {question}\nAnswer:")


def rerank_body():
    return {"query": QUERY, "documents": docs(2, 3) + ["golf hotel india"], "method": "paper"}


def answer_body():
    return {"query": QUERY, "documents": docs(2, 3) + ["golf hotel"], "max_tokens": 8,
            "temperature": 0}


@pytest.mark.parametrize("name", ["llama", "gemma3", "gemma3_wide", "qwen2_q8"])
def test_same_results_as_cpu(emu_bin, fitmd_bin, models, tmp_path, name):
    cpu = start(fitmd_bin, models[name], tmp_path, backend="cpu", **OPTS)
    gpu = start(emu_bin, models[name], tmp_path, backend="cuda", gpu_weights="f32", **OPTS)
    try:
        assert "cuda backend on fitm CUDA emulator" in gpu.log_text(), gpu.log_text()
        assert "prompt products in F32" in gpu.log_text(), gpu.log_text()
        assert "cpu backend with 1 threads" in cpu.log_text()
        rc, rg = post(cpu, rerank_body()).json(), post(gpu, rerank_body()).json()
        assert [x["index"] for x in rg["results"]] == [x["index"] for x in rc["results"]], (rc, rg)
        for a, b in zip(rc["results"], rg["results"]):
            for k in ("attention", "dummy_attention", "calibrated_attention"):
                assert abs(a[k] - b[k]) <= MASS_ATOL, (k, a, b)
        # the scored methods' log-probabilities come from the device (kernels/logprob.cu):
        # the CPU's scores up to the products' F32 rounding, far below what a wrong id or row
        # would move them (query_likelihood's score is the exp of a mean log-probability). Float
        # weights only: on quantized ones the CPU's output head rounds its activations to Q8.
        for method in ("query_likelihood", "relevance") if name != "qwen2_q8" else ():
            body = dict(rerank_body(), method=method)
            sc, sg = post(cpu, body), post(gpu, body)
            assert sg.status_code == sc.status_code, (method, sc.text, sg.text)
            if sc.status_code != 200:  # relevance: a vocabulary that cannot spell Yes/No
                continue
            want = {x["index"]: x["relevance_score"] for x in sc.json()["results"]}
            got = {x["index"]: x["relevance_score"] for x in sg.json()["results"]}
            for i, w in want.items():
                diff = (abs(math.log(got[i]) - math.log(w)) if method == "query_likelihood"
                        else abs(got[i] - w))
                assert diff <= 1e-3, (method, i, w, got[i])
        if name != "qwen2_q8":  # quantized: the CPU's decode steps round activations to Q8
            ac, ag = post(cpu, answer_body(), path="/answer"), post(gpu, answer_body(),
                                                                   path="/answer")
            assert ac.status_code == 200 and ag.status_code == 200, (ac.text, ag.text)
            assert ag.json()["answer"] == ac.json()["answer"]
            assert ag.json()["usage"] == ac.json()["usage"]
            assert ac.json()["usage"]["completion_tokens"] > 0
        if name not in ("qwen2_q8", "gemma3_wide"):
            # (gemma3_wide: greedy above only. Its 4,000 unused tokens have random logits as
            # large as the real ones', so a step's candidates are close to equally likely and
            # the backends' logits, equal up to F32 rounding, draw differently for some seeds.)
            # sampled answers: the device selects the 64 candidates, the host draws from them
            # (src/pipeline/answer.c); the same seed must draw the same tokens on both
            greedy, sampled = ac.json()["answer"], []
            for temp, top_p, seed in ((1.5, 1.0, 3), (0.9, 0.8, 11), (2.0, 0.95, 7)):
                body = dict(answer_body(), temperature=temp, top_p=top_p, seed=seed)
                ac, ag = post(cpu, body, path="/answer"), post(gpu, body, path="/answer")
                assert ac.status_code == 200 and ag.status_code == 200, (ac.text, ag.text)
                assert ag.json()["answer"] == ac.json()["answer"], (temp, top_p, seed)
                assert ag.json()["usage"] == ac.json()["usage"]
                sampled.append(ac.json()["answer"])
            assert any(a != greedy for a in sampled), (greedy, sampled)  # it did sample
            body = {"prompt": "once upon a time", "max_tokens": 6, "seed": 5, "temperature": 1.2}
            oc = post(cpu, body, path="/v1/completions")
            og = post(gpu, body, path="/v1/completions")
            assert oc.status_code == 200 and og.status_code == 200, (oc.text, og.text)
            assert og.json()["choices"][0]["text"] == oc.json()["choices"][0]["text"]
    finally:
        assert cpu.terminate() == 0, cpu.log_text()
        assert gpu.terminate(timeout=120) == 0, gpu.log_text()


@pytest.mark.parametrize("name", ["gemma3", "qwen2_q8"])
def test_bf16_prompts_within_their_bound(emu_bin, fitmd_bin, models, tmp_path, name):
    cpu = start(fitmd_bin, models[name], tmp_path, backend="cpu", **OPTS)
    gpu = start(emu_bin, models[name], tmp_path, backend="cuda", **OPTS)  # bf16: the default
    try:
        log = gpu.log_text()
        assert "prompt products in bfloat16: weight copies" in log, log
        assert "start-up check against the CPU: logits within" in log, log
        assert "; programmatic launches)" in log, log  # the emulator reports sm_90
        rc, rg = post(cpu, rerank_body()).json(), post(gpu, rerank_body()).json()
        for a in rc["results"]:
            b = next(x for x in rg["results"] if x["index"] == a["index"])
            for k in ("attention", "dummy_attention", "calibrated_attention"):
                assert abs(a[k] - b[k]) <= MASS_ATOL_BF16, (k, a, b)
        scores = sorted(x["calibrated_attention"] for x in rc["results"])
        if all(hi - lo > 2 * MASS_ATOL_BF16 for lo, hi in zip(scores, scores[1:])):
            assert [x["index"] for x in rg["results"]] == [x["index"] for x in rc["results"]]
        ag = post(gpu, answer_body(), path="/answer")
        assert ag.status_code == 200, ag.text
        assert ag.json()["usage"]["completion_tokens"] > 0
    finally:
        assert cpu.terminate() == 0, cpu.log_text()
        assert gpu.terminate(timeout=120) == 0, gpu.log_text()


def test_auto_selects_the_device_or_says_why_not(emu_bin, models, tmp_path):
    m = models["llama"]
    d = start(emu_bin, m, tmp_path, backend="auto", **OPTS)
    assert "cuda backend on fitm CUDA emulator" in d.log_text()
    assert d.terminate() == 0
    d = start(emu_bin, m, tmp_path, env={"FITM_CUDA_EMU_DEVICES": "0"}, backend="auto", **OPTS)
    log = d.log_text()
    assert d.terminate() == 0
    assert log.count("backend auto: the CPU, since") == 1 and "no CUDA device" in log, log
    assert "cpu backend with 1 threads" in log
    # a device that fails the start-up check: the CPU, with the check's failure in the log
    trigger = tmp_path / "fail-next-launch"
    trigger.touch()
    d = start(emu_bin, m, tmp_path, env={"FITM_CUDA_EMU_FAIL_LAUNCH_IF": str(trigger)},
              backend="auto", **OPTS)
    log = d.log_text()
    assert post(d, rerank_body()).status_code == 200
    assert d.terminate() == 0
    assert not trigger.exists()
    assert "backend auto: the CPU, since the CUDA start-up check failed" in log, log
    assert "cudaErrorLaunchFailure" in log and "cpu backend with 1 threads" in log, log


def test_cuda_without_a_working_device_is_a_startup_error(emu_bin, fitmd_bin, models, tmp_path):
    m = models["llama"]
    rc, out = start_fails(emu_bin, m, env={"FITM_CUDA_EMU_DEVICES": "0"}, backend="cuda", **OPTS)
    assert rc != 0 and "backend 'cuda': no CUDA device" in out, out
    trigger = tmp_path / "fail-next-launch"
    trigger.touch()
    rc, out = start_fails(emu_bin, m, env={"FITM_CUDA_EMU_FAIL_LAUNCH_IF": str(trigger)},
                          backend="cuda", **OPTS)
    assert rc != 0 and "backend 'cuda': start-up check failed" in out, out
    assert "cudaErrorLaunchFailure" in out
    # the plain CPU build has no CUDA backend, unless nvcc built it in
    if not (build_dir() / "kernels" / "libfitm_kernels.a").exists():
        rc, out = start_fails(fitmd_bin, m, backend="cuda", **OPTS)
        assert rc != 0 and "not built into this fitmd" in out, out


def test_device_lost_while_serving_makes_health_fail(emu_bin, models, tmp_path):
    trigger = tmp_path / "fail-next-launch"
    d = start(emu_bin, models["llama"], tmp_path,
              env={"FITM_CUDA_EMU_FAIL_LAUNCH_IF": str(trigger)}, backend="cuda", **OPTS)
    try:
        trigger.touch()
        r = post(d, rerank_body())
        assert_error(r, 500, mentions="cudaErrorLaunchFailure")
        assert not trigger.exists()
        h = requests.get(d.url("/health"), timeout=10)
        assert h.status_code == 503, h.text
        assert h.json()["status"] == "error" and "restart" in h.text, h.text
        assert_error(post(d, answer_body(), path="/answer"), 503)
        assert_error(post(d, rerank_body()), 503)
        assert d.proc.poll() is None
    finally:
        assert d.terminate() == 0, d.log_text()
