"""Golden single-rank checkpoints: every backend loads every writer's files bit-exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from conformance.golden.cases import CASES, DTENSOR_CASE, GOLDEN_DIR, Case, assert_tree_equal
from conformance.helpers import files

Factory = Callable[..., Any]
REQUIRED_WRITERS = ("ours", "upstream")


def _writers() -> list[str]:
    return sorted(p.name for p in GOLDEN_DIR.iterdir() if p.is_dir() and not p.name.startswith("__"))


def _params() -> list[Any]:
    return [
        pytest.param(writer, case, id=f"{writer}-{case.name}", marks=pytest.mark.clause(*case.clauses))
        for writer in _writers()
        for case in CASES
    ]


@pytest.mark.clause("TORCH-FILE-1")
def test_golden_sets_are_present() -> None:
    for writer in REQUIRED_WRITERS:
        present = {p.name for p in (GOLDEN_DIR / writer).iterdir()} if (GOLDEN_DIR / writer).is_dir() else set()
        missing = {c.name for c in CASES} - present
        assert not missing, f"golden/{writer} lacks {sorted(missing)}: run python -m conformance.golden.regenerate"
    assert (GOLDEN_DIR / "ours" / DTENSOR_CASE).is_dir(), "golden/ours lacks the 2-rank DTensor checkpoint"


@pytest.mark.parametrize(("writer", "case"), _params())
@pytest.mark.local_only(
    "the golden checkpoints are files committed to this repository, loaded where they lie (on the local disk); "
    "under a storage URL the suite would load an upload of them, which is no longer the other writers' bytes"
)
def test_golden_loads_bit_exact(manager_factory: Factory, writer: str, case: Case) -> None:
    ckpt = GOLDEN_DIR / writer / case.name
    assert set(case.files) <= files(ckpt), f"{ckpt.name}: expected files {case.files}, found {sorted(files(ckpt))}"
    m = manager_factory(case.items())
    template = case.template()
    out = m.load(str(ckpt), into=template)
    want = case.payload()
    assert set(out) == set(want)
    for key, value in want.items():
        assert_tree_equal(out[key], value, f"{writer}/{case.name}:{key}")
