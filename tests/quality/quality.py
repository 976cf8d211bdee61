#!/usr/bin/env python3
"""Rerank and answer quality on the committed QA sets (tests/quality/dataset.py), against a
live fitmd: Recall@1 and Recall@3 per (variant, K, gold position) for every method and option
set given, a BM25 baseline computed here, answer accuracy for /answer modes, forward tokens
(usage.forward_tokens, also as a multiple of one pass over the prompt) and wall time per
request, with Wilson 95% intervals. Writes markdown that regenerates docs/rerank-results.md
and docs/answer-results.md.

Methods: `bm25` (computed here), a server method name (`calibrated`, `attention`, `paper`,
`query_likelihood`, ...), or LABEL=JSON with any /rerank request fields, passed through
unchanged, e.g.
    --method paper calibrated query_likelihood bm25 \\
    --method 'icr={"method": "calibrated", "rows": "question", "reference": "null_query"}'
A spec whose JSON has `fuse` is computed here from two server rankings of the same request,
`{"method": "query_likelihood"}` and `{"method": "calibrated", "window": 1}` (each document in a
prompt of its own, as the default model's profile scores them), each requested once per item:
score_k = QL_k + w x z(calibrated_attention)_k, QL the query likelihood's mean log-probability
(the log of its relevance_score), z the z-score over
the K documents (`"fuse": {"w": 0.1}`; `"form": "z"` z-scores QL too; `"form": "attention"` leaves QL out: the
default's own order when its windows are of 1), e.g.
    --method 'fuse-0.1={"fuse": {"w": 0.1}}'
Answer modes are LABEL=JSON bodies for /answer (default: vanilla = {"calibrate": false,
"reorder": "none"}, plain generation; calibrated = the same with calibrate true; default = {},
the server's own defaults, which the model's profile may set). A method or mode the server rejects (an option it does not know yet, say)
is reported as such in its row and the run goes on.

    tests/quality/quality.py --model M.gguf [--split test] [--groups 50] [--k 10 20]
        [--variants plain hard] [--method ...] [--answer [--mode ...]]
        [--markdown docs/rerank-results.md] [--answer-markdown docs/answer-results.md]
        [--json results.json]
    tests/quality/quality.py --url http://127.0.0.1:8080 [--key KEY] ...
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import re
import socket
import subprocess
import sys
import time
from collections import Counter

import requests

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dataset  # noqa: E402
import traps  # noqa: E402

ROOT = HERE.parent.parent

DEFAULT_MODES = ['vanilla={"calibrate": false, "reorder": "none"}',
                 'calibrated={"calibrate": true, "reorder": "none"}', "default={}"]


def start_daemon(model: str, build: str, extra: list) -> tuple:
    """(process, url) of a fitmd serving model on a free port, once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = pathlib.Path(build) / "src" / "fitmd"
    p = subprocess.Popen([str(exe), f"--model={model}", f"--port={port}", "--log-level=warn",
                          "--request-timeout-ms=3600000",
                          # measurements run requests far costlier than a service admits
                          "--max-request-forward-tokens=0", "--max-queued-forward-tokens=0",
                          *extra])
    url = f"http://127.0.0.1:{port}"
    wait_healthy(p, url, "fitmd")
    return p, url


def wait_healthy(p, url: str, what: str) -> None:
    """Returns once url's /health answers 200 (up to 2 minutes); exits the tool when the server
    process p dies or never gets there."""
    for _ in range(1200):
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        if p.poll() is not None:
            sys.exit(f"{what} exited {p.returncode}")
        time.sleep(0.1)
    p.kill()
    sys.exit(f"{what} did not become healthy")


# ---- statistics --------------------------------------------------------------------------

def wilson(k: int, n: int, z: float = 1.96) -> tuple:
    """95% Wilson score interval of a proportion k / n."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def fmt_p(k: int, n: int) -> str:
    if n == 0:
        return "–"
    lo, hi = wilson(k, n)
    return f"{k / n:.2f} ({lo:.2f}–{hi:.2f})"


# ---- BM25 --------------------------------------------------------------------------------

WORD = re.compile(r"\w+", re.UNICODE)


def words(s: str) -> list:
    return WORD.findall(s.lower())


def bm25(query: str, docs: list, k1: float = 1.2, b: float = 0.75) -> list:
    """Okapi BM25 of each document (title + text) for the query, the K documents of the
    request being the collection (IDF = ln(1 + (N - n + 0.5) / (n + 0.5)))."""
    toks = [words(d.get("title", "") + " " + d["text"]) for d in docs]
    N = len(toks)
    avg = sum(len(t) for t in toks) / max(N, 1)
    df = Counter(w for t in toks for w in set(t))
    q = words(query)
    out = []
    for t in toks:
        tf = Counter(t)
        s = 0.0
        for w in q:
            if not tf[w]:
                continue
            idf = math.log(1 + (N - df[w] + 0.5) / (df[w] + 0.5))
            s += idf * tf[w] * (k1 + 1) / (tf[w] + k1 * (1 - b + b * len(t) / avg))
        out.append(s)
    return out


# ---- runs --------------------------------------------------------------------------------

def parse_spec(spec: str) -> tuple:
    """(label, request fields) from NAME or LABEL=JSON."""
    if "=" in spec:
        label, js = spec.split("=", 1)
        return label, json.loads(js)
    return spec, ({} if spec == "bm25" else {"method": spec})


class Cell:
    def __init__(self):
        self.n = self.r1 = self.r3 = self.ok = 0
        self.fwd = self.prompt = 0
        self.wall = 0.0
        self.error = None


def post_rerank(url, headers, item, fields):
    """POST /rerank of item's query and documents with fields: (the JSON answer, or an error
    str, and the seconds it took)."""
    body = {"query": item["query"], "documents": item["documents"], **fields}
    t = time.perf_counter()
    r = requests.post(url + "/rerank", headers=headers, timeout=3600, json=body)
    dt = time.perf_counter() - t
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:200]}", dt
    return r.json(), dt


FUSE_PARTS = {"ql": {"method": "query_likelihood"}, "default": {"method": "calibrated", "window": 1}}
_fuse_cache = {}


def zscores(xs: list) -> list:
    """xs as z-scores over the list (all 0 when they do not vary)."""
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
    return [(x - m) / sd if sd > 0 else 0.0 for x in xs]


def fuse(url, headers, item, fields):
    """A fused ranking (the module's doc) from the two component requests, each made once per
    item and kept for the other fused specs of the run; forward tokens and seconds are both
    requests'."""
    key = (item["id"], item["gold_pos"], item["k"], item["variant"])
    if key not in _fuse_cache:
        got = {}
        for part, f in FUSE_PARTS.items():
            js, dt = post_rerank(url, headers, item, f)
            if isinstance(js, str):
                return js
            got[part] = ({x["index"]: x for x in js["results"]},
                         js.get("usage", {}).get("forward_tokens", 0),
                         js.get("usage", {}).get("prompt_tokens", 0), dt)
        _fuse_cache[key] = got
    got = _fuse_cache[key]
    spec = fields["fuse"]
    k = len(item["documents"])
    ql = [math.log(max(got["ql"][0][i]["relevance_score"], 1e-300)) for i in range(k)]
    att = zscores([got["default"][0][i]["calibrated_attention"] for i in range(k)])
    base = {"z": zscores(ql), "attention": [0.0] * k}.get(spec.get("form"), ql)
    s = [base[i] + spec.get("w", 0.0) * att[i] for i in range(k)]
    order = sorted(range(k), key=lambda i: (-s[i], i))
    return (order, sum(g[1] for g in got.values()), max(g[2] for g in got.values()),
            sum(g[3] for g in got.values()))


def rank(url, headers, item, label, fields):
    """(order of document indices, forward tokens, prompt tokens, seconds) or an error str."""
    if "fuse" in fields:
        return fuse(url, headers, item, fields)
    if label == "bm25" and not fields:
        t = time.perf_counter()
        s = bm25(item["query"], item["documents"])
        order = sorted(range(len(s)), key=lambda i: (-s[i], i))
        return order, 0, 0, time.perf_counter() - t
    js, dt = post_rerank(url, headers, item, fields)
    if isinstance(js, str):
        return js
    u = js.get("usage", {})
    return ([x["index"] for x in js["results"]], u.get("forward_tokens", 0),
            u.get("prompt_tokens", 0), dt)


def answer(url, headers, item, fields, max_tokens):
    body = {"query": item["query"], "documents": item["documents"], "max_tokens": max_tokens,
            **fields}
    t = time.perf_counter()
    r = requests.post(url + "/answer", headers=headers, timeout=3600, json=body)
    dt = time.perf_counter() - t
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text[:200]}"
    js = r.json()
    u = js.get("usage", {})
    return js["answer"], u.get("forward_tokens", 0), u.get("prompt_tokens", 0), dt


def select(a) -> list:
    """The items of the run: the committed sets' variants from their files, the trap variants
    generated (traps.py), the first a.groups groups of each cell."""
    its = [it for it in dataset.load(a.split) if it["variant"] in a.variants
           and it["k"] in a.k and dataset.group(it) < a.groups]
    trap_variants = [v for v in a.variants if v in traps.VARIANTS]
    if trap_variants:
        its += traps.items(a.split, min(a.groups, traps.GROUPS), variants=trap_variants,
                           ks=[k for k in a.k if k in traps.KS])
    if getattr(a, "first_only", False):
        return [it for it in its if it["gold_pos"] == 1]
    extra = [dataset.moved(it, p) for it in its if it["gold_pos"] == 1
             for p in sorted(set(getattr(a, "positions", None) or ())) if p <= it["k"]
             and p not in dataset.positions(it["k"])]
    return its + extra


def doc_label(it: dict, i: int) -> str:
    """How --verbose names document i of an item: its title (its text's start when untitled),
    with a trap's form (traps.py) in brackets."""
    d = it["documents"][i]
    name = d["title"] or d["text"][:70] + "..."
    forms = dict(zip(it.get("traps", ()), it.get("forms", ())))
    return f"[{forms[i]}] {name}" if i in forms else name


def cell_positions(results: dict, variant: str, k: int) -> list:
    """The gold positions of the cells of (variant, k) in results: first / middle / last, and
    any --positions."""
    return sorted({key[2] for cells in results.values() for key in cells
                   if key[0] == variant and key[1] == k})


def run(a, url, headers, specs, answer_mode: bool) -> dict:
    """{label: {(variant, k, pos): Cell}}"""
    out = {}
    items = select(a)
    for label, fields in specs:
        cells = out[label] = {}
        for it in items:
            c = cells.setdefault((it["variant"], it["k"], it["gold_pos"]), Cell())
            if c.error:
                continue
            if answer_mode:
                res = answer(url, headers, it, fields, a.max_tokens)
            else:
                res = rank(url, headers, it, label, fields)
            if isinstance(res, str):
                c.error = res
                print(f"{label}: {res}", file=sys.stderr, flush=True)
                continue
            c.n += 1
            if answer_mode:
                got, c_fwd, c_prompt, dt = res
                hit = it["answer"].lower() in got.lower()
                c.ok += hit
                if a.verbose:
                    print(f"  [{label} {it['id']}] {it['answer']!r}: {got!r}", flush=True)
            else:
                order, c_fwd, c_prompt, dt = res
                c.r1 += order[0] == it["gold_index"]
                c.r3 += it["gold_index"] in order[:3]
                if a.verbose and order[0] != it["gold_index"]:
                    rank_of = order.index(it["gold_index"])
                    above = [doc_label(it, i) for i in order[:rank_of]]
                    print(f"  [{label} {it['id']}] {it['query']!r}: gold "
                          f"{doc_label(it, it['gold_index'])!r} ranked {rank_of + 1}, "
                          f"after {above}", flush=True)
            c.fwd += c_fwd
            c.prompt += c_prompt
            c.wall += dt
        print(f"{label}: done", file=sys.stderr, flush=True)
    return out


# ---- reports -----------------------------------------------------------------------------

def cost(cells: list, one_pass: float) -> str:
    """Mean forward tokens per request, as a multiple of one_pass (mean tokens of the whole
    prompt), and mean wall milliseconds."""
    n = sum(c.n for c in cells)
    if not n:
        return "–", "–"
    fwd = sum(c.fwd for c in cells) / n
    ratio = f" ({fwd / one_pass:.2f}×)" if one_pass and fwd else ""
    return f"{fwd:.0f}{ratio}", f"{1000 * sum(c.wall for c in cells) / n:.0f}"


def one_pass_tokens(results: dict, keys: list) -> float:
    """Mean length of the whole prompt over the cells `keys`: usage.prompt_tokens is the longest
    prompt a request built, which for windowed methods is one window's, so the whole prompt is
    the largest mean any method of the table reports for these cells."""
    best = 0.0
    for cells in results.values():
        cs = [c for c in (cells.get(key) for key in keys) if c]
        n = sum(c.n for c in cs)
        if n and not any(c.error for c in cs):
            best = max(best, sum(c.prompt for c in cs) / n)
    return best


def table(results: dict, variant: str, k: int, answer_mode: bool) -> str:
    pos = cell_positions(results, variant, k)
    head = ["method" if not answer_mode else "mode", "n"] + [
        f"gold {p}" + (" R@1 / R@3" if not answer_mode else " accuracy") for p in pos] + [
        "forward tokens (× one pass)", "ms / request"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    one_pass = one_pass_tokens(results, [(variant, k, p) for p in pos])
    for label, cells in results.items():
        at = [cells.get((variant, k, p)) for p in pos]  # None: a position this run left out
        cs = [c for c in at if c]
        if not cs:
            continue
        row = [f"`{label}`", str(min(c.n for c in cs))]
        err = next((c.error for c in cs if c.error), None)
        if err:
            row += [f"not run: {err[:80]}"] + [""] * (len(head) - 3)
        else:
            for c in at:
                row.append("–" if c is None else fmt_p(c.ok, c.n) if answer_mode
                           else f"{fmt_p(c.r1, c.n)} / {fmt_p(c.r3, c.n)}")
            row += list(cost(cs, one_pass))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def machine() -> str:
    """The CPU, its core count and the commit of the source tree (as the run starts), for the
    report's provenance."""
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        if subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                          capture_output=True, text=True, check=True).stdout.strip():
            rev += " with local changes"
    except (OSError, subprocess.CalledProcessError):
        rev = "unknown"
    import os
    return f"{cpu}, {os.cpu_count()} cores, commit {rev}"


def run_meta(a, model: str) -> dict:
    """How a run was made, kept in its JSON so a report merged from several runs names each."""
    return {"cmd": "python3 tests/quality/quality.py " + " ".join(sys.argv[1:]),
            "split": a.split, "groups": a.groups, "model": model, "machine": machine(),
            "daemon_args": a.daemon_arg, "max_tokens": a.max_tokens,
            "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"}


def markdown(runs: list, results: dict, answer_mode: bool, specs: list, variants: list,
             ks: list, intro: str = "") -> str:
    """The report of one or more runs (run_meta each) over the same split; intro (markdown,
    the reading of the tables: --intro) goes after the title."""
    what = "/answer accuracy" if answer_mode else "/rerank Recall@1 / Recall@3"
    r0 = runs[0]
    out = [f"# {what} by gold position: {r0['model']}", "",
           f"Generated by `tests/quality/quality.py`; nothing in this file is edited by hand"
           + (" (the text before the first table comes from its --intro file)." if intro else "."),
           ""] + ([intro.strip(), ""] if intro else []) + [
           f"Set: tests/quality/data/{r0['split']}.jsonl (the first n questions of each cell, n "
           "in the table; gold document first / middle ((K + 1) // 2) / last, and at any other position "
           "shown (the gold-first items with the gold document moved there); fictional "
           "entities, so only the documents can answer; `hard`: every distractor shares part "
           "of the gold entity's name and states the asked attribute; `traps` / "
           "`traps_untitled`: tests/quality/traps.py, biographies where 2 (titled) or 3 "
           "(untitled) distractors name the asked person and state the asked attribute of "
           "someone else: a correspondent, a relative, a namesake, a place named after the "
           "person, a denied claim; `traps_long`: untitled, 3 such distractors, the gold and "
           "the unrelated biographies seven sentences long). Cells: proportion with "
           "its Wilson 95% interval. Forward tokens: usage.forward_tokens per request, and its "
           "ratio to one pass over the whole prompt (the longest usage.prompt_tokens of the "
           "table's methods: a windowed method's own prompts are shorter). Wall time: one request at a time.", ""]
    if answer_mode:
        out += ["An answer counts when it contains the gold answer string (case-insensitive); "
                f"greedy, max_tokens {r0['max_tokens']}.", ""]
    out += ["Methods and modes (request fields as sent):", ""]
    out += [f"- `{label}`: `{json.dumps(fields)}`" if fields or answer_mode or label != "bm25" else
            f"- `{label}`: BM25 (k1 1.2, b 0.75, the request's K documents as the collection), "
            "computed by the tool" for label, fields in specs]
    for variant in variants:
        for k in ks:
            t = table(results, variant, k, answer_mode)
            if t.count("\n") > 1:  # a (variant, K) no run measured gets no section
                out += ["", f"## {variant}, K = {k}", "", t]
    out += ["", "Runs (the command, the machine and the source tree; a `note` added to a run's "
            "JSON meta is shown after it):", ""]
    out += [f"- {r['date']}: `{r['cmd']}`"
            + (f" (fitmd flags {' '.join(r['daemon_args'])})" if r.get("daemon_args") else "")
            + f"; {r['machine']}" + (f"; {r['note']}" if r.get("note") else "")
            for r in runs]
    out.append("")
    return "\n".join(out)


def plot(path: str, results: dict, a, split: str) -> None:
    """/answer accuracy against the gold document's position, one line per (mode, K) of the
    plain set (the hard set's lines when it is the only one run); needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    variant = "plain" if "plain" in a.variants else a.variants[0]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.get_cmap("tab10" if len(results) <= 10 else "tab20").colors
    for m, (label, cells) in enumerate(results.items()):
        for j, k in enumerate(a.k):  # one colour per mode, one line style per K
            pts = [(p, cells[(variant, k, p)]) for p in cell_positions(results, variant, k)
                   if (variant, k, p) in cells and cells[(variant, k, p)].n]
            if pts:
                ax.plot([p for p, _ in pts], [c.ok / c.n for _, c in pts], marker="o",
                        color=colors[m % len(colors)], linestyle=("-", "--", ":")[j % 3],
                        label=f"{label}, K={k}")
    ax.set_xlabel("position of the gold document")
    ax.set_ylabel("answer accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(f"/answer accuracy by gold position ({variant} set, {split} split)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def dump(results: dict) -> dict:
    return {label: {"/".join(map(str, key)): vars(c) for key, c in cells.items()}
            for label, cells in results.items()}


def undump(d: dict) -> dict:
    out = {}
    for label, cells in d.items():
        out[label] = {}
        for key, v in cells.items():
            variant, k, p = key.split("/")
            c = out[label][(variant, int(k), int(p))] = Cell()
            vars(c).update(v)
    return out


def intro(path: str | None) -> str:
    return pathlib.Path(path).read_text(encoding="utf-8") if path else ""


def merge(a) -> int:
    """--merge: one report from the JSON files of several runs of the same split."""
    runs, res, ans, rspecs, aspecs = [], {}, {}, [], []
    for path in a.merge:
        d = json.loads(pathlib.Path(path).read_text())
        runs.append(d["meta"])
        for src, dst, specs, key in ((d["rerank"], res, rspecs, "rerank"),
                                     (d["answer"], ans, aspecs, "answer")):
            for label, cells in undump(src).items():
                if set(cells) & set(dst.get(label, {})):
                    sys.exit(f"--merge: method {label!r} has the same cell in two runs")
                dst.setdefault(label, {}).update(cells)
            specs += [tuple(x) for x in d["specs"][key]
                      if tuple(x) not in specs]
    if len({r["split"] for r in runs}) != 1:
        sys.exit("--merge: the runs are of different splits")
    if a.markdown and res:
        pathlib.Path(a.markdown).write_text(
            markdown(runs, res, False, rspecs, a.variants, a.k, intro(a.intro)))
    if a.answer_markdown and ans:
        pathlib.Path(a.answer_markdown).write_text(
            markdown(runs, ans, True, aspecs, a.variants, a.k, intro(a.answer_intro)))
    if a.plot and ans:
        plot(a.plot, ans, a, runs[0]["split"])
    return 0


def server_args(ap: argparse.ArgumentParser) -> None:
    """The options that say which fitmd a tool talks to: one it starts (--model, --build,
    --daemon-arg) or one running (--url, --key); and the split."""
    ap.add_argument("--model")
    ap.add_argument("--url")
    ap.add_argument("--key")
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="extra fitmd flag when the tool starts it (repeatable)")
    ap.add_argument("--split", default="test", choices=["dev", "test"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    server_args(ap)
    ap.add_argument("--variants", nargs="+", default=list(dataset.VARIANTS),
                    choices=list(dataset.VARIANTS) + list(traps.VARIANTS))
    ap.add_argument("--k", type=int, nargs="+", default=list(dataset.KS))
    ap.add_argument("--groups", type=int, default=dataset.GROUPS,
                    help="questions per cell (the first N groups)")
    ap.add_argument("--positions", type=int, nargs="+", default=None,
                    help="more gold positions (1-based) besides first / middle / last: the "
                         "gold-first items with the gold document moved there")
    ap.add_argument("--first-only", action="store_true",
                    help="only the gold-first items (enough to compare methods that score each "
                         "document alone, whose ranking does not depend on the order)")
    ap.add_argument("--method", nargs="+", action="extend", default=None,
                    help="methods to rank with; `none` for only /answer (with --answer)")
    ap.add_argument("--answer", action="store_true", help="also measure /answer")
    ap.add_argument("--mode", nargs="+", action="extend", default=None)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--markdown", help="write the /rerank report here")
    ap.add_argument("--answer-markdown", help="write the /answer report here")
    ap.add_argument("--json", help="write raw counts here")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="write the reports (--markdown, --answer-markdown, --plot) from the "
                         "--json files of earlier runs instead of running")
    ap.add_argument("--intro", help="with --merge: markdown put before the /rerank report's "
                                    "tables (what they show, in words)")
    ap.add_argument("--answer-intro", help="with --merge: the same for the /answer report")
    ap.add_argument("--plot", help="with --answer: draw accuracy by gold position to this PNG "
                                   "(needs matplotlib)")
    ap.add_argument("--verbose", action="store_true",
                    help="print each /answer reply, and each /rerank that does not rank the gold "
                         "document first (the titles ranked above it)")
    a = ap.parse_args()
    if a.merge:
        return merge(a)
    if not a.model and not a.url:
        ap.error("give --model or --url")
    methods = [parse_spec(s) for s in (a.method or ["paper", "calibrated", "attention",
                                                    "query_likelihood", "bm25"]) if s != "none"]
    modes = [parse_spec(s) for s in (a.mode or DEFAULT_MODES)]
    if a.model:
        proc, url = start_daemon(a.model, a.build, a.daemon_arg)
    else:
        proc, url = None, a.url
    headers = {"Authorization": f"Bearer {a.key}"} if a.key else {}
    try:
        model = requests.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        meta = run_meta(a, model)  # the tree as the run starts, not as it ends
        res = run(a, url, headers, methods, False)
        for variant in a.variants:
            for k in a.k:
                print(f"\n{variant}, K = {k}\n" + table(res, variant, k, False), flush=True)
        if a.markdown:
            pathlib.Path(a.markdown).write_text(
                markdown([meta], res, False, methods, a.variants, a.k))
        ans = {}
        if a.answer:
            ans = run(a, url, headers, modes, True)
            for variant in a.variants:
                for k in a.k:
                    print(f"\n{variant}, K = {k}\n" + table(ans, variant, k, True), flush=True)
            if a.answer_markdown:
                pathlib.Path(a.answer_markdown).write_text(
                    markdown([meta], ans, True, modes, a.variants, a.k))
            if a.plot:
                plot(a.plot, ans, a, a.split)
        if a.json:
            pathlib.Path(a.json).write_text(json.dumps({
                "meta": meta, "specs": {"rerank": methods, "answer": modes if a.answer else []},
                "rerank": dump(res), "answer": dump(ans)}, indent=1))
    finally:
        if proc:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
