"""What rank 0's trainer answers to the commit step for its writer that died in it (one process, a real TCPStore).

`tests/test_async_round22_multirank.py` kills a real writer on two gloo ranks; these pin the two decisions inside
it that a timed kill reaches only by luck: what `Commit.adopt` makes of each state the id can be left in, and that
an answer the writer gave before it died is given again unchanged (the other ranks may already have read it),
never replaced by the trainer's own look at the id.
"""

from __future__ import annotations

import contextlib
import json
import uuid
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from torch_checkpointing.checkpoint_writer import SavePlan, _commit_step, _manifest_key, _stand_in_for_rank_0
from torch_checkpointing.commit import (
    INCOMPLETE_MARKER,
    MANIFEST_FILE_NAME,
    Commit,
    CommitTarget,
    make_parents,
    manifest_digest,
    temporary_name,
)
from torch_checkpointing.errors import CommitError, WriterProcessDied
from torch_checkpointing.manifest import FileRecord, Manifest
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig
from torch_checkpointing.store_channel import StoreAddress, StoreChannel
from torch_checkpointing.version import __version__

OURS = b'{"ours": true}'
EARLIER = b'{"earlier": true}'


def _ids(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "ck", tmp_path / ".ck.tmp-0123abcd-1"


def _commit(tmp_path: Path) -> Commit:
    final, tmp = _ids(tmp_path)
    storage = LocalFileSystemStorageConfig(use_direct_io=False).create_storage()
    return Commit(storage, CommitTarget(str(final), str(tmp)))


def _checkpoint(path: Path, manifest: bytes, marker: bool = False) -> None:
    path.mkdir()
    (path / "model_0.pt").write_bytes(b"x")
    (path / MANIFEST_FILE_NAME).write_bytes(manifest)
    if marker:
        (path / INCOMPLETE_MARKER).write_bytes(b"")


def test_adopt_removes_an_unfinished_save_and_leaves_the_earlier_checkpoint(tmp_path: Path) -> None:
    final, tmp = _ids(tmp_path)
    _checkpoint(final, EARLIER)
    _checkpoint(tmp, OURS, marker=True)  # killed before the swap: the manifest written, the marker still there
    assert _commit(tmp_path).adopt(manifest_digest(OURS)) is False
    assert not tmp.exists()
    assert (final / MANIFEST_FILE_NAME).read_bytes() == EARLIER


def test_adopt_without_a_manifest_never_takes_the_earlier_checkpoint_for_this_save(tmp_path: Path) -> None:
    final, tmp = _ids(tmp_path)
    _checkpoint(final, EARLIER)
    tmp.mkdir()
    (tmp / INCOMPLETE_MARKER).write_bytes(b"")
    assert _commit(tmp_path).adopt(None) is False
    assert not tmp.exists() and (final / MANIFEST_FILE_NAME).read_bytes() == EARLIER


def test_adopt_finishes_a_swapped_save_by_removing_the_replaced_copy(tmp_path: Path) -> None:
    final, tmp = _ids(tmp_path)
    _checkpoint(final, OURS)  # the exchange done: this save at the id, the replaced one at its temporary name
    _checkpoint(tmp, EARLIER)
    assert _commit(tmp_path).adopt(manifest_digest(OURS)) is True
    assert not tmp.exists()
    assert (final / MANIFEST_FILE_NAME).read_bytes() == OURS


@pytest.fixture
def channel() -> Any:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return StoreChannel(StoreAddress("127.0.0.1", store.port, "ns"), 10.0, store)


def _plan(tmp_path: Path) -> SavePlan:
    final, tmp = _ids(tmp_path)
    return SavePlan(checkpoint_dir=str(final), tmp_dir=str(tmp), rank=0, world_size=2)


@pytest.mark.parametrize("answer", [{"ok": None}, {"error": "rank 0's own words, read by rank 1 already"}])
def test_an_answer_the_writer_gave_before_it_died_is_given_again(tmp_path: Path, channel: Any, answer: Any) -> None:
    plan = _plan(tmp_path)
    final, tmp = _ids(tmp_path)
    _checkpoint(final, EARLIER)  # the id says "not this save": the trainer must not look there
    _checkpoint(tmp, OURS, marker=True)
    channel.publish(f"{_commit_step(plan)}/0", json.dumps(answer))
    channel.publish(_manifest_key(plan), manifest_digest(OURS))
    publish = _stand_in_for_rank_0(plan, _commit(tmp_path), channel, WriterProcessDied("died"))
    if "ok" in answer:
        publish()
    else:
        with pytest.raises(CommitError) as raised:
            publish()
        assert str(raised.value) == answer["error"]
    assert tmp.exists(), "the trainer looked at the id instead of repeating the writer's answer"


def test_with_no_answer_the_id_decides_and_the_failure_says_what_became_of_the_save(
    tmp_path: Path, channel: Any
) -> None:
    plan = _plan(tmp_path)
    final, tmp = _ids(tmp_path)
    _checkpoint(final, EARLIER)
    _checkpoint(tmp, OURS, marker=True)
    channel.publish(_manifest_key(plan), manifest_digest(OURS))
    with pytest.raises(CommitError) as raised:
        _stand_in_for_rank_0(plan, _commit(tmp_path), channel, WriterProcessDied("killed by SIGKILL"))()
    message = str(raised.value)
    assert "died before the checkpoint was in place" in message and "earlier checkpoint" in message, message
    assert "Save again" in message, message
    assert not tmp.exists() and (final / MANIFEST_FILE_NAME).read_bytes() == EARLIER


def _killed() -> None:
    raise RuntimeError("killed right before the marker's removal")


def _object_store_save(fail_at_the_marker: bool) -> tuple[Any, CommitTarget, str]:
    """A one-file save under a memory:// prefix (an object store: the marker is the save's claim, removed last),
    published by a Commit as the writer's would be; `fail_at_the_marker`: the writer stops right before the
    marker's removal, as a kill there leaves it (manifest written, records dropped, claim held)."""
    storage = FsspecStorageConfig(url=f"memory://r22-{uuid.uuid4().hex[:8]}/run").create_storage()
    target = CommitTarget("step_1", temporary_name("step_1", uuid.uuid4().hex[:16], 1))
    writer = Commit(storage, target)
    make_parents(storage, target.final)  # rank 0 does so when the ranks agree to save; begin() makes one level
    writer.begin(0, ["model_0.pt"])
    storage.write(writer.root / "model_0.pt", b"x")
    record = FileRecord("model", 0, "model_0.pt", 1, zlib.crc32(b"x"), {"type": "TorchSerialization"})
    announced: list[str] = []
    if fail_at_the_marker:
        writer._remove_claim = _killed  # type: ignore[method-assign]
    with contextlib.suppress(RuntimeError):
        writer.publish(Manifest(1, __version__, (record,)), None, lambda: None, announced.append)
    return storage, target, announced[0]


def test_adopt_on_an_object_store_removes_a_save_killed_before_its_marker_went() -> None:
    storage, target, manifest = _object_store_save(fail_at_the_marker=True)
    assert storage.exists(Path("step_1") / MANIFEST_FILE_NAME) and storage.exists(Path("step_1") / INCOMPLETE_MARKER)
    assert Commit(storage, target).adopt(manifest) is False
    assert not storage.exists(Path("step_1") / MANIFEST_FILE_NAME)
    assert not storage.exists(Path("step_1") / INCOMPLETE_MARKER)
    assert not storage.exists(Path("step_1") / "model_0.pt")


def test_adopt_on_an_object_store_keeps_a_committed_save() -> None:
    storage, target, manifest = _object_store_save(fail_at_the_marker=False)
    assert Commit(storage, target).adopt(manifest) is True
    assert manifest_digest(storage.read(Path("step_1") / MANIFEST_FILE_NAME)) == manifest
    assert storage.exists(Path("step_1") / "model_0.pt")
    assert not storage.exists(Path("step_1") / INCOMPLETE_MARKER)


def test_a_trainer_that_cannot_read_the_id_tells_every_rank_the_outcome_is_unknown(
    tmp_path: Path, channel: Any
) -> None:
    """Rank 0's writer died in the commit and its trainer's read of the id's manifest fails (EIO, not "none
    there"). Before, `Commit.adopt` took it for "not this save": the save was removed and every rank raised
    "died before the checkpoint was in place ... an earlier checkpoint at this id is intact" although the id held
    this save. Then the trainer's CommitOutcomeUnknownError travelled as "commit failed on rank(s) [0]: ... not
    known ... Nothing was committed." Now every rank raises CommitOutcomeUnknownError, and nothing is removed."""
    from torch_checkpointing.agreement import Contribution, StoreTransport
    from torch_checkpointing.checkpoint_writer import _agree_on_the_commit
    from torch_checkpointing.errors import CommitOutcomeUnknownError

    plan = _plan(tmp_path)
    final, tmp = _ids(tmp_path)
    _checkpoint(final, OURS)  # the writer had swapped it in (an exchange: the replaced one at tmp)
    _checkpoint(tmp, EARLIER)
    channel.publish(_manifest_key(plan), manifest_digest(OURS))
    channel.publish(f"{_commit_step(plan)}/1", Contribution(value=None).to_json())  # rank 1's answer, in already
    commit = _commit(tmp_path)
    real_read = commit.storage.read

    def failing_read(path: Any, *args: Any, **kwargs: Any) -> bytes:
        if Path(path) == final / MANIFEST_FILE_NAME:
            raise OSError(5, "Input/output error", str(path))
        return real_read(path, *args, **kwargs)

    commit.storage.read = failing_read  # type: ignore[method-assign]
    publish = _stand_in_for_rank_0(plan, commit, channel, WriterProcessDied("killed by SIGKILL"))
    with pytest.raises(CommitOutcomeUnknownError) as raised:
        _agree_on_the_commit(plan, StoreTransport(0, 2, channel), channel, publish)
    message = str(raised.value)
    assert "not known" in message and "Nothing was committed" not in message, message
    assert "intact" not in message, message
    assert (final / MANIFEST_FILE_NAME).read_bytes() == OURS and tmp.exists()  # nothing removed by the trainer
