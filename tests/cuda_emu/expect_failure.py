"""Runs a test that must fail in a stated way: exit status 0 when the command exits with a
nonzero status (not killed by a signal: a crash is not the failure wanted) and its output
matches every --want pattern, else 1. For the mutant and racy builds of tests/meson.build.

    python3 expect_failure.py --want 'FAIL' [--want REGEX ...] -- COMMAND [ARGS ...]"""
import argparse
import os
import re
import subprocess
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--want", action="append", default=[], help="regex the output must match")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    # one failing check is the failure wanted: tests/check.h then exits at the first
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       errors="replace", env=dict(os.environ, FITM_CHECK_FIRST_FAIL="1"))
    out = p.stdout
    print(out[-6000:])
    missing = [w for w in a.want if not re.search(w, out, re.M)]
    if p.returncode <= 0:
        why = "passed" if p.returncode == 0 else f"was killed by signal {-p.returncode}"
        print(f"expect_failure: the command {why}; it must fail", file=sys.stderr)
        return 1
    if missing:
        print(f"expect_failure: exit {p.returncode}, but the output lacks {missing}",
              file=sys.stderr)
        return 1
    print(f"expect_failure: failed as expected (exit {p.returncode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
