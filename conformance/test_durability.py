"""The durability profile: clauses beyond the design document (DUR-*, INTEG-*, SAFE-*, see CLAUSES.md).

Every fault is made by the suite (``conformance/faults.py``): real SIGKILLs of the saving process tree,
real file-size limits, real corrupted and crafted files. The backend is driven through its public API.
Skip the profile with ``-m "not durability"``.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from conformance import faults
from conformance.helpers import (
    Where,
    copy_tree,
    files,
    layout,
    raised_by,
    read_bytes,
    read_text,
    remove,
    save,
    spec,
    torch_save,
    write_bytes,
)

clause = pytest.mark.clause
local_only = pytest.mark.local_only
pytestmark = pytest.mark.durability
NOT_MEASURED = "not measured: "
INSTANTS = 10
# The calibration and each instant's case start a saving child and, async, its writer: 10 s and more apiece
# under coverage on a busy 2-core machine (130 s for the async series, against the 180 s it had).
KILL_SERIES_TIMEOUT_S = 30.0 * (INSTANTS + 2)
FSIZE_LIMITS = (0, 100, 4096, 200_000)  # bytes: every file, the JSON item's, the tensors' (256 KiB each)


def _commit(path: Where, version: int, mode: str = "sync") -> None:
    m = faults.manager(mode)
    try:
        save(m, path, faults.payload(version))
    finally:
        m.close()


@pytest.fixture
def committed(ckpt_root: Where) -> Where:
    """A committed checkpoint of version 1 (the one the corruption clauses damage copies of)."""
    _commit(ckpt_root / "good", 1)
    return ckpt_root / "good"


Damage = Callable[[Where, str], None]  # (the file in the copy, its path relative to the checkpoint)


def _each_file(src: Where, root: Where, damage: Damage) -> Iterator[tuple[str, Where]]:
    """For every file of ``src``: a fresh copy of the checkpoint (under ``root``) with that one file damaged.

    First an undamaged copy must load exactly as saved: were it refused (a backend may not take a copied
    checkpoint, or may not load at all), every damaged copy would "raise" and the clause hold by construction.
    """
    names = sorted(files(src))
    assert names, f"no files found under {src}: nothing to damage"  # a listing that saw nothing must not pass
    copy_tree(src, root / "undamaged")
    control = faults.classify(root / "undamaged", {"right": 1})
    if control != "right":
        pytest.skip(f"{NOT_MEASURED}an undamaged copy of the checkpoint loads as {control!r}, so damage shows nothing")
    for i, rel in enumerate(names):
        dst = root / f"damaged{i}"
        copy_tree(src, dst)
        damage(dst / rel, rel)
        yield rel, dst


def _right_or_raises(src: Where, tmp: Where, damage: Damage) -> None:
    wrong = {}
    for rel, dst in _each_file(src, tmp, damage):
        got = faults.classify(dst, {"right": 1, "other": 2})
        if got not in ("right", "raised"):
            wrong[rel] = got
    assert not wrong, f"damaged file -> load returned wrong data instead of raising: {wrong}"


# --------------------------------------------------------------- premise: saving over a committed id
def _overwrites(outcome: Mapping[str, Any], after: str, what: str) -> None:
    """Skip as not measured unless the uninterrupted save over a committed id replaced it.

    ``outcome`` is the harness's record of that save (``overwrite``: replaced, refused with ``error``, died),
    ``after`` what the id then loaded. A refusal leaves ``what`` (the part of the clause that saves over the
    id) not measured; a save that returned without replacing the id fails: it failed silently.
    """
    if outcome["overwrite"] == "refused":
        pytest.skip(
            f"{NOT_MEASURED}the backend refuses to replace a committed checkpoint ({outcome['error']}), "
            f"so {what} is not measured"
        )
    assert outcome["overwrite"] == "replaced", f"the uninterrupted save over a committed id: {outcome}"
    assert after == "new", f"an uninterrupted save over a committed id returned, but the id then loads {after!r}"


def _in_flight(at_kill: list[str]) -> None:
    if "in flight" not in at_kill:
        pytest.skip(f"{NOT_MEASURED}no kill instant fell inside the save over the committed id ({at_kill})")


# --------------------------------------------------------------- killed saves
@pytest.mark.parametrize(
    "mode", [pytest.param("sync", marks=clause("DUR-KILL-1")), pytest.param("async", marks=clause("DUR-KILL-2"))]
)
def test_killed_save_leaves_old_or_new(ckpt_root: Where, mode: str) -> None:
    args = {"root": str(ckpt_root), "mode": mode, "instants": INSTANTS}
    out = faults.run_json("kill-series", args, timeout=KILL_SERIES_TIMEOUT_S)
    assert not out.get("timeout"), "the kill series did not finish"
    calibration = out["calibration"]
    _overwrites(calibration, faults.classify(ckpt_root / "calibration" / "ck", {"old": 1, "new": 2}), "a kill over it")
    bad = {}
    for i, (delay, at_kill) in enumerate(zip(out["delays"], out["at_kill"], strict=True)):
        case = ckpt_root / f"case{i}"
        got = faults.classify(case / "ck", {"old": 1, "new": 2})
        earlier = faults.classify(case / "earlier", {"intact": 0})
        if got not in ("old", "new", "raised") or earlier != "intact":
            bad[f"kill at {delay:.3f}s ({at_kill})"] = {"id": got, "earlier checkpoint": earlier}
    assert not bad, f"save over the id of {calibration['elapsed']:.3f}s killed ({mode}): {bad}"
    _in_flight(out["at_kill"])


@pytest.mark.multirank
@clause("DUR-KILL-3")
def test_killed_two_rank_save_leaves_old_or_new(ckpt_root: Where, tmp_path: Path) -> None:
    from conformance import durability_programs
    from simulator.launcher import launch

    args = {"root": str(ckpt_root), "control": str(tmp_path / "stamps"), "instants": INSTANTS}
    out = faults.run_json("kill-series-ranks", args, timeout=400.0)
    assert not out.get("timeout"), "the 2-rank kill series did not finish"
    calibration = str(ckpt_root / "calibration")
    cases = [str(ckpt_root / f"case{i}") for i in range(len(out["delays"]))]
    if out["calibration"]["overwrite"] != "replaced":  # nothing was killed: skip (refused) or fail (died)
        _overwrites(out["calibration"], "not loaded", "a kill over it")
    per_rank = launch(durability_programs.classify_cases, 2, args=([calibration, *cases],), timeout=180.0)
    for seen in per_rank:
        _overwrites(out["calibration"], seen[calibration]["id"], "a kill over it")
    bad = {}
    for rank, seen in enumerate(per_rank):
        for case, delay, at_kill in zip(cases, out["delays"], out["at_kill"], strict=True):
            got = seen[case]
            if got["id"] not in ("old", "new", "raised") or got["earlier"] != "intact":
                bad[f"rank {rank}, kill at {delay:.3f}s ({at_kill})"] = got
    assert not bad, f"2-rank save over the id killed: {bad}"
    _in_flight(out["at_kill"])


# --------------------------------------------------------------- failing storage
@clause("DUR-DISKFULL-1")
@pytest.mark.parametrize("mode", ["sync", "async"])
@local_only(
    "a full disk is made with RLIMIT_FSIZE, a limit on the size of local files; an upload to a store is HTTP "
    "requests, which the limit does not bound"
)
def test_disk_full_fails_cleanly(tmp_path: Path, mode: str) -> None:
    limits = FSIZE_LIMITS if mode == "sync" else FSIZE_LIMITS[::3]  # async: every file, then the tensors only
    out = faults.run_json("fsize", {"root": str(tmp_path), "limits": list(limits), "mode": mode})
    assert not out.get("timeout"), "a save under a file-size limit hung"
    bad = {}
    for limit, got in out["limits"].items():
        case = tmp_path / f"limit{limit}"
        problems = [
            "raised nothing" if not got["error"] else "",
            "the save over the committed checkpoint raised nothing" if not got["over_error"] else "",
            "the committed checkpoint changed" if faults.classify(case / "ck", {"old": 1}) != "old" else "",
            "a checkpoint was committed" if faults.classify(case / "fresh", {"new": 2}) != "raised" else "",
            f"the next save failed: {got['next_error']}" if got["next_error"] else "",
            "the next save does not load back" if faults.classify(case / "next", {"next": 3}) != "next" else "",
        ]
        if any(problems):
            bad[f"RLIMIT_FSIZE={limit}"] = [p for p in problems if p]
    assert not bad, f"{mode} saves on a full disk: {bad}"
    _overwrites(out["overwrite"], out["overwrite"]["after"], "a full disk during a save over a committed id")


# --------------------------------------------------------------- the next save after a failed write
# Two ways an async write fails on the value alone: its format refuses it, or it does not pickle.
FAILING_VALUES: dict[str, Callable[[], Any]] = {
    "refused-by-format": lambda: "not bytes",
    "not-picklable": lambda: threading.Lock(),
}


@clause("DUR-NEXT-1")
@pytest.mark.parametrize("failure", sorted(FAILING_VALUES))
def test_same_manager_saves_after_a_failed_write(
    manager_factory: Callable[..., Any], ckpt_root: Where, failure: str
) -> None:
    """ "A failed async write fails its own Future ... the next save works": on the same manager, not only on a
    new one (DUR-DISKFULL-1), and its close() does not raise an error that belonged to an earlier save."""
    m = manager_factory(
        {"blob": spec(requires_copy=False, layout=layout("blob_{rank}.bin", "RawSerialization"))}, mode="async"
    )
    with pytest.raises(Exception):
        save(m, ckpt_root / "bad", {"blob": FAILING_VALUES[failure]()})
    for n in range(2):
        error = raised_by(save, m, ckpt_root / f"next{n}", {"blob": b"good %d" % n})
        assert error is None, f"save #{n + 1} of the same manager after the failed one raised {error!r}"
        assert m.load(str(ckpt_root / f"next{n}"), into={"blob": None})["blob"] == b"good %d" % n
    m.close()


# --------------------------------------------------------------- one rank fails
@pytest.mark.multirank
@clause("DUR-RANK-1")
def test_one_rank_raising_fails_every_rank(ckpt_root: Where) -> None:
    from conformance import durability_programs
    from simulator.launcher import launch

    results = launch(durability_programs.one_rank_raises, 2, args=(str(ckpt_root),), timeout=120.0)
    limit = durability_programs.RANK_TIMEOUT_S + 10
    slow_or_silent = [r for r in results if r["error"] is None or r["elapsed"] > limit or r["over_error"] is None]
    assert not slow_or_silent, f"ranks whose failing saves did not both raise (within {limit}s): {slow_or_silent}"
    changed = [r for r in results if r["after"] != "old" or r["fresh"] != "raised"]
    assert not changed, f"after the failed save: the earlier id changed or the failed one was committed: {changed}"
    for r in results:
        _overwrites(r["overwrite"], r["overwrite"]["after"], f"a failing save over a committed id (rank {r['rank']})")


# --------------------------------------------------------------- corruption after commit
@clause("INTEG-FLIP-1")
@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_bit_flip_is_detected(committed: Where, ckpt_root: Where, where: float) -> None:
    _right_or_raises(committed, ckpt_root, lambda p, _rel: faults.flip_byte(p, where))


@clause("INTEG-TRUNC-1")
def test_truncation_is_detected(committed: Where, ckpt_root: Where) -> None:
    _right_or_raises(committed, ckpt_root, lambda p, _rel: faults.truncate(p))


@clause("INTEG-DELETE-1")
def test_deleted_file_is_detected(committed: Where, ckpt_root: Where) -> None:
    _right_or_raises(committed, ckpt_root, lambda p, _rel: remove(p))


@clause("INTEG-SYMLINK-1")
@local_only("symbolic links are a filesystem's; an object store has none")
def test_symlink_to_other_data_is_refused(committed: Where, tmp_path: Path) -> None:
    other = tmp_path / "other"
    _commit(other, 2)
    # Each file points at the same file of another, valid checkpoint: returning its data is wrong data.
    _right_or_raises(committed, tmp_path, lambda p, rel: faults.replace_with_symlink(p, other / rel))


@clause("INTEG-FIFO-1")
@local_only("a FIFO is a filesystem's special file; an object store has none")
def test_fifo_in_place_of_a_file_raises_without_hanging(committed: Where, tmp_path: Path) -> None:
    paths = {rel: str(dst) for rel, dst in _each_file(committed, tmp_path, lambda p, _rel: faults.replace_with_fifo(p))}
    out = faults.run_json("load-many", {"paths": paths, "timeout_s": 20.0}, timeout=120.0)
    assert not out.get("timeout"), "the loading process did not finish"
    bad = {rel: got for rel, got in out["results"].items() if got not in ("old", "raised")}  # "old" = the saved data
    assert not bad, f"FIFO in place of a file: {bad}"


# --------------------------------------------------------------- crafted checkpoints
class _Exploit:
    """Unpickling it creates the directory named by ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


@clause("SAFE-PICKLE-1")
@pytest.mark.parametrize("container", ["pickle", "torch"])
def test_pickles_in_a_checkpoint_are_not_executed(
    committed: Where, ckpt_root: Where, tmp_path: Path, container: str
) -> None:
    marker = tmp_path / "executed"  # on the local disk: the exploit runs in the loading (this) process

    def plant(p: Where, _rel: str) -> None:
        if container == "torch":
            torch_save({"w": _Exploit(str(marker))}, p)
        else:
            write_bytes(p, pickle.dumps(_Exploit(str(marker))))

    ran = []
    for rel, dst in _each_file(committed, ckpt_root, plant):
        faults.classify(dst, {"right": 1})  # raising or not is INTEG-*'s business; executing is this clause's
        if marker.exists():
            ran.append(rel)
            marker.rmdir()
    assert not ran, f"loading executed a pickle planted in place of: {ran}"


def _json_files(root: Where) -> list[str]:
    out = []
    for rel in sorted(files(root)):
        try:
            json.loads(read_text(root / rel))
            out.append(rel)
        except (ValueError, UnicodeDecodeError):
            continue
    return out


@clause("SAFE-JSON-1")
@pytest.mark.parametrize("kind", ["malformed", "deep", "huge"])
def test_malformed_json_is_refused(committed: Where, ckpt_root: Where, kind: str) -> None:
    # None of them decodes to the saved data: the load must raise (and not crash, hang or exhaust memory).
    text = {
        "malformed": '{"a": [1, 2',
        "deep": "[" * 200_000 + "]" * 200_000,
        "huge": '{"a": [' + "0," * 2_000_000 + "0]",
    }[kind]
    targets = set(_json_files(committed))
    _right_or_raises(committed, ckpt_root, lambda p, rel: write_bytes(p, text.encode()) if rel in targets else None)


def _rewrite_strings(p: Where, change: Callable[[str], str]) -> None:
    def walk(v: Any) -> Any:
        if isinstance(v, str):
            return change(v)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    write_bytes(p, json.dumps(walk(json.loads(read_text(p)))).encode())


@clause("SAFE-PATH-1")
def test_paths_escaping_the_checkpoint_are_refused(committed: Where, ckpt_root: Where) -> None:
    outside = ckpt_root / "outside"
    _commit(outside, 2)
    names = files(committed)
    targets = set(_json_files(committed))

    rewritten: list[str] = []

    def to_outside(s: str) -> str:
        if s in names or Path(s).name in names:
            rewritten.append(s)
            return f"../outside/{s}"
        return s

    def escape(p: Where, rel: str) -> None:
        if rel in targets:
            _rewrite_strings(p, to_outside)

    returned_outside = {}
    for rel, dst in _each_file(committed, ckpt_root, escape):
        got = faults.classify(dst, {"right": 1, "outside": 2})
        if got in ("outside", "WRONG"):  # WRONG: part of it may come from outside
            returned_outside[rel] = got
    assert not returned_outside, f"escaping paths in these files made load() read outside: {returned_outside}"
    if not rewritten:  # nothing to craft: the backend's files name no paths in JSON
        pytest.skip("not measured: no JSON file of the checkpoint names a file of it")


@clause("SAFE-IMPORT-1")
def test_names_in_metadata_are_never_imported(
    committed: Where, ckpt_root: Where, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "canary"
    monkeypatch.setenv("CONFORMANCE_CANARY_FILE", str(marker))
    targets = set(_json_files(committed))

    def plant(p: Where, rel: str) -> None:
        if rel in targets:
            _rewrite_strings(p, lambda s: "conformance.canary.Canary" if not s.endswith((".pt", ".json")) else s)

    for _rel, dst in _each_file(committed, ckpt_root, plant):
        faults.classify(dst, {"right": 1})  # raising or not is INTEG-*'s business; importing is this clause's
    assert "conformance.canary" not in sys.modules and not marker.exists(), "a name read from metadata was imported"


# --------------------------------------------------------------- concurrent overwrite
@clause("DUR-CONC-1")
def test_load_during_overwrite_is_one_whole_checkpoint(ckpt_root: Where, tmp_path: Path) -> None:
    ck, stop = ckpt_root / "ck", tmp_path / "stop"  # the id on the storage under test; the suite's signals locally
    _commit(ck, 1)
    result: dict[str, Any] = {}
    saver = threading.Thread(
        target=lambda: result.update(
            faults.run_json("overwrite-loop", {"path": str(ck), "stop": str(stop), "max_s": 60.0})
        )
    )
    saver.start()
    try:
        loads = faults.run_json("load-loop", {"path": str(ck), "started": str(tmp_path / "saving"), "window_s": 8.0})
    except RuntimeError as exc:  # the loading process died (e.g. SIGBUS on a file rewritten under it)
        loads = {"seen": {"CRASHED": str(exc)[:300]}}
    finally:
        stop.touch()
        saver.join(90.0)
    seen = loads.get("seen", {})
    assert not {"WRONG", "CRASHED"} & set(seen), f"loads during overwrites returned a mix or crashed: {seen}"
    if result.get("refused") and result.get("saves", 0) < 2:
        _overwrites({"overwrite": "refused", "error": result["refused"]}, "", "a load during an overwrite")
    assert result.get("saves", 0) >= 2, f"the overwriting process did not save twice: {result}"
    _overwrites({"overwrite": "replaced"}, result["first"], "a load during an overwrite")


# --------------------------------------------------------------- foreign ids
def _snapshot(root: Where) -> dict[str, bytes]:
    return {rel: read_bytes(root / rel) for rel in files(root)}


def _saves(m: Any, control: Where) -> None:
    """Skip as not measured unless ``m`` saves to a fresh id: one that raises on every save "refuses" anything."""
    error = faults.save_error(m, control, faults.payload(1))
    if error:
        pytest.skip(f"{NOT_MEASURED}a save to a fresh id raised too ({error}), so a refusal shows nothing")


@clause("SAFE-ID-1")
def test_save_over_an_unrelated_directory_is_refused(ckpt_root: Where) -> None:
    user = ckpt_root / "photos"  # on an object store: a prefix holding the user's objects
    write_bytes(user / "2024" / "beach.jpg", b"\xff\xd8 not a checkpoint")
    write_bytes(user / "notes.txt", b"keep me\n")
    before = _snapshot(user)
    m = faults.manager("sync")
    try:
        _saves(m, ckpt_root / "control")
        with pytest.raises(Exception):
            save(m, user, faults.payload(1))
    finally:
        m.close()
    assert _snapshot(user) == before, "saving touched an unrelated directory"


@clause("SAFE-ID-2")
@local_only(
    "a file in the way of the id is a filesystem's conflict; on an object store an object named like the id and "
    "objects under the id's prefix coexist, so nothing is in the way"
)
def test_save_over_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "report.txt"
    target.write_text("not a checkpoint\n")
    m = faults.manager("sync")
    try:
        _saves(m, tmp_path / "control")
        with pytest.raises(Exception):
            save(m, target, faults.payload(1))
    finally:
        m.close()
    assert target.is_file() and target.read_text() == "not a checkpoint\n", "saving touched an unrelated file"
