"""A scoring profile's keys (config/profiles/, docs/scoring.md), read as fitmd reads them; for
tools/fit_profile.py and tests/bench_cuda.py, with nothing beyond the standard library (the
GPU machine runs the latter)."""
import pathlib


def profile_keys(path) -> dict:
    """A profile's `key = value` lines as strings, quotes removed; as fitmd reads it, a line
    whose first character is `#` is a comment (a `#` inside a value is part of it)."""
    kv = {}
    for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if "=" in line and not line.startswith("#"):
            k, v = (x.strip() for x in line.split("=", 1))
            kv[k] = v[1:-1] if len(v) >= 2 and v[0] == v[-1] == '"' else v
    return kv
