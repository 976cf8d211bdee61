"""`fitm mkmodel`: the generated models have llama.cpp's layout for each architecture and weight
type, are byte-identical for the same seed, carry a consistent tokenizer, and behave like models
(logits with spread, attention far from uniform). Files are parsed with the oracle's own GGUF
reader (tests/oracle/gguf_reader.py), not with fitm's.

The expected layout below is written from llama.cpp's GGUF conventions, independently of
src/genmodel.c."""
import re
import subprocess

import numpy as np
import pytest

from oracle import gguf_reader

ARCHS = ("llama", "qwen2", "gemma3")
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
TYPE_ID = {"F32": 0, "F16": 1, "Q4_0": 2, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
           "Q6_K": 14, "BF16": 30}
FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q5_0": 8, "Q4_K": 14, "Q5_K": 16,
             "Q6_K": 18, "BF16": 32}
# Defaults documented in `fitm mkmodel --help`.
DEFAULTS = {
    "llama": dict(L=2, C=256, H=4, Hkv=2, D=64, F=512, ctx=1024, base=1e4, eps=1e-5, swa=0),
    "qwen2": dict(L=2, C=256, H=4, Hkv=2, D=64, F=512, ctx=1024, base=1e6, eps=1e-6, swa=0),
    "gemma3": dict(L=8, C=256, H=4, Hkv=1, D=128, F=512, ctx=1024, base=1e6, eps=1e-6, swa=16),
}
DEFAULT_TOK = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma"}


def mkmodel(fitm_bin, path, *args, check=True):
    p = subprocess.run([str(fitm_bin), "mkmodel", "-o", str(path), *map(str, args)],
                       capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, p.stderr
    return p


@pytest.fixture(scope="session")
def model(fitm_bin, tmp_path_factory):
    """model(arch, type, seed=1, *extra) -> path of a generated file (cached per session)."""
    d = tmp_path_factory.mktemp("genmodel")
    cache = {}

    def make(arch, wtype="F32", seed=1, *extra):
        key = (arch, wtype, seed, extra)
        if key not in cache:
            name = "-".join([arch, wtype, str(seed), *map(str, extra)]).replace("/", "_")
            path = d / f"{name}.gguf"
            mkmodel(fitm_bin, path, "--arch", arch, "--type", wtype, "--seed", seed, *extra)
            cache[key] = path
        return cache[key]

    return make


def expected_tensors(arch, h, V, tied):
    """name -> (GGUF shape, True if a weight matrix stored in the chosen type)."""
    C, H, Hkv, D, F = h["C"], h["H"], h["Hkv"], h["D"], h["F"]
    t = {"token_embd.weight": ((C, V), True), "output_norm.weight": ((C,), False)}
    if not tied and arch != "gemma3":
        t["output.weight"] = ((C, V), True)
    for il in range(h["L"]):
        b = f"blk.{il}."
        t.update({
            b + "attn_norm.weight": ((C,), False),
            b + "attn_q.weight": ((C, H * D), True),
            b + "attn_k.weight": ((C, Hkv * D), True),
            b + "attn_v.weight": ((C, Hkv * D), True),
            b + "attn_output.weight": ((H * D, C), True),
            b + "ffn_norm.weight": ((C,), False),
            b + "ffn_gate.weight": ((C, F), True),
            b + "ffn_up.weight": ((C, F), True),
            b + "ffn_down.weight": ((F, C), True),
        })
        if arch == "qwen2":
            t.update({b + "attn_q.bias": ((H * D,), False), b + "attn_k.bias": ((Hkv * D,), False),
                      b + "attn_v.bias": ((Hkv * D,), False)})
        if arch == "gemma3":
            t.update({b + "attn_q_norm.weight": ((D,), False),
                      b + "attn_k_norm.weight": ((D,), False),
                      b + "post_attention_norm.weight": ((C,), False),
                      b + "post_ffw_norm.weight": ((C,), False)})
    return t


def check_layout(g, arch, wtype, h, tied=False):
    m = g.metadata
    a = arch
    assert m["general.architecture"] == arch
    assert m["general.file_type"] == FILE_TYPE[wtype]
    assert ("general.quantization_version" in m) == (wtype not in ("F32", "F16", "BF16"))
    for key, want in (("context_length", h["ctx"]), ("embedding_length", h["C"]),
                      ("block_count", h["L"]), ("feed_forward_length", h["F"]),
                      ("attention.head_count", h["H"]), ("attention.head_count_kv", h["Hkv"])):
        assert m[f"{a}.{key}"] == want, key
        assert g.metadata_types[f"{a}.{key}"] == gguf_reader.T_UINT32, key
    assert m[f"{a}.attention.layer_norm_rms_epsilon"] == pytest.approx(h["eps"], rel=1e-6)
    assert m[f"{a}.rope.freq_base"] == pytest.approx(h["base"], rel=1e-6)
    own_head_dim = arch == "gemma3" or h["D"] * h["H"] != h["C"]
    assert m.get(f"{a}.attention.key_length") == (h["D"] if own_head_dim else None)
    assert m.get(f"{a}.attention.value_length") == (h["D"] if own_head_dim else None)
    assert m.get(f"{a}.rope.dimension_count") == (h["D"] if arch == "llama" else None)
    assert m.get(f"{a}.attention.sliding_window") == (h["swa"] if arch == "gemma3" else None)

    V = len(m["tokenizer.ggml.tokens"])
    want = expected_tensors(arch, h, V, tied)
    assert list(g.tensors)[:2] == ["token_embd.weight", "output_norm.weight"]
    assert set(g.tensors) == set(want)
    for name, (shape, is_matrix) in want.items():
        t = g.tensors[name]
        assert t.shape == shape, name
        assert t.type_id == (TYPE_ID[wtype] if is_matrix else 0), name
    return V


# --- every architecture in every weight type -----------------------------------------------------


@pytest.mark.parametrize("wtype", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_layout_and_determinism(fitm_bin, model, tmp_path, arch, wtype):
    path = model(arch, wtype)
    again = tmp_path / "again.gguf"
    mkmodel(fitm_bin, again, "--arch", arch, "--type", wtype, "--seed", 1)
    assert again.read_bytes() == path.read_bytes(), "same seed must give the same bytes"
    other = model(arch, wtype, 2)
    assert other.read_bytes() != path.read_bytes(), "another seed must give other bytes"

    g = gguf_reader.read(path)
    assert g.version == 3 and g.alignment == 32
    check_layout(g, arch, wtype, DEFAULTS[arch])
    # Same seed, same source weights in every type: the stored values agree with F32's
    # within the format's error.
    ref = gguf_reader.read(model(arch, "F32")).tensor("blk.0.ffn_up.weight")
    got = g.tensor("blk.0.ffn_up.weight")
    bound = {"F32": 0, "F16": 5e-4, "BF16": 4e-3, "Q8_0": 9e-3, "Q6_K": 0.027, "Q5_K": 0.055,
             "Q5_0": 0.065, "Q4_K": 0.11, "Q4_0": 0.13}[wtype]
    assert np.sqrt(np.mean((got - ref) ** 2)) / ref.std() <= bound


@pytest.mark.parametrize("wtype", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_reads_generated_model(fitm_bin, model, arch, wtype):
    path = model(arch, wtype)
    p = subprocess.run([str(fitm_bin), "inspect", "-m", str(path), "--tensors"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    g = gguf_reader.read(path)
    assert re.search(rf'^architecture:\s*"{arch}"', p.stdout, re.M), p.stdout
    assert re.search(rf"^tensors:\s*{len(g.tensors)}\b", p.stdout, re.M), p.stdout
    n_params = sum(t.n_elements for t in g.tensors.values())
    assert re.search(rf"^parameters:\s*{n_params}\b", p.stdout, re.M), p.stdout
    for name in ("token_embd.weight", "blk.0.ffn_down.weight"):
        assert re.search(rf"^\s*{re.escape(name)}\s+{wtype}\s", p.stdout, re.M), name


# --- size overrides and options ------------------------------------------------------------------


def test_size_overrides(fitm_bin, tmp_path):
    path = tmp_path / "m.gguf"
    out = mkmodel(fitm_bin, path, "--arch", "llama", "--type", "Q5_K", "--layers", 3, "--dim",
                  512, "--heads", 8, "--kv-heads", 2, "--ff", 768, "--ctx", 333, "--rope-base",
                  5e5, "--eps", 1e-6).stdout
    assert "wrote" in out and "L 3 C 512 H 8 Hkv 2 D 64 F 768" in out
    h = dict(L=3, C=512, H=8, Hkv=2, D=64, F=768, ctx=333, base=5e5, eps=1e-6, swa=0)
    check_layout(gguf_reader.read(path), "llama", "Q5_K", h)


def test_head_dim_override_writes_key_length(fitm_bin, tmp_path):
    path = tmp_path / "m.gguf"
    mkmodel(fitm_bin, path, "--arch", "qwen2", "--head-dim", 32, "--heads", 2, "--kv-heads", 1)
    h = dict(DEFAULTS["qwen2"], H=2, Hkv=1, D=32)
    check_layout(gguf_reader.read(path), "qwen2", "F32", h)


def test_gemma3_window_and_layers(fitm_bin, tmp_path):
    path = tmp_path / "m.gguf"
    mkmodel(fitm_bin, path, "--arch", "gemma3", "--swa", 8, "--layers", 12, "--type", "Q8_0")
    check_layout(gguf_reader.read(path), "gemma3", "Q8_0", dict(DEFAULTS["gemma3"], swa=8, L=12))


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_tied_and_vocab_extra(fitm_bin, model, arch):
    base = gguf_reader.read(model(arch))
    g = gguf_reader.read(model(arch, "Q4_0", 1, "--tied", "--vocab-extra", 100))
    V = check_layout(g, arch, "Q4_0", DEFAULTS[arch], tied=True)
    assert V == len(base.metadata["tokenizer.ggml.tokens"]) + 100
    toks = g.metadata["tokenizer.ggml.tokens"]
    assert all(t.startswith(("<extra_", "<|extra_")) for t in toks[-100:])
    assert list(g.metadata["tokenizer.ggml.token_type"][-100:]) == [5] * 100  # unused


def test_small_dim_with_block32_type(fitm_bin, tmp_path):
    path = tmp_path / "m.gguf"
    mkmodel(fitm_bin, path, "--arch", "llama", "--dim", 64, "--heads", 2, "--ff", 96,
            "--type", "Q8_0")
    check_layout(gguf_reader.read(path), "llama", "Q8_0",
                 dict(DEFAULTS["llama"], C=64, H=2, D=32, F=96))


@pytest.mark.parametrize("src_arch,extra", [("qwen2", ("--vocab-extra", 5)), ("llama", ())])
def test_tokenizer_from_another_file(fitm_bin, model, tmp_path, src_arch, extra):
    """--tokenizer-from copies every tokenizer.* key of the file with its type and value (a
    byte-level BPE with merges, a SentencePiece vocabulary with scores), sizes the vocabulary
    by it, and the model tokenizes exactly as the file's model does."""
    src_path = model(src_arch, "F32", 1, *extra)
    src = gguf_reader.read(src_path)
    path = tmp_path / "g.gguf"
    mkmodel(fitm_bin, path, "--arch", "gemma3", "--type", "Q8_0", "--layers", 2,
            "--tokenizer-from", src_path)
    g = gguf_reader.read(path)
    V = check_layout(g, "gemma3", "Q8_0", dict(DEFAULTS["gemma3"], L=2))
    assert V == len(src.metadata["tokenizer.ggml.tokens"])
    tok_keys = [k for k in src.metadata if k.startswith("tokenizer.")]
    assert [k for k in g.metadata if k.startswith("tokenizer.")] == tok_keys
    for k in tok_keys:
        assert g.metadata_types[k] == src.metadata_types[k], k
        a, b = g.metadata[k], src.metadata[k]
        assert (np.array_equal(a, b) if isinstance(b, np.ndarray) else a == b), k
    text = "Which document answers the question? Paris, France: 1,234 results."
    ids = [subprocess.run([str(fitm_bin), "tokenize", "-m", str(m), text], capture_output=True,
                          text=True, timeout=60, check=True).stdout for m in (src_path, path)]
    assert ids[0] == ids[1] and len(ids[0].split()) > 5, ids


@pytest.mark.parametrize("args,code,msg", [
    (["--arch", "llama", "--type", "Q4_K", "--dim", 128], 1, "multiples of 256"),
    (["--arch", "llama", "--type", "Q8_0", "--ff", 100], 1, "multiples of 32"),
    (["--arch", "llama", "--heads", 4, "--kv-heads", 3], 1, "multiple of kv-heads"),
    (["--arch", "gpt2"], 2, "unknown architecture"),
    (["--arch", "llama", "--type", "Q8_K"], 2, "unknown --type"),
    (["--arch", "llama", "--layers", "two"], 2, "bad integer"),
    (["--arch", "llama", "--swa", 8], 2, "gemma3 only"),
    (["--arch", "llama", "--bogus"], 2, "unknown option"),
    (["--arch", "llama", "--layers", 0], 1, "layers"),
    (["--arch", "llama", "--tokenizer", "bert"], 2, "unknown tokenizer"),
    (["--arch", "llama", "--tokenizer-from", "x.gguf", "--vocab-extra", 3], 2, "takes the place"),
    (["--arch", "llama", "--tokenizer-from", "/nonexistent.gguf"], 1, "/nonexistent.gguf"),
])
def test_errors(fitm_bin, tmp_path, args, code, msg):
    path = tmp_path / "m.gguf"
    p = mkmodel(fitm_bin, path, *args, check=False)
    assert p.returncode == code, (p.stdout, p.stderr)
    assert msg in p.stderr


def test_tokenizer_from_a_file_without_one(fitm_bin, tmp_path):
    """A valid GGUF without tokenizer.ggml.tokens (here: no metadata, no tensors) is refused
    with the key named; nothing is written."""
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))
    out = tmp_path / "m.gguf"
    p = mkmodel(fitm_bin, out, "--arch", "llama", "--tokenizer-from", empty, check=False)
    assert p.returncode == 1 and "no tokenizer.ggml.tokens" in p.stderr, p.stderr
    assert not out.exists()


def test_requires_arch_and_output(fitm_bin):
    p = subprocess.run([str(fitm_bin), "mkmodel", "--arch", "llama"], capture_output=True,
                       text=True)
    assert p.returncode == 2 and "required" in p.stderr
    p = subprocess.run([str(fitm_bin), "mkmodel", "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "--vocab-extra" in p.stdout


# --- tokenizer -----------------------------------------------------------------------------------

WORDS = ["the", "of", "and", "question", "answer", "document", "search", "results", "capital",
         "France", "Paris", "Question", "Document", "Title", "Answer", "Write", "irrelevant"]


def spm_segment(text, piece_score):
    """SentencePiece-style BPE: start from characters, repeatedly merge the adjacent pair whose
    concatenation is a piece with the best score."""
    sym = list(text)
    while True:
        best = None
        for i in range(len(sym) - 1):
            s = piece_score.get(sym[i] + sym[i + 1])
            if s is not None and (best is None or s > best[0]):
                best = (s, i)
        if best is None:
            return sym
        i = best[1]
        sym[i:i + 2] = [sym[i] + sym[i + 1]]


def bpe_segment(text, ranks):
    """Byte-level BPE: repeatedly apply the lowest-ranked merge present."""
    sym = list(text)
    while True:
        best = None
        for i in range(len(sym) - 1):
            r = ranks.get((sym[i], sym[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return sym
        i = best[1]
        sym[i:i + 2] = [sym[i] + sym[i + 1]]


def gpt2_byte_chars():
    printable = list(range(0x21, 0x7f)) + list(range(0xa1, 0xad)) + list(range(0xae, 0x100))
    rest = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(0x100 + i) for i in range(len(rest))]


@pytest.mark.parametrize("tok", ("llama", "gemma"))
def test_sentencepiece_vocab(model, tok):
    arch = "gemma3" if tok == "gemma" else "llama"
    m = gguf_reader.read(model(arch)).metadata
    toks, scores = m["tokenizer.ggml.tokens"], m["tokenizer.ggml.scores"]
    types = m["tokenizer.ggml.token_type"]
    assert m["tokenizer.ggml.model"] == "llama"
    assert len(toks) == len(set(toks)) == len(scores) == len(types)
    if tok == "llama":
        assert toks[:3] == ["<unk>", "<s>", "</s>"] and list(types[:3]) == [2, 3, 3]
        ids = dict(unknown=0, bos=1, eos=2)
        assert "tokenizer.chat_template" not in m
    else:
        assert toks[:5] == ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
        assert toks[105:108] == ["<start_of_turn>", "<end_of_turn>", "\n"]
        assert types[105] == types[106] == 3 and types[107] == 4
        ids = dict(padding=0, eos=1, bos=2, unknown=3, eot=106)
        assert m["tokenizer.ggml.add_space_prefix"] is False
        assert "<start_of_turn>" in m["tokenizer.chat_template"]
    for k, v in ids.items():
        assert m[f"tokenizer.ggml.{k}_token_id"] == v
    assert m["tokenizer.ggml.add_bos_token"] is True
    b0 = toks.index("<0x00>")
    assert toks[b0:b0 + 256] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(types[b0:b0 + 256]) == {6}
    normal = {t: float(s) for t, s, ty in zip(toks, scores, types) if ty == 1}
    assert "▁" in normal and all(chr(c) in normal for c in range(0x21, 0x7f))
    # Every multi-character piece is reachable by merging two shorter pieces.
    for t in normal:
        if len(t) > 1:
            assert any(t[:i] in normal and t[i:] in normal for i in range(1, len(t))), t
    # Real merges: each listed word comes out as one piece; other text falls back to pieces.
    for w in WORDS:
        assert spm_segment("▁" + w, normal) == ["▁" + w], w
    seg = spm_segment("▁Whichever▁documents", normal)
    assert 1 < len(seg) < len("▁Whichever▁documents") and "▁documents" in seg


@pytest.mark.parametrize("arch,tok", (("qwen2", "qwen2"), ("llama", "llama3")))
def test_bpe_vocab(model, arch, tok):
    path = model(arch) if tok == "qwen2" else model(arch, "F32", 1, "--tokenizer", tok)
    m = gguf_reader.read(path).metadata
    toks, types, merges = (m["tokenizer.ggml.tokens"], m["tokenizer.ggml.token_type"],
                           m["tokenizer.ggml.merges"])
    assert m["tokenizer.ggml.model"] == "gpt2"
    assert "tokenizer.ggml.scores" not in m
    assert len(toks) == len(set(toks)) == len(types)
    assert toks[:256] == gpt2_byte_chars()
    assert toks[220] == "Ġ"  # the space, as in GPT-2 and Qwen2
    vocab = set(toks)
    ranks = {}
    for r, mg in enumerate(merges):
        a, b = mg.split(" ")
        assert a in vocab and b in vocab and a + b in vocab, mg
        ranks[(a, b)] = r
    for w in WORDS:
        assert bpe_segment("Ġ" + w, ranks) == ["Ġ" + w], w
    if tok == "qwen2":
        assert m["tokenizer.ggml.pre"] == "qwen2"
        assert toks[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        n = len(toks)
        assert m["tokenizer.ggml.bos_token_id"] == n - 3
        assert m["tokenizer.ggml.eos_token_id"] == m["tokenizer.ggml.eot_token_id"] == n - 1
        assert m["tokenizer.ggml.add_bos_token"] is False
        assert "<|im_start|>" in m["tokenizer.chat_template"]
    else:
        assert m["tokenizer.ggml.pre"] == "llama-bpe"
        assert toks[m["tokenizer.ggml.bos_token_id"]] == "<|begin_of_text|>"
        assert toks[m["tokenizer.ggml.eot_token_id"]] == "<|eot_id|>"
        assert "<|start_header_id|>" in m["tokenizer.chat_template"]
    assert set(types[-3:]) == {3}


def test_tokenizer_does_not_depend_on_seed(model):
    a = gguf_reader.read(model("qwen2", "F32", 1)).metadata
    b = gguf_reader.read(model("qwen2", "F32", 7)).metadata
    assert a["tokenizer.ggml.tokens"] == b["tokenizer.ggml.tokens"]
    assert a["tokenizer.ggml.merges"] == b["tokenizer.ggml.merges"]


# --- the weights behave like a model -------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_statistics(model, arch):
    g = gguf_reader.read(model(arch))
    C = DEFAULTS[arch]["C"]
    w = g.tensor("blk.0.ffn_down.weight")  # (C, F): rows over the input dim F
    assert abs(w.mean()) < 2e-3 and w.std() == pytest.approx(1 / np.sqrt(DEFAULTS[arch]["F"]),
                                                              rel=0.02)
    n = g.tensor("blk.0.attn_norm.weight")
    assert n.mean() == pytest.approx(1.0, abs=0.03) and 0.05 < n.std() < 0.15
    if arch == "qwen2":
        assert 0.1 < g.tensor("blk.0.attn_k.bias").std() < 0.3
    if arch == "gemma3":
        assert g.tensor("blk.0.attn_q_norm.weight").mean() > 1.2  # sharper attention
        assert g.tensor("blk.0.post_ffw_norm.weight").mean() > 2
    assert g.tensor("token_embd.weight").shape == (len(g.metadata["tokenizer.ggml.tokens"]), C)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_attention_are_not_degenerate(model, arch):
    from oracle.model import Model

    m = Model.load(model(arch))
    rng = np.random.default_rng(3)
    ids = rng.integers(300, 900, 48)
    T = len(ids)
    logits = m.forward(ids, capture_rows=[T - 1])
    spread = logits.std(axis=-1)
    assert np.all((spread > 1.0) & (spread < 5.0)), spread
    top = np.argsort(logits, axis=-1)[:, ::-1]
    assert len(set(top[:, 0])) > T // 2, "argmax should vary with the input"
    assert (top[:, 0] == ids).mean() < 0.3, "a model that mostly repeats its input is degenerate"
    # The last token's attention is far from uniform in every layer, but not one-hot either.
    for il, heads in enumerate(m.attn):
        ent = []
        for p in heads:
            p = np.asarray(p).reshape(-1)
            p = p[p > 0]
            ent.append(-(p * np.log(p)).sum() / np.log(len(p)))
        assert 0.1 < np.mean(ent) < 0.9, (il, ent)
