"""The writer writes what the staging copy has reached while the copy goes on (`staging_gate.py`).

The first save's copy runs at the speed of first-touch page faults; before this, the writer waited for the
whole copy and only then wrote, so the first save's time to durable was the copy plus the write. These tests
hold one tensor's copy back (a tensor subclass whose copy waits for an Event) and check that the items before
it are written meanwhile, that what is committed is exactly what was staged, and that a copy that fails or a
trainer that dies mid-copy commits nothing and leaves the earlier checkpoint whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.staging_gate import SlabGate, StagingFailed, StagingMarks, _GatedStream

BIG = 12 << 20  # float32 elements: 48 MiB, past the copy's 32 MiB reporting step


class HeldCopy(torch.Tensor):
    """A tensor whose copy into the slab waits until `release` is set (or raises, with `fail`)."""

    release = threading.Event()
    fail = False
    copying = threading.Event()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], HeldCopy):
            cls.copying.set()
            assert cls.release.wait(60), "the test never released the held copy"
            if cls.fail:
                raise RuntimeError("held copy failed on purpose")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture(autouse=True)
def _reset_held() -> Any:
    HeldCopy.release, HeldCopy.copying, HeldCopy.fail = threading.Event(), threading.Event(), False
    yield
    HeldCopy.release.set()


def _manager(async_staging: bool, items: dict[str, Any] | None = None) -> CheckpointManager:
    conf = CheckpointManager.Config.with_async_save()
    conf.save.staging_config.use_async_staging = async_staging
    if items:
        conf.items = items
    return CheckpointManager(conf)


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    first = {"w": torch.randn(BIG, generator=gen), "b": torch.randn(7, generator=gen)}
    held = torch.randn(1000, generator=gen).as_subclass(HeldCopy)
    return {"a": first, "z": {"held": held, "after": torch.randn(5, generator=gen)}}


def _templates(state: dict[str, Any]) -> dict[str, Any]:
    return {k: {n: torch.zeros(t.shape) for n, t in v.items()} for k, v in state.items()}


def _files_under(parent: Path, name: str) -> list[Path]:
    return [p for p in parent.rglob(name) if ".tmp-" in str(p)]


def _wait_for(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _written_while_held(manager: CheckpointManager, tmp_path: Path, state: dict[str, Any], a_file: str) -> None:
    """Save in a thread (an inline copy holds save() itself), and see item a's file complete meanwhile."""
    outcome: list[Any] = []
    saver = threading.Thread(target=lambda: outcome.append(manager.save(str(tmp_path / "ck"), state)))
    saver.start()
    assert HeldCopy.copying.wait(60)
    size = state["a"]["w"].numel() * 4
    written = _wait_for(lambda: any(p.stat().st_size >= size for p in _files_under(tmp_path, a_file)), 30)
    HeldCopy.release.set()
    saver.join(60)
    outcome[0].result(120)
    assert written, "item a was not written while the copy of item z was still running"


@pytest.mark.parametrize("async_staging", [False, True], ids=["inline-copy", "async-staging"])
def test_items_before_a_held_copy_are_written_during_it(tmp_path: Path, async_staging: bool) -> None:
    state = _state()
    manager = _manager(async_staging)
    try:
        _written_while_held(manager, tmp_path, state, "a*.pt")
        loaded = manager.load(str(tmp_path / "ck"), into=_templates(state))
    finally:
        manager.close()
    for item, values in state.items():
        for name, tensor in values.items():
            assert torch.equal(loaded[item][name], tensor.as_subclass(torch.Tensor)), f"{item}.{name}"


def test_a_safetensors_item_waits_for_its_whole_range(tmp_path: Path) -> None:
    """safetensors reads every tensor before writing: its item is written once its last tensor is staged."""
    items = {"a": ItemSpec(layout=LayoutInfo("a.safetensors", SafetensorsSerialization()))}
    state = _state()
    manager = _manager(False, items)
    try:
        _written_while_held(manager, tmp_path, state, "a.safetensors")
        loaded = manager.load(str(tmp_path / "ck"), into=_templates(state))
    finally:
        manager.close()
    assert torch.equal(loaded["a"]["w"], state["a"]["w"]) and torch.equal(loaded["z"]["after"], state["z"]["after"])


def test_a_copy_that_fails_midway_commits_nothing(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    before = {  # another layout than _state()'s: the failing save gets a fresh slab, so it is written during its copy
        "a": {"w": torch.full((BIG + 1,), 3.0), "b": torch.ones(7)},
        "z": {"held": torch.ones(1000), "after": torch.ones(5)},
    }
    manager = _manager(True)
    try:
        manager.save(ck, before).result(120)
        HeldCopy.fail = True
        future = manager.save(ck, _state())
        assert HeldCopy.copying.wait(60)
        written = _wait_for(lambda: any(p.stat().st_size >= BIG * 4 for p in _files_under(tmp_path, "a*.pt")), 30)
        assert written, "the failing save was not being written during its copy"
        HeldCopy.release.set()
        with pytest.raises(RuntimeError, match="held copy failed on purpose"):
            future.result(120)
        loaded = manager.load(ck, into=_templates(before))
        assert torch.equal(loaded["a"]["w"], before["a"]["w"]), "the earlier checkpoint changed"
        assert _wait_for(lambda: not list(tmp_path.glob(".ck.tmp-*")), 10), list(tmp_path.iterdir())
        HeldCopy.fail = False
        manager.save(ck, before).result(120)  # the manager goes on
    finally:
        manager.close()


_DIES_MID_COPY = textwrap.dedent(
    """
    import os, signal, sys, threading, torch
    sys.path.insert(0, {tests!r})
    from test_staging_pipeline import HeldCopy, _manager, _state
    if __name__ == "__main__":
        ck = sys.argv[1]
        manager = _manager(True)
        manager.save(ck, {{"a": {{"w": torch.full((4,), 3.0)}}}}).result(120)
        manager.save(ck, _state())
        assert HeldCopy.copying.wait(60)
        print("copying", flush=True)
        threading.Event().wait(120)  # killed here by the test
    """
)


def test_a_trainer_killed_mid_copy_commits_nothing(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    script = tmp_path / "dies.py"
    script.write_text(_DIES_MID_COPY.format(tests=str(Path(__file__).parent)))
    proc = subprocess.Popen([sys.executable, str(script), str(ck)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "copying"
        size = BIG * 4
        _wait_for(lambda: any(p.stat().st_size >= size for p in _files_under(tmp_path, "a*.pt")), 20)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    time.sleep(1.0)  # the orphaned writer notices its trainer is gone within 0.2 s and exits
    manager = _manager(False)
    try:
        loaded = manager.load(str(ck), into={"a": {"w": torch.zeros(4)}})
    finally:
        manager.close()
    assert torch.equal(loaded["a"]["w"], torch.full((4,), 3.0)), "the earlier checkpoint was replaced or damaged"


# ------------------------------------------------------------------------------------------- the gate itself


def test_gated_writes_of_slab_bytes_wait_for_the_copy() -> None:
    slab = torch.zeros(1 << 16, dtype=torch.uint8)
    marks = StagingMarks()
    gate = SlabGate(marks, 0, slab, timeout_s=30, what="test")
    written: list[int] = []

    class Sink:
        def write(self, data: Any) -> int:
            written.append(memoryview(data).nbytes)
            return memoryview(data).nbytes

    stream = _GatedStream(Sink(), gate)
    stream.write(b"header, not slab memory")  # never waits
    done = threading.Event()
    worker = threading.Thread(target=lambda: (stream.write(slab[1000:2000].numpy().data), done.set()))
    worker.start()
    marks.update(0, 1500)
    assert not done.wait(0.3), "a write of slab bytes 1000..2000 went ahead with only 1500 staged"
    marks.update(0, 2000)
    assert done.wait(10)
    worker.join(10)
    assert written == [23, 1000] and stream.streamed == 1000


def test_a_failed_copy_or_a_gone_trainer_fails_the_wait() -> None:
    slab = torch.zeros(4096, dtype=torch.uint8)
    marks = StagingMarks()
    marks.update(3, 100)
    marks.update(3, -1)
    with pytest.raises(StagingFailed, match="staging copy failed"):
        SlabGate(marks, 3, slab, 30, "test").wait_for(200)
    gone = StagingMarks()
    gone.trainer_gone()
    with pytest.raises(StagingFailed, match="stopped reporting"):
        SlabGate(gone, 0, slab, 30, "test").wait_all()
    with pytest.raises(StagingFailed, match="within"):
        SlabGate(StagingMarks(), 0, slab, 0.2, "test").wait_all()


def test_progress_reports_never_block_the_copy_on_a_stopped_writer(tmp_path: Path) -> None:
    """The copy reports its progress over a pipe; a writer that is stopped (SIGSTOP, a debugger) lets that pipe
    fill, and a blocking report would then stall save() itself. Reports are dropped to the latest one instead,
    and the write resends it once the writer reads again."""
    import itertools

    manager = _manager(False)
    try:
        saver = manager._saver  # type: ignore[attr-defined]
        saver._staging_numbers = itertools.count(1)  # this test reports for save number 0 itself
        process = saver.process
        process.wait_ready()
        os.kill(process.pid, signal.SIGSTOP)
        try:
            reporter = threading.Thread(target=lambda: [process.report_staged(0, i) for i in range(50_000)])
            reporter.start()
            reporter.join(30)
            assert not reporter.is_alive(), "reporting progress blocked on a stopped writer"
        finally:
            os.kill(process.pid, signal.SIGCONT)
        state = _state()
        state["z"]["held"] = state["z"]["held"].as_subclass(torch.Tensor)
        manager.save(str(tmp_path / "ck"), state).result(120)  # type: ignore[union-attr]
        loaded = manager.load(str(tmp_path / "ck"), into=_templates(state))
        assert torch.equal(loaded["a"]["w"], state["a"]["w"])
    finally:
        manager.close()
