#!/usr/bin/env python3
"""Router-only MoICE training (docs/moice.md, docs/moice-training.md): reads a frozen GGUF model
through tests/oracle (weights dequantized once to float32 or float64), trains one router per
(layer, head) with the paper's loss (language-modelling loss + coef x Switch-style balance loss
over all routers), linear warm-up then a constant learning rate, Adam without weight decay, and
writes the sidecar with tests/oracle/moice_sidecar.py. Gradients by the HIPS `autograd` package
through a numpy forward pass written once here for training (the frozen weights are constants,
so only activation gradients are formed). Deterministic from --seed: the same seed and inputs
give the same sidecar bytes (one BLAS thread, fixed data order, no timings in the file).

Training text: a synthetic ledger (generate_ledger): lines that file invented items under
invented owners and codes, then questions at the end whose answers only the ledger holds; the
LM loss is taken on the question section (the tokens that need the long context). Its name
material (LEDGER_SYLLABLES) shares no syllable with tests/quality/dataset.py; test_moice_train
checks that no training name occurs in the quality sets.

    nice -n 15 python3 tools/moice_train.py --model MODEL.gguf --out models/moice-gemma-3-270m-q4_k_m.gguf
    python3 tools/moice_train.py --model M.gguf --out S.gguf --search-only   # expert-set search
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # determinism and a fair share of 2 cores

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Dict, List, Optional, Sequence, Tuple  # noqa: E402

import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import autograd.numpy as anp  # noqa: E402
from autograd import value_and_grad  # noqa: E402
from autograd.extend import defvjp, primitive  # noqa: E402

from oracle import model as omodel  # noqa: E402
from oracle import moice_sidecar  # noqa: E402

# The paper's recipe (training/train.sh of the authors' code): AdamW, weight decay 0, warm-up
# ratio 0.2 then a constant rate, balance coefficient 0.3. Steps, rate and lengths are ours
# (docs/moice-training.md says why).
BALANCE_COEF = 0.3
WARMUP_RATIO = 0.2
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-8

# Invented syllables for ledger names: none is a syllable of tests/quality/dataset.py.
LEDGER_SYLLABLES = "brok stev glim drup snel kwah thom plix grun vesk hald mory trek".split()
LEDGER_ITEMS = ["saddle bag", "tin lamp", "wool cap", "hand drill", "seed sack", "fishing net",
                "salt jar", "tool chest", "sled", "lantern hook", "rain cloak", "hay fork"]
LEDGER_PLACES = ["north shed", "mill loft", "cellar", "east barn", "granary", "boat house"]


# ---------------------------------------------------------------------------------------------
# Training text


def ledger_name(rng: random.Random) -> str:
    return "".join(rng.choice(LEDGER_SYLLABLES) for _ in range(2)).capitalize()


def generate_ledger(rng: random.Random, n_entries: int, n_questions: int) -> Tuple[str, str]:
    """(context, questions): n_entries ledger lines, then n_questions questions about random
    entries, each followed by its answer. Codes are unique within one ledger."""
    codes = rng.sample(range(100, 1000), n_entries)
    entries = []
    for code in codes:
        entries.append((code, ledger_name(rng), rng.choice(LEDGER_ITEMS),
                        rng.choice(LEDGER_PLACES)))
    lines = [f"Entry {c}: the {item} of {name} is kept in the {place}." for c, name, item, place
             in entries]
    qs = []
    for c, name, item, place in rng.sample(entries, min(n_questions, n_entries)):
        qs.append(f"Entry {c} belongs to {name}, and it is kept in the {place}.")
    return "Farm ledger.\n" + "\n".join(lines) + "\n", "Checks:\n" + "\n".join(qs) + "\n"


def tokenize(fitm: str, model_path: str, text: str, bos: bool) -> List[int]:
    args = [fitm, "tokenize", "-m", model_path, "-f", "-"] + ([] if bos else ["--no-bos"])
    if not bos:
        args.append("--continuation")
    out = subprocess.run(args, input=text.encode(), capture_output=True, check=True).stdout
    return [int(x) for x in out.split()]


def text_batch(fitm: str, model_path: str, seed: int, count: int, seq_len: int,
               loss_len: int) -> List[Tuple[np.ndarray, int]]:
    """count sequences of at most seq_len ids: a whole ledger (as many entries as fit), then the
    first loss_len ids of its questions, which ask only about entries the context holds;
    returns (ids, first loss position)."""
    out = []
    for i in range(count):
        n = max(2, (seq_len - loss_len) // 18)  # about 17 ids per entry: one tokenization
        while True:
            ctx, qs = generate_ledger(random.Random(seed * 100003 + i), n, n)
            c = tokenize(fitm, model_path, ctx, bos=True)
            if len(c) <= seq_len - loss_len or n == 2:
                break
            n -= 1
        q = tokenize(fitm, model_path, qs, bos=False)[:loss_len]
        out.append((np.asarray(c + q, dtype=np.int64)[:seq_len], len(c)))
    return out


def token_batch(n_vocab: int, seed: int, count: int, seq_len: int,
                loss_len: int) -> List[Tuple[np.ndarray, int]]:
    """Synthetic ids for models without a real tokenizer (the tests' generated models): a random
    context of (key, value) id pairs, then loss_len ids that repeat pairs of the context, so
    the values are predictable only by looking back."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n_pairs = (seq_len - loss_len) // 2
        keys = rng.permutation(n_vocab // 2)[:n_pairs] if n_pairs <= n_vocab // 2 else \
            rng.integers(0, n_vocab // 2, n_pairs)
        vals = rng.integers(n_vocab // 2, n_vocab, n_pairs)
        ctx = np.stack([keys, vals], 1).reshape(-1)
        pick = rng.integers(0, n_pairs, (loss_len + 1) // 2)
        tail = np.stack([keys[pick], vals[pick]], 1).reshape(-1)[:loss_len]
        ids = np.concatenate([ctx, tail])
        if ids.size < seq_len:
            ids = np.concatenate([rng.integers(0, n_vocab, seq_len - ids.size), ids])
        out.append((ids[:seq_len].astype(np.int64), seq_len - loss_len))
    return out


# ---------------------------------------------------------------------------------------------
# The frozen model and the forward pass


class Frozen:
    """A GGUF model's weights, dequantized once, in the compute dtype."""

    def __init__(self, path: str, dtype=np.float32):
        self.m = omodel.Model.load(path, dtype=dtype)
        self.hp = self.m.hp
        self.dtype = np.dtype(dtype)
        self.path = path
        hp = self.hp
        if hp.n_head % hp.n_head_kv:
            raise ValueError("heads must be a multiple of KV heads")
        self.W = {name: self.m.w(name).astype(self.dtype, copy=False) for name in self.m.g.tensors
                  if name != "token_embd.weight" or self.m.out_name == name}
        self.head_w = self.W[self.m.out_name]  # (V, C)
        self._rope = {}

    def has(self, name):
        return name in self.W

    def lin(self, x, il, name):
        p = f"blk.{il}.{name}"
        y = anp.dot(x, self.W[p + ".weight"].T)
        if self.has(p + ".bias"):
            y = y + self.W[p + ".bias"]
        return y

    def norm(self, x, name):
        ms = anp.mean(x * x, axis=-1, keepdims=True)
        return x / anp.sqrt(ms + self.hp.eps) * self.W[name]

    def cos_sin(self, T: int, base: float, scale: float):
        key = (T, float(base), float(scale))
        if key not in self._rope:
            hp = self.hp
            half = hp.n_rot // 2
            inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / hp.n_rot)
            th = (np.arange(T, dtype=np.float64) * scale)[:, None] * inv[None, :]
            self._rope[key] = (np.cos(th).astype(self.dtype)[:, None, :],
                               np.sin(th).astype(self.dtype)[:, None, :])
        return self._rope[key]

    def rope(self, x, base: float, scale: float):
        """x (T, nh, D) rotated at positions 0..T-1 as tests/oracle/model.py's rope does."""
        hp = self.hp
        T = x.shape[0]
        cos, sin = self.cos_sin(T, base, scale)
        half = hp.n_rot // 2
        if hp.rope_neox:
            a, b = x[..., :half], x[..., half:hp.n_rot]
            parts = [a * cos - b * sin, a * sin + b * cos]
        else:
            a, b = x[..., 0:hp.n_rot:2], x[..., 1:hp.n_rot:2]
            ra, rb = a * cos - b * sin, a * sin + b * cos
            parts = [anp.reshape(anp.stack([ra, rb], -1), a.shape[:-1] + (hp.n_rot,))]
        if hp.n_rot < x.shape[-1]:
            parts.append(x[..., hp.n_rot:])
        return anp.concatenate(parts, axis=-1)


def router_logits(x, ga, gb, go):
    """x (T, H, D) -> (T, H, N): G_out (SiLU(G_a x) * (G_b x)) per head (docs/moice.md)."""
    a = anp.einsum("thd,hnd->thn", x, ga)
    b = anp.einsum("thd,hnd->thn", x, gb)
    z = a * (0.5 * (1.0 + anp.tanh(0.5 * a))) * b
    return anp.einsum("thn,hmn->thm", z, go)


def topk_mask(r: np.ndarray, k: int) -> np.ndarray:
    """1 where a logit is among its row's top k (lower index wins ties), else 0."""
    order = np.argsort(-r, axis=-1, kind="stable")[..., :k]
    m = np.zeros(r.shape, dtype=r.dtype)
    np.put_along_axis(m, order, 1.0, axis=-1)
    return m


def softmax(x, axis=-1):
    e = anp.exp(x - np.max(getattr(x, "_value", x), axis=axis, keepdims=True))
    return e / anp.sum(e, axis=axis, keepdims=True)


@primitive
def lm_loss(x, W, targets):
    """Mean cross-entropy of logits x @ W.T (x (n, C), W (V, C)) at targets (n,). A primitive
    so that autograd keeps no (n, V) logits between the passes: the backward recomputes them."""
    z = x @ W.T
    zmax = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - zmax).sum(axis=1)) + zmax[:, 0]
    return float(np.mean(lse - z[np.arange(x.shape[0]), targets]))


def _lm_loss_vjp(ans, x, W, targets):
    def vjp(g):
        z = x @ W.T
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(x.shape[0]), targets] -= 1.0
        return (g / x.shape[0]) * (p @ W).astype(x.dtype)
    return vjp


defvjp(lm_loss, _lm_loss_vjp)


def forward_loss(fz: Frozen, routers: dict, bases: dict, top_k: int, ids: np.ndarray,
                 loss_from: int, stats: Optional[dict] = None):
    """(LM loss on positions loss_from.. predicting the next id, the router logits of every
    routed layer as a list of (T*H, N) arrays). routers: {layer: (ga, gb, go)} (may be autograd
    boxes); bases: {layer: [θ_0..θ_{N-1}]}. stats, if a dict, gets per-layer mean routing
    weights and entropy."""
    hp = fz.hp
    T = ids.size
    H, Hkv, D = hp.n_head, hp.n_head_kv, hp.head_dim
    group = H // Hkv
    x = fz.m.embed(ids).astype(fz.dtype) * fz.dtype.type(hp.embd_scale)
    all_r = []
    neg = fz.dtype.type(-1e30)
    for il in range(hp.n_layer):
        h = fz.norm(x, f"blk.{il}.attn_norm.weight")
        q = anp.reshape(fz.lin(h, il, "attn_q"), (T, H, D))
        k = anp.reshape(fz.lin(h, il, "attn_k"), (T, Hkv, D))
        v = anp.reshape(fz.lin(h, il, "attn_v"), (T, Hkv, hp.head_dim_v))
        if hp.qk_norm:
            q = fz.norm(q, f"blk.{il}.attn_q_norm.weight")
            k = fz.norm(k, f"blk.{il}.attn_k_norm.weight")
        base, scale = hp.rope_for(il)
        mask = omodel.attention_mask(T, hp.n_swa if hp.swa_layers[il] else 0)[None]  # (1,T,T)

        def head_probs(theta):
            qr = fz.rope(q, theta, scale)
            kr = fz.rope(k, theta, scale)
            qg = anp.reshape(qr, (T, Hkv, group, D))
            s = anp.reshape(anp.einsum("tkgd,skd->kgts", qg, kr), (H, T, T))
            s = anp.where(mask, s * fz.dtype.type(hp.attn_scale), neg)
            return softmax(s, -1)  # (H, T, T)

        if il in routers:
            ga, gb, go = routers[il]
            thetas = bases[il]
            xr = fz.rope(q, thetas[0], scale)
            r = router_logits(xr, ga, gb, go)  # (T, H, N)
            all_r.append(anp.reshape(r, (T * H, len(thetas))))
            p = softmax(r, -1)
            sel = topk_mask(getattr(r, "_value", r), top_k)
            w = p * sel
            w = w / anp.sum(w, axis=-1, keepdims=True)  # (T, H, N)
            probs = 0.0
            for e, theta in enumerate(thetas):
                we = anp.transpose(w[:, :, e])[:, :, None]  # (H, T, 1)
                probs = probs + we * head_probs(theta)
            if stats is not None:
                wv, pv = getattr(w, "_value", w), getattr(p, "_value", p)
                ent = -np.sum(pv * np.log(np.maximum(pv, 1e-30)), -1)
                stats[il] = {"usage": wv.mean(axis=(0, 1)).tolist(),
                             "entropy": float(ent.mean())}
        else:
            probs = head_probs(base)
        o = anp.einsum("kgts,skd->tkgd", anp.reshape(probs, (Hkv, group, T, T)), v)
        o = fz.lin(anp.reshape(o, (T, H * hp.head_dim_v)), il, "attn_output")
        if hp.post_norms:
            o = fz.norm(o, f"blk.{il}.post_attention_norm.weight")
        x = x + o
        h = fz.norm(x, f"blk.{il}.ffn_norm.weight")
        gate = fz.lin(h, il, "ffn_gate")
        up = fz.lin(h, il, "ffn_up")
        if hp.ffn_gelu:
            act = 0.5 * gate * (1.0 + anp.tanh(math.sqrt(2.0 / math.pi) *
                                               (gate + 0.044715 * gate ** 3)))
        else:
            act = gate * (0.5 * (1.0 + anp.tanh(0.5 * gate)))
        f = fz.lin(act * up, il, "ffn_down")
        if hp.post_norms:
            f = fz.norm(f, f"blk.{il}.post_ffw_norm.weight")
        x = x + f
    x = fz.norm(x, "output_norm.weight")
    if hp.final_softcap:
        raise NotImplementedError("final logit soft-capping in training")
    rows = np.arange(loss_from - 1, T - 1)
    return lm_loss(x[rows], fz.head_w, ids[rows + 1]), all_r


def balance_loss(all_r: list, n: int, top_k: int):
    """Switch-style load balance over every routed (layer, token, head) row, as the authors'
    load_balancing_loss_func: N * sum_e F_e P_e, F_e the fraction of rows whose top k holds e
    (no gradient), P_e the mean routing probability."""
    r = anp.concatenate(all_r, axis=0)
    p = softmax(r, -1)
    f = topk_mask(getattr(r, "_value", r), top_k).mean(axis=0)
    return n * anp.sum(f * anp.mean(p, axis=0))


def total_loss(fz, routers, bases, top_k, ids, loss_from, coef=BALANCE_COEF):
    lm, rs = forward_loss(fz, routers, bases, top_k, ids, loss_from)
    n = len(next(iter(bases.values())))
    bal = balance_loss(rs, n, top_k)
    return lm + coef * bal, (lm, bal)


# ---------------------------------------------------------------------------------------------
# Routers: initialisation, flattening, training


def init_routers(hp, layers, n: int, seed: int, dtype) -> dict:
    """nn.Linear's default initialisation (uniform in ±1/sqrt(fan_in)), from seed."""
    rng = np.random.default_rng(seed)
    H, D = hp.n_head, hp.head_dim
    out = {}
    for il in layers:
        ga = rng.uniform(-1, 1, (H, n, D)) / math.sqrt(D)
        gb = rng.uniform(-1, 1, (H, n, D)) / math.sqrt(D)
        go = rng.uniform(-1, 1, (H, n, n)) / math.sqrt(n)
        out[il] = tuple(a.astype(dtype) for a in (ga, gb, go))
    return out


def flatten(routers: dict) -> Tuple[np.ndarray, list]:
    keys, parts = [], []
    for il in sorted(routers):
        for j, a in enumerate(routers[il]):
            keys.append((il, j, a.shape))
            parts.append(a.reshape(-1))
    return np.concatenate(parts), keys


def unflatten(vec, keys) -> dict:
    out, at = {}, 0
    for il, j, shape in keys:
        size = int(np.prod(shape))
        out.setdefault(il, [None, None, None])[j] = anp.reshape(vec[at: at + size], shape)
        at += size
    return {il: tuple(v) for il, v in out.items()}


def evaluate(fz, routers, bases, top_k, batch) -> Tuple[float, float]:
    lms, bals = [], []
    for ids, lf in batch:
        _, (lm, bal) = total_loss(fz, routers, bases, top_k, ids, lf)
        lms.append(float(lm))
        bals.append(float(bal))
    return float(np.mean(lms)), float(np.mean(bals))


def train(fz: Frozen, bases: dict, top_k: int, train_batch, held_out, steps: int, lr: float,
          seed: int, log=None, accum: int = 1) -> Tuple[dict, list]:
    """Adam on the router weights only; warm-up over WARMUP_RATIO of the steps, then constant.
    Returns (routers, log rows). Each step averages the gradient of `accum` sequences taken in
    order from train_batch (cycling)."""
    n = len(next(iter(bases.values())))
    routers = init_routers(fz.hp, sorted(bases), n, seed, fz.dtype)
    vec, keys = flatten(routers)
    m = np.zeros_like(vec)
    v2 = np.zeros_like(vec)
    warm = max(1, int(round(WARMUP_RATIO * steps)))

    def obj(flat, ids, lf):
        loss, _ = total_loss(fz, unflatten(flat, keys), bases, top_k, ids, lf)
        return loss

    grad_fn = value_and_grad(obj)
    rows = []
    held0 = evaluate(fz, routers, bases, top_k, held_out) if held_out else (float("nan"),) * 2
    rows.append({"step": 0, "lr": 0.0, "train_loss": float("nan"), "held_lm": held0[0],
                 "held_balance": held0[1]})
    if log:
        log(rows[-1])
    at = 0
    for step in range(1, steps + 1):
        g = np.zeros_like(vec)
        losses = []
        for _ in range(accum):
            ids, lf = train_batch[at % len(train_batch)]
            at += 1
            with np.errstate(over="ignore"):  # tanh' = 1/cosh^2: cosh overflows to inf, 0 is right
                val, gi = grad_fn(vec, ids, lf)
            g += gi / accum
            losses.append(float(val))
        rate = lr * min(1.0, step / warm)
        m = ADAM_B1 * m + (1 - ADAM_B1) * g
        v2 = ADAM_B2 * v2 + (1 - ADAM_B2) * g * g
        mh = m / (1 - ADAM_B1 ** step)
        vh = v2 / (1 - ADAM_B2 ** step)
        vec = (vec - rate * mh / (np.sqrt(vh) + ADAM_EPS)).astype(fz.dtype)
        row = {"step": step, "lr": rate, "train_loss": float(np.mean(losses)),
               "held_lm": float("nan"), "held_balance": float("nan")}
        rows.append(row)
        if held_out and step in (steps // 2, steps):
            row["held_lm"], row["held_balance"] = evaluate(fz, unflatten(vec, keys), bases,
                                                           top_k, held_out)
        if log:
            log(row)
    return {il: tuple(np.asarray(a) for a in r) for il, r in unflatten(vec, keys).items()}, rows


# ---------------------------------------------------------------------------------------------
# Expert-set search (Attention Buckets' way: single-base loss on training text)


def base_search(fz: Frozen, batch, kind_layers: dict, grid: dict) -> dict:
    """For each layer kind: the LM loss with every layer of that kind using one base from its
    grid (the other kind unchanged). Returns {kind: [(base, loss), ...]}."""
    out = {}
    for kind, layers in kind_layers.items():
        res = []
        for theta in grid[kind]:
            n1 = {il: [theta] for il in layers}
            one = {il: (np.zeros((fz.hp.n_head, 1, fz.hp.head_dim), fz.dtype),) * 2 +
                   (np.zeros((fz.hp.n_head, 1, 1), fz.dtype),) for il in layers}
            losses = [float(forward_loss(fz, one, n1, 1, ids, lf)[0]) for ids, lf in batch]
            res.append((float(theta), float(np.mean(losses))))
        out[kind] = res
    return out


def pick_bases(own: float, scores: Sequence[Tuple[float, float]], n: int) -> List[float]:
    """The layer's own base first (router input and the identity case), then the n - 1 other
    grid bases with the lowest single-base loss, ascending."""
    others = sorted((s for s in scores if s[0] != own), key=lambda s: (s[1], s[0]))
    return [float(own)] + sorted(b for b, _ in others[: n - 1])


def layer_kinds(hp, which: str) -> dict:
    local = [il for il in range(hp.n_layer) if hp.swa_layers[il]]
    glob = [il for il in range(hp.n_layer) if not hp.swa_layers[il]]
    kinds = {"local": local, "global": glob}
    if which == "global":
        kinds = {"global": glob}
    elif which == "local":
        kinds = {"local": local}
    return {k: v for k, v in kinds.items() if v}


# Only bases at or above the layer's own: a smaller base turns the same distance further, so
# beyond the training sequences' length it shows the model rotations it never saw. On Gemma 3
# 270M a set searched over {0.5 ... 3} x own picked 0.5, 0.75 and 1.25 (best loss on 192-token
# ledgers) and answered nothing right on the MDQA dev split past ~1,000 tokens; the set
# {1, 1.5, 2, 2.5} x own answered (docs/moice-results.md). The paper's Llama-2 set also lies
# above the model's base.
GRID_FACTORS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0)


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    s = [r["step"] for r in rows if r["step"] > 0]
    ax.plot(s, [r["train_loss"] for r in rows if r["step"] > 0], label="train (LM + coef x balance)")
    hs = [(r["step"], r["held_lm"]) for r in rows if not math.isnan(r["held_lm"])]
    ax.plot([a for a, _ in hs], [b for _, b in hs], "o-", label="held-out LM")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="sidecar to write")
    ap.add_argument("--fitm", default=str(ROOT / "build" / "src" / "fitm"),
                    help="fitm binary (its tokenizer makes the ledger ids)")
    ap.add_argument("--data", choices=("ledger", "tokens"), default="ledger",
                    help="ledger: synthetic text through the model's tokenizer; tokens: "
                         "synthetic id pairs (models without a real tokenizer)")
    ap.add_argument("--layers", choices=("all", "global", "local"), default="all")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--loss-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--train-seqs", type=int, default=30)
    ap.add_argument("--held-seqs", type=int, default=4)
    ap.add_argument("--search-seqs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--log", help="CSV of the loss curves (default OUT.csv; PNG beside it)")
    ap.add_argument("--search-only", action="store_true")
    ap.add_argument("--bases", action="append", default=[], metavar="KIND=B0,B1,...",
                    help="use this expert set for a layer kind (local, global) instead of the "
                         "searched one; B0 is the router's input base")
    a = ap.parse_args(argv)

    t0 = time.time()
    fz = Frozen(a.model, dtype=np.dtype(a.dtype))
    hp = fz.hp

    def batch(seed, count):
        if a.data == "tokens":
            return token_batch(hp.n_vocab, seed, count, a.seq_len, a.loss_len)
        return text_batch(a.fitm, a.model, seed, count, a.seq_len, a.loss_len)

    # Disjoint seeds for search, training and held-out text.
    search = batch(a.seed * 1000 + 1, a.search_seqs)
    train_b = batch(a.seed * 1000 + 2, a.train_seqs)
    held = batch(a.seed * 1000 + 3, a.held_seqs)
    kinds = layer_kinds(hp, a.layers)
    own = {"local": hp.rope_base_swa, "global": hp.rope_base}
    grid = {k: [own[k] * f for f in GRID_FACTORS] for k in kinds}
    given = {}
    for spec in a.bases:
        kind, _, vals = spec.partition("=")
        if kind not in kinds:
            ap.error(f"--bases {spec}: no routed {kind!r} layers (have {', '.join(kinds)})")
        given[kind] = [float(x) for x in vals.split(",")]
        if len(given[kind]) != a.experts:
            ap.error(f"--bases {spec}: {len(given[kind])} bases, --experts is {a.experts}")
    # kinds whose set is given skip the search (the same set gives the same sidecar)
    scores = base_search(fz, search, {k: v for k, v in kinds.items()
                                      if k not in given or a.search_only}, grid)
    print(json.dumps({"base_search": scores}), flush=True)
    if a.search_only:
        return 0
    bases = {}
    for kind, layers in kinds.items():
        chosen = given.get(kind) or pick_bases(own[kind], scores[kind], a.experts)
        for il in layers:
            bases[il] = chosen
    log_path = pathlib.Path(a.log or (str(a.out) + ".csv"))
    rows_out = []

    def log(row):
        rows_out.append(row)
        print(json.dumps({**row, "s": round(time.time() - t0, 1),
                          "cpu_s": round(time.process_time(), 1)}), flush=True)

    routers, rows = train(fz, bases, a.top_k, train_b, held, a.steps, a.lr, a.seed, log,
                          a.accum)
    stats = {}
    for ids, lf in held[:1]:
        forward_loss(fz, routers, bases, a.top_k, ids, lf, stats)
    with open(log_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(log_path.with_suffix(".usage.json"), "w") as f:
        json.dump({"bases": {str(k): v for k, v in bases.items()}, "base_search": scores,
                   "per_layer": {str(k): v for k, v in stats.items()}}, f, indent=1)
    plot(rows, log_path.with_suffix(".png"))
    held_lm0 = rows[0]["held_lm"]
    train_meta = {"seed": a.seed, "steps": a.steps, "lr": float(a.lr), "accum": a.accum,
                  "seq_len": a.seq_len, "loss_len": a.loss_len,
                  "data": f"{a.data} (tools/moice_train.py synthetic; {a.train_seqs} training "
                          f"sequences)",
                  "balance_coef": float(BALANCE_COEF), "warmup_ratio": float(WARMUP_RATIO),
                  "held_lm_initial": float(held_lm0), "held_lm_final": float(rows[-1]["held_lm"]),
                  "train_loss_final": float(rows[-1]["train_loss"])}
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # models/ is not in git
    moice_sidecar.write(a.out, moice_sidecar.base_identity(a.model), bases, routers, a.top_k,
                        train_meta)
    print(json.dumps({"wrote": str(a.out), "log": str(log_path),
                      "seconds": round(time.time() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
