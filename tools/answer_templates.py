#!/usr/bin/env python3
"""Which /answer prompt makes a base model answer briefly? Builds the answer prompt of a
dataset item (tests/quality/dataset.py) under each candidate template, generates greedily with
`fitm generate` (the project's own CPU forward pass), and counts an answer correct when its
first line contains the gold answer (case-insensitive). Prints accuracy per template and gold
position, and with --verbose every answer.

    python3 tools/answer_templates.py --model M.gguf [--split dev] [--variant plain] [--k 10]
        [--groups 0-7] [--templates paper cue few_words one_shot] [--tokens 16]
"""
from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "quality"))
import dataset  # noqa: E402

HEAD = ("Write a high-quality answer for the given question using only the provided search "
        "results (some of which might be irrelevant).\n\n")

# A worked example about entities that appear in neither split, in the documents' format.
ONE_SHOT = ("Example:\n"
            "Document [1](Title: Pellow Marsh) Pellow Marsh is a wetland reserve in the north. "
            "Its warden is Ada Quenby.\n"
            "Document [2](Title: Hartle Mill) Hartle Mill grinds barley and was rebuilt in "
            "1874.\n"
            "Question: When was Hartle Mill rebuilt?\n"
            "Answer: 1874\n\n")

# Two worked examples with answers of different types (a person, a year), so that the answer
# type is taken from the question rather than copied from the example.
TWO_SHOT = ("Example:\n"
            "Document [1](Title: Pellow Marsh) Pellow Marsh is a wetland reserve in the north. "
            "Its warden is Ada Quenby.\n"
            "Document [2](Title: Hartle Mill) Hartle Mill grinds barley and was rebuilt in "
            "1874.\n"
            "Question: Who is the warden of Pellow Marsh?\n"
            "Answer: Ada Quenby\n"
            "Question: When was Hartle Mill rebuilt?\n"
            "Answer: 1874\n\n")

TEMPLATES = {
    # today's prompt (Liu et al.): the model continues after "Answer:"
    "paper": dict(pre=HEAD + "Question: {q}\n\n", post="\nQuestion: {q}\nAnswer:"),
    "cue": dict(pre=HEAD + "Question: {q}\n\n", post="\nQuestion: {q}\nShort answer:"),
    "few_words": dict(pre=HEAD + "Question: {q}\n\n",
                      post="\nQuestion: {q}\nAnswer in a few words:"),
    "one_shot": dict(pre=HEAD + ONE_SHOT + "Question: {q}\n\n",
                     post="\nQuestion: {q}\nAnswer:"),
    "one_shot_nohead": dict(pre=ONE_SHOT, post="\nQuestion: {q}\nAnswer:"),
    "two_shot": dict(pre=HEAD + TWO_SHOT + "Question: {q}\n\n",
                     post="\nQuestion: {q}\nAnswer:"),
}


def prompt(template: str, item: dict) -> str:
    t = TEMPLATES[template]
    docs = "".join(f"Document [{i + 1}](Title: {d['title']}) {d['text']}\n"
                   for i, d in enumerate(item["documents"]))
    return t["pre"].format(q=item["query"]) + docs + t["post"].format(q=item["query"])


def generate(fitm: str, model: str, text: str, n: int) -> str:
    r = subprocess.run([fitm, "generate", "-m", model, "-n", str(n), "-t", "1", text],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"fitm generate failed: {r.stderr[-300:]}")
    out = r.stdout
    return out[len(text):] if out.startswith(text) else out


def first_line(s: str) -> str:
    s = s.lstrip(" ")
    s = s.lstrip("\n") if not s.startswith("\n\n") else s.lstrip("\n")
    return s.split("\n", 1)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--fitm", default=str(ROOT / "build" / "src" / "fitm"))
    ap.add_argument("--split", default="dev")
    ap.add_argument("--variant", default="plain")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--groups", default="0-7")
    ap.add_argument("--templates", nargs="+", default=list(TEMPLATES))
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    g0, g1 = (int(x) for x in a.groups.split("-"))
    items = [it for it in dataset.load(a.split) if it["variant"] == a.variant
             and it["k"] == a.k and g0 <= dataset.group(it) <= g1]
    pos = dataset.positions(a.k)
    print(f"{a.split} {a.variant} K={a.k}, groups {a.groups}: accuracy by gold position")
    print(f"{'template':<18}" + "".join(f"{'pos ' + str(p):>9}" for p in pos) + f"{'all':>9}")
    for t in a.templates:
        ok = {p: [] for p in pos}
        for it in items:
            got = first_line(generate(a.fitm, a.model, prompt(t, it), a.tokens))
            hit = it["answer"].lower() in got.lower()
            ok[it["gold_pos"]].append(hit)
            if a.verbose:
                print(f"  [{t} pos {it['gold_pos']}] {it['answer']!r}: {got!r}", flush=True)
        allv = [x for p in pos for x in ok[p]]
        print(f"{t:<18}" + "".join(f"{sum(ok[p]) / max(1, len(ok[p])):>9.2f}" for p in pos)
              + f"{sum(allv) / max(1, len(allv)):>9.2f}  (n={len(allv)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
