"""Independent numpy oracle for fitm: GGUF reading, dequantization, the forward pass of the
supported architectures, the calibration math of docs/design.md, Method, and its sampling
definition (Decoding; `sample`, with the chi-square tails of `stats`).

Written from the published format and architecture definitions, not from the C code it checks,
so that agreement between the two means something. Import as `from oracle import gguf_reader,
model, calib` (tests/ is on sys.path via tests/conftest.py).

The oracle's matrix products are small (a few dozen rows), where a multi-threaded BLAS on a
busy 2-core machine is many times slower than one thread. If numpy is not loaded yet and the
user has not chosen, load it with OPENBLAS_NUM_THREADS=1, then restore the environment so that
processes the tests start (the fitm daemon) do not inherit the setting."""
import os
import sys

if "numpy" not in sys.modules and "OPENBLAS_NUM_THREADS" not in os.environ:
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401  (OpenBLAS reads the variable once, when it loads)
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]
