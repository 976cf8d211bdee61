#!/usr/bin/env python3
"""Writes the seed corpus for fuzz_gguf: small GGUF files (each < 8 KiB) covering every value
type, nested arrays, several alignments, both versions, every tensor type fitm reads, and a few
near-misses. The files are assembled here from the GGUF layout with struct, independently of
the C writer. Usage: make_gguf_corpus.py OUT_DIR"""
import struct
import sys
from pathlib import Path

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SCALAR_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
              BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}
# tensor types: id -> (block elements, block bytes)
DTYPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 6: (32, 22), 8: (32, 34), 12: (256, 144),
          13: (256, 176), 14: (256, 210), 15: (256, 292), 30: (1, 2)}


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(t, v):
    if t == STR:
        return gstr(v)
    if t == ARR:
        et, items = v
        out = struct.pack("<IQ", et, len(items))
        return out + b"".join(value(et, x) for x in items)
    return struct.pack(SCALAR_FMT[t], v)


def gguf(kvs, tensors, version=3, alignment=32):
    """kvs: [(key, type, value)]; tensors: [(name, type, ne)] laid out in order."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for k, t, v in kvs:
        out += gstr(k) + struct.pack("<I", t) + value(t, v)
    off, blobs = 0, []
    for i, (name, ty, ne) in enumerate(tensors):
        be, bb = DTYPES[ty]
        n = 1
        for d in ne:
            n *= d
        size = n // be * bb
        out += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", ty, off)
        blobs.append(bytes((i * 31 + j) & 0xFF for j in range(size)))
        off += size + (-size) % alignment
    if tensors:
        out += b"\0" * ((-len(out)) % alignment)
        for b in blobs:
            out += b + b"\0" * ((-len(b)) % alignment)
    return out


def raw_tensor(name, ne, ty, offset, data_bytes):
    """One tensor info written as given (no checks), then a data section of data_bytes."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + gstr(name) + struct.pack("<I", len(ne))
    out += b"".join(struct.pack("<Q", d) for d in ne) + struct.pack("<IQ", ty, offset)
    return out + b"\0" * ((-len(out)) % 32) + b"\0" * data_bytes


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    seeds = {}
    llama = [("general.architecture", STR, "llama"), ("general.name", STR, "tiny"),
             ("llama.block_count", U32, 2), ("llama.embedding_length", U32, 32),
             ("llama.attention.head_count", U32, 4),
             ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
             ("tokenizer.ggml.model", STR, "llama"),
             ("tokenizer.ggml.tokens", ARR, (STR, ["<unk>", "<s>", "</s>", "\u2581a", "b"])),
             ("tokenizer.ggml.scores", ARR, (F32, [0.0, 0.0, 0.0, -1.0, -2.0])),
             ("tokenizer.ggml.token_type", ARR, (I32, [2, 3, 3, 1, 1])),
             ("tokenizer.ggml.add_bos_token", BOOL, 1)]
    seeds["llama_f32"] = gguf(llama, [("token_embd.weight", 0, [32, 5]), ("output_norm.weight", 0, [32])])
    seeds["no_tensors"] = gguf(llama, [])
    seeds["empty"] = gguf([], [])
    seeds["v2"] = gguf(llama[:3], [("w", 1, [8, 2])], version=2)
    every = [(f"t.{t}", t, v) for t, v in [(U8, 200), (I8, -3), (U16, 60000), (I16, -300),
                                             (U32, 7), (I32, -7), (F32, 0.5), (BOOL, 0),
                                             (STR, "s"), (U64, 2**64 - 1), (I64, -(2**63)),
                                             (F64, 1e300)]]
    every += [(f"a.{t}", ARR, (t, [v, v])) for t, v in [(U8, 1), (I8, -1), (U16, 2), (I16, -2),
                                                         (U32, 3), (I32, -3), (F32, 1.5),
                                                         (BOOL, 1), (STR, "x"), (U64, 4),
                                                         (I64, -4), (F64, 2.5)]]
    every.append(("a.nested", ARR, (ARR, [(U8, [1, 2]), (STR, ["p", "q"]), (ARR, [(I32, [5])])])))
    every.append(("a.empty", ARR, (STR, [])))
    seeds["every_type"] = gguf(every, [])
    for ty, (be, _) in DTYPES.items():
        seeds[f"tensor_type_{ty}"] = gguf([("general.architecture", STR, "llama")],
                                          [(f"w{ty}", ty, [be, 1, 2] if be > 1 else [3, 2])])
    for a in (1, 8, 64):
        seeds[f"align_{a}"] = gguf([("general.alignment", U32, a)],
                                   [("a", 0, [3]), ("b", 8, [32]), ("c", 0, [1, 1, 1, 2])], alignment=a)
    seeds["four_dims"] = gguf([], [("x", 0, [2, 3, 2, 2])])
    # near-misses the fuzzer can flip into either side of a check
    base = gguf([("general.alignment", U32, 32)], [("a", 0, [8]), ("b", 0, [8])])
    seeds["dup_tensor"] = base.replace(b"\x01\x00\x00\x00\x00\x00\x00\x00b", b"\x01\x00\x00\x00\x00\x00\x00\x00a")
    seeds["bad_magic"] = b"GGUG" + base[4:]
    seeds["v1"] = base[:4] + struct.pack("<I", 1) + base[8:]
    seeds["truncated"] = base[: len(base) - 7]
    seeds["deep_nesting"] = gguf([("d", ARR, (ARR, [(ARR, [(ARR, [(U8, [1])])])]))], [])
    # one per rejection the fuzzer's coverage feedback does not tell apart (error paths that
    # the optimiser merges), so the replay still walks each of them
    seeds["bool_2"] = gguf([("x.flag", BOOL, 2)], [])
    seeds["empty_key"] = gguf([("", U32, 1)], [])
    seeds["alignment_u64"] = gguf([("general.alignment", U64, 32)], [])
    seeds["alignment_48"] = gguf([("general.alignment", U32, 48)], [])
    seeds["empty_tensor_name"] = gguf([], [("", 0, [4])])
    seeds["nul_tensor_name"] = gguf([], [("a\0b", 0, [4])])
    seeds["long_tensor_name"] = gguf([], [("n" * 65, 0, [4])])
    q8 = gguf([], [("q", 8, [32, 2])])
    seeds["block_mismatch"] = q8.replace(struct.pack("<QQ", 32, 2), struct.pack("<QQ", 40, 2))
    seeds["bytes_overflow"] = raw_tensor("big", [2**62], 0, 0, 32)
    seeds["elems_overflow"] = gguf([], [("big", 0, [2, 2])]).replace(
        struct.pack("<QQ", 2, 2), struct.pack("<QQ", 2**32, 2**31))
    seeds["foreign_type"] = raw_tensor("q4_1", [32], 3, 0, 64)
    seeds["misaligned"] = gguf([], [("a", 0, [8]), ("b", 0, [8])]).replace(
        struct.pack("<IQ", 0, 32), struct.pack("<IQ", 0, 16))
    seeds["overlap"] = gguf([], [("a", 0, [16]), ("b", 0, [16])]).replace(
        struct.pack("<IQ", 0, 64), struct.pack("<IQ", 0, 32))
    for name, data in seeds.items():
        assert len(data) < 8192, name
        (out / f"seed_{name}").write_bytes(data)  # no .gguf suffix: *.gguf is git-ignored
    print(f"wrote {len(seeds)} seeds to {out}")


if __name__ == "__main__":
    main()
