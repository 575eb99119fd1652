"""Async lifecycle defects found in round 15, each with the test that failed before its fix.

* A stopped (SIGSTOP) or hung writer process refused every later save until close(): the save after it waited
  `wait_timeout_secs` and raised "refusing to start another", and so did every save after that, because
  nothing ended the writer (wait() kills it on the same timeout; the next save did not).
* `CheckpointProcessConfig` accepted writer timeouts past the longest wait a pipe's poll() takes (about 24.8
  days): close() then raised a bare OverflowError and left the writer running, and every save failed with
  "the writer failed to start ... guard your entry point", which was not the fix.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.probes import stop
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, CheckpointProcessConfig
from torch_checkpointing.errors import CheckpointError, ConfigError


def test_a_stopped_writer_is_killed_by_the_next_saves_timeout_and_the_save_after_works(tmp_path: Path) -> None:
    config = CheckpointManager.Config(save=AsyncCheckpointSaverConfig(wait_timeout_secs=3))
    with CheckpointManager(config) as manager:
        first = manager.save(str(tmp_path / "a"), {"m": {"w": torch.ones(4)}})
        assert first is not None
        first.result(timeout=120)
        pid = manager.writer_pid
        assert pid is not None
        stop(pid)
        try:
            stuck = manager.save(str(tmp_path / "b"), {"m": {"w": torch.full((4,), 2.0)}})
            with pytest.raises(CheckpointError, match=r"killed"):
                manager.save(str(tmp_path / "c"), {"m": {"w": torch.full((4,), 3.0)}})
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert stuck is not None and stuck.exception(timeout=60) is not None  # it resolves: not committed
        again = manager.save(str(tmp_path / "c"), {"m": {"w": torch.full((4,), 3.0)}})  # a new writer
        assert again is not None
        again.result(timeout=120)
        assert torch.equal(manager.load(str(tmp_path / "c"))["m"]["w"], torch.full((4,), 3.0))
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("field", ["subprocess_init_timeout_secs", "subprocess_shutdown_timeout_secs"])
@pytest.mark.parametrize("value", [3e6, 1e308])
def test_a_writer_timeout_no_os_wait_takes_is_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        CheckpointProcessConfig(**{field: value})


def test_a_writer_timeout_of_three_weeks_is_taken() -> None:
    config = CheckpointProcessConfig(subprocess_init_timeout_secs=21 * 86400, subprocess_shutdown_timeout_secs=1800)
    assert config.subprocess_init_timeout_secs == 21 * 86400


# ------------------------------------------------------------------------------ a tensor whose storage was freed

FREED_CHILD = """
import sys, warnings
import torch
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
mode, fmt, path = sys.argv[1], sys.argv[2], sys.argv[3]
freed = torch.ones(100)
freed.untyped_storage().resize_(0)  # what FSDP does to an unsharded parameter
config = CheckpointManager.Config.with_sync_save() if mode == "sync" else CheckpointManager.Config.with_async_save()
spec = {"requires_copy": mode != "async-no-copy"}
if fmt == "safetensors":
    spec["layout"] = LayoutInfo("m.safetensors", SafetensorsSerialization())
config.items = {"m": ItemSpec(**spec)}
with CheckpointManager(config) as manager:
    if mode == "load":
        manager.save(path, {"m": {"w": torch.ones(100)}})
        template = torch.ones(100)
        template.untyped_storage().resize_(0)
        try:
            manager.load(path, into={"m": {"w": template}})
        except Exception as exc:
            print("REFUSED", type(exc).__name__, exc)
        sys.exit(0)
    try:
        future = manager.save(path, {"m": {"w": freed}})
        if future is not None:
            future.result(timeout=120)
    except Exception as exc:
        print("REFUSED", type(exc).__name__, exc)
"""


@pytest.mark.parametrize(
    ("mode", "fmt"),
    [("sync", "torch"), ("sync", "safetensors"), ("async", "torch"), ("async-no-copy", "torch"), ("load", "torch")],
)
def test_a_tensor_whose_storage_was_freed_is_refused_naming_it_and_the_process_lives(
    tmp_path: Path, mode: str, fmt: str
) -> None:
    """Before: the process died of SIGSEGV inside torch's copy (the sync writer's, or the staging copy's)."""
    proc = subprocess.run(
        [sys.executable, "-c", FREED_CHILD, mode, fmt, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    said = proc.stdout
    assert "REFUSED" in said and "freed" in said and ("m::w" in said or "m.w" in said or "'m'" in said), said
    if mode != "load":
        assert not (tmp_path / "ck").exists()


# ------------------------------------------------------------------- a new staging slab after a layout change


def _slab_inodes(pid: int | None) -> set[str]:
    """The staging slabs `pid` maps, by inode: a count also saw other managers' slabs, which a test worker's
    earlier tests release on a daemon thread, so it changed under the test."""
    if pid is None:
        return set()
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[4] for line in maps if "torch_checkpointing-staging" in line}


def test_a_new_layouts_slab_is_allocated_once_neither_process_maps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the trainer (the staging worker still held the last job, and with it the staged tree) and the
    writer (until it got the new slab) both mapped the old slab while the new one was allocated, so a state
    whose layout changed needed room for both: in a staging directory with room for one it failed with ENOSPC
    on that save and on every later one, and in memory the peak was both slabs."""
    from torch_checkpointing import staging

    made: list[set[str]] = []  # the inode of each slab allocated
    still_mapped: list[tuple[set[str], set[str]]] = []  # (trainer, writer): earlier slabs mapped at each allocation
    real = staging.SharedSlab.allocate.__func__  # type: ignore[attr-defined]
    with CheckpointManager(CheckpointManager.Config(save=AsyncCheckpointSaverConfig())) as manager:

        def allocate(cls: Any, nbytes: int, directory: str | None) -> Any:
            earlier = set().union(*made)
            still_mapped.append((_slab_inodes(os.getpid()) & earlier, _slab_inodes(manager.writer_pid) & earlier))
            before = _slab_inodes(os.getpid())
            slab = real(cls, nbytes, directory)
            made.append(_slab_inodes(os.getpid()) - before)
            return slab

        monkeypatch.setattr(staging.SharedSlab, "allocate", classmethod(allocate))
        for n in (4096, 4096, 1024):  # the third save changes the layout
            future = manager.save(str(tmp_path / "ck"), {"m": {"w": torch.full((n,), float(n))}})
            assert future is not None
            future.result(timeout=120)
        assert torch.equal(manager.load(str(tmp_path / "ck"))["m"]["w"], torch.full((1024,), 1024.0))
    assert len(made) == 2 and all(len(inodes) == 1 for inodes in made), made  # one slab per layout
    assert still_mapped == [(set(), set()), (set(), set())], (made, still_mapped)  # the old one is gone from both


def test_a_writer_killed_while_it_starts_is_said_to_be_killed(tmp_path: Path) -> None:
    """Before: "failed to start: EOFError ... guard your script's entry point", which was not the fix."""
    import time

    with CheckpointManager(CheckpointManager.Config(save=AsyncCheckpointSaverConfig())) as manager:
        process = manager._saver.process  # type: ignore[attr-defined]  # this manager's writer, not a neighbour's
        deadline = time.monotonic() + 60
        while process._starting is None and time.monotonic() < deadline:
            time.sleep(0.005)
        starting = process._starting
        assert starting is not None and manager.writer_pid is None  # still importing torch: not ready yet
        os.kill(starting.pid, signal.SIGKILL)
        first = manager.save(str(tmp_path / "a"), {"m": {"w": torch.ones(4)}})
        assert first is not None
        error = first.exception(timeout=120)
        assert isinstance(error, CheckpointError) and "killed by SIGKILL while it started" in str(error), error
        assert "__main__" not in str(error)
        again = manager.save(str(tmp_path / "a"), {"m": {"w": torch.ones(4)}})  # a new writer
        assert again is not None
        again.result(timeout=120)
