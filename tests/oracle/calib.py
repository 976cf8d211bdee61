"""The calibration math of docs/design.md, Method on plain arrays: document attention, calibrated scores,
the attention intervention, sliding-window visibility; plus the whole /rerank computation on
the oracle model (score_documents) so a response's scores can be recomputed from its tokens.

Spans are half-open token ranges [s, e) of the prompt, one per document (K documents).

    A[k]     = mean over layers used for k, mean over all heads, of the mean over i in [s_k, e_k)
               of p[l, h, i], p being the last prompt token's attention probabilities
    rel      = A - A_dum
    alpha    = softmax(rel / t)
    intervention of one row p: m_k = sum_{i in k} p_i, S = sum_k m_k, N_k = e_k - s_k,
               C = S / sum_k N_k alpha_k,  p_i <- p_i * (alpha_k N_k / m_k) * C  for i in span k

The guard (m_k at most `eps`, e.g. a span outside a sliding window): such a span is left as it
is and takes no part in the rescaling; the other spans share their own mass S' = sum of their
m_k by the same rule (C = S' / sum over them of N_k alpha_k). Total document mass stays S and
non-document keys are untouched in every case."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

DEFAULT_T = 5e-5
DEFAULT_EPS = 1e-30  # zero or underflowed mass only: anything representable is rescaled


def softmax(x, axis: int = -1) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def _check_spans(spans, T: Optional[int] = None):
    spans = [(int(s), int(e)) for s, e in spans]
    for k, (s, e) in enumerate(spans):
        if not 0 <= s < e or (T is not None and e > T):
            raise ValueError(f"span {k} = [{s}, {e}) is empty or outside [0, {T})")
    order = sorted(spans)
    for (_, e0), (s1, _) in zip(order, order[1:]):
        if s1 < e0:
            raise ValueError("spans overlap")
    return spans


def visible_layers(spans, last_pos: int, swa_layers: Sequence[bool], n_swa: int,
                   layers: Optional[Sequence[int]] = None) -> list:
    """For each span, the layers of `layers` (default: all) from which the whole span is
    visible to the query at last_pos: every global layer, and a sliding-window layer only if
    last_pos - s < n_swa (llama.cpp hides key j from query i when i - j >= n_swa)."""
    layers = range(len(swa_layers)) if layers is None else layers
    out = []
    for s, _ in _check_spans(spans):
        out.append([int(l) for l in layers
                    if not swa_layers[l] or n_swa <= 0 or last_pos - s < n_swa])
    return out


def doc_attention(last_attn, spans, layers=None) -> np.ndarray:
    """A (K,) from last_attn (L, H, T), the last prompt token's attention probabilities.

    layers: None (all L), one sequence of layer ids for every span, or a list of K sequences
    (one per span, e.g. from visible_layers). A span with no layer is an error."""
    P = np.asarray(last_attn, dtype=np.float64)
    if P.ndim != 3:
        raise ValueError("last_attn must be (L, H, T)")
    L, _, T = P.shape
    spans = _check_spans(spans, T)
    if layers is None:
        per_span = [list(range(L))] * len(spans)
    elif len(layers) and not np.isscalar(layers[0]):
        per_span = [list(x) for x in layers]
        if len(per_span) != len(spans):
            raise ValueError("need one layer list per span")
    else:
        per_span = [list(layers)] * len(spans)
    A = np.empty(len(spans))
    for k, ((s, e), ls) in enumerate(zip(spans, per_span)):
        if not ls:
            raise ValueError(f"span {k}: no layer to average over")
        A[k] = P[ls, :, s:e].mean(axis=2).mean(axis=1).mean(axis=0)
    return A


def calibrate(A, A_dum, t: float = DEFAULT_T):
    """(rel, alpha): rel = A - A_dum, alpha = softmax(rel / t)."""
    rel = np.asarray(A, dtype=np.float64) - np.asarray(A_dum, dtype=np.float64)
    return rel, softmax(rel / t)


def intervention_factors(p, spans, alpha, eps: float = DEFAULT_EPS) -> np.ndarray:
    """Per-key multipliers (T,) that the intervention applies to row p: alpha_k N_k C / m_k on
    the keys of span k, 1 elsewhere and on guarded spans (m_k <= eps)."""
    p = np.asarray(p, dtype=np.float64)
    alpha = np.asarray(alpha, dtype=np.float64)
    spans = _check_spans(spans, p.shape[-1])
    if alpha.shape != (len(spans),):
        raise ValueError("need one alpha per span")
    m = np.array([p[s:e].sum() for s, e in spans])
    N = np.array([e - s for s, e in spans], dtype=np.float64)
    ok = m > eps
    f = np.ones_like(p)
    den = np.sum(N[ok] * alpha[ok])
    if not ok.any() or den <= 0:
        return f
    C = m[ok].sum() / den
    for k, (s, e) in enumerate(spans):
        if ok[k]:
            f[s:e] = alpha[k] * N[k] * C / m[k]
    return f


def intervene_row(p, spans, alpha, eps: float = DEFAULT_EPS) -> np.ndarray:
    """The intervened copy of one post-softmax attention row p (T,)."""
    return np.asarray(p, dtype=np.float64) * intervention_factors(p, spans, alpha, eps)


def intervention_bias(p, spans, alpha, eps: float = DEFAULT_EPS) -> np.ndarray:
    """The same intervention as an additive logit bias (T,): log of the factors, so that
    softmax(logits + bias) == intervene_row(softmax(logits)) (the row's total stays 1)."""
    return np.log(intervention_factors(p, spans, alpha, eps))


def make_hook(spans, alpha, layers: Sequence[int], first_row: Optional[int] = None,
              eps: float = DEFAULT_EPS):
    """An intervention hook for oracle.model.Model.forward/generate: rewrites the rows at
    positions >= first_row (default: the end of the last span) in the given layers, all
    heads; everything else passes through."""
    spans = _check_spans(spans)
    first = max(e for _, e in spans) if first_row is None else int(first_row)
    layer_set = {int(l) for l in layers}
    alpha = np.asarray(alpha, dtype=np.float64)

    def hook(layer, head, row, probs):
        if layer in layer_set and row >= first:
            return intervene_row(probs, spans, alpha, eps).astype(probs.dtype)
        return probs
    return hook


def default_score_layers(hp) -> list:
    """docs/design.md, Method's default layer set for scoring: the full-attention layers of a model with
    sliding-window layers, else all layers."""
    glob = [l for l in range(hp.n_layer) if not hp.swa_layers[l]]
    return glob if hp.n_swa > 0 and glob else list(range(hp.n_layer))


def score_documents(model, ids, spans, dummy_ids, t: float = DEFAULT_T, layers=None) -> dict:
    """The /rerank computation on the oracle model.

    ids: the prompt (its last token predicts the answer); spans: K document spans [s, e);
    dummy_ids[k]: the e_k - s_k ids that replace span k in reference pass k. layers: the layer
    set (default default_score_layers), narrowed per span to the layers that see the whole
    span from the last token. Returns dict(A, A_dum, rel, alpha, layers) (layers per span)."""
    ids = [int(i) for i in ids]
    T = len(ids)
    spans = _check_spans(spans, T)
    hp = model.hp
    layers = default_score_layers(hp) if layers is None else list(layers)
    per_span = visible_layers(spans, T - 1, hp.swa_layers, hp.n_swa, layers)
    A = doc_attention(model.last_row_attention(ids), spans, per_span)
    A_dum = np.empty(len(spans))
    for k, (s, e) in enumerate(spans):
        d = [int(i) for i in dummy_ids[k]]
        if len(d) != e - s:
            raise ValueError(f"dummy {k}: {len(d)} ids for a span of {e - s}")
        ref = model.last_row_attention(ids[:s] + d + ids[e:])
        A_dum[k] = doc_attention(ref, [(s, e)], [per_span[k]])[0]
    rel, alpha = calibrate(A, A_dum, t)
    return dict(A=A, A_dum=A_dum, rel=rel, alpha=alpha, layers=per_span)


# ---- the scoring options (the spec of `calibrated`, implemented from it) ----------------------
#
#   rows        last: [T-1]; question: the trailing question's span; suffix: [end of the last
#               document, T)
#   pairs       `heads` [(layer, head)] when given, else every head of `layers`; a (row, layer)
#               whose layer cannot see the document's first token from the row is left out
#   a[i]        per document token: the mean over the visible (row, layer, head) triples of the
#               attention probability on that token (0 when none is visible)
#   A, A_ref    over the counted tokens (i >= skip_first, and with sink_factor f > 0 and a
#               reference: a_ref[i] <= f x the mean of a_ref over i >= skip_first): sum or mean
#   A_ref       the dummy pass's (document k's body replaced), the null pass's (the null
#               prompt, its own rows and spans) or, for `both`, the mean of the two, per token
#   rel         A - A_ref, or ln(A + 1e-9) - ln(A_ref + 1e-9)
#   rel_scaled  rel x (documents in the group); the paper's recipe keeps rel
#   weight      softmax(rel_scaled / temperature) over all K
#   relevance   sigmoid(score_scale x rel_scaled + score_bias)

LOG_EPS = 1e-9


def rows_attention(model, ids, rows) -> np.ndarray:
    """(n_rows, L, H, T) attention probabilities of the given rows over the whole prompt."""
    ids = [int(i) for i in ids]
    model.forward(ids, capture_rows=list(rows), logits_rows=[len(ids) - 1])
    return np.stack([a for a in model.attn], axis=0).transpose(2, 0, 1, 3)


def score_rows(kind: str, T: int, spans, question) -> list:
    if kind == "last":
        return [T - 1]
    if kind == "question":
        return list(range(question[0], question[1]))
    if kind == "suffix":
        return list(range(spans[-1][1], T))
    raise ValueError(kind)


def pair_mask(hp, layers=None, heads=None) -> np.ndarray:
    """(L, H) booleans: the (layer, head) pairs averaged over (negative layers from the end)."""
    m = np.zeros((hp.n_layer, hp.n_head), dtype=bool)
    if heads is not None:
        for l, h in heads:
            m[l % hp.n_layer, h] = True
    else:
        for l in layers:
            m[l % hp.n_layer, :] = True
    return m


def token_attention(P, rows, span, pairs, hp) -> np.ndarray:
    """a (N,) for one document: P (n_rows, L, H, T) averaged over the visible triples."""
    s, e = span
    total = np.zeros(e - s)
    count = 0
    for i, row in enumerate(rows):
        for l in range(hp.n_layer):
            if hp.swa_layers[l] and hp.n_swa > 0 and row - s >= hp.n_swa:
                continue
            for h in range(hp.n_head):
                if pairs[l, h]:
                    total += P[i, l, h, s:e]
                    count += 1
    return total / count if count else total


def reduce_document(a, a_ref, skip_first: int, sink_factor: float, aggregate: str):
    """(A, A_ref) of one document from per-token attention (a_ref None: no reference)."""
    keep = np.arange(len(a)) >= skip_first
    if a_ref is not None and sink_factor > 0 and keep.any():
        keep &= a_ref <= sink_factor * a_ref[keep].mean()
    ref = np.zeros_like(a) if a_ref is None else a_ref
    A, R = a[keep].sum(), ref[keep].sum()
    if aggregate == "mean":
        n = keep.sum()
        A, R = (A / n, R / n) if n else (0.0, 0.0)
    return float(A), float(R)


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.asarray(z, dtype=np.float64)))


def score_options(model, groups, o: dict, K: int, paper: bool = False) -> dict:
    """The scores of `calibrated` with options o (rows, layers, heads, aggregate, skip_first,
    reference, form, sink_factor, temperature, score_scale, score_bias) recomputed on the
    oracle model from each scored prompt's tokens (the daemon's return_tokens groups: prompt,
    spans, question, first_document, dummies, null_prompt, null_spans, null_question).
    Returns dict(A, A_ref, rel, scaled, weight, relevance) over the K documents."""
    hp = model.hp
    pairs = pair_mask(hp, o.get("layers"), o.get("heads"))
    out = {k: np.zeros(K) for k in ("A", "A_ref", "rel", "scaled")}
    ref_kind = o["reference"]
    for g in groups:
        ids, spans = g["prompt"], [tuple(s) for s in g["spans"]]
        rows = score_rows(o["rows"], len(ids), spans, g["question"])
        P = rows_attention(model, ids, rows)
        n = len(spans)
        nul = None
        if ref_kind in ("null_query", "null_suffix", "both"):
            nspans = [tuple(s) for s in g["null_spans"]]
            nrows = score_rows(o["rows"], len(g["null_prompt"]), nspans, g["null_question"])
            NP = rows_attention(model, g["null_prompt"], nrows)
            nul = [token_attention(NP, nrows, nspans[j], pairs, hp) for j in range(n)]
        for j, (s, e) in enumerate(spans):
            a = token_attention(P, rows, (s, e), pairs, hp)
            a_ref = None
            if ref_kind in ("dummy", "both"):
                ref_ids = list(ids[:s]) + list(g["dummies"][j]) + list(ids[e:])
                a_ref = token_attention(rows_attention(model, ref_ids, rows), rows, (s, e),
                                        pairs, hp)
            if nul is not None:
                a_ref = nul[j] if a_ref is None else 0.5 * (a_ref + nul[j])
            A, R = reduce_document(a, a_ref, o["skip_first"], o["sink_factor"], o["aggregate"])
            k = g["first_document"] + j
            rel = (np.log(A + LOG_EPS) - np.log(R + LOG_EPS) if o["form"] == "log_ratio"
                   else A - R)
            out["A"][k], out["A_ref"][k], out["rel"][k] = A, R, rel
            out["scaled"][k] = rel if paper else rel * n
    out["weight"] = softmax(out["scaled"] / o["temperature"])
    out["relevance"] = sigmoid(o["score_scale"] * out["scaled"] + o["score_bias"])
    return out


def window_groups(K: int, W: int) -> list:
    """The window rule: ceil(K / W) consecutive groups of sizes differing by at most one, the
    larger first; one group when W is 0 or at least K."""
    G = 1 if W <= 0 or W >= K else -(-K // W)
    sizes = [K // G + (1 if g < K % G else 0) for g in range(G)]
    return [sum(sizes[:g]) for g in range(G)] + [K]


def documents_dummy(bodies, k: int, N: int) -> list:
    """dummy_source documents: the other documents' body ids cycling from k + 1, cut to N."""
    K = len(bodies)
    out = []
    i = 1
    while len(out) < N:
        out += list(bodies[(k + i) % K])
        i = i % (K - 1) + 1
    return out[:N]
