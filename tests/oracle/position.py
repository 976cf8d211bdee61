"""The position methods of docs/position-methods.md in numpy, for Model.forward(position=...):
MoICE (docs/moice.md), Ms-PoE (per-head rescaled positions) and Attention Buckets (passes with
scaled RoPE bases, aggregated at the output). Written from the papers and the docs, not from the
C code they check.

    m = model.Model.load(path)
    mo = MoICE(moice_sidecar.read(sidecar_path))
    logits = m.forward(ids, position=mo)
    ranks = ms_poe_ranks(m)                       # (L, H) from the built-in calibration ids
    logits = m.forward(ids, position=MsPoE(m, ranks))
    logits, attn = buckets_forward(m, ids, capture_rows=[...])

Each method object has probs(model, il, q_raw, k_raw, pos, mask) -> (H, T, S) or None (plain
layer): q_raw (T, H, D) the queries after q-norm and before RoPE, k_raw (S, Hkv, D) every
visible key before RoPE, pos (T,) the query positions, mask (T, S) what each query may see.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from oracle import model as om

# Ms-PoE (Zhang et al. 2024): head ratios from MS_POE_MIN to MS_POE_MAX, layers from
# MS_POE_FIRST_LAYER on (the authors' scripts leave the first two layers plain).
MS_POE_MIN, MS_POE_MAX, MS_POE_FIRST_LAYER = 1.2, 1.8, 2
# Position-awareness statistics are taken on this many fixed token ids (ms_poe_calib_ids).
MS_POE_CALIB_LEN = 64
# Attention Buckets (Chen et al. 2023): each pass multiplies every layer's RoPE base by one of
# these factors; the set is the MoICE paper's Llama-2 base set {10000, 17500, 18000, 19000,
# 20000, 22500, 25000} divided by Llama-2's base, so the same factors apply to Gemma 3's local
# (10,000) and global (1,000,000) bases.
BUCKET_FACTORS = (1.0, 1.75, 1.8, 1.9, 2.0, 2.25, 2.5)


def _rotate(m: om.Model, x: np.ndarray, pos: np.ndarray, il: int, base: float,
            pos_scale: float = 1.0) -> np.ndarray:
    """x (T, n, D) rotated as layer il rotates, but with RoPE base `base` and positions
    multiplied by pos_scale on top of the layer's own scaling."""
    hp = m.hp
    _, scale = hp.rope_for(il)
    ff = m.w("rope_freqs.weight").astype(np.float64) if m.has("rope_freqs.weight") else None
    return om.rope(x, pos, hp.n_rot, base, scale * pos_scale, hp.rope_neox, ff)


def _masked_softmax(m: om.Model, il: int, q: np.ndarray, k: np.ndarray,
                    mask: np.ndarray) -> np.ndarray:
    """(H, T, S) probabilities for rotated q (T, H, D) and keys k (S, n_kh, D), n_kh = Hkv
    (query head h reads KV head h // (H / Hkv)) or H (each head its own keys)."""
    hp = m.hp
    H, T, S = hp.n_head, q.shape[0], k.shape[0]
    kh = np.arange(H) // (H // k.shape[1])
    scores = np.einsum("thd,shd->hts", q, k[:, kh, :]) * q.dtype.type(hp.attn_scale)
    scores = np.where(mask[None], scores, -np.inf)
    return om.softmax(scores, axis=-1)


class MoICE:
    """docs/moice.md: per routed layer, head and query, A = sum_e w_e a_e."""

    def __init__(self, sidecar):
        self.sc = sidecar
        self.weights = {}  # layer -> (T, H, N) router weights of the last call, for tests

    def router_weights(self, m: om.Model, il: int, q_raw: np.ndarray,
                       pos: np.ndarray) -> np.ndarray:
        """(T, H, N) w_e: softmax of the router logits, renormalized over the top-k (ties: the
        lower expert index)."""
        bases = self.sc.bases[il].astype(np.float64)
        ga, gb, go = (x.astype(np.float64) for x in self.sc.routers[il])
        x = _rotate(m, q_raw.astype(np.float64), pos, il, float(bases[0]))  # (T, H, D)
        a = np.einsum("hnd,thd->thn", ga, x)
        b = np.einsum("hnd,thd->thn", gb, x)
        r = np.einsum("hmn,thn->thm", go, om.silu(a) * b)  # (T, H, N)
        p = om.softmax(r, axis=-1)
        order = np.argsort(-r, axis=-1, kind="stable")[..., : self.sc.top_k]
        w = np.zeros_like(p)
        np.put_along_axis(w, order, np.take_along_axis(p, order, axis=-1), axis=-1)
        return w / w.sum(axis=-1, keepdims=True)

    def probs(self, m, il, q_raw, k_raw, pos, mask):
        if il not in self.sc.bases:
            return None
        w = self.router_weights(m, il, q_raw, pos)
        self.weights[il] = w
        kpos = np.arange(k_raw.shape[0])
        A = None
        for e, base in enumerate(self.sc.bases[il].astype(np.float64)):
            a = _masked_softmax(m, il, _rotate(m, q_raw, pos, il, base),
                                _rotate(m, k_raw, kpos, il, base), mask)
            a = a * w[:, :, e].T[:, :, None].astype(a.dtype)
            A = a if A is None else A + a
        return A


def ms_poe_calib_ids(n_vocab: int, n: int = MS_POE_CALIB_LEN) -> list:
    """The fixed token ids the head statistics are taken on: a fixed pseudo-random walk over
    the vocabulary (no tokenizer at the model layer); the same in C (forward.c)."""
    return [int((i * 7919 + 17) % n_vocab) for i in range(n)]


def ms_poe_ranks(m: om.Model, ids: Optional[Sequence[int]] = None) -> np.ndarray:
    """(L, H) rank of each head by position awareness, 0 = most aware. The statistic is the
    authors': on the plain model's queries and keys before RoPE, the last row's attention
    p (masked softmax of scale q.k), the fraction of the row's S keys with p > 3 * mean(p);
    more such outliers = more position-aware. Ties: the lower head index ranks first."""
    hp = m.hp
    ids = ms_poe_calib_ids(hp.n_vocab) if ids is None else list(ids)
    T = len(ids)
    trace: dict = {}
    m.forward(ids, trace=trace, logits_rows=[T - 1])
    ranks = np.zeros((hp.n_layer, hp.n_head), dtype=np.int64)
    for il in range(hp.n_layer):
        q = trace[f"l{il}.q_raw"][-1:].astype(np.float64)      # (1, H, D)
        k = trace[f"l{il}.k_raw"].astype(np.float64)           # (T, Hkv, D)
        n_swa = hp.n_swa if hp.swa_layers[il] else 0
        mask = om.attention_mask(T, n_swa)[-1:]                 # (1, T)
        kh = np.arange(hp.n_head) // (hp.n_head // hp.n_head_kv)
        s = np.einsum("hd,shd->hs", q[0], k[:, kh, :]) * hp.attn_scale
        p = om.softmax(np.where(mask, s, -np.inf), axis=-1)    # (H, T)
        frac = (p > 3.0 * p.mean(axis=-1, keepdims=True)).mean(axis=-1)
        order = np.argsort(-frac, kind="stable")
        ranks[il, order] = np.arange(hp.n_head)
    return ranks


def ms_poe_ratios(ranks: np.ndarray) -> np.ndarray:
    """(L, H) compression ratio r = min + (max - min) * rank / H (the authors' spacing)."""
    H = ranks.shape[1]
    return MS_POE_MIN + (MS_POE_MAX - MS_POE_MIN) * ranks.astype(np.float64) / H


class MsPoE:
    """Layers >= MS_POE_FIRST_LAYER: head h's queries and keys at positions p / r_h (its own
    keys: heads sharing a KV head may have different ratios)."""

    def __init__(self, m: om.Model, ranks: Optional[np.ndarray] = None):
        self.ratios = ms_poe_ratios(ms_poe_ranks(m) if ranks is None else ranks)

    def probs(self, m, il, q_raw, k_raw, pos, mask):
        if il < MS_POE_FIRST_LAYER:
            return None
        hp = m.hp
        base, _ = hp.rope_for(il)
        kpos = np.arange(k_raw.shape[0])
        kh = np.arange(hp.n_head) // (hp.n_head // hp.n_head_kv)
        out = []
        for h in range(hp.n_head):
            s = 1.0 / self.ratios[il, h]
            q = _rotate(m, q_raw[:, h: h + 1], pos, il, base, s)
            k = _rotate(m, k_raw[:, kh[h]: kh[h] + 1], kpos, il, base, s)
            qs = q[:, 0] @ k[:, 0].T * q.dtype.type(hp.attn_scale)  # (T, S)
            out.append(om.softmax(np.where(mask, qs, -np.inf), axis=-1))
        return np.stack(out)


class Bucket:
    """One Attention Buckets pass: every layer's RoPE base times `factor`."""

    def __init__(self, factor: float):
        self.factor = float(factor)

    def probs(self, m, il, q_raw, k_raw, pos, mask):
        if self.factor == 1.0:
            return None
        base, _ = m.hp.rope_for(il)
        kpos = np.arange(k_raw.shape[0])
        return _masked_softmax(m, il, _rotate(m, q_raw, pos, il, base * self.factor),
                               _rotate(m, k_raw, kpos, il, base * self.factor), mask)


def buckets_aggregate(logits: Sequence[np.ndarray]) -> np.ndarray:
    """The paper's output aggregation: p_b = softmax(logits_b), alpha_b = max p_b (the pass's
    confidence), p = sum alpha_b p_b / sum alpha_b, row by row; returned as log p (so softmax
    of the result is p and argmax picks the same token)."""
    ps = [om.softmax(np.asarray(x, dtype=np.float64), axis=-1) for x in logits]
    al = [p.max(axis=-1, keepdims=True) for p in ps]
    p = sum(a * x for a, x in zip(al, ps)) / sum(al)
    with np.errstate(divide="ignore"):
        return np.log(p)


def buckets_forward(m: om.Model, ids, factors: Sequence[float] = BUCKET_FACTORS,
                    capture_rows=None, intervene=None, logits_rows=None):
    """One pass per factor; returns (aggregated log-probabilities, attention) where attention
    is the mean over passes of the captured probabilities (a list over layers, as m.attn), or
    None without capture_rows."""
    outs, attn = [], None
    for f in factors:
        outs.append(m.forward(ids, capture_rows=capture_rows, intervene=intervene,
                              logits_rows=logits_rows, position=Bucket(f)))
        if capture_rows is not None:
            attn = ([a.copy() for a in m.attn] if attn is None
                    else [x + a for x, a in zip(attn, m.attn)])
    if attn is not None:
        attn = [a / len(factors) for a in attn]
    return buckets_aggregate(outs), attn
