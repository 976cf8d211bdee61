#!/usr/bin/env python3
"""Writes the seed corpus for fuzz_tokenizer: texts (byte 0 picks the built-in vocabulary and
the encode flags, see fuzz_tokenizer.c) and small GGUF files that carry only tokenizer
metadata: SentencePiece and byte-level BPE vocabularies, every supported pre-tokenizer, and
near-misses (wrong counts, wrong types, ids out of range, unknown models). Files are named by
their sha1, like libFuzzer's. tests/fuzz/corpus/tokenizer also holds the small inputs a
libFuzzer run found on top of these seeds (fuzz_tokenizer -merge=1, files under 1.6 KB); keep
them, they are replayed as regression tests. Usage: make_tokenizer_corpus.py OUT_DIR"""
import hashlib
import struct
import sys
from pathlib import Path

U32, I32, F32, BOOL, STR, ARR = 4, 5, 6, 7, 8, 9


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(t, v):
    if t == STR:
        return gstr(v)
    if t == ARR:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(value(et, x) for x in items)
    return struct.pack({U32: "<I", I32: "<i", F32: "<f", BOOL: "<B"}[t], v)


def gguf(kvs):
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
    for k, t, v in kvs:
        out += gstr(k) + struct.pack("<I", t) + value(t, v)
    return out


def byte_name(b):
    return "<0x%02X>" % b


def standin(b):
    printable = 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE
    if printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if not (0x21 <= x <= 0x7E or 0xA1 <= x <= 0xAC or x >= 0xAE)))


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    seeds = []

    texts = ["Hello world", " Hello  world!\n\n", "Once upon a time, there was a girl.",
             "\u2581\u2581 \t\r\n", "<s>x</s><start_of_turn>user\n<b>hi</b>",
             "I'll y'all 'RE 'Ve 333333 1.5", "\U0001f999 \u6771\u4eac \u041c\u043e\u0441\u043a\u0432\u0430",
             "caf\u00e9 na\u0308ive \u0915\u094d\u0937", "<|endoftext|> the theory"]
    for i, t in enumerate(texts):
        for sel in range(4):
            flags = (i + sel) % 16
            seeds.append(bytes([sel | flags << 2]) + t.encode())
    seeds.append(bytes([0, 0xFF, 0xFE, 0xC3, 0x28, 0xE2, 0x82, 0x20, 0xF0, 0x9F]))
    seeds.append(bytes([1]) + bytes(range(256)))

    spm_tokens = ["<unk>", "<s>", "</s>"] + [byte_name(b) for b in range(256)] + \
        ["\u2581", "a", "b", "ab", "\u2581ab", "\u2581\u2581", "<start_of_turn>", "\n"]
    n = len(spm_tokens)
    spm = [("tokenizer.ggml.model", STR, "llama"),
           ("tokenizer.ggml.tokens", ARR, (STR, spm_tokens)),
           ("tokenizer.ggml.scores", ARR, (F32, [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, 0.0, 0.0])),
           ("tokenizer.ggml.token_type", ARR, (I32, [2, 3, 3] + [6] * 256 + [1] * 6 + [3, 4])),
           ("tokenizer.ggml.bos_token_id", U32, 1), ("tokenizer.ggml.eos_token_id", U32, 2),
           ("tokenizer.ggml.add_space_prefix", BOOL, 1), ("tokenizer.ggml.add_eos_token", BOOL, 1)]
    seeds.append(gguf(spm))
    seeds.append(gguf(spm[:2]))                                  # no scores, no types
    seeds.append(gguf(spm[:2] + [("tokenizer.ggml.scores", ARR, (F32, [0.0]))]))   # wrong count
    seeds.append(gguf(spm[:2] + [("tokenizer.ggml.token_type", ARR, (U32, [1] * n))]))  # wrong type
    seeds.append(gguf(spm + [("tokenizer.ggml.unknown_token_id", U32, 99999)]))     # out of range
    seeds.append(gguf([("tokenizer.ggml.model", STR, "bert")] + spm[1:2]))
    seeds.append(gguf([("tokenizer.ggml.model", STR, "llama"),
                       ("tokenizer.ggml.tokens", ARR, (STR, ["", "a", "a", "\u2581"]))]))  # empty, repeated

    bpe_tokens = [standin(b) for b in range(256)] + ["\u0120t", "he", "\u0120the", "12", "123",
                                                     "<|endoftext|>", "<|im_end|>"]
    merges = ["\u0120 t", "h e", "\u0120t he", "1 2", "12 3", "bad", "x  y", " z"]
    for pre in ("gpt-2", "llama-bpe", "qwen2", None, "nope"):
        kv = [("tokenizer.ggml.model", STR, "gpt2"),
              ("tokenizer.ggml.tokens", ARR, (STR, bpe_tokens)),
              ("tokenizer.ggml.merges", ARR, (STR, merges)),
              ("tokenizer.ggml.eos_token_id", U32, len(bpe_tokens) - 2)]
        if pre:
            kv.append(("tokenizer.ggml.pre", STR, pre))
        seeds.append(gguf(kv))
    seeds.append(gguf([("tokenizer.ggml.model", STR, "gpt2"),
                       ("tokenizer.ggml.tokens", ARR, (STR, bpe_tokens))]))  # no merges

    for s in seeds:
        (out / hashlib.sha1(s).hexdigest()).write_bytes(s)
    print(f"{len(seeds)} seeds in {out}")


if __name__ == "__main__":
    main()
