"""A minimal GGUF writer for the oracle's own tests: hand-made files with every metadata type,
and tiny random-weight models of each architecture (F32), independent of the C writer.

    write(path, kv, tensors, version=3, alignment=32)
      kv:      list of (key, value_type, value); arrays as (key, T_ARRAY, (elem_type, values))
      tensors: list of (name, ggml_type_id, ne (ne[0] first), raw bytes)
    tiny_model(path, arch, seed=0, **sizes) -> writes a random F32 model, returns the sizes
"""
from __future__ import annotations

import struct

import numpy as np

from oracle.gguf_reader import (T_ARRAY, T_FLOAT32, T_STRING, T_UINT32, _SCALAR,
                                tensor_nbytes)


def _str(s) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, v) -> bytes:
    if vtype == T_STRING:
        return _str(v)
    if vtype == T_ARRAY:
        etype, values = v
        out = struct.pack("<IQ", etype, len(values))
        if etype in _SCALAR:
            return out + np.asarray(values).astype(_SCALAR[etype]).tobytes()
        return out + b"".join(_value(etype, x) for x in values)
    return np.asarray([v]).astype(_SCALAR[vtype]).tobytes()


def write(path, kv, tensors, version: int = 3, alignment: int = 32) -> None:
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv))
    for key, vtype, v in kv:
        head += _str(key) + struct.pack("<I", vtype) + _value(vtype, v)
    offset, blobs = 0, []
    for name, tid, ne, raw in tensors:
        if len(raw) != tensor_nbytes(tid, ne):
            raise ValueError(f"{name}: {len(raw)} bytes for shape {ne}")
        head += _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        head += struct.pack("<IQ", tid, offset)
        pad = -len(raw) % alignment
        blobs.append(bytes(raw) + b"\0" * pad)
        offset += len(raw) + pad
    head += b"\0" * (-len(head) % alignment)
    with open(path, "wb") as f:
        f.write(head)
        for b in blobs:
            f.write(b)


def tiny_model(path, arch: str, seed: int = 0, n_layer: int = 3, n_embd: int = 32,
               n_head: int = 4, n_head_kv: int = 2, head_dim: int = 8, n_ff: int = 48,
               n_vocab: int = 64, n_swa: int = 4, swa_pattern: int = 3, tied: bool = False,
               rope_base: float = 10000.0, extra_kv=()) -> dict:
    """A random F32 model of arch ('llama', 'qwen2', 'gemma3') with llama.cpp's names and
    shapes; gemma3 gets a sliding window n_swa with pattern swa_pattern and a tied head.
    extra_kv: more (key, type, value) entries, e.g. a full tokenizer for other readers."""
    rng = np.random.default_rng(seed)
    C, H, Hkv, D, F, V = n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab
    tensors = []

    def add(name, *ne, scale=0.3, center=0.0):
        a = (center + scale * rng.standard_normal(ne[::-1])).astype("<f4")
        tensors.append((name, 0, tuple(ne), a.tobytes()))

    add("token_embd.weight", C, V, scale=1.0)
    add("output_norm.weight", C, scale=0.1, center=1.0)
    if not tied and arch != "gemma3":
        add("output.weight", C, V)
    for il in range(n_layer):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", C, scale=0.1, center=1.0)
        add(p + "attn_q.weight", C, H * D)
        add(p + "attn_k.weight", C, Hkv * D)
        add(p + "attn_v.weight", C, Hkv * D)
        add(p + "attn_output.weight", H * D, C)
        add(p + "ffn_norm.weight", C, scale=0.1, center=1.0)
        add(p + "ffn_gate.weight", C, F)
        add(p + "ffn_up.weight", C, F)
        add(p + "ffn_down.weight", F, C)
        if arch == "qwen2":
            add(p + "attn_q.bias", H * D)
            add(p + "attn_k.bias", Hkv * D)
            add(p + "attn_v.bias", Hkv * D)
        if arch == "gemma3":
            add(p + "attn_q_norm.weight", D, scale=0.1, center=1.0)
            add(p + "attn_k_norm.weight", D, scale=0.1, center=1.0)
            add(p + "post_attention_norm.weight", C, scale=0.1, center=1.0)
            add(p + "post_ffw_norm.weight", C, scale=0.1, center=1.0)

    kv = [("general.architecture", T_STRING, arch),
          (f"{arch}.block_count", T_UINT32, n_layer),
          (f"{arch}.embedding_length", T_UINT32, C),
          (f"{arch}.feed_forward_length", T_UINT32, F),
          (f"{arch}.attention.head_count", T_UINT32, H),
          (f"{arch}.attention.head_count_kv", T_UINT32, Hkv),
          (f"{arch}.attention.key_length", T_UINT32, D),
          (f"{arch}.attention.value_length", T_UINT32, D),
          (f"{arch}.attention.layer_norm_rms_epsilon", T_FLOAT32, 1e-6),
          (f"{arch}.rope.freq_base", T_FLOAT32, rope_base),
          (f"{arch}.context_length", T_UINT32, 4096)]
    if not any(key == "tokenizer.ggml.tokens" for key, _, _ in extra_kv):
        kv.append(("tokenizer.ggml.tokens", T_ARRAY, (T_STRING, [f"t{i}" for i in range(V)])))
    kv += list(extra_kv)
    if arch == "gemma3":
        kv += [(f"{arch}.attention.sliding_window", T_UINT32, n_swa),
               (f"{arch}.attention.sliding_window_pattern", T_UINT32, swa_pattern)]
    write(path, kv, tensors)
    return dict(n_layer=n_layer, C=C, H=H, Hkv=Hkv, D=D, F=F, V=V, n_swa=n_swa)
