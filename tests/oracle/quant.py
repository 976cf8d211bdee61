"""Independent numpy reference for fitm's weight formats (the GGML block layouts as stored in
GGUF files).

Written from the format description, block by block, vectorised over blocks with numpy. Every
float step is done in float32 in the same order as the format defines it, so results are
bit-exact with any conforming decoder:

    Q4_0 / Q5_0 / Q8_0  x = d * q                        (d: fp16, q signed)
    Q4_K / Q5_K         x = (d * sc) * q - (dmin * m)    (sc, m: 6-bit, q unsigned)
    Q6_K                x = (d * sc) * q                 (sc: int8, q = 6-bit - 32)
    Q8_K                x = d * q                        (d: fp32, activations only)

Public API:
    dequantize(type_id, raw, n) -> np.ndarray[float32] of n values
    dequantize_exact(type_id, raw, n) -> (a, b) float64 with value = a - b, no rounding
    quantize(type_id, x) -> bytes  for F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q8_K (round to
        nearest, ties to even; the scale choices are documented on each function)
    TYPES: {type_id: (name, block_elems, block_bytes)}
"""
import numpy as np

F32, F16, Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, Q8_K, BF16 = 0, 1, 2, 6, 8, 12, 13, 14, 15, 30

TYPES = {
    F32: ("F32", 1, 4),
    F16: ("F16", 1, 2),
    BF16: ("BF16", 1, 2),
    Q4_0: ("Q4_0", 32, 18),
    Q5_0: ("Q5_0", 32, 22),
    Q8_0: ("Q8_0", 32, 34),
    Q4_K: ("Q4_K", 256, 144),
    Q5_K: ("Q5_K", 256, 176),
    Q6_K: ("Q6_K", 256, 210),
    Q8_K: ("Q8_K", 256, 292),
}

NAMES = {v[0]: k for k, v in TYPES.items()}


def type_id(name_or_id) -> int:
    if isinstance(name_or_id, str):
        return NAMES[name_or_id.upper()]
    return int(name_or_id)


def row_bytes(tid: int, n: int) -> int:
    _, be, bb = TYPES[tid]
    if n % be:
        raise ValueError(f"{TYPES[tid][0]}: n={n} is not a multiple of {be}")
    return n // be * bb


def _blocks(tid: int, raw, n: int) -> np.ndarray:
    """raw as a (n_blocks, block_bytes) uint8 array."""
    if isinstance(raw, np.ndarray):
        buf = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    else:
        buf = np.frombuffer(bytes(raw), dtype=np.uint8)
    need = row_bytes(tid, n)
    if buf.size < need:
        raise ValueError(f"{TYPES[tid][0]}: {buf.size} bytes given, {need} needed for n={n}")
    return buf[:need].reshape(-1, TYPES[tid][2])


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from a (..., 2) uint8 array, widened (exactly) to float32."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32: widen by shifting the bits up."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _k_scales_mins(sc12: np.ndarray):
    """The 12 packed bytes of Q4_K/Q5_K -> (scales, mins), each (n_blocks, 8) float32.

    Sub-blocks 0..3 use the low 6 bits of bytes 0..3 (scale) and 4..7 (min). Sub-blocks 4..7
    take their low 4 bits from the nibbles of bytes 8..11 (scale: low nibble, min: high nibble)
    and their top 2 bits from the top 2 bits of bytes 0..3 (scale) and 4..7 (min)."""
    s = sc12.astype(np.uint32)
    sc = np.empty((s.shape[0], 8), np.uint32)
    mn = np.empty((s.shape[0], 8), np.uint32)
    sc[:, 0:4] = s[:, 0:4] & 63
    mn[:, 0:4] = s[:, 4:8] & 63
    sc[:, 4:8] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:8] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k4_nibbles(qs128: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K low 4 bits as (n_blocks, 8, 32): four 32-byte groups; in group g the low
    nibbles are sub-block 2g and the high nibbles sub-block 2g+1."""
    g = qs128.reshape(-1, 4, 32)
    out = np.empty((g.shape[0], 8, 32), np.uint8)
    out[:, 0::2, :] = g & 0xF
    out[:, 1::2, :] = g >> 4
    return out


def dequantize(tid, raw, n: int) -> np.ndarray:
    """Decode n values of type tid (a GGUF type id or name) from raw bytes to float32,
    bit-exact: scale * q is rounded to float32, then the min (K-quants) is subtracted and the
    result rounded again, with scale = d (Q4_0/Q5_0/Q8_0/Q8_K) or float32(d * sc) (K-quants)."""
    tid = type_id(tid)
    b = _blocks(tid, raw, n)
    if tid == F32:
        return b.reshape(-1).view("<f4").astype(np.float32)
    if tid == F16:
        return b.reshape(-1).view("<f2").astype(np.float32)
    if tid == BF16:
        return bf16_to_f32(b.reshape(-1).view("<u2"))
    scale, q, off = _parts(tid, b)
    x = scale.astype(np.float32) * q.astype(np.float32)  # float32, rounded once
    if off is not None:
        x = x - off.astype(np.float32)  # rounded again
    return x.astype(np.float32)


def dequantize_exact(tid, raw, n: int):
    """The values without float32 rounding, as float64 (a, b) with value = a - b exactly:
    a = scale * q and b = the subtracted min (zero except for Q4_K/Q5_K). |a| + |b| is the
    magnitude a dot product's rounding error scales with."""
    tid = type_id(tid)
    b = _blocks(tid, raw, n)
    if tid in (F32, F16, BF16):
        v = dequantize(tid, raw, n).astype(np.float64)
        return v, np.zeros_like(v)
    scale, q, off = _parts(tid, b)
    a = scale * q  # exact: a <= 22-bit scale times a 6-bit q
    return a, (off if off is not None else np.zeros_like(a))


def _parts(tid: int, b: np.ndarray):
    """Per element (scale, q, off) as float64 arrays, each exactly representable in float32;
    value = scale * q - off. off is None for types without a min."""
    if tid == Q8_0:  # fp16 d, int8 q[32]
        d = _f16(b[:, 0:2])
        q = b[:, 2:34].view(np.int8)
        return np.repeat(d, 32).astype(np.float64), q.reshape(-1).astype(np.float64), None

    if tid == Q4_0:  # fp16 d, 16 bytes: element j low nibble, element j+16 high nibble
        d = _f16(b[:, 0:2])
        qs = b[:, 2:18]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float64) - 8.0
        return np.repeat(d, 32).astype(np.float64), q.reshape(-1), None

    if tid == Q5_0:  # fp16 d, u32 qh (bit j = 5th bit of element j), 16 nibble bytes as Q4_0
        d = _f16(b[:, 0:2])
        qh = np.ascontiguousarray(b[:, 2:6]).view("<u4")[:, 0]
        hi = (qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1
        qs = b[:, 6:22]
        lo = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.uint32)
        q = (lo | (hi << 4)).astype(np.float64) - 16.0
        return np.repeat(d, 32).astype(np.float64), q.reshape(-1), None

    if tid == Q8_K:  # fp32 d, int8 q[256], int16 bsums[16] (sums of 16 q's; not needed here)
        d = np.ascontiguousarray(b[:, 0:4]).view("<f4")[:, 0]
        q = b[:, 4:260].view(np.int8)
        return np.repeat(d, 256).astype(np.float64), q.reshape(-1).astype(np.float64), None

    if tid in (Q4_K, Q5_K):
        # fp16 d, fp16 dmin, 12 packed scale/min bytes, [Q5_K: 32 qh bytes], 128 nibble bytes
        d = _f16(b[:, 0:2]).astype(np.float64)
        dmin = _f16(b[:, 2:4]).astype(np.float64)
        sc, mn = _k_scales_mins(b[:, 4:16])
        if tid == Q4_K:
            q = _k4_nibbles(b[:, 16:144]).astype(np.uint32)
        else:
            qh = b[:, 16:48].astype(np.uint32)  # (nb, 32): bit s of byte l -> sub-block s, pos l
            hi = (qh[:, None, :] >> np.arange(8, dtype=np.uint32)[None, :, None]) & 1
            q = _k4_nibbles(b[:, 48:176]).astype(np.uint32) | (hi << 4)
        scale = d[:, None] * sc  # (nb, 8): fp16 * 6-bit, exact in float32 and float64
        off = dmin[:, None] * mn
        q = q.astype(np.float64)
        return (np.repeat(scale, 32, axis=1).reshape(-1), q.reshape(-1),
                np.repeat(off, 32, axis=1).reshape(-1))

    if tid == Q6_K:
        # ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16], fp16 d (last).
        # Two halves of 128 elements; half h uses ql[64h:64h+64], qh[32h:32h+32],
        # scales[8h:8h+8]. Element 32k+l of the half (k = 0..3, l = 0..31):
        #   low  = k=0: ql[l]&15, k=1: ql[l+32]&15, k=2: ql[l]>>4, k=3: ql[l+32]>>4
        #   high = (qh[l] >> 2k) & 3;  scale = scales[2k + l//16]
        ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # (nb, half, first/second 32, l)
        qh = b[:, 128:192].reshape(-1, 2, 32).astype(np.uint32)
        scales = b[:, 192:208].view(np.int8).astype(np.float64)  # (nb, 16)
        d = _f16(b[:, 208:210]).astype(np.float64)
        low = np.empty((b.shape[0], 2, 4, 32), np.uint32)
        low[:, :, 0] = ql[:, :, 0] & 0xF
        low[:, :, 1] = ql[:, :, 1] & 0xF
        low[:, :, 2] = ql[:, :, 0] >> 4
        low[:, :, 3] = ql[:, :, 1] >> 4
        high = (qh[:, :, None, :] >> (2 * np.arange(4, dtype=np.uint32))[None, None, :, None]) & 3
        q = (low | (high << 4)).astype(np.float64) - 32.0  # (nb, 2, 4, 32) = element order
        # the scale index 8h + 2k + l//16 is the element's 16-group index
        scale = np.repeat(d[:, None] * scales, 16, axis=1)  # fp16 * int8: exact in float32
        return scale.reshape(-1), q.reshape(-1), None

    raise ValueError(f"unknown type id {tid}")


# ---------------------------------------------------------------------------------------------
# Reference quantizers (round to nearest, ties to even, in float32).


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even; NaN -> quiet NaN of the same sign."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out = np.where(nan, (u >> 16) | 0x40, rounded)
    return out.astype(np.uint16)


def _rint_clip(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(v), lo, hi).astype(np.int32)


def _inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)


def _absmax_signed(xb: np.ndarray) -> np.ndarray:
    """Per block, the value with the largest magnitude (the first one on ties), with its sign."""
    idx = np.argmax(np.abs(xb), axis=1)
    return xb[np.arange(xb.shape[0]), idx]


def quantize(tid, x) -> bytes:
    """Encode float32 values x (length a multiple of the block size).

    Q8_0: d = amax/127, q = rint(x * (1/d)) in [-127, 127], d stored as fp16.
    Q4_0: m = the value of largest magnitude (sign kept), d = m / -8,
          q = clip(rint(x * (1/d)), -8, 7) + 8, d stored as fp16.
    Q5_0: as Q4_0 with d = m / -16 and q = clip(rint(x/d), -16, 15) + 16.
    Q8_K: d = amax/127 stored as fp32, q = rint(x * (1/d)), bsums = sums of 16 q's.
    (1/d is 0 when d is 0, giving all-zero q.)"""
    tid = type_id(tid)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if tid == F32:
        return x.astype("<f4").tobytes()
    if tid == F16:
        return x.astype("<f2").tobytes()
    if tid == BF16:
        return f32_to_bf16_bits(x).astype("<u2").tobytes()
    name, be, bb = TYPES[tid]
    if x.size % be:
        raise ValueError(f"{name}: n={x.size} is not a multiple of {be}")
    xb = x.reshape(-1, be)
    nb = xb.shape[0]
    out = np.zeros((nb, bb), np.uint8)
    if tid in (Q8_0, Q8_K):
        amax = np.max(np.abs(xb), axis=1)
        d = (amax / np.float32(127.0)).astype(np.float32)
        q = _rint_clip(xb * _inv(d)[:, None], -127, 127)
        if tid == Q8_0:
            out[:, 0:2] = d.astype("<f2").view(np.uint8).reshape(nb, 2)
            out[:, 2:34] = q.astype(np.int8).view(np.uint8)
        else:
            out[:, 0:4] = d.astype("<f4").view(np.uint8).reshape(nb, 4)
            out[:, 4:260] = q.astype(np.int8).view(np.uint8)
            bs = q.reshape(nb, 16, 16).sum(axis=2).astype("<i2")
            out[:, 260:292] = bs.view(np.uint8).reshape(nb, 32)
        return out.tobytes()
    if tid in (Q4_0, Q5_0):
        half = 8 if tid == Q4_0 else 16
        m = _absmax_signed(xb)
        d = (m / np.float32(-half)).astype(np.float32)
        q = (_rint_clip(xb * _inv(d)[:, None], -half, half - 1) + half).astype(np.uint32)
        nib = ((q[:, 0:16] & 0xF) | ((q[:, 16:32] & 0xF) << 4)).astype(np.uint8)
        out[:, 0:2] = d.astype("<f2").view(np.uint8).reshape(nb, 2)
        if tid == Q4_0:
            out[:, 2:18] = nib
        else:
            qh = ((q >> 4) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint64)
            out[:, 2:6] = qh.astype("<u4").view(np.uint8).reshape(nb, 4)
            out[:, 6:22] = nib
        return out.tobytes()
    raise ValueError(f"no reference quantizer for {name}")
