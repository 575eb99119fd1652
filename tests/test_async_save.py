"""Async saves: staging into reusable shared host buffers, a spawned writer, and what each call waits for."""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_storage import Control, RecordingStorageConfig, SlowCopy, controlled_manager, with_clean_controls
from tests.probes import memory_maps
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, RawSerialization
from torch_checkpointing.config import AsyncCheckpointSaverConfig
from torch_checkpointing.staging import CheckpointStagerConfig, DefaultStager

RESULT_TIMEOUT = 120
HANG_S = 60  # what a held write or copy is let go after: only a test that would otherwise hang waits it


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CheckpointManager, Control]]:
    """One async manager for the module: 'snap' skips the staging copy, 'raw' is raw bytes."""
    items = {
        "snap": ItemSpec(requires_copy=False, required=False),
        "raw": ItemSpec(layout=LayoutInfo("raw.bin", RawSerialization()), required=False),
    }
    yield from controlled_manager(Control(tmp_path_factory.mktemp("async-control")), items)


@pytest.fixture
def amgr(shared: tuple[CheckpointManager, Control]) -> Iterator[tuple[CheckpointManager, Control]]:
    yield from with_clean_controls(*shared, timeout=RESULT_TIMEOUT)


def _result(fut: Future[Any] | None) -> Any:
    assert isinstance(fut, Future)
    return fut.result(timeout=RESULT_TIMEOUT)


@contextlib.contextmanager
def _write_held(control: Control) -> Iterator[Callable[[], bool]]:
    """The save's first write of its model blocks (once it has handed over its bytes) until the block ends, or
    HANG_S has passed; yields `held()`: whether it is held still, so cannot have finished.

    A held write, not a slow one: "save() returned before the write" was `returned < 1.0` against a write delayed
    1.5 s, which a busy machine's save() alone could fail. Now only the order counts: a save() (or lock()) that
    waits for the write returns once HANG_S let it go, and `held()` is then False."""
    control.block("model")
    block_on = control.root / "block_on"
    hang_bound = threading.Timer(HANG_S, lambda: block_on.unlink(missing_ok=True))
    hang_bound.start()
    try:
        yield block_on.exists
    finally:
        hang_bound.cancel()
        block_on.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------- default preset


@pytest.mark.parametrize("nbytes", [0, 4096, 4096 * 3 + 17, (16 << 20) + 4096 * 2 + 5])
def test_default_async_preset_works_on_cpu(async_manager: CheckpointManager, tmp_path: Path, nbytes: int) -> None:
    blob = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    payload = {"model": {"blob": blob}, "step": 7}
    _result(async_manager.save(str(tmp_path / "c"), payload))
    out = async_manager.load(str(tmp_path / "c"), into={"model": {"blob": torch.empty_like(blob)}, "step": 0})
    assert torch.equal(out["model"]["blob"], blob) and out["step"] == 7


# ------------------------------------------------------------------------------------------- staging


def test_staging_reuses_shared_host_buffers() -> None:
    stager = DefaultStager(CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False))
    try:
        model = {"w": torch.randn(64, 8), "b": torch.randn(8), "layers": [torch.randn(3)]}
        staged = stager.stage({"model": model})["model"]
        first = {"w": staged["w"], "b": staged["b"], "l0": staged["layers"][0]}
        sources = {"w": model["w"], "b": model["b"], "l0": model["layers"][0]}
        for name, buf in first.items():
            assert buf.is_shared(), name
            assert buf.data_ptr() != sources[name].data_ptr(), f"{name} was not copied"
        with torch.no_grad():
            model["w"].add_(1)
        staged = stager.stage({"model": model})["model"]
        assert staged["w"] is first["w"] and staged["b"] is first["b"] and staged["layers"][0] is first["l0"]
        assert torch.equal(staged["w"], model["w"])
    finally:
        stager.close()


def _slab_inodes() -> set[str]:
    """Inodes of the staging slabs this process maps: what a save's staging copy lands in."""
    return {region.inode for region in memory_maps() if "torch_checkpointing-staging" in region.path}


def test_mutation_after_lock_does_not_reach_the_checkpoint(
    amgr: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, control = amgr
    control.set_delay(0.5)
    weights = torch.arange(1000.0)
    fut = manager.save(str(tmp_path / "c"), {"model": {"w": weights}})
    with manager.lock():  # the training step: waits for the staging copy, not for the write
        weights.mul_(-1)
    _result(fut)
    out = manager.load(str(tmp_path / "c"), into={"model": {"w": torch.zeros(1000)}})
    assert torch.equal(out["model"]["w"], torch.arange(1000.0))


def test_requires_copy_false_values_are_left_alone(amgr: tuple[CheckpointManager, Control], tmp_path: Path) -> None:
    manager, _ = amgr
    t = torch.arange(6.0)
    snap = {"progress": t, "seen": [1, 2, 3]}
    ptr = t.data_ptr()
    _result(manager.save(str(tmp_path / "c"), {"snap": snap}))
    assert not t.is_shared(), "a requires_copy=False tensor was moved to shared memory"
    assert t.data_ptr() == ptr and torch.equal(t, torch.arange(6.0))
    assert snap == {"progress": t, "seen": [1, 2, 3]} and snap["progress"] is t
    out = manager.load(str(tmp_path / "c"), into={"snap": None})
    assert torch.equal(out["snap"]["progress"], t) and out["snap"]["seen"] == [1, 2, 3]


def test_requires_copy_false_values_are_not_deep_copied(
    amgr: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, _ = amgr
    copies = SlowCopy.copies
    _result(manager.save(str(tmp_path / "c"), {"snap": {"probe": SlowCopy(0.0)}}))
    assert SlowCopy.copies == copies, "a requires_copy=False value went through the staging copy"
    _result(manager.save(str(tmp_path / "d"), {"model": {"probe": SlowCopy(0.0)}}))
    assert SlowCopy.copies == copies + 1, "the staging copy of a requires_copy=True value was not seen"


def test_prewarm_allocates_the_buffers_the_save_uses(amgr: tuple[CheckpointManager, Control], tmp_path: Path) -> None:
    manager, control = amgr
    model = {"pw": torch.randn(32, 4)}
    before = _slab_inodes()
    assert manager.prewarm_staging({"model": model, "snap": {"x": 1}}) is None
    with manager.lock():  # waits for the prewarm's staging copy
        prewarmed = _slab_inodes() - before
    assert prewarmed, "the prewarm mapped no new staging slab"
    _result(manager.save(str(tmp_path / "c"), {"model": model}))
    assert not _slab_inodes() - before - prewarmed, "the save allocated a new slab instead of the prewarmed one"
    out = manager.load(str(tmp_path / "c"), into={"model": None})
    assert torch.equal(out["model"]["pw"], model["pw"])
    with _write_held(control):
        fut = manager.save(str(tmp_path / "d"), {"model": model})
        with pytest.raises(RuntimeError, match="write is active"):
            manager.prewarm_staging({"model": model})
    _result(fut)


# -------------------------------------------------------------------------------------- what waits for what


def test_save_returns_before_the_write_is_durable(amgr: tuple[CheckpointManager, Control], tmp_path: Path) -> None:
    manager, control = amgr
    with _write_held(control) as held:
        fut = manager.save(str(tmp_path / "c"), {"model": {"w": torch.ones(4)}})
        assert held(), "save() returned only once its write was let go: it waited for the write"
        assert not fut.done()
        assert not (tmp_path / "c").exists()
    assert _result(fut) is None
    assert (tmp_path / "c" / "manifest.json").is_file()


def test_second_save_waits_for_the_previous_write(amgr: tuple[CheckpointManager, Control], tmp_path: Path) -> None:
    manager, control = amgr
    control.set_delay(0.8)
    first = manager.save(str(tmp_path / "a"), {"model": torch.ones(2)})
    second = manager.save(str(tmp_path / "b"), {"model": torch.zeros(2)})
    assert first.done() and first.exception() is None
    assert (tmp_path / "a" / "manifest.json").is_file()
    _result(second)
    assert torch.equal(manager.load(str(tmp_path / "b"), into={"model": None})["model"], torch.zeros(2))


def test_default_save_returns_after_the_copy_but_before_the_write(
    amgr: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    """Default staging is done when save() returns: the loop may mutate at once; the write is still running."""
    manager, control = amgr
    finished = SlowCopy.finished
    with _write_held(control) as held:
        fut = manager.save(str(tmp_path / "c"), {"model": {"slow": SlowCopy(1.0, 5), "w": torch.ones(2)}})
        assert SlowCopy.finished == finished + 1, "save() returned before its staging copy finished"
        assert not fut.done(), "save() waited for the write"
        with manager.lock():
            assert held(), "lock() waited for the write, with no staging copy in flight"
    _result(fut)


def test_async_staging_lock_waits_for_staging_only(tmp_path: Path) -> None:
    control = Control(tmp_path / "control")
    config = CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(staging_config=CheckpointStagerConfig(use_async_staging=True)),
        storage_config=RecordingStorageConfig(control_dir=str(control.root)),
    )
    with CheckpointManager(config) as manager:
        with _write_held(control) as held, _copies_gated() as gate:
            finished = SlowCopy.finished
            fut = manager.save(str(tmp_path / "c"), {"model": {"slow": SlowCopy(HANG_S, 5), "w": torch.ones(2)}})
            assert SlowCopy.finished == finished, "with use_async_staging=True, save() waited for the copy"
            threading.Timer(0.5, gate.set).start()
            with manager.lock():
                copied = SlowCopy.finished == finished + 1
                write_done = fut.done()
            assert copied, "lock() did not wait for the staging copy"
            assert held() and not write_done, "lock() waited for the write, not just the staging copy"
        _result(fut)
        with torch.serialization.safe_globals([SlowCopy]):
            assert manager.load(str(tmp_path / "c"), into={"model": None})["model"]["slow"] == SlowCopy(HANG_S, 5)
        control.reset()


@contextlib.contextmanager
def _copies_gated() -> Iterator[threading.Event]:
    """A `SlowCopy`'s deep copy ends once the Event yielded is set (or its `seconds` passed): the test says when,
    where a sleeping copy raced the machine's load."""
    SlowCopy.gate = gate = threading.Event()
    try:
        yield gate
    finally:
        gate.set()
        SlowCopy.gate = None


def test_lock_does_not_block_between_saves(amgr: tuple[CheckpointManager, Control]) -> None:
    manager, _ = amgr
    done = threading.Event()

    def hold() -> None:
        with manager.lock():
            done.set()

    thread = threading.Thread(target=hold)
    thread.start()
    thread.join(5)
    assert done.is_set()


def test_writes_happen_in_the_writer_process_through_the_configured_storage(
    amgr: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, control = amgr
    _result(manager.save(str(tmp_path / "c"), {"model": torch.ones(1)}))
    writes = [c for c in control.calls() if c[1] == "stream_write" and c[2].endswith("model_0.pt")]
    assert writes, "the item file was not written through the configured storage"
    writer_pid = manager.writer_pid
    assert {int(c[0]) for c in writes} == {writer_pid} and writer_pid != os.getpid()
    cmdline = Path(f"/proc/{writer_pid}/cmdline").read_bytes().replace(b"\0", b" ")
    assert b"multiprocessing.spawn import spawn_main" in cmdline, f"the writer was not spawned: {cmdline!r}"


# --------------------------------------------------------------------------------------------- failures


def test_unpicklable_requires_copy_false_value_names_the_key(
    amgr: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, _ = amgr
    with pytest.raises(pickle.PicklingError, match="'snap'"):
        _result(manager.save(str(tmp_path / "bad"), {"snap": {"lock": threading.Lock()}}))
    assert not (tmp_path / "bad").exists()
    _result(manager.save(str(tmp_path / "good"), {"snap": {"x": 1}}))
    assert manager.load(str(tmp_path / "good"), into={"snap": None}) == {"snap": {"x": 1}}


def test_unpicklable_requires_copy_true_value_names_the_key(
    amgr: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, _ = amgr
    with pytest.raises(Exception) as info:
        _result(manager.save(str(tmp_path / "bad"), {"model": {"fn": lambda x: x}}))
    assert "'model'" in str(info.value), f"error does not name the item: {info.value!r}"
    assert not (tmp_path / "bad").exists()
    _result(manager.save(str(tmp_path / "good"), {"model": {"x": 1}}))
    assert manager.load(str(tmp_path / "good"), into={"model": None}) == {"model": {"x": 1}}


def test_failed_write_fails_its_own_future_with_the_original_type(
    amgr: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    manager, _ = amgr
    fut = manager.save(str(tmp_path / "bad"), {"raw": "not bytes"})
    with pytest.raises(ValueError, match="RawSerialization requires bytes, but key 'raw'"):
        _result(fut)
    assert not (tmp_path / "bad").exists()
    assert not [p for p in tmp_path.iterdir() if "bad" in p.name], "failed save left its temporary directory"
    nxt = manager.save(str(tmp_path / "good"), {"raw": b"bytes"})
    assert _result(nxt) is None
    assert manager.load(str(tmp_path / "good"), into={"raw": None}) == {"raw": b"bytes"}


def test_close_waits_for_the_last_write(tmp_path: Path) -> None:
    control = Control(tmp_path / "control")
    manager = CheckpointManager(
        CheckpointManager.Config(storage_config=RecordingStorageConfig(control_dir=str(control.root)))
    )
    _result(manager.save(str(tmp_path / "warm"), {"a": 1}))  # the writer is up
    with _write_held(control) as held:
        fut = manager.save(str(tmp_path / "c"), {"model": torch.ones(3)})
        assert held() and not fut.done()
        threading.Timer(0.5, lambda: (control.root / "block_on").unlink(missing_ok=True)).start()  # while close() waits
        manager.close()
    assert fut.done() and fut.exception() is None
    assert (tmp_path / "c" / "manifest.json").is_file()
    with pytest.raises(RuntimeError, match="closed"):
        manager.save(str(tmp_path / "d"), {"a": 1})


def test_staged_items_are_written_alone_and_in_their_own_dtypes(
    amgr: tuple[CheckpointManager, Control], tmp_path: Path
) -> None:
    """Staged tensors share one slab; each item's file must still hold only that item's tensors."""
    manager, _ = amgr
    big = {"w": torch.randn(512, 256), "h": torch.randn(300).bfloat16(), "i": torch.arange(7), "e": torch.empty(0, 3)}
    small = {"x": torch.randn(4)}
    _result(manager.save(str(tmp_path / "c"), {"model": big, "raw": b"r", "snap": {"s": 1}, "opt": small}))
    own = sum(t.numel() * t.element_size() for t in big.values())
    assert own <= (tmp_path / "c" / "model_0.pt").stat().st_size < own + (64 << 10)
    assert (tmp_path / "c" / "opt_0.pt").stat().st_size < 64 << 10, "another item's data leaked into this file"
    out = manager.load(str(tmp_path / "c"), into={"model": None, "opt": None})
    assert all(torch.equal(out["model"][k], v) and out["model"][k].dtype == v.dtype for k, v in big.items())
    assert torch.equal(out["opt"]["x"], small["x"])
