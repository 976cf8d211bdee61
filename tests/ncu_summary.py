#!/usr/bin/env python3
"""Summarises an Nsight Compute CSV of kernel durations (ncu --csv --print-units base
--metrics gpu__time_duration.sum --log-file FILE), as tests/gpu_check.sh writes it.

  tests/ncu_summary.py FILE            each kernel (name and grid): launches, total, mean
  tests/ncu_summary.py --steps FILE    per forward call (a call begins at its embedding
                                       launch): kernels and time, its three longest kernels;
                                       then each kernel's mean and max over the calls of more
                                       than 100 kernels (decode steps and prompts)
"""
import collections
import csv
import sys


def launches(path):
    """[(kernel name and grid, microseconds)] in launch order."""
    rows = list(csv.reader(open(path)))
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if head is None:
        sys.exit(f"{path}: no 'Kernel Name' header (not an ncu --csv log?)")
    h = rows[head]
    ki, vi, gi = h.index("Kernel Name"), h.index("Metric Value"), h.index("Grid Size")
    out = []
    for r in rows[head + 1:]:
        try:
            us = float(r[vi].replace(",", "")) / 1e3
        except (ValueError, IndexError):
            continue
        out.append((r[ki].split("(")[0].replace("void ", "")[:48] + " g" + r[gi], us))
    return out


def by_kernel(ls):
    t = collections.defaultdict(list)
    for n, us in ls:
        t[n].append(us)
    print(f"{len(ls)} launches, {sum(us for _, us in ls):.1f} us")
    print(f"{'total us':>10} {'launches':>8} {'mean us':>9}  kernel")
    for n, v in sorted(t.items(), key=lambda x: -sum(x[1]))[:40]:
        print(f"{sum(v):10.1f} {len(v):8d} {sum(v) / len(v):9.2f}  {n}")


def by_step(ls):
    steps, cur = [], None
    for n, us in ls:
        if n.startswith("fitm_embed_rows"):
            cur = []
            steps.append(cur)
        if cur is not None:
            cur.append((n, us))
    per = collections.defaultdict(list)
    for i, s in enumerate(steps):
        top = sorted(s, key=lambda x: -x[1])[:3]
        print(f"call {i:3d}: {len(s):4d} kernels {sum(us for _, us in s):9.1f} us  " +
              "; ".join(f"{n} {us:.1f}" for n, us in top))
        if len(s) > 100:
            for n, us in s:
                per[n].append(us)
    print("over the calls of more than 100 kernels: launches, mean us, max us, total us")
    for n, v in sorted(per.items(), key=lambda x: -sum(x[1]))[:25]:
        print(f"  {n:60s} {len(v):6d} {sum(v) / len(v):8.2f} {max(v):8.2f} {sum(v):9.1f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "--steps":
        by_step(launches(args[1]))
    elif len(args) == 1 and not args[0].startswith("-"):
        by_kernel(launches(args[0]))
    else:
        sys.exit(__doc__)
