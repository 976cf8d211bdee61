"""How many candidates the device's top-k selection (kernels/topk.cu) collects on a model's
real decode rows: the rows are the logits after each prompt and after each of its first N
greedy tokens (`fitm generate --logits` on the CPU backend), and each row's count is computed
here as the kernel's stage 2 defines it: the row cut in chunks of ceil(V / 256) entries, T the
k-th of the chunks' first entries in fitm_ops_topk's order (logit descending, equal logits
lower id first), the count the number of entries that are T or come before it.

    python3 tools/topk_candidates.py --fitm build/src/fitm -m MODEL [-n 8] [-k 64] [PROMPT...]

Prints one line per row (prompt number, step, count) and the distribution (min, quartiles,
max). A row whose count exceeds the kernel's FITM_CUDA_TOPK_CAP takes its fallback."""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

CHUNKS = 256  # FITM_CUDA_TOPK_CHUNKS (kernels/kernels.h)

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Question: Which planet is closest to the sun?\nAnswer:",
    "In 1969, the first humans",
    "Les chats sont",
]


def candidates(row: np.ndarray, k: int) -> int:
    n = row.size
    chunk = -(-n // CHUNKS)
    firsts = []
    for lo in range(0, n, chunk):
        part = row[lo:lo + chunk]
        i = int(np.argmax(part))  # the first maximum: the lower id among equal logits
        firsts.append((-float(part[i]), lo + i))
    firsts.sort()
    tv, ti = firsts[k - 1]
    tv = -tv
    ids = np.arange(n)
    return int(np.count_nonzero((row > tv) | ((row == tv) & (ids <= ti))))


def run(cmd) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fitm", default="build/src/fitm")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", type=int, default=8, help="greedy steps after each prompt")
    ap.add_argument("-k", type=int, default=64)
    ap.add_argument("prompts", nargs="*")
    a = ap.parse_args()
    counts = []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits")
        for p, prompt in enumerate(a.prompts or PROMPTS):
            ids = run([a.fitm, "tokenize", "-m", a.model, prompt]).split()
            gen = run([a.fitm, "generate", "-m", a.model, "-n", str(a.n), "--ids",
                       "--ignore-eos", "--prompt-ids", " ".join(ids)]).split()
            for s in range(len(gen) + 1):
                run([a.fitm, "generate", "-m", a.model, "-n", "1", "--ids", "--logits", out,
                     "--prompt-ids", " ".join(ids + gen[:s])])
                row = np.loadtxt(out, dtype=np.float32)
                c = candidates(row, a.k)
                counts.append(c)
                print(f"prompt {p} step {s}: V {row.size} count {c}")
    q = np.percentile(counts, [0, 25, 50, 75, 90, 100])
    print(f"rows {len(counts)} k {a.k}: min {q[0]:.0f} q1 {q[1]:.0f} median {q[2]:.0f} "
          f"q3 {q[3]:.0f} p90 {q[4]:.0f} max {q[5]:.0f} mean {np.mean(counts):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
