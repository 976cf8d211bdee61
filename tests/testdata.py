"""Where the test suite finds its reference data, and how `bash tests/fetch-data` obtains it.

Every file is looked up on its own, in this order (the first directory holding it wins):
  1. $FITM_SHARED_DATA, when set;
  2. ../shared/data beside the repository;
  3. the cache: $FITM_DATA_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/fitm/test-data,
     which `bash tests/fetch-data` fills from the files' public origins.
pytest (tests/conftest.py) and the C unit tests (through `exec`, below, from tests/meson.build)
both see the result as one directory of links, so a file missing from ../shared/data (the
llama-bpe and qwen2 vocabularies are) can still come from the cache.

Every fetched file is pinned by SHA-256: a download whose hash differs is an error, never a
silent replacement. The reference outputs in reference/ were made once with llama.cpp and have
no public origin; tests that need them skip when they are absent.

Usage:
  python3 tests/testdata.py fetch                  download what is missing into the cache
  python3 tests/testdata.py status                 where each file was found, or "missing"
  python3 tests/testdata.py exec GROUP[,GROUP...] -- PROG ARGS...
      run PROG with FITM_TEST_DATA set to a directory of links to the found files when every
      file of the GROUPS is found; otherwise print one skip line naming the command, run PROG
      without FITM_TEST_DATA (its checks that need no data) and exit 77 (meson's "skipped")
      if it passed."""
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
FETCH_COMMAND = "bash tests/fetch-data"
SKIP_EXIT = 77

LLAMA_CPP_COMMIT = "c392e5094deaf2d1a7c18683214f007fad3fe42b"
LLAMA_CPP_RAW = f"https://raw.githubusercontent.com/ggml-org/llama.cpp/{LLAMA_CPP_COMMIT}/models/"
# stories260K.gguf: llama2.c's stories260K converted by llama.cpp's llama2.c converter. llama.cpp's
# own CI downloads it from here; the hash below is that of the file this suite was written
# against, so a hosted file that differs makes the fetch fail, loudly.
STORIES_URL = "https://huggingface.co/ggml-org/models/resolve/main/tinyllamas/stories260K.gguf"
# llama-cpp-python 0.3.7's source distribution on PyPI vendors llama.cpp with its models/ folder,
# byte-identical to the commit above for every file listed here (checked with git hash-object:
# llama-bpe is blob e51a9911..., qwen2 541e475b...): the fallback origin of the llama.cpp files
# when GitHub is unreachable (PyPI may still be). Pinned by its own SHA-256 and each member's.
SDIST = {
    "url": "https://files.pythonhosted.org/packages/a6/38/"
           "7a47b1fb1d83eaddd86ca8ddaf20f141cbc019faf7b425283d8e5ef710e5/"
           "llama_cpp_python-0.3.7.tar.gz",
    "sha256": "0566a0dcc0f38005c4093309a87f67c2452449522e3e17e15cd735a62957894c",
    "prefix": "llama_cpp_python-0.3.7/vendor/llama.cpp/models/",
}

INP = "ef7a25a263fba141f64a8a842ceb1c572cdb8e1313f592d974f7a06bbd3a4934"
# name -> sha256 (all but stories260K.gguf are in llama.cpp's models/ folder)
FILES = {
    "stories260K.gguf": "047bf46455a544931cff6fef14d7910154c56afbc23ab1c5e56a72e69912c04b",
    "ggml-vocab-llama-spm.gguf": "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
    "ggml-vocab-llama-spm.gguf.inp": INP,
    "ggml-vocab-llama-spm.gguf.out": "ea602819af9f9af53a7af285a284ee810e70a4a14a5972e4c891ccd683488af5",
    "ggml-vocab-gpt-2.gguf": "cedc56ca6e2e89f63e781696d1fd76b4b1d49e6720dee86463e915f6e90016ac",
    "ggml-vocab-gpt-2.gguf.inp": INP,
    "ggml-vocab-gpt-2.gguf.out": "a2630e9cf29c0ddbd9fd79fe358dc83e80af779f886eeaa7627dbfdeec54bae6",
    "ggml-vocab-llama-bpe.gguf": "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
    "ggml-vocab-llama-bpe.gguf.inp": INP,
    "ggml-vocab-llama-bpe.gguf.out": "5c92e3c68163aa74c73a6128c0598c1dfad31dde068a0a48be496d3046816ec1",
    "ggml-vocab-qwen2.gguf": "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c",
    "ggml-vocab-qwen2.gguf.inp": INP,
    "ggml-vocab-qwen2.gguf.out": "4fdf5ff70fcfbb819642b522a47b8f61522fa20d938fa7470a8497bc52773cd4",
}
# made once with llama.cpp (see ../shared/data/README.md); no public origin, never fetched
REFERENCE = [f"reference/once-upon-a-time.{x}" for x in (
    "prompt-ids.txt", "greedy32-ids.txt", "greedy32-text.txt", "first-pos-top5.txt",
    "llama-tokenize.txt", "llamacpp-f32kv.json", "llamacpp-f16kv.json",
    "llama-server-completion.json")]

# What a test needs, by group: "core" is what the stories260K and vocabulary tests need.
GROUPS = {
    "core": ["stories260K.gguf"] + [f"ggml-vocab-{v}.gguf{x}" for v in ("llama-spm", "gpt-2")
                                    for x in ("", ".inp", ".out")],
    "reference": REFERENCE,
}
for _v in ("llama-bpe", "qwen2"):
    GROUPS[_v] = [f"ggml-vocab-{_v}.gguf{x}" for x in ("", ".inp", ".out")]


def cache_dir() -> pathlib.Path:
    if os.environ.get("FITM_DATA_CACHE"):
        return pathlib.Path(os.environ["FITM_DATA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "fitm" / "test-data"


def sources() -> list:
    """The directories searched, in order."""
    dirs = []
    if os.environ.get("FITM_SHARED_DATA"):
        dirs.append(pathlib.Path(os.environ["FITM_SHARED_DATA"]))
    dirs.append(ROOT.parent / "shared" / "data")
    dirs.append(cache_dir())
    return dirs


def find(name: str):
    """The path of data file `name` (relative, e.g. "reference/x.txt"), or None."""
    for d in sources():
        p = d / name
        if p.is_file():
            return p.resolve()
    return None


def missing(groups: str) -> list:
    """The files of the comma-separated GROUPS found nowhere."""
    return [n for g in groups.split(",") for n in GROUPS[g] if find(n) is None]


def skip_line(names) -> str:
    """The one line a test skipped for want of data prints."""
    names = list(names)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    if all(n.startswith("reference/") for n in names):
        return (f"test data missing: {shown} (llama.cpp reference outputs with no public origin:"
                f" only in ../shared/data or $FITM_SHARED_DATA; {FETCH_COMMAND} cannot get them)")
    return f"test data missing: {shown} (run `{FETCH_COMMAND}` to download it)"


def make_view(dest: pathlib.Path) -> pathlib.Path:
    """Fill `dest` with links to every data file found, under their usual names."""
    for name in list(FILES) + REFERENCE:
        p = find(name)
        if p is not None:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).symlink_to(p)
    return dest


# ---- fetch ------------------------------------------------------------------------------------

def sha256_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(url: str, dest: pathlib.Path, want: str) -> None:
    """Download url to dest, atomically, failing unless its SHA-256 is `want`."""
    part = dest.with_name(dest.name + ".part")
    with urllib.request.urlopen(url, timeout=60) as r, open(part, "wb") as f:
        shutil.copyfileobj(r, f)
    got = sha256_of(part)
    if got != want:
        part.unlink()
        raise RuntimeError(f"{url}: sha256 {got}, expected {want}")
    part.replace(dest)


def fetch_sdist_members(names, cache: pathlib.Path) -> list:
    """Extract `names` from the pinned sdist into cache, each verified; returns those that
    could not be had."""
    failed = []
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tgz = pathlib.Path(tmp) / "sdist.tar.gz"
        try:
            download(SDIST["url"], tgz, SDIST["sha256"])
        except Exception as e:  # noqa: BLE001 -- reported, and every name fails
            print(f"  {SDIST['url']}: {e}", file=sys.stderr)
            return list(names)
        with tarfile.open(tgz) as t:
            for name in names:
                part = pathlib.Path(tmp) / name
                part.write_bytes(t.extractfile(SDIST["prefix"] + name).read())
                got = sha256_of(part)
                if got == FILES[name]:
                    part.replace(cache / name)
                    print(f"  {name}: ok (from the sdist)")
                else:
                    failed.append(name)
                    print(f"  {name} in the sdist: sha256 {got}, expected {FILES[name]}",
                          file=sys.stderr)
    return failed


def fetch() -> int:
    """Download every missing fetchable file into the cache; 1 if any could not be had."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    todo = [n for n in FILES if find(n) is None]
    if not todo:
        print("all fetchable test data present: " + ", ".join(map(str, sources())))
        return 0
    print(f"fetching {len(todo)} file(s) into {cache}")
    failed, from_sdist, github = [], [], True
    for name in todo:
        stories = name == "stories260K.gguf"
        if not (stories or github):
            from_sdist.append(name)
            continue
        url = STORIES_URL if stories else LLAMA_CPP_RAW + name
        try:
            download(url, cache / name, FILES[name])
            print(f"  {name}: ok")
        except Exception as e:  # noqa: BLE001 -- report it, try the next origin
            print(f"  {name}: {url}: {e}", file=sys.stderr)
            if isinstance(e, urllib.error.URLError) and not stories:
                github = False  # unreachable: the sdist has the rest of them too
            (failed if stories else from_sdist).append(name)
    if from_sdist:
        print(f"  the rest from {SDIST['url']}")
        failed += fetch_sdist_members(from_sdist, cache)
    if failed:
        print(f"fetch-data: not obtained: {', '.join(failed)}; the tests that need them skip",
              file=sys.stderr)
        return 1
    return 0


# ---- command line -----------------------------------------------------------------------------

def status() -> int:
    for name in list(FILES) + REFERENCE:
        print(f"{name}: {find(name) or 'missing'}")
    return 0


def exec_with_data(groups: str, argv: list) -> int:
    absent = missing(groups)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="fitm-test-data-") as view:
        if absent:
            env.pop("FITM_TEST_DATA", None)
        else:
            env["FITM_TEST_DATA"] = str(make_view(pathlib.Path(view)))
        rc = subprocess.call(argv, env=env)
    if absent and rc == 0:
        print(f"SKIP {skip_line(absent)}", flush=True)
        return SKIP_EXIT
    return rc


def main(argv: list) -> int:
    if argv[:1] == ["fetch"]:
        return fetch()
    if argv[:1] == ["status"]:
        return status()
    if (len(argv) >= 4 and argv[0] == "exec" and argv[2] == "--" and
            all(g in GROUPS for g in argv[1].split(","))):
        return exec_with_data(argv[1], argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
