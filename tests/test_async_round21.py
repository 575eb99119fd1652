"""An async save's callbacks on their way to the writer process: a callable object found picklable may stop
pickling later (given a lock). Its save must fail with an error naming the callback and the fix, the next save()
must refuse it at once, and saves must work again once it pickles. A request whose first writer died before it
took it must reach a second writer whole."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import TorchSerialization
from torch_checkpointing.checkpoint_process import CheckpointProcess, CheckpointProcessConfig
from torch_checkpointing.checkpoint_writer import SavePlan, WriteEntry, WriteRequest
from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

WAIT_S = 120


class Callback:
    """A callable object that pickles until it is given a lock."""

    def __call__(self, path: str, metadata: Any) -> None:
        return None


@pytest.fixture(scope="module")
def manager() -> Iterator[CheckpointManager]:
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.items = {"extra": ItemSpec(requires_copy=True, required=False)}
    config.save.wait_timeout_secs = WAIT_S
    with CheckpointManager(config) as built:
        yield built


@pytest.fixture
def clean(manager: CheckpointManager) -> Iterator[CheckpointManager]:
    yield manager
    manager.config.finalize_callback = None
    manager.config.pre_finalize_callback = None


def _save(manager: CheckpointManager, path: Path, **extra: Any) -> None:
    future = manager.save(str(path), {"model": {"w": torch.ones(3)}, **extra})
    assert future is not None
    future.result(timeout=WAIT_S)


def test_a_callback_that_stops_pickling_after_it_was_found_picklable_is_named(
    clean: CheckpointManager, tmp_path: Path
) -> None:
    """Found picklable once, a callback was taken as picklable for good: given a lock later, its save failed with
    the bare "The checkpoint write request cannot be pickled for the async writer process", naming neither the
    callback nor the fix, and so did every later save."""
    callback = Callback()
    clean.config.finalize_callback = callback
    _save(clean, tmp_path / "a")
    callback.lock = threading.Lock()  # type: ignore[attr-defined]
    with pytest.raises(ConfigTypeError, match=r"finalize_callback cannot be pickled .*Define it at module level"):
        _save(clean, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    with pytest.raises(ConfigTypeError, match=r"finalize_callback cannot be pickled"):
        clean.save(str(tmp_path / "c"), {"model": {"w": torch.ones(3)}})  # refused in save() itself now
    del callback.lock  # type: ignore[attr-defined]
    _save(clean, tmp_path / "d")


def die_on_the_first_request(marker: str) -> None:
    """(A writer's init function.) The first writer to read a request dies reading its buffers: after it has
    unpickled the request (taking the file descriptors of its shared-memory tensors), before it says Taken."""
    import torch_checkpointing.checkpoint_process as process

    receive = process._receive_buffers

    def die_once(fd: int, message: Any) -> Any:
        if not os.path.exists(marker):
            Path(marker).touch()
            os._exit(3)
        return receive(fd, message)

    process._receive_buffers = die_once


def test_a_request_whose_first_writer_died_reading_it_is_served_by_the_second(tmp_path: Path) -> None:
    """The request went to the second writer as the same bytes, whose shared-memory tensors' file descriptors
    the first writer had taken (multiprocessing hands each out once): the second writer died unpickling it, and
    the save failed as "died before it took the write" instead of being retried."""
    marker = tmp_path / "first_died"
    process = CheckpointProcess(
        LocalFileSystemStorageConfig(use_direct_io=False),
        CheckpointProcessConfig(subprocess_init_timeout_secs=WAIT_S),
        die_on_the_first_request,
        (str(marker),),
    )
    entry = WriteEntry("w", "w_0.pt", TorchSerialization(), torch.full((2,), 7.0))
    plan = SavePlan(checkpoint_dir=str(tmp_path / "c"), tmp_dir=str(tmp_path / ".c.tmp"), rank=0, world_size=1)
    try:
        assert process.write(WriteRequest(plan, [entry])) > 0
    finally:
        process.close()
    assert marker.exists(), "the first writer did not die: the test proves nothing"
    assert torch.equal(torch.load(tmp_path / "c" / "w_0.pt"), torch.full((2,), 7.0))
