"""Shared pytest fixtures: where the built binaries, the shared test data and generated models are.

FITM_BUILD_DIR points at the meson build directory (default: ./build at the repository root).
Shared data lives in ../shared/data beside the repository (FITM_SHARED_DATA overrides)."""
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def build_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("FITM_BUILD_DIR", ROOT / "build")).resolve()


def shared_data() -> pathlib.Path:
    return pathlib.Path(os.environ.get("FITM_SHARED_DATA", ROOT.parent / "shared" / "data")).resolve()


@pytest.fixture(scope="session")
def fitm_bin() -> pathlib.Path:
    p = build_dir() / "src" / "fitm"
    if not p.exists():
        pytest.fail(f"{p} not built; run meson/ninja first (or set FITM_BUILD_DIR)")
    return p


@pytest.fixture(scope="session")
def data_dir() -> pathlib.Path:
    d = shared_data()
    if not d.is_dir():
        pytest.fail(f"shared test data not found at {d} (set FITM_SHARED_DATA)")
    return d
