"""Two real gloo ranks where only one rank's save goes wrong before its writer process gets it (round 8).

A value that cannot travel to the writer process (a `requires_copy=False` value that does not pickle, or a
deep-copied one that does not) fails on the trainer's side of that rank only. Before, that rank's Future failed at
once while every other rank's writer waited `wait_timeout_secs` for it and then called it silent ("did not
report"), and the ranks then fell out of step: the next save of every rank failed too ("lost contact"). Now the
failing rank answers the save's agreement with its failure, so every rank raises the same `CommitError` at once,
naming that rank and its reason, nothing is committed, and the next save works on every rank.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from tests.memory_storage import Control, RecordingStorageConfig
from tests.rank_outcomes import record_outcome
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank
WORLD = 2
WAIT_S = 20


class _NoPickle:
    """Deep-copies (a staging copy takes it) but refuses to pickle (so it can never reach the writer)."""

    def __reduce__(self) -> Any:
        raise TypeError("_NoPickle refuses to be pickled")

    def __deepcopy__(self, memo: dict[int, Any]) -> _NoPickle:
        return _NoPickle()


def bad_value_on_one_rank(root: str, bad_rank: int, item: str) -> dict[str, Any]:
    """Every rank saves; on `bad_rank` only, `item` holds a value that cannot reach the writer process."""
    rank = dist.get_rank()
    config = CheckpointManager.Config(
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        items={"frozen": ItemSpec(requires_copy=False), "copied": ItemSpec(requires_copy=True)},
    )
    config.save.wait_timeout_secs = WAIT_S
    manager = CheckpointManager(config)
    out: dict[str, Any] = {"rank": rank}

    def state(value: float, bad: bool) -> dict[str, Any]:
        payload: dict[str, Any] = {"model": {"w": torch.full((4,), value)}, "frozen": 1, "copied": 1}
        if bad:
            payload[item] = _NoPickle()
        return payload

    manager.save(f"{root}/first", state(1.0, False)).result(WAIT_S * 3)
    started = time.monotonic()
    record_outcome(out, "bad", lambda: manager.save(f"{root}/bad", state(2.0, rank == bad_rank)).result(WAIT_S * 3))
    out["bad_s"] = time.monotonic() - started
    dist.barrier()
    out["bad_exists"] = Path(root, "bad").exists()
    out["leftovers"] = sorted(p.name for p in Path(root).iterdir() if p.name not in ("first", "bad"))
    try:
        manager.save(f"{root}/after", state(3.0, False)).result(WAIT_S * 3)
        into = {"model": {"w": torch.zeros(4)}, "frozen": None, "copied": None}
        out["after"] = float(manager.load(f"{root}/after", into)["model"]["w"][0])
        into = {"model": {"w": torch.zeros(4)}, "frozen": None, "copied": None}
        out["first"] = float(manager.load(f"{root}/first", into)["model"]["w"][0])
    except BaseException as exc:
        out["after"] = f"{type(exc).__name__}: {exc}"
    manager.close()
    return out


def fail_first_start(marker: str | None) -> None:
    """The writer's `subprocess_init_fn`: fails the first start where a marker path is given, then works."""
    if marker is not None and not os.path.exists(marker):
        Path(marker).touch()
        raise RuntimeError("subprocess_init_fn failed on purpose")


def writer_fails_to_start_on_rank_1(root: str) -> dict[str, Any]:
    """Rank 1's writer process fails its first start; every rank saves once, then again."""
    rank = dist.get_rank()
    config = CheckpointManager.Config(
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        subprocess_init_fn=fail_first_start,
        subprocess_init_args=(f"{root}/.marker" if rank == 1 else None,),
    )
    config.save.wait_timeout_secs = WAIT_S
    manager = CheckpointManager(config)
    out: dict[str, Any] = {"rank": rank}
    started = time.monotonic()
    record_outcome(
        out, "first", lambda: manager.save(f"{root}/first", {"model": {"w": torch.full((4,), 1.0)}}).result(WAIT_S * 3)
    )
    out["first_s"] = time.monotonic() - started
    out["first_at"] = time.monotonic()  # CLOCK_MONOTONIC is one clock for every process on this machine
    dist.barrier()
    out["first_exists"] = Path(root, "first").exists()
    try:
        manager.save(f"{root}/after", {"model": {"w": torch.full((4,), 3.0)}}).result(WAIT_S * 3)
        out["after"] = float(manager.load(f"{root}/after", {"model": {"w": torch.zeros(4)}})["model"]["w"][0])
    except BaseException as exc:
        out["after"] = f"{type(exc).__name__}: {exc}"
    manager.close()
    return out


def test_a_writer_that_fails_to_start_on_one_rank_fails_every_rank_at_once(
    every_case: list[dict[str, dict[str, Any]]],
) -> None:
    results = [per_rank["fails_to_start"] for per_rank in every_case]
    for r in results:
        assert r["first"].startswith("CommitError:") and "failed to start" in r["first"], r
        assert r["failures"] == [1], r
        assert not r["first_exists"], r
        assert r["after"] == 3.0, r
    # Before, rank 0 raised WAIT_S after rank 1 did. Compared with each other, not with the start: both ranks'
    # writers import torch first, which on 2 busy cores under coverage took most of WAIT_S / 2 by itself.
    spread = max(r["first_at"] for r in results) - min(r["first_at"] for r in results)
    assert spread < WAIT_S / 2, results


def writer_killed_on_rank_1(root: str, control_dir: str) -> dict[str, Any]:
    """Rank 1's writer is SIGKILLed (the OOM killer) while it writes its file; then every rank saves again."""
    rank = dist.get_rank()
    control = Control(control_dir)
    config = CheckpointManager.Config(storage_config=RecordingStorageConfig(control_dir=control_dir))
    config.save.wait_timeout_secs = WAIT_S
    manager = CheckpointManager(config)
    out: dict[str, Any] = {"rank": rank}
    manager.save(f"{root}/first", {"model": {"w": torch.full((4,), 1.0)}}).result(WAIT_S * 3)
    if rank == 1:
        control.block("model_1.pt")
    dist.barrier()
    started = time.monotonic()
    future = manager.save(f"{root}/killed", {"model": {"w": torch.full((4,), 2.0)}})
    if rank == 1:
        os.kill(control.wait_blocked(WAIT_S), signal.SIGKILL)
    record_outcome(out, "killed", lambda: future.result(WAIT_S * 3))
    out["killed_s"] = time.monotonic() - started
    dist.barrier()
    control.reset()
    out["killed_exists"] = Path(root, "killed").exists()
    out["leftovers"] = sorted(p.name for p in Path(root).iterdir() if p.name not in ("first", "control"))
    try:
        manager.save(f"{root}/after", {"model": {"w": torch.full((4,), 3.0)}}).result(WAIT_S * 3)
        out["after"] = float(manager.load(f"{root}/after", {"model": {"w": torch.zeros(4)}})["model"]["w"][0])
        out["first"] = float(manager.load(f"{root}/first", {"model": {"w": torch.zeros(4)}})["model"]["w"][0])
    except BaseException as exc:
        out["after"] = f"{type(exc).__name__}: {exc}"
    manager.close()
    return out


def test_a_writer_killed_on_one_rank_fails_every_rank_at_once(every_case: list[dict[str, dict[str, Any]]]) -> None:
    results = [per_rank["killed"] for per_rank in every_case]
    for r in results:
        assert r["killed"].startswith("CommitError:") and "died" in r["killed"] and "exit code -9" in r["killed"], r
        assert r["failures"] == [1], r
        assert r["killed_s"] < WAIT_S, r  # before: rank 0 waited WAIT_S (at least) for rank 1's dead writer
        assert not r["killed_exists"], r
        assert r["leftovers"] == ["after"] or r["leftovers"] == [], r
        assert r["after"] == 3.0 and r["first"] == 1.0, r


BAD_VALUES = {"rank1-frozen": (1, "frozen"), "rank0-frozen": (0, "frozen"), "rank1-copied": (1, "copied")}


def every_case_one_after_another(root: str) -> dict[str, dict[str, Any]]:
    """The cases of this file in one launch (ranks are seconds each to start), each in a directory of its own
    with a manager of its own, its result under its own name."""
    out = {"fails_to_start": writer_fails_to_start_on_rank_1(f"{root}/fails_to_start")}
    out["killed"] = writer_killed_on_rank_1(f"{root}/killed", f"{root}/control")
    return out | {name: bad_value_on_one_rank(f"{root}/{name}", *case) for name, case in BAD_VALUES.items()}


@pytest.fixture(scope="module")
def every_case(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("round8")
    for name in ("fails_to_start", "killed", *BAD_VALUES):
        (root / name).mkdir()
    return launch(every_case_one_after_another, WORLD, args=(str(root),), timeout=600)


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_value_that_cannot_reach_one_ranks_writer_fails_every_rank_at_once(
    case: str, every_case: list[dict[str, dict[str, Any]]]
) -> None:
    bad_rank, item = BAD_VALUES[case]
    results = [per_rank[case] for per_rank in every_case]
    for r in results:
        assert r["bad"].startswith("CommitError:"), r
        assert f"'{item}'" in r["bad"] and "pickle" in r["bad"], r  # the failing rank's own reason, on every rank
        assert r["failures"] == [bad_rank], r
        assert r["bad_s"] < WAIT_S, r  # before: the good rank waited WAIT_S (at least) for the bad one
        assert not r["bad_exists"], r
        assert r["leftovers"] == [], r  # the good rank's files in the temporary directory are discarded too
        assert r["after"] == 3.0, r  # before: 'lost contact' on every rank
        assert r["first"] == 1.0, r
