"""fitmd under a service manager (systemd Type=notify, deploy/systemd/fitmd.service): READY=1
once the model is loaded (and not before /health says ok), WATCHDOG=1 at half $WATCHDOG_USEC
while it runs, STOPPING=1 when SIGTERM starts the drain; a filesystem or abstract
$NOTIFY_SOCKET; nothing is sent for another process's WATCHDOG_PID. The manager here is a
unix datagram socket the test binds."""
import os
import signal
import socket
import subprocess
import tempfile
import time

import pytest
import requests

from conftest import build_dir
from test_http import free_port, wait_healthy


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = tmp_path_factory.mktemp("models") / "m.gguf"
    subprocess.run([str(build_dir() / "src" / "fitm"), "mkmodel", "--arch", "llama", "--type",
                    "F32", "--seed", "1", "-q", "-o", str(p)], check=True)
    return p


def manager(abstract: bool):
    """A bound datagram socket and the NOTIFY_SOCKET value naming it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"@fitm-test-notify-{os.getpid()}-{time.monotonic_ns()}"
        s.bind("\0" + name[1:])
    else:  # (sun_path is 108 bytes: a short directory, not pytest's tmp_path)
        name = os.path.join(tempfile.mkdtemp(prefix="fitm-n-"), "notify")
        s.bind(name)
    s.settimeout(0.2)
    return s, name


def start(model, env_extra):
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FITM_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC",
                                                       "WATCHDOG_PID")}
    env.update(env_extra)
    p = subprocess.Popen([str(build_dir() / "src" / "fitmd"), f"--model={model}",
                          "--host=127.0.0.1", f"--port={port}"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return p, f"http://127.0.0.1:{port}"


def collect(sock, until, deadline_s):
    """Messages received until until(messages) holds (or the deadline passes)."""
    got = []
    deadline = time.time() + deadline_s
    while time.time() < deadline and not until(got):
        try:
            got.append(sock.recv(4096).decode())
        except socket.timeout:
            pass
    return got


@pytest.mark.parametrize("abstract", [False, True])
def test_ready_watchdog_stopping(model, abstract):
    sock, name = manager(abstract)
    p, base = start(model, {"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "400000",
                            "WATCHDOG_PID": str(os.getpid())})
    # WATCHDOG_PID names another process here (this one): no pings may come; READY still does
    try:
        got = collect(sock, lambda g: any("READY=1" in m for m in g), 60)
        assert any("READY=1" in m for m in got), (got, p.poll())
        assert requests.get(base + "/health", timeout=5).status_code == 200
        got += collect(sock, lambda g: False, 1.5)
        assert not any("WATCHDOG=1" in m for m in got), got
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        sock.close()


def test_watchdog_pings_and_stopping(model):
    sock, name = manager(False)
    p, base = start(model, {"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "400000"})
    try:
        got = collect(sock, lambda g: any("READY=1" in m for m in g), 60)
        ready_at = next(i for i, m in enumerate(got) if "READY=1" in m)
        assert "STATUS=ready" in got[ready_at]
        # READY comes after the model loaded: /health was already ok when it was sent
        assert requests.get(base + "/health", timeout=5).json()["status"] == "ok"
        t0 = time.time()
        pings = collect(sock, lambda g: sum("WATCHDOG=1" in m for m in g) >= 4, 10)
        assert sum("WATCHDOG=1" in m for m in pings) >= 4, pings
        assert time.time() - t0 < 8  # at 0.2 s intervals: well inside the 10 s deadline
        p.send_signal(signal.SIGTERM)
        got = collect(sock, lambda g: any("STOPPING=1" in m for m in g), 30)
        assert any("STOPPING=1" in m for m in got), got
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
        sock.close()


def test_no_notify_socket_and_a_dead_one(model):
    # unset: nothing to do; a path nobody listens on: logged once, the daemon still serves
    dead = os.path.join(tempfile.mkdtemp(prefix="fitm-n-"), "gone")
    p, base = start(model, {"NOTIFY_SOCKET": dead, "WATCHDOG_USEC": "200000"})
    try:
        wait_healthy(base, p, 60)
        time.sleep(1)
        assert requests.get(base + "/health", timeout=2).status_code == 200
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        err = p.stderr.read()
    assert err.count(dead) == 1, err
