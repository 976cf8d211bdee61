"""GGUF v2/v3 reader for the oracle: metadata of every type (arrays included), tensor infos,
alignment and data offsets, tensors as raw byte views or dequantized numpy arrays.

Written from the GGUF format description (little-endian):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x  (string key | u32 value_type | value)
    n_tensors x (string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset)
    padding to general.alignment (default 32) | tensor data, each at data_offset + offset

    string = u64 length + bytes (no NUL); array = u32 elem_type | u64 n | n elements.

Shapes are kept in GGUF order (ne[0] first, the contiguous dimension). `GGUFFile.tensor()`
returns the numpy array in C order, i.e. shape reversed: a weight with ne = [C, F] comes back as
(F, C), so `x @ w.T` applies it. The file is memory-mapped; raw tensor views point into the map.

Usage:
    g = read(path)
    g.metadata["llama.block_count"]          # python int / float / bool / str,
                                             # numeric arrays as numpy arrays, others as lists
    g.tensors["token_embd.weight"]           # TensorInfo(name, type_id, shape, offset, raw)
    g.tensor("blk.0.attn_q.weight")          # float32 ndarray, shape (ne[1], ne[0])
    g.rows("token_embd.weight", [1, 5, 7])   # only those rows of a 2-D tensor
"""
from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any

import numpy as np

try:  # oracle/quant.py decodes the quantized types; F32/F16/BF16 are handled here regardless
    from oracle.quant import dequantize as _dequantize
except ImportError:  # pragma: no cover - a reader that still handles the float types
    _dequantize = None

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
CHUNK_ELEMENTS = 1 << 22  # tensor(): larger tensors are decoded this many values at a time

# Metadata value types.
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, \
    T_UINT64, T_INT64, T_FLOAT64 = range(13)

_SCALAR = {  # value type -> numpy little-endian dtype
    T_UINT8: "<u1", T_INT8: "<i1", T_UINT16: "<u2", T_INT16: "<i2", T_UINT32: "<u4",
    T_INT32: "<i4", T_FLOAT32: "<f4", T_BOOL: "<u1", T_UINT64: "<u8", T_INT64: "<i8",
    T_FLOAT64: "<f8",
}

_STRUCT = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I",
           T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<B", T_UINT64: "<Q", T_INT64: "<q",
           T_FLOAT64: "<d"}

# ggml tensor types: id -> (name, elements per block, bytes per block). Sizes of types the oracle
# cannot dequantize are listed too, so files holding them still parse.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}
TYPE_IDS = {v[0]: k for k, v in GGML_TYPES.items()}


class GGUFError(ValueError):
    """The file is not a GGUF file this reader accepts, or it is truncated or inconsistent."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    shape: tuple  # GGUF order: ne[0] (contiguous) first
    offset: int   # absolute byte offset in the file
    raw: np.ndarray  # uint8 view of the tensor's bytes (into the memory map)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0]


def tensor_nbytes(type_id: int, shape) -> int:
    if type_id not in GGML_TYPES:
        raise GGUFError(f"unknown ggml type id {type_id}")
    _, blk, size = GGML_TYPES[type_id]
    if shape[0] % blk:
        raise GGUFError(f"ne[0]={shape[0]} is not a multiple of the block size {blk}")
    return shape[0] // blk * size * math.prod(shape[1:])


def dequantize(type_id: int, raw, n: int) -> np.ndarray:
    """n float32 values from raw bytes of type type_id."""
    buf = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    if type_id == 0:
        return buf[: 4 * n].view("<f4").astype(np.float32)
    if type_id == 1:
        return buf[: 2 * n].view("<f2").astype(np.float32)
    if type_id == 30:  # bfloat16 = the top 16 bits of a float32
        return (buf[: 2 * n].view("<u2").astype(np.uint32) << 16).view(np.float32)
    if _dequantize is None:
        raise NotImplementedError(f"{GGML_TYPES.get(type_id, ('?',))[0]}: "
                                  "oracle.quant.dequantize unavailable")
    return np.asarray(_dequantize(type_id, buf, n), dtype=np.float32)


class _Cursor:
    """Bounds-checked little-endian reads from a byte buffer (a memoryview of the map)."""

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"truncated file: need {n} bytes at offset {self.pos}")
        b = self.buf[self.pos: self.pos + n]
        self.pos += n
        return b

    def scalar(self, vtype: int):
        fmt = _STRUCT[vtype]
        v = struct.unpack_from(fmt, self.take(struct.calcsize(fmt)))[0]
        if vtype == T_BOOL:
            if v > 1:
                raise GGUFError(f"bool value {v} at offset {self.pos - 1}")
            return bool(v)
        return v

    def u32(self) -> int:
        return self.scalar(T_UINT32)

    def u64(self) -> int:
        return self.scalar(T_UINT64)

    def string(self):
        b = bytes(self.take(self.u64()))
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return b  # kept as bytes: token pieces need not be valid UTF-8

    def value(self, vtype: int):
        if vtype == T_STRING:
            return self.string()
        if vtype == T_ARRAY:
            etype = self.u32()
            n = self.u64()
            if etype in _SCALAR:
                dt = np.dtype(_SCALAR[etype])
                a = np.frombuffer(self.take(n * dt.itemsize), dtype=dt).copy()
                return a.astype(bool) if etype == T_BOOL else a
            if etype in (T_STRING, T_ARRAY):
                if n > len(self.buf) - self.pos:  # each element needs at least one byte
                    raise GGUFError(f"array of {n} elements cannot fit in the file")
                return [self.value(etype) for _ in range(n)]
            raise GGUFError(f"unknown array element type {etype}")
        if vtype in _SCALAR:
            return self.scalar(vtype)
        raise GGUFError(f"unknown metadata value type {vtype}")


class GGUFFile:
    """A parsed GGUF file. Attributes: path, version, metadata (key -> value, insertion order),
    metadata_types (key -> value type id, T_ARRAY for arrays), tensors (name -> TensorInfo, file
    order), alignment, data_offset (absolute offset of the tensor data section)."""

    def __init__(self, path):
        self.path = str(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map).cast("B"))
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic)")
        self.version = cur.u32()
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} not supported (2 or 3)")
        n_tensors = cur.u64()
        n_kv = cur.u64()
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, int] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.u32()
            if key in self.metadata:
                raise GGUFError(f"duplicate metadata key {key!r}")
            self.metadata[key] = cur.value(vtype)
            self.metadata_types[key] = vtype

        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(self.alignment, int) or self.alignment <= 0 or \
                self.alignment & (self.alignment - 1):
            raise GGUFError(f"general.alignment {self.alignment!r} is not a power of two")

        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.u32()
            if not 1 <= n_dims <= 4:
                raise GGUFError(f"tensor {name!r}: n_dims {n_dims}")
            shape = tuple(cur.u64() for _ in range(n_dims))
            type_id = cur.u32()
            offset = cur.u64()
            infos.append((name, shape, type_id, offset))

        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, offset in infos:
            if name in self.tensors:
                raise GGUFError(f"duplicate tensor name {name!r}")
            if offset % self.alignment:
                raise GGUFError(f"tensor {name!r}: offset {offset} not aligned")
            nbytes = tensor_nbytes(type_id, shape)
            start = self.data_offset + offset
            if start + nbytes > len(self._map):
                raise GGUFError(f"tensor {name!r}: data past the end of the file")
            self.tensors[name] = TensorInfo(name, type_id, shape, start,
                                            self._map[start: start + nbytes])

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor dequantized to float32, in C order (shape = reversed ne). Large
        tensors are decoded a block of rows at a time, bounding the decoder's temporaries."""
        t = self.tensors[name]
        if t.n_elements <= CHUNK_ELEMENTS:
            return dequantize(t.type_id, t.raw, t.n_elements).reshape(t.shape[::-1])
        ne0 = t.shape[0]
        rows = t.n_elements // ne0
        out = np.empty((rows, ne0), dtype=np.float32)
        for s, block in self._blocks(t, max(1, CHUNK_ELEMENTS // ne0)):
            out[s: s + block.shape[0]] = block
        return out.reshape(t.shape[::-1])

    def rows(self, name: str, idx) -> np.ndarray:
        """Rows idx (indices along ne[1]) of a 2-D tensor, float32 (len(idx), ne[0]); reads
        only those rows' bytes."""
        t = self.tensors[name]
        if len(t.shape) != 2:
            raise ValueError(f"{name}: rows() needs a 2-D tensor, shape {t.shape}")
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= t.shape[1]):
            raise IndexError(f"{name}: row index out of range [0, {t.shape[1]})")
        rb = tensor_nbytes(t.type_id, (t.shape[0],))
        raw = t.raw.reshape(t.shape[1], rb)[idx]
        return dequantize(t.type_id, raw.reshape(-1), idx.size * t.shape[0]).reshape(
            idx.size, t.shape[0])

    def row_blocks(self, name: str, chunk: int):
        """Yields (start, rows) over a 2-D tensor in chunks of `chunk` rows, float32 — for
        products with huge matrices (a 262144-row output head) without holding all of it."""
        t = self.tensors[name]
        if len(t.shape) != 2:
            raise ValueError(f"{name}: row_blocks() needs a 2-D tensor, shape {t.shape}")
        return self._blocks(t, chunk)

    @staticmethod
    def _blocks(t: TensorInfo, chunk: int):
        """(start, rows (n, ne[0]) float32) over all rows of t (every dim past ne[0] flattened)."""
        ne0 = t.shape[0]
        rows = t.n_elements // ne0
        raw = t.raw.reshape(rows, tensor_nbytes(t.type_id, (ne0,)))
        for s in range(0, rows, chunk):
            e = min(s + chunk, rows)
            yield s, dequantize(t.type_id, raw[s:e].reshape(-1), (e - s) * ne0).reshape(e - s, ne0)


def read(path) -> GGUFFile:
    return GGUFFile(path)
