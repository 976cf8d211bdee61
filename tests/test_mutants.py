"""tests/mutate.py's mutants stay plantable: each snippet occurs exactly once under src/ and
kernels/ (the tool refuses one that does not), so a refactor that moves the code a mutant
targets fails here instead of leaving the mutation check quietly short of that bug."""
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import mutate  # noqa: E402


@pytest.mark.parametrize("m", mutate.MUTANTS, ids=lambda m: m.name)
def test_mutant_snippet_found_once(m):
    path = mutate.locate(ROOT, m.snippet)
    text = path.read_text()
    assert text.replace(m.snippet, m.replacement, 1) != text
