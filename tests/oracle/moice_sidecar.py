"""The MoICE router sidecar: write, read and check the small GGUF file that holds one base
model's routers (format in docs/moice.md). One module for every Python producer and consumer:
the training tool writes with it, the tests write random routers with it, the oracle reads it.

    write(path, base, bases, routers, top_k, train=None)
      base:    dict(architecture, block_count, head_count, head_count_kv, key_length, sha256)
      bases:   {layer: float sequence of N RoPE bases}          (layers with routers only)
      routers: {layer: (gate_a, gate_b, gate_out)}  arrays (n_head, N, d), (n_head, N, d),
               (n_head, N, N)
      train:   optional {key: int | float | str} stored under fitm-moice.train.<key>
    read(path) -> Sidecar (the same fields back, float32 arrays)
    base_identity(model_path) -> the `base` dict of a GGUF model file (sha256 of the whole file)
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from oracle import gguf_reader, gguf_write
from oracle.gguf_reader import T_ARRAY, T_FLOAT32, T_STRING, T_UINT32

ARCH = "fitm-moice"
PREFIX = ARCH + "."
BASE_KEYS = ("block_count", "head_count", "head_count_kv", "key_length")
F32 = gguf_reader.TYPE_IDS["F32"]


@dataclasses.dataclass
class Sidecar:
    base: dict
    top_k: int
    layers: list
    bases: Dict[int, np.ndarray]
    routers: Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray]]
    train: dict


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def base_identity(model_path) -> dict:
    """What a sidecar records of its base model: the shapes routers depend on, and the SHA-256 of
    the whole GGUF file (so `sha256sum model.gguf` checks it by hand)."""
    md = gguf_reader.read(model_path).metadata
    arch = md["general.architecture"]

    def u32(key):
        v = md[f"{arch}.{key}"]
        return int(np.max(v)) if isinstance(v, np.ndarray) else int(v)

    n_head = u32("attention.head_count")
    key_length = (u32("attention.key_length") if f"{arch}.attention.key_length" in md
                  else u32("embedding_length") // n_head)
    return {"architecture": arch, "block_count": u32("block_count"), "head_count": n_head,
            "head_count_kv": u32("attention.head_count_kv"), "key_length": key_length,
            "sha256": file_sha256(model_path)}


def _check(base: Mapping, bases: Mapping, routers: Mapping, top_k: int) -> int:
    if set(bases) != set(routers) or not bases:
        raise ValueError("bases and routers must name the same, non-empty set of layers")
    n_layer, n_head, d = base["block_count"], base["head_count"], base["key_length"]
    n = None
    for layer, (a, b, o) in routers.items():
        if not 0 <= layer < n_layer:
            raise ValueError(f"layer {layer} outside the base model's {n_layer} layers")
        e = len(bases[layer])
        n = e if n is None else n
        if e != n:
            raise ValueError(f"layer {layer}: {e} experts, other layers have {n}")
        want = {"gate_a": (n_head, e, d), "gate_b": (n_head, e, d), "gate_out": (n_head, e, e)}
        for name, arr in zip(want, (a, b, o)):
            if np.shape(arr) != want[name]:
                raise ValueError(f"layer {layer} {name}: shape {np.shape(arr)}, want {want[name]}")
        if any(not (x > 1.0) for x in bases[layer]):
            raise ValueError(f"layer {layer}: RoPE bases must be > 1")
    if not 1 <= top_k <= n:
        raise ValueError(f"top_k {top_k} outside 1..{n}")
    if len(base["sha256"]) != 64:
        raise ValueError("base sha256 must be 64 hex digits")
    return n


def write(path, base: Mapping, bases: Mapping, routers: Mapping, top_k: int,
          train: Optional[Mapping] = None) -> None:
    n = _check(base, bases, routers, top_k)
    layers = sorted(bases)
    kv = [("general.architecture", T_STRING, ARCH),
          ("general.alignment", T_UINT32, 32),
          (PREFIX + "base.architecture", T_STRING, base["architecture"]),
          (PREFIX + "base.sha256", T_STRING, base["sha256"])]
    kv += [(PREFIX + "base." + k, T_UINT32, int(base[k])) for k in BASE_KEYS]
    kv += [(PREFIX + "expert_count", T_UINT32, n), (PREFIX + "top_k", T_UINT32, int(top_k)),
           (PREFIX + "layers", T_ARRAY, (T_UINT32, layers))]
    for key, v in sorted((train or {}).items()):
        vtype = T_STRING if isinstance(v, str) else T_FLOAT32 if isinstance(v, float) else T_UINT32
        kv.append((PREFIX + "train." + key, vtype, v))
    tensors = []
    for layer in layers:
        arrays = {"bases": np.asarray(bases[layer], dtype="<f4")}
        arrays.update(zip(("gate_a", "gate_b", "gate_out"),
                          (np.ascontiguousarray(x, dtype="<f4") for x in routers[layer])))
        for name, arr in arrays.items():
            tensors.append((f"moice.blk.{layer}.{name}", F32, list(arr.shape[::-1]),
                            arr.tobytes()))
    gguf_write.write(path, kv, tensors)


def read(path) -> Sidecar:
    g = gguf_reader.read(path)
    if g.metadata.get("general.architecture") != ARCH:
        raise ValueError(f"{path}: not a MoICE sidecar (general.architecture is "
                         f"{g.metadata.get('general.architecture')!r})")
    md = g.metadata
    base = {"architecture": md[PREFIX + "base.architecture"], "sha256": md[PREFIX + "base.sha256"]}
    base.update({k: int(md[PREFIX + "base." + k]) for k in BASE_KEYS})
    layers = [int(x) for x in md[PREFIX + "layers"]]
    bases = {l: g.tensor(f"moice.blk.{l}.bases").astype(np.float32) for l in layers}
    routers = {l: tuple(g.tensor(f"moice.blk.{l}.{n}").astype(np.float32)
                        for n in ("gate_a", "gate_b", "gate_out")) for l in layers}
    train = {k[len(PREFIX + "train."):]: v for k, v in md.items()
             if k.startswith(PREFIX + "train.")}
    top_k = int(md[PREFIX + "top_k"])
    _check(base, bases, routers, top_k)
    return Sidecar(base, top_k, layers, bases, routers, train)


def random_routers(base: Mapping, bases: Mapping[int, Sequence[float]], seed: int,
                   scale: float = 0.5) -> dict:
    """Random router weights for tests, shaped for `base` (fresh values from `seed`)."""
    rng = np.random.default_rng(seed)
    h, d = base["head_count"], base["key_length"]
    out = {}
    for layer in sorted(bases):
        n = len(bases[layer])
        out[layer] = (rng.normal(0, scale / np.sqrt(d), (h, n, d)).astype(np.float32),
                      rng.normal(0, scale / np.sqrt(d), (h, n, d)).astype(np.float32),
                      rng.normal(0, scale, (h, n, n)).astype(np.float32))
    return out
