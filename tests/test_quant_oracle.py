"""The C quant module against the independent numpy oracle (tests/oracle/quant.py).

Runs build_dir()/tests/quant_tool on fresh seeded random data (several seeds and sizes, with
outliers, negative values, an all-zero and a constant block) for every weight type:

* dequantization: C (vectorised and scalar) == numpy, bit for bit, on random blocks and on
  what the C quantizer writes;
* quantization: F16/BF16/Q8_0/Q4_0/Q5_0/Q8_K bytes == the numpy reference quantizer's bytes;
  every type's round-trip error within the per-type bound justified at ERROR_BOUNDS;
* matvec (quantized activations, vectorised and scalar) and matmul (dequantized tiles + BLAS)
  against float64 numpy on the exact dequantized values, within float rounding (see
  test_matvec / test_matmul for the tolerances).
"""
import pathlib
import subprocess

import numpy as np
import pytest

from conftest import build_dir
from oracle import quant as Q

WEIGHT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
ALL_TYPES = WEIGHT_TYPES + ["Q8_K"]
SIMPLE_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q8_K"]  # exact reference bytes
U = 2.0 ** -24  # float32 unit roundoff


@pytest.fixture(scope="module")
def tool() -> pathlib.Path:
    p = build_dir() / "tests" / "quant_tool"
    if not p.exists():
        pytest.fail(f"{p} not built; run meson/ninja first (or set FITM_BUILD_DIR)")
    return p


def run(tool, *args):
    r = subprocess.run([str(tool), *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, f"quant_tool {' '.join(map(str, args))}: {r.stderr}"


def block_elems(t: str) -> int:
    return Q.TYPES[Q.type_id(t)][1]


def weights(rng: np.random.Generator, n: int) -> np.ndarray:
    """Weight-like data: normal values with a scale varying per 256-chunk over three orders of
    magnitude, a mean offset, about 1% outliers of either sign at 10-30x, one all-zero
    32-block and one constant negative 32-block."""
    x = rng.standard_normal(n)
    chunk_scale = 10.0 ** rng.uniform(-2, 1, size=(n + 255) // 256)
    x = x * np.repeat(chunk_scale, 256)[:n] + rng.normal(0, 0.1) * np.repeat(chunk_scale, 256)[:n]
    out = rng.random(n) < 0.01
    x[out] *= rng.uniform(10, 30, size=out.sum())
    if n >= 128:
        x[32:64] = 0.0
        x[64:96] = -abs(rng.normal()) - 0.5
    return x.astype(np.float32)


def random_blocks(rng: np.random.Generator, t: str, n: int) -> bytes:
    """Random bytes for n values of type t, with the float scale fields set to random finite
    values of both signs (random fp16 bits could be NaN, whose float32 widening may differ)."""
    tid = Q.type_id(t)
    if t == "F32":
        return (rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30, n)).astype("<f4").tobytes()
    if t in ("F16", "BF16"):
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
        exp_all_ones = (bits & 0x7C00) == 0x7C00 if t == "F16" else (bits & 0x7F80) == 0x7F80
        bits[exp_all_ones] &= 0xBFFF  # keep inf/NaN out: numpy's NaN widening is its own
        return bits.astype("<u2").tobytes()
    _, be, bb = Q.TYPES[tid]
    nb = n // be
    raw = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)

    def f16(k):
        return (rng.standard_normal(nb) * 10.0 ** rng.uniform(-4, 1, nb)).astype("<f2").view(np.uint8).reshape(nb, 2)

    if t in ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K"):
        raw[:, 0:2] = f16(0)
    if t in ("Q4_K", "Q5_K"):
        raw[:, 2:4] = f16(1)
    if t == "Q6_K":
        raw[:, 208:210] = f16(0)
    if t == "Q8_K":
        raw[:, 0:4] = (rng.standard_normal(nb) * 1e-2).astype("<f4").view(np.uint8).reshape(nb, 4)
    return raw.tobytes()


def c_quant(tool, tmp, t, x) -> bytes:
    x.astype("<f4").tofile(tmp / "x.f32")
    run(tool, "quant", t, tmp / "x.f32", tmp / "q.bin")
    return (tmp / "q.bin").read_bytes()


def c_dequant(tool, tmp, t, raw, n, scalar=False) -> np.ndarray:
    (tmp / "d.bin").write_bytes(raw)
    run(tool, "dequant", t, tmp / "d.bin", tmp / "d.f32", n, *(["scalar"] if scalar else []))
    return np.fromfile(tmp / "d.f32", dtype="<f4")


def assert_bits_equal(a: np.ndarray, b: np.ndarray, what: str):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    assert a.shape == b.shape, what
    diff = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert diff.size == 0, (f"{what}: {diff.size} values differ, first at {diff[0]}: "
                            f"{a[diff[0]]!r} vs {b[diff[0]]!r}")


# ------------------------------------------------------------------------------------------
# Dequantization


@pytest.mark.parametrize("t", ALL_TYPES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_dequant_random_blocks_bit_exact(tool, tmp_path, t, seed):
    rng = np.random.default_rng([seed, ALL_TYPES.index(t)])
    n = block_elems(t) * int(rng.integers(1, 24))
    raw = random_blocks(rng, t, n)
    ref = Q.dequantize(t, raw, n)
    assert np.all(np.isfinite(ref))
    assert_bits_equal(c_dequant(tool, tmp_path, t, raw, n), ref, f"{t} vectorised")
    assert_bits_equal(c_dequant(tool, tmp_path, t, raw, n, scalar=True), ref, f"{t} scalar")


# ------------------------------------------------------------------------------------------
# Quantization


def block_view(x: np.ndarray, be: int) -> np.ndarray:
    return x.astype(np.float64).reshape(-1, be)


def check_error_bound(t: str, x: np.ndarray, y: np.ndarray):
    """Per-type round-trip bounds, each from the format and the scale choice:

    F16   |e| <= 2^-11 |x| + 2^-25 (round to nearest: half an ulp; absolute in subnormals)
    BF16  |e| <= 2^-8 |x|
    Q8_0  d = amax/127: |e| <= d/2 from rounding, + 127 * |d - fp16(d)| <= 127 * 2^-11 d
    Q8_K  |e| <= d/2 (d kept as float32)
    Q4_0  d = m/-8 (m the largest-magnitude value): values on m's side round into [-8, 7]
          with |e| <= |d|/2, the opposite side may reach 8|d| and clip to 7: |e| <= |d|;
          fp16(d) adds <= 8 * 2^-11 |d|
    Q5_0  the same with 16: |e| <= |d| (1 + 16 * 2^-11)
    K-quants: the (scale, min) search may clip extremes and the 6/8-bit scale quantization
          shifts levels, so there is no tight per-element bound; instead the max error in a
          super-block is bounded by the super-block's range / nmax * c, where range / nmax
          is the step a plain min-max quantizer of the whole super-block would have (a wrong
          bit placement gives errors of the order of the range, 5-30x above this), and the
          RMS error of Gaussian rows is bounded by the uniform-quantizer model:
          step / sqrt(12) with step = (expected range of the sub-block) / nmax.
    All bounds carry a factor 1.001 for the float32 arithmetic of the quantizer."""
    e = np.abs(x.astype(np.float64) - y.astype(np.float64))
    ax = np.abs(x.astype(np.float64))
    if t == "F32":
        assert np.array_equal(x, y)
        return
    if t == "F16":
        bound = 2.0 ** -11 * ax + 2.0 ** -25
    elif t == "BF16":
        bound = 2.0 ** -8 * ax
    elif t in ("Q8_0", "Q8_K"):
        be = block_elems(t)
        d = np.abs(block_view(x, be)).max(axis=1) / 127
        per = d * (0.5 + (127 * 2.0 ** -11 if t == "Q8_0" else 0.0))
        bound = np.repeat(per, be) * 1.001
    elif t in ("Q4_0", "Q5_0"):
        half = 8 if t == "Q4_0" else 16
        d = np.abs(block_view(x, 32)).max(axis=1) / half
        bound = np.repeat(d * (1 + half * 2.0 ** -11), 32) * 1.001
    else:
        nmax = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[t]
        c = {"Q4_K": 1.0, "Q5_K": 1.0, "Q6_K": 1.0}[t]
        xb = block_view(x, 256)
        rng_sb = xb.max(axis=1) - np.minimum(xb.min(axis=1), 0.0)
        if t == "Q6_K":  # symmetric: the step spans 2 * amax over 63 levels
            rng_sb = 2 * np.abs(xb).max(axis=1)
        bound = np.repeat(rng_sb / nmax * c, 256) * 1.001
    bad = np.flatnonzero(e > bound)
    assert bad.size == 0, (f"{t}: {bad.size} values over the bound, worst ratio "
                           f"{(e[bad] / np.maximum(bound[bad], 1e-300)).max():.3f} at {bad[0]}")


# RMS error / RMS value on plain Gaussian rows (no outliers). Model: step / sqrt(12) with
# step = E[range of the block] / levels; plus margin for scale quantization and for the
# fp16 scale. Q8_0 0.0063 (32 normals: E[amax] ~ 2.07 sigma, step 2*2.07/254: 0.0047),
# Q8_K 0.008 (256 normals: E[amax] ~ 2.9 sigma: 0.0066),
# Q4_0 0.11 (step ~ 2.07/8 sigma, worse at the clipped side), Q5_0 0.055, Q4_K 0.095
# (range ~ 4.1 sigma over 15 levels: 0.079), Q5_K 0.045 (0.038), Q6_K 0.022 (16 normals:
# E[amax] ~ 1.77 sigma, step 2 * 1.77 / 63: 0.016), F16 2^-11/sqrt(3), BF16 2^-8/sqrt(3).
RMS_BOUND = {"F32": 0.0, "F16": 2.9e-4, "BF16": 2.3e-3, "Q8_0": 0.0063, "Q8_K": 0.008,
             "Q4_0": 0.11, "Q5_0": 0.055, "Q4_K": 0.095, "Q5_K": 0.045, "Q6_K": 0.022}


@pytest.mark.parametrize("t", ALL_TYPES)
@pytest.mark.parametrize("seed,blocks", [(11, 1), (12, 3), (13, 17)])
def test_quant_roundtrip(tool, tmp_path, t, seed, blocks):
    rng = np.random.default_rng([seed, ALL_TYPES.index(t)])
    n = 256 * blocks  # a multiple of every block size
    x = weights(rng, n)
    raw = c_quant(tool, tmp_path, t, x)
    assert len(raw) == Q.row_bytes(Q.type_id(t), n)
    if t in SIMPLE_TYPES:
        ref = Q.quantize(t, x)
        if raw != ref:
            first = next(i for i in range(len(raw)) if raw[i] != ref[i])
            pytest.fail(f"{t}: C bytes differ from the reference quantizer at byte {first}")
    y_c = c_dequant(tool, tmp_path, t, raw, n)
    y = Q.dequantize(t, raw, n)
    assert_bits_equal(y_c, y, f"{t} dequantize(quantize(x))")
    check_error_bound(t, x, y)


@pytest.mark.parametrize("t", ALL_TYPES)
def test_quant_rms_error_gaussian(tool, tmp_path, t):
    rng = np.random.default_rng([21, ALL_TYPES.index(t)])
    n = 256 * 64
    x = (rng.standard_normal(n) * 0.05).astype(np.float32)
    y = Q.dequantize(t, c_quant(tool, tmp_path, t, x), n)
    rel = np.sqrt(np.mean((x.astype(np.float64) - y) ** 2)) / np.sqrt(np.mean(x.astype(np.float64) ** 2))
    assert rel <= RMS_BOUND[t], f"{t}: relative RMS error {rel:.5f} > {RMS_BOUND[t]}"
    if t != "F32":
        assert rel > 0  # the format really is lossy: the comparison can fail


# ------------------------------------------------------------------------------------------
# Dot products and matrix products


def exact_rows(t: str, raw: bytes, N: int, K: int):
    a, b = Q.dequantize_exact(t, raw, N * K)
    return (a - b).reshape(N, K), (np.abs(a) + np.abs(b)).reshape(N, K)


@pytest.mark.parametrize("t", WEIGHT_TYPES)
@pytest.mark.parametrize("seed,N,K", [(31, 37, 256), (32, 64, 768), (33, 9, 4096)])
@pytest.mark.parametrize("path", ["simd", "scalar"])
def test_matvec(tool, tmp_path, t, seed, N, K, path):
    """y = W x with x quantized to the partner type, against float64 on the exact values of
    W and x_q. Tolerance |y - ref| <= (K/32 + 70) u * sum_k (|a| + |b|)_nk |x_q,k|: integer
    block sums are exact, each block adds a few float32 roundings and the blocks are summed
    in float32 (at most K/32 terms per accumulator; the float types sum K/32 per SIMD lane,
    or 64-element partial sums on the scalar path, + the horizontal sum). |a| + |b| is the
    magnitude of the two terms K-quants subtract, which is what the rounding scales with."""
    rng = np.random.default_rng([seed, WEIGHT_TYPES.index(t)])
    W = weights(rng, N * K)
    x = (rng.standard_normal(K) * rng.uniform(0.1, 10)).astype(np.float32)
    x[rng.integers(0, K, 3)] *= -25  # activation outliers
    raw = c_quant(tool, tmp_path, t, W)
    (tmp_path / "w.bin").write_bytes(raw)
    x.tofile(tmp_path / "xv.f32")
    run(tool, "matvec", t, tmp_path / "w.bin", tmp_path / "xv.f32", N, K, tmp_path / "y.f32",
        tmp_path / "xq.bin", *(["scalar"] if path == "scalar" else []))
    y = np.fromfile(tmp_path / "y.f32", dtype="<f4").astype(np.float64)
    vt = {"F32": "F32", "F16": "F32", "BF16": "F32", "Q8_0": "Q8_0", "Q4_0": "Q8_0",
          "Q5_0": "Q8_0"}.get(t, "Q8_K")
    xq_raw = (tmp_path / "xq.bin").read_bytes()
    if vt == "F32":
        assert xq_raw == x.tobytes()
    else:
        assert xq_raw == Q.quantize(vt, x)  # the activation quantizer is the reference one
    xa, xb = Q.dequantize_exact(vt, xq_raw, K)
    xe = xa - xb
    We, mag = exact_rows(t, raw, N, K)
    ref = We @ xe
    scale = mag @ np.abs(xe)
    tol = (K / 32 + 70) * U * scale
    err = np.abs(y - ref)
    assert np.all(err <= tol), f"{t}: worst err/tol {np.max(err / tol):.3f}"
    # the result is not trivially small: the test can fail
    assert np.max(np.abs(ref)) > 100 * np.max(tol)


@pytest.mark.parametrize("t", WEIGHT_TYPES)
@pytest.mark.parametrize("seed,N,K,M", [(41, 530, 256, 5), (42, 70, 1024, 33)])  # 530: 3 tiles
def test_matmul(tool, tmp_path, t, seed, N, K, M):
    """Y = X W^T through dequantized tiles and BLAS sgemm, against float64 on the float32
    dequantized W (what sgemm multiplies) and X. sgemm accumulates in float32 with one
    accumulator per output in the worst case: |Y - ref| <= (K + 16) u * sum_k |w x|."""
    rng = np.random.default_rng([seed, WEIGHT_TYPES.index(t)])
    W = weights(rng, N * K)
    X = (rng.standard_normal((M, K)) * rng.uniform(0.1, 10, size=(M, 1))).astype(np.float32)
    raw = c_quant(tool, tmp_path, t, W)
    (tmp_path / "w.bin").write_bytes(raw)
    X.tofile(tmp_path / "X.f32")
    run(tool, "matmul", t, tmp_path / "w.bin", tmp_path / "X.f32", N, K, M, tmp_path / "Y.f32")
    Y = np.fromfile(tmp_path / "Y.f32", dtype="<f4").astype(np.float64).reshape(M, N)
    Wd = Q.dequantize(t, raw, N * K).astype(np.float64).reshape(N, K)
    ref = X.astype(np.float64) @ Wd.T
    tol = (K + 16) * U * (np.abs(X.astype(np.float64)) @ np.abs(Wd).T)
    err = np.abs(Y - ref)
    assert np.all(err <= tol), f"{t}: worst err/tol {np.max(err / tol):.3f}"
    assert np.max(np.abs(ref)) > 100 * np.max(tol)
