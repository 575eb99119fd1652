"""Ctrl-C (a real SIGINT) on one rank while its async save stages its state (two real gloo ranks, one launch;
round 24).

The ranks agree on the plan, then each rank's saver stages its tensors before handing the save to its writer
process. A staging failure was already answered for the rank's writer (`_refused`): every rank raised the same
`CommitError` naming it, at once. A Ctrl-C there is no `Exception`, so it was not: rank 1 raised its
KeyboardInterrupt, its writer never heard of the save, and rank 0's writer waited the save's whole timeout,
then said rank 1 "did not report". Now rank 1 answers for its writer before its KeyboardInterrupt goes on: rank
0 raises at once the `CommitError` naming rank 1 and the interrupt, nothing is committed, and the next save
goes on as usual on both ranks.

The same launch interrupts a sync save on rank 1 while it writes its files (round 25): rank 0 read rank 1's
reason as "KeyboardInterrupt: ." (Ctrl-C's exception has no message); it now says that rank 1 was interrupted.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.async_multirank_support import launch_job, loaded, local_async_manager, state, timed
from tests.memory_storage import Control, RecordingStorageConfig
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank
TIMEOUT_S = 30  # save.wait_timeout_secs: the old code made rank 0 wait this long
FAST_S = TIMEOUT_S / 2


def _interrupt_staging(manager: CheckpointManager) -> None:
    """This rank's next staging copy is interrupted by a real SIGINT (Python's default handler: Ctrl-C)."""
    stager = manager._saver.stager  # type: ignore[union-attr]
    stage = stager.stage

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        stager.stage = stage  # once
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler raises in here
        return stage(*args, **kwargs)

    stager.stage = interrupted


def _save(manager: CheckpointManager, path: str, value: dict[str, Any]) -> dict[str, Any]:
    """The save, its Future waited for: "ok" or `Type: message` (a KeyboardInterrupt too), and how long."""
    return _result_of(lambda: manager.save(path, value).result(120))


def _result_of(call: Callable[[], Any]) -> dict[str, Any]:
    """`call()`: "ok" or its failure as `Type: message` (a KeyboardInterrupt too), and how long it took."""
    out: dict[str, Any] = {}
    started = time.monotonic()
    try:
        call()
        out["result"] = "ok"
    except BaseException as exc:
        out["result"] = f"{type(exc).__name__}: {exc}"
    out["elapsed"] = time.monotonic() - started
    return out


def _job(root: str, control: str) -> dict[str, Any]:
    out = interrupted_save_job(_interrupt_staging, root)
    out["sync"] = _interrupted_sync_save(Path(root).parent / "sync")
    out["sync_waiting"] = _sync_save_left_while_waiting(Path(root).parent / "sync_waiting")
    out["sync_commit"] = _sync_save_left_during_the_commit(Path(root).parent / "sync_commit", Control(control))
    return out


def _sync_save_left_during_the_commit(root: Path, control: Control) -> dict[str, Any]:
    """A sync save that rank 1 leaves (a real SIGINT) while rank 0's writing of the manifest is held, the files
    agreed on by every rank; rank 0's manifest goes on once rank 1's save() has raised (round 25)."""
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = RecordingStorageConfig(control_dir=str(control.root))
    config.save.wait_timeout_secs = TIMEOUT_S
    manager = CheckpointManager(config)
    if dist.get_rank() == 0:
        control.block("manifest")
    dist.barrier()
    if dist.get_rank() == 1:
        threading.Thread(target=lambda: (control.wait_blocked(FAST_S), os.kill(os.getpid(), signal.SIGINT))).start()
    out = _result_of(lambda: manager.save(str(root / "ck"), state(1, dist.get_rank())))
    if dist.get_rank() == 1:
        (control.root / "block_on").unlink()  # rank 0's manifest goes on
    dist.barrier()
    out["loaded"] = loaded(manager, str(root / "ck"))
    manager.close()
    return out


def _interrupt_now(_checkpoint_dir: str, _: Any) -> None:
    """A pre_finalize_callback that is interrupted by a real SIGINT (Python's default handler: Ctrl-C)."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # the handler raises in here


def _sync_save_left_while_waiting(root: Path) -> dict[str, Any]:
    """A sync save that rank 1 leaves (a real SIGINT, half a second after its files are written) while it waits
    for rank 0's answer; rank 0 answers only once rank 1's save() has raised (round 25)."""
    left = root / "rank_1_left"

    def interrupt_soon(_dir: str, _: Any) -> None:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()

    return _sync_save(root, interrupt_soon if dist.get_rank() == 1 else lambda _dir, _: _wait_for(left), left)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + FAST_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _interrupted_sync_save(root: Path) -> dict[str, Any]:
    """A sync save whose writing of the files is interrupted on rank 1 (round 25)."""
    return _sync_save(root, _interrupt_now if dist.get_rank() == 1 else None)


def _sync_save(root: Path, callback: Callable[[str, Any], None] | None, done: Path | None = None) -> dict[str, Any]:
    """A sync save of `root/ck` with this rank's pre_finalize_callback: its result, how long it took, and what is
    left under `root` on every rank. Rank 1 touches `done` (if given) once its save() has ended."""
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.save.wait_timeout_secs = TIMEOUT_S
    config.pre_finalize_callback = callback
    manager = CheckpointManager(config)
    out = _result_of(lambda: manager.save(str(root / "ck"), state(1, dist.get_rank())))
    if done is not None and dist.get_rank() == 1:
        done.touch()
    manager.close()
    dist.barrier()
    out["left"] = sorted(p.name for p in root.iterdir() if p != done) if root.exists() else []
    return out


def interrupted_save_job(arm: Callable[[CheckpointManager], None], root: str) -> dict[str, Any]:
    """A warm save on both ranks, then one whose save() `arm` interrupts on rank 1, then one more, each result
    under its name: shared by the staging and the hand-over tests."""
    rank = dist.get_rank()
    manager = local_async_manager(TIMEOUT_S)
    out: dict[str, Any] = {"warm": timed(lambda: manager.save(f"{root}/warm", state(0, rank)).result(120))["result"]}
    if rank == 1:
        arm(manager)
    out["interrupted"] = _save(manager, f"{root}/interrupted", state(1, rank))
    dist.barrier()
    out["after"] = _save(manager, f"{root}/after", state(2, rank))["result"]
    out["after_loaded"] = loaded(manager, f"{root}/after")
    manager.close()
    out["left"] = sorted(p.name for p in Path(root).iterdir())
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_job(_job, 2, tmp_path_factory.mktemp("interrupted"), timeout=300)


def test_the_other_rank_raises_at_once_naming_the_interrupted_rank(ranks: list[dict[str, Any]]) -> None:
    other = ranks[0]["interrupted"]
    assert other["result"].startswith("CommitError: ") and "rank(s) [1]" in other["result"], ranks
    assert "interrupted" in other["result"] and "KeyboardInterrupt" in other["result"], ranks
    assert other["elapsed"] < FAST_S, ranks  # before: the save's whole timeout, then "did not report"


def test_the_interrupted_rank_raises_its_keyboard_interrupt(ranks: list[dict[str, Any]]) -> None:
    assert ranks[1]["interrupted"]["result"].startswith("KeyboardInterrupt"), ranks


def test_nothing_is_committed_and_the_next_save_goes_on(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        assert out["warm"] == "ok" and out["after"] == "ok", out
        assert out["after_loaded"] == 20.0 + rank, out
        assert out["left"] == ["after", "warm"], out  # no temporary directory, no interrupted checkpoint


def test_a_sync_save_interrupted_on_one_rank_tells_the_others_what_happened(ranks: list[dict[str, Any]]) -> None:
    """Round 25: rank 0 raised "... failed on rank(s) [1]: rank 1: KeyboardInterrupt: . Nothing was committed."
    (the bare exception's empty message): nothing said that rank 1 was interrupted."""
    other, interrupted = ranks[0]["sync"], ranks[1]["sync"]
    assert other["result"].startswith("CommitError: ") and "rank(s) [1]" in other["result"], ranks
    assert "rank 1: KeyboardInterrupt: the rank was interrupted (Ctrl-C" in other["result"], ranks
    assert other["elapsed"] < FAST_S, ranks
    assert interrupted["result"].startswith("KeyboardInterrupt: ") and "interrupted" in interrupted["result"], ranks
    assert other["left"] == interrupted["left"] == [], ranks  # nothing committed, no temporary directory


def test_a_rank_interrupted_while_it_waits_in_a_sync_save_fails_it_on_every_rank_at_once(
    ranks: list[dict[str, Any]],
) -> None:
    """Round 25: rank 1, interrupted while it waited for rank 0's answer (its own files written and reported),
    left without a word: rank 0 committed the save, waited the save's whole timeout for rank 1's answer to the
    commit, and returned "ok", while rank 1 had raised "nothing was committed". Now rank 1 decides the step failed
    as it leaves: rank 0 raises at once, naming rank 1, and nothing is committed."""
    other, interrupted = ranks[0]["sync_waiting"], ranks[1]["sync_waiting"]
    assert other["result"].startswith("CommitError: ") and "rank 1: KeyboardInterrupt: the rank was" in other["result"]
    assert other["elapsed"] < FAST_S, ranks  # before: the whole timeout (30 s), then "ok"
    assert interrupted["result"].startswith("KeyboardInterrupt: ") and "nothing was committed" in interrupted["result"]
    assert other["left"] == interrupted["left"] == [], ranks  # nothing committed, no temporary directory


def test_a_rank_interrupted_once_the_files_are_agreed_does_not_say_nothing_was_committed(
    ranks: list[dict[str, Any]],
) -> None:
    """Round 25: rank 1, interrupted while rank 0 wrote the manifest (every rank's files agreed on), raised
    "nothing was committed at <id>; an earlier checkpoint there, if any, is intact" while rank 0 committed the
    save a moment later. It now says rank 0 commits it without this rank, and to load it to check."""
    committer, interrupted = ranks[0]["sync_commit"], ranks[1]["sync_commit"]
    assert committer["result"] == "ok" and committer["elapsed"] < FAST_S, ranks
    assert interrupted["result"].startswith("KeyboardInterrupt: "), ranks
    assert "nothing was committed" not in interrupted["result"], ranks
    assert "rank 0 commits it without this rank" in interrupted["result"], ranks
    assert committer["loaded"] == 10.0 and interrupted["loaded"] == 11.0, ranks  # it was committed
