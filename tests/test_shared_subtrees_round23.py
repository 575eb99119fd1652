"""A Torch file whose pickle shares one container under many paths (round 23).

A pickle's memo lets a few hundred bytes describe a value whose tree walk never ends: `x = [x, x]` sixty times
over is 60 lists, and 2**60 paths to walk. Every walk of a loaded value (the check that each mapped tensor lies
in its record, the merge into a template, the flat view of a resharding source or an export) walks such a value
as a tree, so a 438-byte crafted file hung the load (and, without a template, was still walking after minutes).
The design document's promise: a load "returns exactly what was committed, or raises"; a crafted checkpoint
never hangs a load. Each load runs in a child under a time and address-space limit (`in_child`).

A value that shares containers the way a saved state can (a list referenced from two keys: torch.save keeps
the sharing) still loads, shared.
"""

from __future__ import annotations

import io
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_crafted_round9 import _assert_refused, _save, in_child
from tests.test_crafted_round14 import _craft_torch, _rezip
from tests.test_verified_loads import _manager, _reshard_save
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.traversal import walk_sizes

LEVELS = 60


def _blown_up_pickle() -> bytes:
    """{"w": x, "v": x} where x = [x', x'] nested LEVELS times: LEVELS lists, 2**LEVELS paths."""
    x: list[Any] = []
    for _ in range(LEVELS):
        x = [x, x]
    out = io.BytesIO()
    pickle.dump({"w": x, "v": x}, out, protocol=2)
    assert len(out.getvalue()) < 1024
    return out.getvalue()


def _craft(root: Path) -> None:
    _craft_torch(root, "model_0.pt", _rezip((root / "model_0.pt").read_bytes(), {"data.pkl": _blown_up_pickle()}))


def load_without_templates(root: str, use_mmap: bool) -> dict[str, Any]:
    """(child side) A load without `into=`: what was raised."""
    m = _manager(use_mmap=use_mmap)
    try:
        m.load(root)
        return {"raised": None}
    except CheckpointError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    finally:
        m.close()


def export_outcome(root: str, out: str) -> dict[str, Any]:
    """(child side) An HF export of the item: what was raised."""
    from torch_checkpointing.hf import export_hf

    try:
        export_hf(root, "model", out)
        return {"raised": None}
    except CheckpointError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}


def test_a_pickle_sharing_one_list_down_many_levels_is_refused_not_walked(tmp_path: Path) -> None:
    """Defect: the mapped load walked 2**60 paths checking tensor records (killed by the child's timeout)."""
    root = tmp_path / "ck"
    _save(root)
    _craft(root)
    _assert_refused(in_child(f"load_outcome({str(root)!r})"), "model_0.pt", "shared")


@pytest.mark.parametrize("use_mmap", [True, False])
def test_a_load_without_templates_of_such_a_pickle_is_refused(tmp_path: Path, use_mmap: bool) -> None:
    """Defect: a load without templates walked it too (mapped: killed by the child's timeout), or returned it
    (not mapped), a value every later walk (a save of it, a merge) hangs on."""
    root = tmp_path / "ck"
    _save(root)
    _craft(root)
    outcome = in_child(f"load_without_templates({str(root)!r}, {use_mmap})", __name__)
    assert outcome["raised"] == "UndecodableFileError", outcome
    assert "model_0.pt" in outcome["message"] and "shared" in outcome["message"], outcome


def test_a_resharding_source_of_such_a_pickle_is_refused(tmp_path: Path) -> None:
    """Defect: the resharding load's source file hung the same way."""
    root, _ = _reshard_save(tmp_path)
    _craft(root)
    _assert_refused(in_child(f"load_outcome({str(root)!r}, reshard=True)"), "model_0.pt", "shared")


def test_an_export_of_such_a_pickle_is_refused(tmp_path: Path) -> None:
    """Defect: export_hf's flat view of the file hung the same way."""
    root = tmp_path / "ck"
    _save(root)
    _craft(root)
    outcome = in_child(f"export_outcome({str(root)!r}, {str(tmp_path / 'hf')!r})", __name__)
    assert outcome["raised"] is not None and "model_0.pt" in outcome["message"], outcome
    assert not (tmp_path / "hf").exists()


def _saved_and_loaded(root: Path, state: dict[str, Any], use_mmap: bool) -> Any:
    """`state` saved as item "model" at `root` (anything there first removed), and what a load gives back."""
    shutil.rmtree(root, ignore_errors=True)
    m = _manager(use_mmap=use_mmap)
    try:
        m.save(str(root), {"model": state})
        return m.load(str(root))["model"]
    finally:
        m.close()


def test_a_saved_state_sharing_containers_still_loads_shared(tmp_path: Path) -> None:
    """Held before and after: a list under two keys (and a tensor under two) round-trips, still shared."""
    shared, t = [1, 2, {"x": 3}], torch.arange(4.0)
    state = {"a": shared, "b": shared, "c": {"t": t}, "d": {"t": t}}
    for use_mmap in (True, False):
        loaded = _saved_and_loaded(tmp_path / "ck", state, use_mmap)
        assert loaded["a"] == shared and loaded["a"] is loaded["b"]
        assert torch.equal(loaded["c"]["t"], t) and loaded["c"]["t"] is loaded["d"]["t"]


def test_a_saved_state_sharing_a_large_list_still_loads(tmp_path: Path) -> None:
    """Defect: a sampler's index list of 2**20 + 10 entries under two keys (which a save walks and commits)
    made a load walk 2**20 + 10 positions beyond the distinct ones, and the load refused the committed
    checkpoint as crafted. What sharing adds is bounded in proportion to the file's distinct entries, too."""
    indices = list(range((1 << 20) + 10))
    state = {"sampler": {"order": indices}, "resume": {"order": indices}, "w": torch.arange(3.0)}
    loaded = _saved_and_loaded(tmp_path / "ck", state, use_mmap=True)
    assert loaded["sampler"]["order"] == indices and loaded["sampler"]["order"] is loaded["resume"]["order"]


def test_a_state_sharing_more_than_a_load_accepts_is_refused_at_save(tmp_path: Path) -> None:
    """Defect: a list of 20,000 entries under 100 keys (a walk of 2,000,100 positions over 20,101 distinct
    entries, past what a load accepts) saved and committed, and every load then refused the checkpoint as
    crafted. The save refuses it, naming the item, and commits nothing."""
    shared = list(range(20_000))
    state = {f"k{i}": shared for i in range(100)}
    m = _manager(use_mmap=True)
    try:
        with pytest.raises(ValueError, match=r"save item 'model'.*shared under several paths"):
            m.save(str(tmp_path / "ck"), {"model": state})
    finally:
        m.close()
    assert not (tmp_path / "ck").exists()


def test_counting_the_walk_of_a_long_list_takes_no_python_step_per_entry() -> None:
    """Defect: walk_sizes (run by every Torch load, and now every Torch save) visited each leaf of a long list
    in Python three times: counting a list of 4M ints took about 5 times as long as unpickling it (1.6 s here).
    A list whose entries hold no container is counted from their types, without a Python step per entry: the
    Python lines the count executes do not grow with the list (a step count, not a timing)."""

    def lines_run(n: int) -> int:
        value = {"order": list(range(n)), "w": torch.zeros(2)}
        events = 0

        def trace(frame: Any, event: str, arg: Any) -> Any:
            nonlocal events
            events += event == "line"
            return trace

        sys.settrace(trace)
        try:
            sizes = walk_sizes(value)
        finally:
            sys.settrace(None)
        assert sizes == (2 + n + 1, 2 + n + 1)
        return events

    lines_run(10)  # the first count also runs what is done once per process
    assert lines_run(1_000) == lines_run(20_000)
