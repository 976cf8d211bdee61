"""Checks that every kernel (a __global__ function of kernels/) begins with fitm_grid_begin();
(or fitm_grid_begin_prefetch(...);, which names weights to prefetch before the same wait)
as its first statement (kernels/common.cuh, "programmatic launches"): a kernel's grid may
start while the kernel before it in the stream runs, so nothing of it may come before that
wait. The emulator (tests/cuda_emu) faults a programmatic launch whose threads reach a
barrier, a shuffle or shared memory first, or end without the call; this check covers what
runs before those and the kernels no test runs.

Usage: python3 kernels/check_entry.py KERNELS_DIR   (exit status 1 with one line per finding)
"""
import pathlib
import re
import sys

GLOBAL = re.compile(r"__global__\b")
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
# fitm_grid_begin after prefetching spans of weights (common.cuh): its arguments are computed
# from the launch's parameters and indices alone, and it waits as fitm_grid_begin does
PREFETCH = re.compile(r"fitm_grid_begin_prefetch\(.*\);$", re.S)


def first_statement(text, at):
    """The kernel declared at text[at:]: its name and its body's first statement (up to the
    first ';' or '{' after the body's opening brace), comments left out. No '{' comes between
    __global__ and the body: parameters and launch bounds hold none."""
    body = text.index("{", at)
    head = text[at:body]
    lb = head.find("__launch_bounds__")
    if lb >= 0:  # drop its balanced parentheses, which may hold calls of their own
        depth, i = 0, head.index("(", lb)
        for i in range(i, len(head)):
            depth += {"(": 1, ")": -1}.get(head[i], 0)
            if depth == 0:
                break
        head = head[:lb] + head[i + 1:]
    m = re.search(r"([A-Za-z_]\w*)\s*\(", head)
    first = re.match(r"\s*([^;{]*[;{])", text[body + 1:])
    return (m.group(1) if m else "?"), (" ".join(first.group(1).split()) if first else "")


def main(root):
    findings = []
    for path in sorted(pathlib.Path(root).glob("*.cu*")):
        text = COMMENT.sub(" ", path.read_text(encoding="utf-8"))
        for m in GLOBAL.finditer(text):
            name, first = first_statement(text, m.start())
            if first != "fitm_grid_begin();" and not PREFETCH.match(first):
                findings.append(f"{path.name}: kernel {name} begins with '{first}', not "
                                f"'fitm_grid_begin();' (or fitm_grid_begin_prefetch)")
    for f in findings:
        print(f)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent))
