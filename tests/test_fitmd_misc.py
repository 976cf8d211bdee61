"""fitmd's operational details, one test each: threads = 0 follows the CPU affinity mask, --version,
--print-config hides api_keys, refusals are logged at info while probes are not, a bad model's
message names its path once, 401 says WWW-Authenticate: Bearer, and the spec's `stop` length is
the server's."""
import os
import shutil
import subprocess

import pytest
import requests

from conftest import ROOT
from test_http import Daemon, build_dir, free_port

FITMD = build_dir() / "src" / "fitmd"


def clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = tmp_path_factory.mktemp("misc") / "m.gguf"
    subprocess.run([str(build_dir() / "src" / "fitm"), "mkmodel", "--arch", "llama", "--seed",
                    "4", "-q", "-o", str(p)], check=True)
    return p


def test_threads_follow_the_affinity_mask(model, tmp_path):
    if not shutil.which("taskset"):
        pytest.skip("taskset (util-linux) is not installed")
    port = free_port()
    p = subprocess.Popen(["taskset", "-c", "0", str(FITMD), f"--model={model}",
                          "--host=127.0.0.1", f"--port={port}"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=clean_env())
    try:
        for line in p.stdout:
            if "model loaded" in line:
                break
        assert "cpu backend with 1 threads" in line, line
    finally:
        p.terminate()
        p.wait(30)
    # An explicit count is used as given.
    d = Daemon(FITMD, model, tmp_path, threads=3)
    try:
        assert "cpu backend with 3 threads" in d.log_text()
    finally:
        assert d.terminate() == 0


def test_version():
    p = subprocess.run([str(FITMD), "--version"], capture_output=True, text=True, env=clean_env())
    assert p.returncode == 0
    version = (ROOT / "meson.build").read_text().split("version:")[1].split("'")[1]
    assert p.stdout == f"fitmd {version}\n"
    assert "--version" in subprocess.run([str(FITMD), "--help"], capture_output=True,
                                         text=True).stdout


def test_print_config_redacts_api_keys():
    p = subprocess.run([str(FITMD), "--api_keys=sekrit-1,sekrit-2", "--print-config"],
                       capture_output=True, text=True, env=clean_env(), check=True)
    assert "sekrit" not in p.stdout
    assert 'api_keys = "<redacted>"' in p.stdout
    env = clean_env()
    env["FITM_API_KEYS"] = "from-env"
    p = subprocess.run([str(FITMD), "--print-config"], capture_output=True, text=True, env=env,
                       check=True)
    assert "from-env" not in p.stdout


def test_log_levels(model, tmp_path):
    d = Daemon(FITMD, model, tmp_path, api_keys="k", log_level="info")
    try:
        for _ in range(3):
            requests.get(d.url("/health"), timeout=10)
        requests.get(d.url("/metrics"), timeout=10)
        r = requests.post(d.url("/rerank"), json={"query": "q", "documents": []},
                          headers={"Authorization": "Bearer k"}, timeout=30)
        assert r.status_code == 400
        r = requests.post(d.url("/rerank"), json={"query": "q", "documents": ["a"]}, timeout=30)
        assert r.status_code == 401
    finally:
        assert d.terminate() == 0
    log = d.log_text()
    assert "GET /health" not in log and "GET /metrics" not in log
    assert "level=info" in log and "'documents' is empty" in log
    assert "missing or invalid API key" in log
    d = Daemon(FITMD, model, tmp_path, log_level="debug")
    try:
        requests.get(d.url("/health"), timeout=10)
    finally:
        assert d.terminate() == 0
    assert "GET /health -> 200" in d.log_text()


def test_bad_model_message_names_the_path_once(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"XXXX" + b"\0" * 60)
    p = subprocess.run([str(FITMD), f"--model={bad}", f"--port={free_port()}"],
                       capture_output=True, text=True, timeout=30, env=clean_env())
    assert p.returncode == 1
    line = [x for x in p.stderr.splitlines() if x.startswith("fitmd:")][0]
    assert line.count(str(bad)) == 1, line
    assert line.startswith(f"fitmd: model {bad}: ") and "magic" in line


@pytest.mark.parametrize("keys", [",", " , ,", "   "])
def test_api_keys_of_separators_alone_refuse_to_start(model, keys):
    # Only an empty value serves without keys: a template's "${K1},${K2}" with both unset
    # must not start an open server.
    p = subprocess.run([str(FITMD), f"--model={model}", f"--port={free_port()}",
                        f"--api_keys={keys}"],
                       capture_output=True, text=True, timeout=30, env=clean_env())
    assert p.returncode == 2 and "holds no key" in p.stderr, p.stderr  # a configuration error


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_config_file_that_is_not_a_file_refuses_to_start(model, tmp_path, kind):
    # A ConfigMap mounted without subPath makes the config path a directory: on f93cfae
    # fitmd read it as an empty file and served on defaults (no api_keys); a FIFO blocked it
    # before it listened.
    conf = tmp_path / "fitmd.conf"
    conf.mkdir() if kind == "directory" else os.mkfifo(conf)
    p = subprocess.run([str(FITMD), f"--model={model}", f"--port={free_port()}",
                        f"--config={conf}"], capture_output=True, text=True, timeout=30,
                       env=clean_env())
    assert p.returncode == 2 and "not a regular file" in p.stderr, p.stderr


@pytest.mark.parametrize("flag,says", [("--layers=99", "the default layers name layer 99"),
                                       ("--layers=-9", "the default layers name layer -9"),
                                       ("--fuse_layers=0,7",
                                        "the default fuse_layers name layer 7"),
                                       ("--heads=0:99", "layer 0, head 99")])
def test_defaults_the_model_lacks_refuse_to_start(model, flag, says):
    # else every request taking the default would get a 400 blaming the client; a port of
    # its own (two of these at once on one port: one fails to listen instead). Exit 2: a
    # configuration error, which systemd's unit does not restart.
    p = subprocess.run([str(FITMD), f"--model={model}", f"--port={free_port()}", flag],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    assert p.returncode == 2 and says in p.stderr, p.stderr


def test_401_says_bearer(model, tmp_path):
    d = Daemon(FITMD, model, tmp_path, api_keys="k")
    try:
        for path in ("/rerank", "/v1/chat/completions"):
            r = requests.post(d.url(path), json={}, timeout=10)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        r = requests.get(d.url("/v1/models"), headers={"Authorization": "Bearer wrong"},
                         timeout=10)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert "WWW-Authenticate" not in requests.get(d.url("/health"), timeout=10).headers
    finally:
        assert d.terminate() == 0


def test_stop_length_is_the_spec_s(model, tmp_path):
    yaml = pytest.importorskip("yaml")
    spec = yaml.safe_load((ROOT / "openapi" / "openapi.yaml").read_text())
    stop = spec["components"]["schemas"]["AnswerRequest"]["properties"]["stop"]["oneOf"]
    n = stop[0]["maxLength"]
    assert stop[1]["items"]["maxLength"] == n
    d = Daemon(FITMD, model, tmp_path)
    try:
        def answer(s):
            return requests.post(d.url("/answer"), json={"query": "q", "documents": ["a"],
                                 "max_tokens": 1, "stop": s}, timeout=60)
        assert answer("\u00e9" * n).status_code == 200  # code points, not bytes
        assert answer(["x" * n]).status_code == 200
        r = answer("x" * (n + 1))
        assert r.status_code == 400 and "'stop'" in r.json()["error"]["message"]
    finally:
        assert d.terminate() == 0


def test_ctx_size_over_the_trained_context_is_said(model, tmp_path):
    """A ctx_size over the model's trained context is lowered to it, and the log says so (the
    load line alone showed the number)."""
    d = Daemon(build_dir() / "src" / "fitmd", model, tmp_path, ctx_size=1000000)
    try:
        line = d.wait_log(r"ctx_size 1000000 is over the model's trained context: (\d+) used")
        r = requests.get(d.url("/v1/models"), timeout=10).json()["data"][0]
        assert r["context_length"] == int(line.group(1))
    finally:
        assert d.terminate() == 0


def test_a_port_in_use_stops_fitmd_before_the_model_loads(tmp_path):
    """The ports are bound before the engine starts: a port in use stops fitmd at once with
    exit 1, without first downloading (here: trying to download from a closed port, which
    would retry) or loading the model."""
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        for extra in ([f"--port={port}"], [f"--port={free_port()}", f"--probe_port={port}"]):
            p = subprocess.run([str(build_dir() / "src" / "fitmd"),
                                f"--model={tmp_path / 'absent.gguf'}",
                                f"--model_url=http://127.0.0.1:{free_port()}/m.gguf",
                                "--host=127.0.0.1", *extra], capture_output=True, text=True,
                               timeout=60, env=clean_env())
            assert p.returncode == 1, p.stderr
            assert f"cannot listen on 127.0.0.1:{port}" in p.stderr, p.stderr
            assert "download" not in p.stderr.lower(), p.stderr
