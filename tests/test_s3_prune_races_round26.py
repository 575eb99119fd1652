"""Two retention passes (two trainers, or a trainer and an operator's `prune`) deleting one S3 prefix at once.

A delete on S3 copies the checkpoint to a trash prefix, then deletes the source. When another process deleted
the source between this pass's copy and its delete (or was deleting it then), the source was no longer whole
and this pass took its own copy for the only whole one left: it put the copy back under the id (the checkpoint
the other pass had just deleted came back, and `keep_last` kept every checkpoint both passes chose), or, with
the other delete's claim still up, left it in the trash and told the operator to rename it back by hand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec.asyn
import pytest
import s3fs

from tests.s3_faults import DeletingS3FileSystem
from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager
from torch_checkpointing import FsspecStorageConfig, RetentionPolicy, list_checkpoints
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MANIFEST_FILE_NAME
from torch_checkpointing.retention import collect_garbage, prune
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.fsspec_storage import _live_claim


@dataclass(frozen=True)
class TwoSaves:
    """`run/step_1` (1.0) and `run/step_2` (2.0) committed on the server; `prefix` is step_1's bucket key."""

    config: FsspecStorageConfig
    storage: Storage
    prefix: str


@pytest.fixture
def two_saves(s3_server: S3Server) -> TwoSaves:
    """The two checkpoints every retention race here starts from (keep_last=1 chooses step_1 to delete)."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
        manager.save("run/step_2", state(2.0))
    storage = config.create_storage()
    return TwoSaves(config, storage, storage.remap_path(Path("run/step_1")).split("://", 1)[1])


class _DeletingMidway(DeletingS3FileSystem):  # type: ignore[misc]
    """Another process's delete of `prefix`, caught midway: its live claim is up and the manifest is gone (the
    order `FsspecStorage.rmdir` deletes in), its files still there; `finish()` ends it as that delete would."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held = contextlib.ExitStack()

    def _after(self, kind: str, path: str) -> None:
        if kind != self.after or path != self.trigger or self.deleted:
            return
        self.deleted = [f"{self.prefix}/{MANIFEST_FILE_NAME}"]
        self._plain.pipe_file(f"{self.prefix}/{INCOMPLETE_MARKER}", self._held.enter_context(_live_claim()))
        self._plain.rm_file(f"{self.prefix}/{MANIFEST_FILE_NAME}")
        self.invalidate_cache()

    def finish(self) -> None:
        self._plain.invalidate_cache()
        self._plain.rm([k for k in self._plain.find(self.prefix) if k.startswith(self.prefix + "/")])
        self._held.close()


@pytest.mark.parametrize("other", [DeletingS3FileSystem, _DeletingMidway], ids=["deleted", "deleting"])
def test_a_pass_never_puts_back_a_checkpoint_another_pass_deleted(
    s3_server: S3Server, two_saves: TwoSaves, other: type[Any]
) -> None:
    config, storage, prefix = two_saves.config, two_saves.storage, two_saves.prefix
    # Right after this pass copied the manifest (copied last: the copy is whole), before it deletes the source.
    fs = other(**s3_server.storage_options(), prefix=prefix, trigger=f"{prefix}/{MANIFEST_FILE_NAME}", after="copy")
    racing = FsspecStorageConfig(**{**vars(config), "filesystem": fs}).create_storage()
    root = f"{config.url}/run"
    report = prune(root, RetentionPolicy(keep_last=1), racing)
    assert fs.deleted, "the other delete never ran: the pass did not copy the checkpoint"
    if isinstance(fs, _DeletingMidway):
        fs.finish()
    assert report.failed == [], report.failed  # before: "its files were put back whole", or "rename it back"
    assert [c.name for c in list_checkpoints(root, storage)] == ["step_2"]  # before: step_1 was back
    assert [n for n in storage.ls(Path("run")) if ".trash-" in n] == []  # before: a whole copy left in the trash
    with sync_manager(config) as manager:
        assert float(manager.load("run/step_2")["model"]["w"][0]) == 2.0


class _ClaimedFirst(s3fs.S3FileSystem):  # type: ignore[misc]
    """Another process's live claim (`_live_claim`, held until `release()`) lands at the key `marker` through a
    second, plain client right before this client's own PUT of it: after this client's check, before its create."""

    def __init__(self, *args: Any, marker: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marker, self._plain = marker, s3fs.S3FileSystem(*args, **kwargs)
        self._held = contextlib.ExitStack()
        self.claimed = False

    def pipe_file(self, path: str, data: bytes, **kwargs: Any) -> Any:
        if path == self.marker and not self.claimed:
            self.claimed = True
            self._plain.pipe_file(path, self._held.enter_context(_live_claim()))
        return fsspec.asyn.sync(self.loop, self._pipe_file, path, data, **kwargs)

    def release(self) -> None:
        self._held.close()


def test_a_gc_never_reports_a_copy_another_gc_is_moving_back_as_its_failure(s3_server: S3Server) -> None:
    """Two gc passes (two trainers' retention) both choose the only copy of `step_9` to move back under its id.
    Before, the one whose claim came second failed its copy and reported "could not move ... back ... rename it
    by hand" (an exit 1 of `gc`, and advice to race the move under way), while the other moved it back."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_9", state(9.0))
    storage = config.create_storage()
    fs, bucket = storage.fs, config.url.split("://", 1)[1]
    aside = f"{bucket}/run/.old_step_9_999999"  # a replace killed between its two renames, on another host
    for key in fs.find(f"{bucket}/run/step_9"):
        fs.cp_file(key, key.replace("/step_9/", "/.old_step_9_999999/"))
    storage.rmdir(Path("run/step_9"))
    racing = _ClaimedFirst(**s3_server.storage_options(), marker=f"{bucket}/run/step_9/{INCOMPLETE_MARKER}")
    report = collect_garbage(
        f"{config.url}/run",
        FsspecStorageConfig(**{**vars(config), "filesystem": racing}).create_storage(),
        unowned_after_s=0,
    )
    assert racing.claimed, "the pass never tried to move the copy back"
    for key in fs.find(aside):  # the other gc ends its move
        fs.cp_file(key, key.replace("/.old_step_9_999999/", "/step_9/"))
    fs.rm_file(f"{bucket}/run/step_9/{INCOMPLETE_MARKER}")
    fs.rm(fs.find(aside))
    racing.release()
    assert report.failed == [], report.failed  # before: "could not move ... back ...: rename it by hand"
    with sync_manager(config) as manager:
        assert float(manager.load("run/step_9")["model"]["w"][0]) == 9.0


class _ResavedMidway(DeletingS3FileSystem):  # type: ignore[misc]
    """Another process deletes `prefix` (as `DeletingS3FileSystem`), then a trainer saves that id again and
    commits (`resave`): both between this client's copy of the checkpoint and its delete of the source."""

    def __init__(self, *args: Any, resave: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resave, self.resaved = resave, False

    def _after(self, kind: str, path: str) -> None:
        super()._after(kind, path)
        if self.deleted and not self.resaved:
            self.resaved = True
            self.resave()
            self.invalidate_cache()


def test_a_resave_committed_between_a_deletes_copy_and_its_delete_stays(
    s3_server: S3Server, two_saves: TwoSaves
) -> None:
    """Round 26 review. A delete on S3 copies the checkpoint aside, then deletes the objects it listed before the
    copy. A save that re-used the id after another process deleted the checkpoint, committed between the two, has
    objects of the same names: the delete took its manifest and files, and the pass removed its copy of the old
    checkpoint as deleted. A trainer told its save committed found nothing at the id."""
    config, storage, prefix = two_saves.config, two_saves.storage, two_saves.prefix

    def resave() -> None:
        with sync_manager(config) as trainer:
            trainer.save("run/step_1", state(11.0))

    fs = _ResavedMidway(
        **s3_server.storage_options(),
        prefix=prefix,
        trigger=f"{prefix}/{MANIFEST_FILE_NAME}",
        after="copy",
        resave=resave,
    )
    racing = FsspecStorageConfig(**{**vars(config), "filesystem": fs}).create_storage()
    root = f"{config.url}/run"
    report = prune(root, RetentionPolicy(keep_last=1), racing)
    assert fs.deleted and fs.resaved, "the race never ran: the pass did not copy the checkpoint"
    with sync_manager(config) as manager:  # before: "run/step_1: no manifest.json: not a checkpoint"
        assert float(manager.load("run/step_1")["model"]["w"][0]) == 11.0
    assert report.failed == [], report.failed  # the re-save is no failure of the pass: it was never chosen
    assert [n for n in storage.ls(Path("run")) if ".trash-" in n] == []
