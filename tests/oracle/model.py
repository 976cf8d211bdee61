"""Forward pass of fitm's architectures in numpy (float64 by default, float32 on request), read
straight from a GGUF file: the oracle the C model is tested against.

Architectures, as llama.cpp runs them from GGUF files (the converters bake architecture quirks
into the weights: Q/K rows permuted for llama, +1 added to Gemma's norm weights):

  llama   RMSNorm; SwiGLU FFN; "normal" RoPE rotating adjacent pairs (2i, 2i+1); GQA; optional
          q/k/v/o biases; optional rope_freqs (Llama 3.1 frequency factors); untied or tied head.
  qwen2   as llama, with q/k/v biases and "neox" RoPE rotating halves (i, i + n_rot/2).
  gemma3  embeddings scaled by sqrt(C); per-head RMSNorm on q and k before RoPE; post-attention
          and post-FFN RMSNorms on the residual branches; GeGLU FFN (tanh-approximated GELU);
          neox RoPE; tied head. With gemma3.attention.sliding_window = W > 0, layer il is local
          iff il % P < P - 1 (P = gemma3.attention.sliding_window_pattern, default 6: five local
          layers then one global); a local layer's query at position i sees keys j with
          i - W < j <= i, uses RoPE base gemma3.rope.freq_base_swa (default 10000) and no RoPE
          scaling; global layers see every earlier key and use gemma3.rope.freq_base with the
          file's linear scaling. Queries are scaled by 1/sqrt(D) (by 1/sqrt(C/H) for the 62-layer
          27B, as llama.cpp does). No final logit softcap, except for a gemma3 file without a
          sliding window that carries gemma3.final_logit_softcapping (llama.cpp's non-SWA graph).

Checked against llama.cpp on F32 weights (random tiny models of each architecture, and Gemma 3
270M's weights written out as F32): the same logits up to float32 rounding, once llama.cpp's two
approximations are allowed for. This oracle does neither: llama.cpp's CPU backend quantizes
activations to Q8_0/Q8_K before every product with a quantized weight (about 1 logit on Gemma 3
270M Q4_K_M), and evaluates GELU through an fp16 lookup table (about 0.01 logit there).

Dimension letters: T tokens, C model dim, H heads, Hkv KV heads, D head dim, F FFN dim, V vocab,
L layers. Query head h uses KV head h // (H / Hkv).

    m = Model.load(path)                          # dtype=np.float64
    logits = m.forward(ids)                       # (T, V)
    logits = m.forward(ids, capture_rows=[T - 1]) # then m.attn[l][h] -> (1, T) probabilities
    new_ids = m.generate(ids, 32)                 # greedy, with a KV cache
    c = m.new_cache(); m.forward(prefix, cache=c); m.forward(more, cache=c)  # continue
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import numpy as np

from oracle import gguf_reader

ARCHS = ("llama", "qwen2", "gemma3")

# (layer, head, row_pos, probs (T,)) -> probs (T,): rewrites one post-softmax attention row.
InterventionHook = Callable[[int, int, int, np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class HParams:
    arch: str
    n_layer: int          # L
    n_embd: int           # C
    n_head: int           # H
    n_head_kv: int        # Hkv
    head_dim: int         # D (queries and keys)
    head_dim_v: int       # D of values
    n_ff: int             # F
    n_vocab: int          # V
    eps: float            # RMSNorm epsilon
    n_rot: int            # rotated dims per head (the first n_rot)
    rope_neox: bool       # True: pairs (i, i + n_rot/2); False: pairs (2i, 2i+1)
    rope_base: float      # global (full-attention) layers
    rope_scale: float     # position multiplier of global layers (1 / linear scaling factor)
    rope_base_swa: float  # sliding-window layers
    rope_scale_swa: float
    n_swa: int            # sliding window in tokens; 0 = none
    swa_layers: tuple     # per layer: True = sliding-window (local) layer
    attn_scale: float     # multiplies q.k
    embd_scale: float     # multiplies the token embeddings (Gemma: sqrt(C))
    final_softcap: float  # 0 = none; else logits = cap * tanh(logits / cap)
    ffn_gelu: bool        # GeGLU (gelu_tanh(gate) * up) instead of SwiGLU (silu(gate) * up)
    qk_norm: bool         # per-head RMSNorm on q and k (Gemma 3)
    post_norms: bool      # post_attention_norm / post_ffw_norm (Gemma 3)

    def rope_for(self, il: int):
        """(base, position scale) of layer il."""
        if self.swa_layers[il]:
            return self.rope_base_swa, self.rope_scale_swa
        return self.rope_base, self.rope_scale


def _scalar(g: gguf_reader.GGUFFile, key: str, default=None):
    v = g.get(key, default)
    if isinstance(v, np.ndarray):  # per-layer arrays (llama.cpp allows some): must be uniform
        if v.size == 0 or np.any(v != v.flat[0]):
            raise NotImplementedError(f"{key}: per-layer values {v.tolist()} not supported")
        v = v.flat[0].item()
    if v is None:
        raise KeyError(f"missing metadata key {key}")
    return v


def hparams_from_gguf(g: gguf_reader.GGUFFile) -> HParams:
    """Hyper-parameters from the metadata, with llama.cpp's key names and defaults."""
    arch = g.get("general.architecture")
    if arch not in ARCHS:
        raise NotImplementedError(f"architecture {arch!r} (oracle knows {', '.join(ARCHS)})")
    k = lambda name, default=None: _scalar(g, f"{arch}.{name}", default)  # noqa: E731
    if k("expert_count", 0):
        raise NotImplementedError("mixture-of-experts models")
    n_layer = int(k("block_count"))
    n_embd = int(k("embedding_length"))
    n_head = int(k("attention.head_count"))
    n_head_kv = int(k("attention.head_count_kv", n_head))
    head_dim = int(k("attention.key_length", n_embd // n_head))
    head_dim_v = int(k("attention.value_length", n_embd // n_head))
    n_rot = int(k("rope.dimension_count", head_dim))
    if n_head % n_head_kv or n_rot != head_dim or head_dim % 2:
        # llama.cpp too rejects rope.dimension_count != head dim for these architectures
        raise gguf_reader.GGUFError(f"unsupported heads: H={n_head} Hkv={n_head_kv} "
                                    f"D={head_dim} n_rot={n_rot}")

    scaling = k("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise NotImplementedError(f"rope scaling {scaling!r}")
    factor = float(k("rope.scaling.factor", 0.0) or k("rope.scale_linear", 0.0))
    rope_scale = 1.0 / factor if factor else 1.0
    rope_base = float(k("rope.freq_base", 10000.0))

    n_swa, swa_layers, rope_base_swa, softcap = 0, (False,) * n_layer, rope_base, 0.0
    attn_scale = 1.0 / math.sqrt(head_dim)
    if arch == "gemma3":
        n_swa = int(k("attention.sliding_window", 0))
        if n_swa > 0:
            pattern = g.get(f"{arch}.attention.sliding_window_pattern", 6)
            if isinstance(pattern, np.ndarray):  # explicit per-layer flags
                swa_layers = tuple(bool(x) for x in pattern)
                if len(swa_layers) != n_layer:
                    raise gguf_reader.GGUFError("sliding_window_pattern length != block_count")
            else:  # period P: layer il is local iff il % P < P - 1 (P == 0: all local)
                p = int(pattern)
                swa_layers = tuple(p == 0 or il % p < p - 1 for il in range(n_layer))
            rope_base_swa = float(k("rope.freq_base_swa", 10000.0))
        else:  # llama.cpp's non-SWA gemma3 graph applies the final softcap when the file has one
            softcap = float(k("final_logit_softcapping", 0.0))
        if n_layer == 62:  # 27B: llama.cpp (after gemma_pytorch) scales by 1/sqrt(C/H)
            attn_scale = 1.0 / math.sqrt(n_embd / n_head)

    embd = g.tensors["token_embd.weight"]
    return HParams(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, head_dim_v=head_dim_v, n_ff=int(k("feed_forward_length")),
        n_vocab=int(embd.shape[1]), eps=float(k("attention.layer_norm_rms_epsilon")),
        n_rot=n_rot, rope_neox=arch in ("qwen2", "gemma3"), rope_base=rope_base,
        rope_scale=rope_scale, rope_base_swa=rope_base_swa, rope_scale_swa=1.0, n_swa=n_swa,
        swa_layers=swa_layers, attn_scale=attn_scale,
        embd_scale=math.sqrt(n_embd) if arch == "gemma3" else 1.0, final_softcap=softcap,
        ffn_gelu=arch == "gemma3", qk_norm=arch == "gemma3", post_norms=arch == "gemma3")


# ---------------------------------------------------------------------------------------------
# Ops (shapes in comments). All take and return arrays of the compute dtype.


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis."""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), with sigmoid written through tanh so that no exp can overflow."""
    return x * (0.5 * (1.0 + np.tanh(0.5 * x)))


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float, scale: float, neox: bool,
         freq_factors: Optional[np.ndarray] = None) -> np.ndarray:
    """Rotary embedding of x (T, nh, D) at positions pos (T,). Pair i (i < n_rot/2) turns by
    pos * scale * base^(-2i/n_rot) / freq_factors[i]; dims from n_rot on are left alone."""
    half = n_rot // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)
    if freq_factors is not None:
        inv = inv / freq_factors[:half]
    theta = (pos.astype(np.float64) * scale)[:, None] * inv[None, :]  # (T, n_rot/2)
    cos = np.cos(theta).astype(x.dtype)[:, None, :]
    sin = np.sin(theta).astype(x.dtype)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def attention_mask(T: int, n_swa: int = 0, P: int = 0) -> np.ndarray:
    """(T, P + T) bool for queries at positions P..P+T-1 and keys 0..P+T-1: True where query i
    may see key j: j <= i, and i - j < n_swa if n_swa > 0 (llama.cpp masks a key when
    i - j >= n_swa)."""
    i = np.arange(P, P + T)[:, None]
    j = np.arange(P + T)[None, :]
    ok = j <= i
    if n_swa > 0:
        ok &= (i - j) < n_swa
    return ok


class KVCache:
    """Keys (after RoPE) and values of the positions a Model has processed, per layer, so that
    later forward calls continue the sequence. n: the number of positions held."""

    def __init__(self, n_layer: int):
        self.k = [None] * n_layer  # (n, Hkv, D)
        self.v = [None] * n_layer  # (n, Hkv, Dv)
        self.k_raw = [None] * n_layer  # (n, Hkv, D) keys before RoPE (position methods)
        self.n = 0

    def extend_raw(self, il: int, k_raw: np.ndarray) -> np.ndarray:
        """Appends layer il's new pre-RoPE keys; returns all of the layer's."""
        if self.k_raw[il] is not None:
            k_raw = np.concatenate([self.k_raw[il], k_raw])
        self.k_raw[il] = k_raw
        return k_raw

    def extend(self, il: int, k: np.ndarray, v: np.ndarray):
        """Appends layer il's new rows; returns all keys and values of the layer."""
        if self.k[il] is not None:
            k = np.concatenate([self.k[il], k])
            v = np.concatenate([self.v[il], v])
        self.k[il], self.v[il] = k, v
        return k, v


# ---------------------------------------------------------------------------------------------


class Model:
    """A GGUF model held as a memory map; weight matrices are dequantized (float32) on first
    use and kept, except the token embedding and output head, which are read in row chunks
    (cache_head=True keeps the dequantized head instead: V*C*4 bytes, faster generation).

    After forward(..., capture_rows=rows): self.attn is a list over layers of (H, len(rows), T)
    arrays, the attention probabilities the model used (after any intervention) for those query
    rows; self.attn[l][h] is (len(rows), T). Otherwise self.attn is None.

    kv_half = True rounds every layer's keys (after RoPE) and values to float16 and back, as a
    cache of fp16 values holds them (fitmd's kv_cache_type f16; the position methods' rotated
    keys are not modelled this way)."""

    def __init__(self, g: gguf_reader.GGUFFile, dtype=np.float64, cache_head: bool = False,
                 head_chunk: int = 4096):
        self.g = g
        self.hp = hparams_from_gguf(g)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError("dtype must be float32 or float64")
        self.head_chunk = head_chunk
        self.cache_head = cache_head
        self.out_name = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
        self._w: dict[str, np.ndarray] = {}
        self.attn: Optional[list] = None
        self.kv_half = False

    @classmethod
    def load(cls, path, dtype=np.float64, cache_head: bool = False) -> "Model":
        return cls(gguf_reader.read(path), dtype, cache_head)

    # -- weights --------------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.g.tensors

    def w(self, name: str) -> np.ndarray:
        """Dequantized tensor in C order (float32; converted to the compute dtype in use)."""
        a = self._w.get(name)
        if a is None:
            a = self._w[name] = self.g.tensor(name)
        return a

    def _lin(self, x: np.ndarray, il: int, name: str) -> np.ndarray:
        """x (T, in) @ blk.il.name.weight^T (+ bias if the file has one) -> (T, out)."""
        p = f"blk.{il}.{name}"
        y = x @ self.w(p + ".weight").astype(self.dtype, copy=False).T  # cast before .T: fast
        if self.has(p + ".bias"):
            y = y + self.w(p + ".bias").astype(self.dtype)
        return y

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return rms_norm(x, self.w(name).astype(self.dtype), self.hp.eps)

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        return self.g.rows("token_embd.weight", ids).astype(self.dtype)  # (T, C)

    def head(self, x: np.ndarray) -> np.ndarray:
        """Output logits (n, V) for final-normed hidden rows x (n, C), in row chunks of V."""
        out = np.empty((x.shape[0], self.hp.n_vocab), dtype=self.dtype)
        if self.cache_head:
            W = self.w(self.out_name)  # (V, C)
            blocks = ((s, W[s: s + self.head_chunk]) for s in range(0, W.shape[0], self.head_chunk))
        else:
            blocks = self.g.row_blocks(self.out_name, self.head_chunk)
        for s, rows in blocks:
            out[:, s: s + rows.shape[0]] = x @ rows.astype(self.dtype, copy=False).T
        if self.hp.final_softcap:
            c = self.hp.final_softcap
            out = c * np.tanh(out / c)
        return out

    # -- forward --------------------------------------------------------------------------------

    def new_cache(self) -> KVCache:
        return KVCache(self.hp.n_layer)

    def forward(self, ids: Sequence[int], capture_rows: Optional[Sequence[int]] = None,
                intervene: Optional[InterventionHook] = None,
                intervene_rows: Optional[Sequence[int]] = None,
                logits_rows: Optional[Sequence[int]] = None,
                trace: Optional[dict] = None, cache: Optional[KVCache] = None,
                position=None) -> np.ndarray:
        """Logits (len(logits_rows) or T, V) for the T token ids at positions P..P+T-1, where P
        is the number of positions already in `cache` (0 without one). Row arguments are
        positions in that range; the default is every new row.

        capture_rows: positions whose attention probabilities to record: self.attn[l] is
            (H, len(capture_rows), P + T).
        intervene: called as intervene(layer, head, row_pos, probs (P + T,)) for each layer,
            head and row in intervene_rows after the softmax; its return value (same shape;
            zero wherever the mask hides a key) replaces the row.
        logits_rows: positions to compute logits for ([P + T - 1] for generation).
        trace: if a dict, filled with intermediate activations of the new rows: "inp_embd"
            (T, C), "l{il}.attn_out" (T, C) after wo (and the post-attention norm), "l{il}.out"
            (T, C) the residual stream after layer il, "result_norm" (T, C).
        cache: a KVCache (Model.new_cache()) to continue and extend; the same cache must only
            ever see this model.
        position: None (plain RoPE) or a position method of oracle.position (MoICE, MsPoE,
            a bucket's base): position.probs(model, il, q_raw, k_raw, pos, mask) returns the
            layer's (H, T, S) probabilities from the queries and all keys before RoPE, or None
            where the layer is plain. Captures and interventions act on what it returns.
            trace also gets "l{il}.q_raw" (T, H, D) and "l{il}.k_raw" (T, Hkv, D)."""
        hp, dt = self.hp, self.dtype
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        T = ids.size
        P = cache.n if cache is not None else 0
        if T == 0:
            raise ValueError("empty input")
        if ids.min() < 0 or ids.max() >= hp.n_vocab:
            raise ValueError(f"token id out of range [0, {hp.n_vocab})")
        pos = np.arange(P, P + T)

        def rows(r, default):  # absolute positions -> indices into the new rows
            r = default if r is None else np.asarray(r, dtype=np.int64).reshape(-1)
            if r.size and (r.min() < P or r.max() >= P + T):
                raise ValueError(f"row positions must lie in [{P}, {P + T})")
            return r - P
        rows_c = None if capture_rows is None else rows(capture_rows, None)
        rows_i = rows(intervene_rows, pos)
        rows_l = rows(logits_rows, pos)
        H, Hkv, D, Dv = hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v
        group, S = H // Hkv, P + T  # S: keys seen
        ff = self.w("rope_freqs.weight").astype(np.float64) if self.has("rope_freqs.weight") \
            else None
        masks = {}  # n_swa -> (T, S) bool
        self.attn = [] if rows_c is not None else None

        x = self.embed(ids) * dt.type(hp.embd_scale)  # (T, C)
        if trace is not None:
            trace["inp_embd"] = x.copy()
        for il in range(hp.n_layer):
            h = self._norm(x, f"blk.{il}.attn_norm.weight")
            q = self._lin(h, il, "attn_q").reshape(T, H, D)
            k = self._lin(h, il, "attn_k").reshape(T, Hkv, D)
            v = self._lin(h, il, "attn_v").reshape(T, Hkv, Dv)
            if hp.qk_norm:
                q = self._norm(q, f"blk.{il}.attn_q_norm.weight")
                k = self._norm(k, f"blk.{il}.attn_k_norm.weight")
            q_raw, k_raw = q, k
            if trace is not None:
                trace[f"l{il}.q_raw"], trace[f"l{il}.k_raw"] = q.copy(), k.copy()
            base, scale = hp.rope_for(il)
            q = rope(q, pos, hp.n_rot, base, scale, hp.rope_neox, ff)
            k = rope(k, pos, hp.n_rot, base, scale, hp.rope_neox, ff)
            if self.kv_half:  # round to nearest even, as the cache stores them
                k = k.astype(np.float16).astype(dt)
                v = v.astype(np.float16).astype(dt)
            if cache is not None:
                k, v = cache.extend(il, k, v)  # (S, Hkv, D), (S, Hkv, Dv)
                k_raw = cache.extend_raw(il, k_raw)

            # query head h = kv * group + g reads KV head kv = h // group
            qg = q.reshape(T, Hkv, group, D)
            scores = np.einsum("tkgd,skd->kgts", qg, k).reshape(H, T, S)
            scores = scores * dt.type(hp.attn_scale)  # (H, T, S)
            n_swa = hp.n_swa if hp.swa_layers[il] else 0
            if n_swa not in masks:
                masks[n_swa] = attention_mask(T, n_swa, P)
            mask = masks[n_swa]
            scores = np.where(mask[None], scores, -np.inf)
            probs = None
            if position is not None:
                probs = position.probs(self, il, q_raw, k_raw, pos, mask)
            if probs is None:
                probs = softmax(scores, axis=-1)  # (H, T, S)
            if intervene is not None:
                for r in rows_i:
                    for hh in range(H):
                        new = intervene(il, hh, int(P + r), probs[hh, r].copy())
                        new = np.asarray(new, dtype=dt)
                        if new.shape != (S,) or np.any(new[~mask[r]] != 0):
                            raise ValueError("intervention returned a bad row (shape, or mass "
                                             "on masked keys)")
                        probs[hh, r] = new
            if rows_c is not None:
                self.attn.append(probs[:, rows_c, :].copy())  # (H, n_rows, S)

            o = np.einsum("kgts,skd->tkgd", probs.reshape(Hkv, group, T, S), v)
            o = o.reshape(T, H * Dv)  # heads in order h = kv * group + g
            o = self._lin(o, il, "attn_output")  # (T, C)
            if hp.post_norms:
                o = self._norm(o, f"blk.{il}.post_attention_norm.weight")
            if trace is not None:
                trace[f"l{il}.attn_out"] = o.copy()
            x = x + o

            h = self._norm(x, f"blk.{il}.ffn_norm.weight")
            gate = self._lin(h, il, "ffn_gate")  # (T, F)
            up = self._lin(h, il, "ffn_up")
            a = (gelu_tanh(gate) if hp.ffn_gelu else silu(gate)) * up
            f = self._lin(a, il, "ffn_down")  # (T, C)
            if hp.post_norms:
                f = self._norm(f, f"blk.{il}.post_ffw_norm.weight")
            x = x + f
            if trace is not None:
                trace[f"l{il}.out"] = x.copy()

        if cache is not None:
            cache.n = S
        x = self._norm(x, "output_norm.weight")
        if trace is not None:
            trace["result_norm"] = x.copy()
        if logits_rows is not None:
            x = x[rows_l]
        return self.head(x)

    def generate(self, ids: Sequence[int], n: int, stop_ids: Sequence[int] = (),
                 intervene: Optional[InterventionHook] = None) -> list:
        """Greedy decoding with a KV cache: up to n new ids (argmax; the lowest id on ties),
        stopping after an id in stop_ids (which is included). An intervention hook sees every
        row once: the prompt's rows in the first pass, then each new token's row."""
        if n <= 0:
            return []
        seq = [int(i) for i in ids]
        cache = self.new_cache()
        logits = self.forward(seq, intervene=intervene, logits_rows=[len(seq) - 1], cache=cache)
        out = []
        for step in range(n):
            nxt = int(np.argmax(logits[0]))
            out.append(nxt)
            if nxt in stop_ids or step == n - 1:
                break
            logits = self.forward([nxt], intervene=intervene, logits_rows=[cache.n],
                                  cache=cache)
        return out

    def last_row_attention(self, ids: Sequence[int], **kw) -> np.ndarray:
        """(L, H, T) attention probabilities of the last token, from one forward pass."""
        self.forward(ids, capture_rows=[len(ids) - 1], logits_rows=[len(ids) - 1], **kw)
        return np.stack([a[:, 0, :] for a in self.attn])
