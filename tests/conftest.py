"""Shared pytest fixtures: where the built binaries, the shared test data and generated models are.

FITM_BUILD_DIR points at the meson build directory (default: ./build at the repository root).
Test data (stories260K.gguf, llama.cpp's vocabularies and reference outputs) is found file by file
by tests/testdata.py: $FITM_SHARED_DATA, then ../shared/data, then the cache that
`bash tests/fetch-data` fills. A test whose data is nowhere skips with one line naming that
command (tests/run counts those skips)."""
import atexit
import functools
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import testdata  # noqa: E402


def build_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("FITM_BUILD_DIR", ROOT / "build")).resolve()


@functools.lru_cache(maxsize=None)
def shared_data() -> pathlib.Path:
    """One directory of links to every data file found (tests/testdata.py), for this session."""
    view = pathlib.Path(tempfile.mkdtemp(prefix="fitm-test-data-"))
    atexit.register(shutil.rmtree, view, True)
    return testdata.make_view(view)


def need_data(group: str) -> pathlib.Path:
    """The data directory, or skip the calling test with the one line naming the fetch command
    when a file of `group` (tests/testdata.py's GROUPS) is nowhere."""
    absent = testdata.missing(group)
    if absent:
        pytest.skip(testdata.skip_line(absent))
    return shared_data()


@pytest.fixture(scope="session")
def fitm_bin() -> pathlib.Path:
    p = build_dir() / "src" / "fitm"
    if not p.exists():
        pytest.fail(f"{p} not built; run meson/ninja first (or set FITM_BUILD_DIR)")
    return p


@pytest.fixture(scope="session")
def data_dir() -> pathlib.Path:
    """stories260K.gguf and the llama-spm and gpt-2 vocabularies with their test vectors."""
    return need_data("core")


@pytest.fixture(scope="session")
def reference_dir() -> pathlib.Path:
    """llama.cpp's outputs for stories260K (reference/), which only ../shared/data holds."""
    return need_data("reference") / "reference"
