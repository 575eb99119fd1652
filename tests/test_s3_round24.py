"""Object-store defects found in round 24, against a real S3 API server (moto) on loopback.

* A retention delete on S3 copies the checkpoint to its trash name, then deletes the source. When that delete
  failed midway (its files went, the store's answer was lost), the copy in the trash, by then the only whole copy,
  was deleted too: the report said "could not delete", and the checkpoint was gone. A save that re-used the id
  between the check and the copy was lost the same way, although the policy never chose it.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec.asyn
import pytest
import s3fs
import torch

from tests.s3_faults import LOST, FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import checkpoint_names, state, sync_manager, through_proxy, two_saved
from torch_checkpointing import FsspecStorageConfig, RetentionPolicy
from torch_checkpointing.commit import Claim
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.errors import CommitError
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.retention import prune


def _trash(storage: Any) -> list[str]:
    return [name for name in storage.ls(Path("run")) if ".trash-" in name]


def _lose_the_sources_bulk_delete(proxy: FaultProxy) -> None:
    """The source's bulk delete (the first one: the copy to the trash came before) is done by the server, and
    its answer is lost, and so are those of every retry the client makes, until retention looks at the copy."""
    proxy.rules = [Rule(r"^POST \S*\?delete", LOST, until=r"^(GET|HEAD) \S*\.trash-\S*/manifest\.json")]


def test_a_delete_whose_source_delete_fails_midway_puts_the_whole_copy_back(s3_server: S3Server) -> None:
    config, port, storage, root = two_saved(s3_server)
    with FaultProxy(port) as proxy:
        _lose_the_sources_bulk_delete(proxy)
        report = prune(root, RetentionPolicy(keep_last=1), through_proxy(config, proxy).create_storage())
    assert [c.name for c, _ in report.failed] == ["step_1"], report
    # Not deleted, as the report says: the whole copy is back under its id, and nothing is left in the trash.
    assert checkpoint_names(storage, root) == ["step_1", "step_2"]
    assert _trash(storage) == []
    with sync_manager(config) as manager:
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(1.0)["model"]["w"])
    # The next pass deletes it.
    assert [c.name for c in prune(root, RetentionPolicy(keep_last=1), storage).deleted] == ["step_1"]
    assert checkpoint_names(storage, root) == ["step_2"] and _trash(storage) == []


def test_a_save_that_reused_the_id_during_a_failed_delete_is_not_lost(s3_server: S3Server) -> None:
    config, port, storage, root = two_saved(s3_server)
    with FaultProxy(port) as proxy:
        through = through_proxy(config, proxy).create_storage()
        real_rename = through.rename

        def resaved_first(src: Path, dst: Path, *args: Any, **kwargs: Any) -> None:
            # Another process deletes step_1, and a trainer saves it again, between retention's check and its copy.
            storage.rmdir(Path("run/step_1"))
            with sync_manager(config) as manager:
                manager.save("run/step_1", state(7.0))
            _lose_the_sources_bulk_delete(proxy)
            real_rename(src, dst, *args, **kwargs)

        through.rename = resaved_first  # type: ignore[method-assign]
        prune(root, RetentionPolicy(keep_last=1), through)
    with sync_manager(config) as manager:  # the new save is whole at its id, never chosen by the policy
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(7.0)["model"]["w"])
    assert _trash(storage) == []


def test_leftovers_on_s3_report_the_bytes_they_hold(s3_server: S3Server) -> None:
    """Before, every leftover on an object store was reported as 0 B (the size was summed over local files
    only): `gc --dry-run` could not tell a stray marker from a half-written checkpoint of many GB."""
    config = s3_server.config()
    storage = config.create_storage()
    storage.write(Path("run/step_3") / INCOMPLETE_MARKER, b"")  # a save that stopped before it committed
    storage.write(Path("run/step_3/model_0.pt"), b"x" * 1500)
    storage.write(Path("run/step_3/nested/optim_0.pt"), b"y" * 500)
    storage.write(Path("run/.step_1.trash-1-00000000") / INCOMPLETE_MARKER, b"")  # a delete that stopped
    storage.write(Path("run/.step_1.trash-1-00000000/model_0.pt"), b"z" * 700)
    sizes = {Path(lo.path).name: lo.total_bytes for lo in list_leftovers(Path(f"{config.url}/run"), storage)}
    assert sizes == {"step_3": 2000, ".step_1.trash-1-00000000": 700}, sizes


def test_a_resaved_checkpoint_moved_back_whose_trash_delete_fails_is_reported_back(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A save re-used the id between retention's check and its move to the trash: retention moves it back (a copy
    on S3, then a delete of the trash). Before, when only that last delete failed, the report said the checkpoint
    "could not be moved back: rename it back by hand", of one that was back whole, and a second copy stayed."""
    config, port, storage, root = two_saved(s3_server)
    with FaultProxy(port) as proxy:
        through = through_proxy(config, proxy).create_storage()
        real_rename, calls = through.rename, []

        def resaved_before_the_move(src: Path, dst: Path, *args: Any, **kwargs: Any) -> None:
            calls.append(dst)
            if len(calls) == 1:  # another process deletes step_1, a trainer saves it again
                storage.rmdir(Path("run/step_1"))
                with sync_manager(config) as manager:
                    manager.save("run/step_1", state(7.0))
            else:  # the move back: the trash's delete is done by the server, its answer lost
                proxy.rules = [Rule(r"^POST \S*\?delete", LOST, until=r"^(GET|HEAD) \S*/run/step_1/manifest\.json")]
            real_rename(src, dst, *args, **kwargs)

        through.rename = resaved_before_the_move  # type: ignore[method-assign]
        with caplog.at_level(logging.INFO, logger="torch_checkpointing"):
            report = prune(root, RetentionPolicy(keep_last=1), through)
    assert len(calls) == 2 and report.failed == [], (calls, report)
    assert "could not be moved back" not in caplog.text, caplog.text
    assert _trash(storage) == []
    with sync_manager(config) as manager:
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(7.0)["model"]["w"])


class _PausingAfterTheManifest(s3fs.S3FileSystem):  # type: ignore[misc]
    """A delete of a checkpoint that stops (a slow store, a large prefix) once its manifest is gone, before its
    files go, until the test lets it go on."""

    def __init__(self, *args: Any, paused: threading.Event, go: threading.Event, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paused, self.go = paused, go

    def rm_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        out = fsspec.asyn.sync(self.loop, self._rm_file, path, *args, **kwargs)
        if path.endswith(f"/{MANIFEST_FILE_NAME}"):
            self.paused.set()
            self.go.wait(120)
        return out


def test_a_save_of_an_id_being_deleted_waits_for_the_delete_rather_than_lose_its_files(s3_server: S3Server) -> None:
    """A delete marks the checkpoint `.incomplete` first. Before, that marker was empty, which every judge takes
    for a dead save's claim: a save of the id took it over while the files went, said it committed, and the
    delete's bulk delete (listed before) removed the files it had just written: the committed checkpoint failed
    to load ("meta_0.pt ... is listed in the checkpoint's manifest but missing"). Now the marker is the delete's
    claim, live while the delete runs: the save is refused, naming it, and a save once the delete is done commits."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    refused = _save_during_a_paused_delete(config)
    assert refused is not None and "run/step_1" in str(refused), refused
    assert "a delete (or a move) of the checkpoint" in str(refused), refused
    with sync_manager(config) as manager:  # the delete is done: the id is free
        manager.save("run/step_1", state(7.0))
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(7.0)["model"]["w"])


class _PausingBeforeTheManifestsCopy(s3fs.S3FileSystem):  # type: ignore[misc]
    """A directory rename (a copy, then a delete) that stops once every file is copied, before the manifest is,
    until the test lets it go on."""

    def __init__(self, *args: Any, paused: threading.Event, go: threading.Event, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paused, self.go = paused, go

    def cp_file(self, path1: str, path2: str, *args: Any, **kwargs: Any) -> Any:
        if path1.endswith(f"/{MANIFEST_FILE_NAME}"):
            self.paused.set()
            self.go.wait(120)
        return fsspec.asyn.sync(self.loop, self._cp_file, path1, path2, *args, **kwargs)


def test_a_save_of_an_id_a_checkpoint_is_being_moved_to_never_mixes_their_files(s3_server: S3Server) -> None:
    """A directory rename on S3 (retention's move back of a whole copy, gc's put-back of a trash) copies the files
    to the id under an `.incomplete` marker, the manifest last. That marker was empty, which every judge takes
    for a dead save's claim: a save of the id took it over, wrote its files over the copied ones and committed,
    and the copy's manifest then replaced the save's. The save said it committed, and neither it nor the moved
    checkpoint loaded. Now the marker is a live claim while the copy runs: the save is refused, naming it."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    moving = lambda slow: slow.rename(Path("run/step_1"), Path("run/step_9"), is_directory=True)  # noqa: E731
    refused = _save_while_paused(config, _PausingBeforeTheManifestsCopy, moving, "run/step_9")
    with sync_manager(config) as manager:
        loaded = manager.load("run/step_9")["model"]["w"]
    assert refused is not None and "run/step_9" in str(refused), refused
    assert "a delete (or a move) of the checkpoint" in str(refused), refused
    assert torch.equal(loaded, state(1.0)["model"]["w"])  # the moved checkpoint, whole


def test_a_delete_of_a_checkpoint_beside_a_dead_claim_still_holds_the_id_while_it_runs(s3_server: S3Server) -> None:
    """A committed checkpoint can carry a dead claim of ours beside its manifest (a delete or a move killed after
    its marker went up, or whose marker's own delete failed: readers accept it, gc lets go of it). A delete of
    it kept that marker as it was: dead, so a save of the id took it over while the files went, and the delete's
    bulk delete (listed before) removed the files it had just written. The delete's own live claim replaces it."""
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    dead = Claim("gc-" + "0" * 32, "", socket.gethostname(), _a_dead_pid(), time.time()).to_bytes()
    storage.write(Path("run/step_1") / INCOMPLETE_MARKER, dead)
    with sync_manager(config) as manager:  # committed still: a stray claim beside its manifest
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(1.0)["model"]["w"])
    refused = _save_during_a_paused_delete(config)
    assert refused is not None and "a delete (or a move) of the checkpoint" in str(refused), refused


def _save_during_a_paused_delete(config: FsspecStorageConfig) -> Exception | None:
    """Delete run/step_1 in a thread paused once its manifest is gone, and save the id meanwhile (see
    `_save_while_paused`)."""
    return _save_while_paused(
        config, _PausingAfterTheManifest, lambda slow: slow.rmdir(Path("run/step_1")), "run/step_1"
    )


def _save_while_paused(
    config: FsspecStorageConfig, filesystem: type[s3fs.S3FileSystem], operation: Callable[[Any], Any], save_id: str
) -> Exception | None:
    """Run `operation` on a storage over `filesystem` (one that pauses it until told to go on) in a thread, save
    `save_id` while it is paused, then let it finish: the save's CommitError, or None once what it said it
    committed loaded back whole."""
    paused, go = threading.Event(), threading.Event()
    slow = FsspecStorageConfig(
        url=config.url, filesystem=filesystem(**config.storage_options, paused=paused, go=go)
    ).create_storage()
    running = threading.Thread(target=operation, args=(slow,), daemon=True)
    running.start()
    refused: Exception | None = None
    try:
        assert paused.wait(60)
        try:
            with sync_manager(config) as manager:
                manager.save(save_id, state(7.0))
        except CommitError as exc:
            refused = exc
    finally:
        go.set()
        running.join(60)
    if refused is None:  # it said it committed: what it committed must load
        with sync_manager(config) as manager:
            assert torch.equal(manager.load(save_id)["model"]["w"], state(7.0)["model"]["w"])
    return refused


def _a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(60)
    return proc.pid
