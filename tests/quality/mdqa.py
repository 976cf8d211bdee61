#!/usr/bin/env python3
"""MDQA-style evaluation of the position methods (docs/moice-results.md): /answer accuracy by
gold-document position (1, (K + 1) // 2, K of tests/quality/dataset.py) for K = 10 and 20, for
each `position_method` (none, ms_poe, attention_buckets, moice), each without and with
calibration (`calibrate: false` / `true`, with `reorder: none`), the worst-to-best gap over
the gold positions, and the cost of each method against `none`: prefill and decode tokens/s
(from meta.timings_ms) and the daemon's peak resident memory.

One fitmd per position method (started by this tool; `--moice FILE` for moice only), so that
each daemon's peak memory (VmHWM) is that method's. Every request names its position_method
(docs/moice.md); a method the server rejects is reported as such and the run goes on.

Use --split dev to choose anything (a sidecar, an option), --split test to report.

    tests/quality/mdqa.py --model M.gguf --moice models/moice-gemma-3-270m-q4_k_m.gguf \\
        [--split test] [--groups 20] [--k 10 20] [--variants plain] \\
        [--methods none ms_poe attention_buckets moice] \\
        [--json mdqa.json] [--markdown docs/moice-results.md] [--plot docs/moice-results.png]
    tests/quality/mdqa.py --merge mdqa.json ... --markdown ... --plot ...
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import requests

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dataset  # noqa: E402
import quality  # noqa: E402

METHODS = ("none", "ms_poe", "attention_buckets", "moice")
CALIBRATE = (False, True)


class Cell:
    """Counts of one (method, calibrate, variant, K, gold position)."""

    def __init__(self):
        self.n = self.ok = 0
        self.prompt = self.completion = 0
        self.prefill_ms = self.decode_ms = 0.0
        self.error = None


def mode_fields(method: str, calibrate: bool) -> dict:
    # Both named: the server's own /answer defaults (the model's profile) may reorder.
    return {"position_method": method, "calibrate": calibrate, "reorder": "none"}


def ask(url: str, item: dict, fields: dict, max_tokens: int):
    """(answer, prompt_tokens, completion_tokens, prefill ms, decode ms) or an error string."""
    body = {"query": item["query"], "documents": item["documents"], "max_tokens": max_tokens,
            **fields}
    r = requests.post(url + "/answer", timeout=3600, json=body)
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    js = r.json()
    u, t = js.get("usage", {}), js.get("meta", {}).get("timings_ms", {})
    return (js["answer"], u.get("prompt_tokens", 0), u.get("completion_tokens", 0),
            float(t.get("prefill", 0.0)), float(t.get("decode", 0.0)))


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM) in MiB, or NaN where /proc does not say."""
    try:
        for line in open(f"/proc/{pid}/status", encoding="ascii"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def run_method(url: str, items: list, method: str, max_tokens: int, verbose: bool) -> dict:
    """{(calibrate, variant, k, pos): Cell} for one position method."""
    out = {}
    for cal in CALIBRATE:
        fields = mode_fields(method, cal)
        for it in items:
            c = out.setdefault((cal, it["variant"], it["k"], it["gold_pos"]), Cell())
            if c.error:
                continue
            res = ask(url, it, fields, max_tokens)
            if isinstance(res, str):
                c.error = res
                print(f"{method} calibrate={cal}: {res}", file=sys.stderr, flush=True)
                continue
            got, pt, ct, pre, dec = res
            c.n += 1
            c.ok += it["answer"].lower() in got.lower()
            c.prompt += pt
            c.completion += ct
            c.prefill_ms += pre
            c.decode_ms += dec
            if verbose:
                print(f"  [{method} cal={cal} {it['id']}] {it['answer']!r}: {got!r}", flush=True)
        print(f"{method} calibrate={cal}: done", file=sys.stderr, flush=True)
    return out


# ---- summaries ---------------------------------------------------------------------------


def gap(cells: list) -> float:
    """Best minus worst accuracy over the gold positions (NaN when a cell is empty)."""
    acc = [c.ok / c.n for c in cells if c.n]
    return max(acc) - min(acc) if len(acc) == len(cells) and acc else float("nan")


def rates(cells: list) -> tuple:
    """(prefill tokens/s, decode tokens/s) summed over cells; decode counts every generated
    token but the first (the first comes out of the prefill)."""
    pt = sum(c.prompt for c in cells)
    dt = sum(max(0, c.completion - c.n) for c in cells)
    pre = sum(c.prefill_ms for c in cells) / 1000.0
    dec = sum(c.decode_ms for c in cells) / 1000.0
    return (pt / pre if pre > 0 else float("nan"), dt / dec if dec > 0 else float("nan"))


def fmt(x: float, spec: str = ".0f") -> str:
    return "–" if x != x else format(x, spec)


def table(res: dict, mem: dict, variant: str, k: int) -> str:
    pos = dataset.positions(k)
    head = ["position_method", "calibrated", "n"] + [f"gold {p}" for p in pos] + [
        "gap (best − worst)", "prefill tok/s (× none)", "decode tok/s (× none)",
        "peak RSS MiB (+ vs none)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cal in CALIBRATE:
        base = res.get("none", {})
        bcells = [base.get((cal, variant, k, p)) for p in pos]
        b_pre, b_dec = rates(bcells) if all(bcells) else (float("nan"),) * 2
        for method, cells in res.items():
            cs = [cells.get((cal, variant, k, p)) for p in pos]
            if any(c is None for c in cs):
                continue
            row = [f"`{method}`", "yes" if cal else "no", str(min(c.n for c in cs))]
            err = next((c.error for c in cs if c.error), None)
            if err:
                row += [f"not run: {err[:80]}"] + [""] * (len(head) - 4)
            else:
                row += [quality.fmt_p(c.ok, c.n) for c in cs]
                pre, dec = rates(cs)
                m, m0 = mem.get(method, float("nan")), mem.get("none", float("nan"))
                row += [fmt(gap(cs), ".2f"),
                        f"{fmt(pre)} ({fmt(pre / b_pre, '.2f')}×)",
                        f"{fmt(dec)} ({fmt(dec / b_dec, '.2f')}×)",
                        f"{fmt(m)} ({fmt(m - m0, '+.0f')})"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown(meta: list, res: dict, mem: dict, variants: list, ks: list) -> str:
    m0 = meta[0]
    out = [f"## MDQA by gold position and position method: {m0['model']}", "",
           "Generated by `tests/quality/mdqa.py`; not edited by hand. Set: "
           f"tests/quality/data/{m0['split']}.jsonl, the first n question groups of each cell "
           "(each group asked with its gold document first, in the middle and last). An answer "
           f"counts when it contains the gold string; greedy, max_tokens {m0['max_tokens']}. "
           "Cells: accuracy with its Wilson 95% interval. Gap: best minus worst gold position. "
           "Prefill tok/s: prompt tokens / meta.timings_ms.prefill; decode tok/s: generated "
           "tokens after the first / timings_ms.decode; both summed over the row's requests "
           "and given as a multiple of `none` with the same calibration. Peak RSS: VmHWM of the "
           "method's own fitmd after its run.", ""]
    for variant in variants:
        for k in ks:
            out += [f"### {variant}, K = {k}", "", table(res, mem, variant, k), ""]
    out += ["Runs:", ""] + [f"- {r['date']}: `{r['cmd']}`; {r['machine']}" for r in meta]
    return "\n".join(out) + "\n"


def plot(path: str, res: dict, variants: list, ks: list) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    variant = "plain" if "plain" in variants else variants[0]
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 3.8), squeeze=False)
    for ax, k in zip(axes[0], ks):
        pos = dataset.positions(k)
        for i, (method, cells) in enumerate(res.items()):
            for cal in CALIBRATE:
                cs = [cells.get((cal, variant, k, p)) for p in pos]
                if any(c is None or c.error or not c.n for c in cs):
                    continue
                ax.plot(pos, [c.ok / c.n for c in cs], marker="o", color=f"C{i}",
                        linestyle="-" if cal else "--",
                        label=f"{method}{' calibrated' if cal else ''}")
        ax.set_title(f"K = {k} ({variant})")
        ax.set_xlabel("position of the gold document")
        ax.set_ylabel("answer accuracy")
        ax.set_ylim(0, 1)
        ax.set_xticks(pos)
    axes[0][-1].legend(fontsize=7, handlelength=4)  # long enough to show the dashes
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def dump(res: dict) -> dict:
    return {m: {"/".join(map(str, key)): vars(c) for key, c in cells.items()}
            for m, cells in res.items()}


def undump(d: dict) -> dict:
    out = {}
    for m, cells in d.items():
        out[m] = {}
        for key, v in cells.items():
            cal, variant, k, p = key.split("/")
            c = out[m][(cal == "True", variant, int(k), int(p))] = Cell()
            vars(c).update(v)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--moice", help="router sidecar for the moice daemon (fitmd --moice)")
    ap.add_argument("--build", default=str(quality.ROOT / "build"))
    ap.add_argument("--daemon-arg", action="append", default=[])
    ap.add_argument("--split", default="test", choices=["dev", "test"])
    ap.add_argument("--variants", nargs="+", default=["plain"])
    ap.add_argument("--k", type=int, nargs="+", default=list(dataset.KS))
    ap.add_argument("--groups", type=int, default=20)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--plot")
    ap.add_argument("--merge", nargs="+", metavar="JSON")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    if a.merge:
        meta, res, mem = [], {}, {}
        for p in a.merge:
            d = json.loads(pathlib.Path(p).read_text())
            meta.append(d["meta"])
            for m, cells in undump(d["results"]).items():
                if m in res:
                    sys.exit(f"--merge: method {m!r} is in two runs")
                res[m] = cells
            mem.update(d["peak_rss_mib"])
    else:
        if not a.model:
            ap.error("give --model (or --merge)")
        if "moice" in a.methods and not a.moice:
            ap.error("moice needs --moice SIDECAR")
        items = [it for it in dataset.load(a.split) if it["variant"] in a.variants
                 and it["k"] in a.k and dataset.group(it) < a.groups]
        res, mem = {}, {}
        meta = None
        for method in a.methods:
            extra = list(a.daemon_arg) + ([f"--moice={a.moice}"] if method == "moice" else [])
            proc, url = quality.start_daemon(a.model, a.build, extra)
            try:
                if meta is None:
                    model = requests.get(url + "/v1/models").json()["data"][0]["id"]
                    qa = argparse.Namespace(split=a.split, groups=a.groups,
                                            daemon_arg=a.daemon_arg, max_tokens=a.max_tokens)
                    meta = [quality.run_meta(qa, model)]
                    meta[0]["cmd"] = "python3 tests/quality/mdqa.py " + " ".join(
                        sys.argv[1:] if argv is None else argv)
                t = time.time()
                res[method] = run_method(url, items, method, a.max_tokens, a.verbose)
                mem[method] = peak_rss_mib(proc.pid)
                print(f"{method}: {time.time() - t:.0f} s, peak RSS {mem[method]:.0f} MiB",
                      file=sys.stderr, flush=True)
            finally:
                proc.terminate()
                proc.wait(60)
        if a.json:
            pathlib.Path(a.json).write_text(json.dumps(
                {"meta": meta[0], "results": dump(res), "peak_rss_mib": mem}, indent=1))
    for variant in a.variants:
        for k in a.k:
            print(f"\n{variant}, K = {k}\n" + table(res, mem, variant, k), flush=True)
    if a.markdown:
        pathlib.Path(a.markdown).write_text(markdown(meta, res, mem, a.variants, a.k))
    if a.plot:
        plot(a.plot, res, a.variants, a.k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
