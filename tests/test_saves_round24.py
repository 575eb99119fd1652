"""Saves and their commit (round 24): what the engine removes is only what it can prove it wrote.

* A user's file named `.incomplete` (a download tool's progress, a note) or `metadata.json` inside a committed
  checkpoint was taken for the engine's own by its name alone: overwriting the id (or retention deleting the
  checkpoint) deleted it with no word said. The engine writes neither there for a checkpoint whose manifest
  does not record it: a committed checkpoint holds no marker of ours, and its sharding metadata is named by its
  manifest (`metadata_file`). Such a file is now what any unlisted file is: the replace (and the delete) is
  refused, naming it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CommitError
from torch_checkpointing.retention import RetentionPolicy, apply_retention


def _manager() -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig()))


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((3,), value)}}


# Files a user may keep in a checkpoint directory whose names the engine also uses (for other checkpoints).
_USERS_FILES = {".incomplete": b"42% of weights.bin downloaded\n", "metadata.json": b'{"notes": "mine"}'}


@pytest.mark.parametrize("name", sorted(_USERS_FILES))
def test_overwrite_keeps_a_users_file_named_like_an_engine_file(tmp_path: Path, name: str) -> None:
    ck = tmp_path / "step_1"
    with _manager() as manager:
        manager.save(str(ck), _state(1.0))
        (ck / name).write_bytes(_USERS_FILES[name])
        with pytest.raises(CommitError, match=rf"not part of it \({name}\)"):
            manager.save(str(ck), _state(2.0))
    assert (ck / name).read_bytes() == _USERS_FILES[name]
    if name != ".incomplete":  # the user's marker makes it read as incomplete: the user's doing
        with _manager() as manager:
            assert torch.equal(manager.load(str(ck))["model"]["w"], torch.full((3,), 1.0))
    assert sorted(os.listdir(ck)) == sorted(["manifest.json", "model_0.pt", name])


@pytest.mark.parametrize("name", sorted(_USERS_FILES))
def test_retention_keeps_a_checkpoint_holding_a_users_file_named_like_an_engine_file(tmp_path: Path, name: str) -> None:
    with _manager() as manager:
        for step in (1, 2):
            manager.save(str(tmp_path / f"step_{step}"), _state(float(step)), step=step)
    (tmp_path / "step_1" / name).write_bytes(_USERS_FILES[name])
    if name == ".incomplete":  # a checkpoint with a foreign marker is no committed one: nothing lists it
        assert apply_retention(tmp_path, RetentionPolicy(keep_last=1)) == []
    else:
        apply_retention(tmp_path, RetentionPolicy(keep_last=1))
    assert (tmp_path / "step_1" / name).read_bytes() == _USERS_FILES[name]


def test_retention_names_a_checkpoint_it_keeps_for_a_users_file_once_per_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Retention runs after every save of a long job. Before, each pass said again, at WARNING, that it left the
    checkpoint holding the user's file alone (a line per save, for the whole run); now the first pass says it,
    the later ones at DEBUG, and each pass still leaves it whole."""
    import logging

    with _manager() as manager:
        for step in (1, 2):
            manager.save(str(tmp_path / f"step_{step}"), _state(float(step)), step=step)
    (tmp_path / "step_1" / "metadata.json").write_bytes(_USERS_FILES["metadata.json"])
    with caplog.at_level(logging.DEBUG, logger="torch_checkpointing"):
        for _ in range(3):
            apply_retention(tmp_path, RetentionPolicy(keep_last=1))
    said = [r.levelno for r in caplog.records if "step_1" in r.getMessage() and "metadata.json" in r.getMessage()]
    assert said == [logging.WARNING, logging.DEBUG, logging.DEBUG], said
    assert (tmp_path / "step_1" / "metadata.json").read_bytes() == _USERS_FILES["metadata.json"]


# ------------------------------------------------------------------------------ shared containers, both modes
#
# torch.save pickles an item whole, so a list, dict or tensor reachable under two keys of one item loads back as
# one object, and an async save must write what a sync save writes (staging.as_written). Both rebuilt the
# containers of a tree without remembering which ones they had rebuilt: a sync save whose item held a tensor
# needing its written form (a Parameter, a slice) wrote a shared list as two lists, and an async save (its
# staging copy) did so for every item. Tensors tied across items are one tensor in no file (each item is a file
# of its own), in either mode; a slice is written compacted, as a storage of its own (staging.as_written).


def _shared_state() -> dict[str, Any]:
    t, lst, dct = torch.arange(4.0), [1, [2, 3]], {"lr": 0.1, "betas": [0.9, 0.99]}
    tensors = [torch.full((2,), 7.0), torch.full((3,), 8.0)]  # staged once: the tensors after keep their slots
    return {
        "t1": tensors,
        "t2": tensors,
        "z": torch.full((2,), 9.0),
        "a": t,
        "b": t,
        "l1": lst,
        "l2": lst,
        "d1": dct,
        "nested": {"d2": dct, "l3": lst},
        "p": torch.nn.Parameter(torch.ones(2)),  # needs its written form: the tree is rebuilt
    }


def _sharing(value: dict[str, Any]) -> dict[str, bool]:
    return {
        "a is b": value["a"] is value["b"],
        "t1 is t2": value["t1"] is value["t2"],
        "l1 is l2": value["l1"] is value["l2"],
        "l1 is l3": value["l1"] is value["nested"]["l3"],
        "d1 is d2": value["d1"] is value["nested"]["d2"],
    }


def _as_torch_keeps_it(value: dict[str, Any]) -> dict[str, bool]:
    import io

    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return _sharing(torch.load(buf, weights_only=True))


def _saved_and_loaded(root: Path, state: dict[str, Any], mode: str) -> dict[str, Any]:
    from torch_checkpointing.config import AsyncCheckpointSaverConfig

    save = AsyncCheckpointSaverConfig() if mode == "async" else SyncCheckpointSaverConfig()
    with CheckpointManager(CheckpointManager.Config(save=save)) as manager:
        future = manager.save(str(root), state)
        if future is not None:
            future.result(timeout=120)
        loaded: dict[str, Any] = manager.load(str(root))
    return loaded


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_keeps_what_one_item_shares_as_torch_save_does(tmp_path: Path, mode: str) -> None:
    state = _shared_state()
    expected = _as_torch_keeps_it(state)
    assert all(expected.values()), expected  # torch.save keeps every one of them shared
    loaded = _saved_and_loaded(tmp_path / "ck", {"model": state}, mode)["model"]
    assert _sharing(loaded) == expected
    assert loaded["l1"] == [1, [2, 3]] and loaded["d1"] == {"lr": 0.1, "betas": [0.9, 0.99]}
    assert torch.equal(loaded["a"], torch.arange(4.0)) and torch.equal(loaded["p"], torch.ones(2))
    assert torch.equal(loaded["t1"][1], torch.full((3,), 8.0)) and torch.equal(loaded["z"], torch.full((2,), 9.0))
    loaded["l1"].append(4)  # one list, as the trainer's was
    assert loaded["nested"]["l3"] == [1, [2, 3], 4]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_async_and_sync_saves_load_the_same_sharing(tmp_path: Path, mode: str) -> None:
    """Across items nothing is shared (each item is a file), in both modes alike."""
    t, lst = torch.arange(3.0), [1, 2]
    loaded = _saved_and_loaded(tmp_path / "ck", {"model": {"t": t, "l": lst}, "opt": {"t": t, "l": lst}}, mode)
    assert loaded["model"]["t"] is not loaded["opt"]["t"] and loaded["model"]["l"] is not loaded["opt"]["l"]
    assert torch.equal(loaded["opt"]["t"], t) and loaded["opt"]["l"] == lst


class _RowsView(Mapping[int, list[Any]]):
    """A read-only view whose values are made at each access (a list per row, as a lazy view of a table
    gives): nothing but the walk keeps one alive, so the next one made may reuse its id."""

    def __init__(self, rows: list[torch.Tensor], scale: float) -> None:
        self._rows, self._scale = rows, scale

    def __getitem__(self, key: int) -> list[Any]:
        return [key * self._scale, self._rows[key]]

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._rows)))

    def __len__(self) -> int:
        return len(self._rows)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_values_made_at_each_access_are_each_saved_as_themselves(tmp_path: Path, mode: str) -> None:
    """A container met again was told by its id alone; a value made at the access and dropped once walked gave
    its id to the next one made, which then got the first one's copy (and its tensors no slot): wrong data."""
    rows = [torch.full((2,), float(i)) for i in range(6)]
    state = {"view": _RowsView(rows, 10.0), "p": torch.nn.Parameter(torch.ones(2))}  # p: the tree is rebuilt
    loaded = _saved_and_loaded(tmp_path / "ck", {"model": state}, mode)["model"]
    assert [v[0] for v in loaded["view"].values()] == [i * 10.0 for i in range(6)]
    assert all(torch.equal(v[1], rows[i]) for i, v in enumerate(loaded["view"].values()))


# ------------------------------------------------------------------ a copy aside made on another host (NFS)
#
# The replace without an atomic exchange (NFS) moves the old checkpoint aside under a name that carried only its
# maker's pid and a nonce. gc, or a trainer, on another host sharing the directory took that pid for one of its
# own host: not alive there, so the maker "was dead", and gc put the copy back (or removed it) under a replace
# that may be running. A name now says which host (hostname and boot) made it; a copy of another host's is never
# judged dead by its pid, only once it is older than `unowned_after_s`, as every leftover whose owner cannot be
# checked from here.

_OTHER_HOST = "import socket\nsocket.gethostname = lambda: 'another-host-sharing-the-directory'\n"


def _killed_replace_on_another_host(ckpt: Path) -> Path:
    """`ckpt` (1.0) replaced by 2.0 in a child that takes itself for another host, SIGKILLed between the two
    renames: its pid is no process here, as another host's live replacer's is not. The copy aside it left."""
    import signal
    import subprocess
    import sys

    from tests.test_long_names_and_removal import SUBPROCESS_TIMEOUT_S
    from tests.test_put_back_asides import KILLED_CHILD

    with _manager() as manager:
        manager.save(str(ckpt), {"model": {f"t{i}": torch.full((4,), 1.0) for i in range(3)}}, step=1)
    before = set(os.listdir(ckpt.parent))
    proc = subprocess.run(
        [sys.executable, "-c", _OTHER_HOST + KILLED_CHILD, str(ckpt), "2.0", "between"],
        timeout=SUBPROCESS_TIMEOUT_S,
        capture_output=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    (aside,) = [n for n in set(os.listdir(ckpt.parent)) - before if n.startswith(".old_")]
    assert not ckpt.exists()
    return ckpt.parent / aside


def test_gc_never_judges_another_hosts_copy_aside_dead_by_its_pid(tmp_path: Path) -> None:
    from torch_checkpointing.asides import copy_to_put_back
    from torch_checkpointing.retention import collect_garbage
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

    ckpt = tmp_path / "step_1"
    aside = _killed_replace_on_another_host(ckpt)
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
    choice = copy_to_put_back(storage, ckpt)
    assert choice.chosen is None and "may still be running" in choice.why_not, choice
    report = collect_garbage(tmp_path, unowned_after_s=3600)
    assert not ckpt.exists() and aside.is_dir(), report  # neither put back nor removed under its replacer
    assert [lo for lo in report.removed if lo.path == str(aside)] == [], report
    assert [lo.owner_alive for lo, _ in report.kept if lo.path == str(aside)] == [None], report  # not "dead"
    # Once older than the age after which an owner that cannot be checked counts as gone: put back, whole.
    report = collect_garbage(tmp_path, unowned_after_s=0)
    assert ckpt.is_dir() and not aside.exists(), report
    with _manager() as manager:
        assert float(manager.load(str(ckpt))["model"]["t0"][0]) == 1.0


def test_hidden_names_say_their_host_and_keep_reading_older_ones() -> None:
    from torch_checkpointing.names import ASIDE_RE, TRASH_RE, aside_name, aside_of, host_tag, made_here, trash_name

    here, there = host_tag(), "0badc0de" if host_tag() != "0badc0de" else "0badc0df"
    long_id = "run_" + "x" * 250 + "_1"
    for host, made_on_this_host in ((here, True), (there, False), (None, True)):  # None: an earlier version's
        aside = aside_name(long_id, 123, "abcdef01", host)
        match = ASIDE_RE.match(aside)
        assert match is not None and int(match["pid"]) == 123 and match["host"] == host
        assert made_here(match) is made_on_this_host and aside_of(aside, ["other", long_id]) == long_id
        trash = TRASH_RE.match(trash_name("step_1", 123, "abcdef01", host))
        assert trash is not None and trash["name"] == "step_1" and made_here(trash) is made_on_this_host
    assert ASIDE_RE.match(".old_step_1_123") is not None  # the oldest names: no nonce, no host


# ------------------------------------------------- a rank never re-creates what the failed save's rank 0 removed
#
# A rank's files below a subdirectory (`rank_{rank}/w.pt`) had that subdirectory made by a recursive mkdir: once
# rank 0 had removed the save's temporary directory and the id's parents it made (the save having failed on it),
# a slower rank re-created all of them, wrote its files there, and left them, the temporary without the marker
# that makes it gc's to collect. Now the rank's write stops with a `CommitError` naming the missing directory.


def test_a_rank_does_not_recreate_the_directories_rank_0_removed(tmp_path: Path) -> None:
    import shutil

    from torch_checkpointing.checkpoint_layout import TorchSerialization
    from torch_checkpointing.checkpoint_writer import SavePlan, WriteEntry, WriteRequest, _write_local_files
    from torch_checkpointing.commit import Commit
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

    made = tmp_path / "runs"  # the id's parent, made for this save by its rank 0

    class RemovedByRank0AfterTheMarker(LocalFileSystemStorage):
        """Rank 0 fails and removes what it made right after this rank has begun (its marker written)."""

        def write(self, path: Path, data: bytes) -> None:
            super().write(path, data)
            if path.name == ".incomplete":
                shutil.rmtree(made)

    made.mkdir()
    plan = SavePlan(checkpoint_dir=str(made / "step_1"), tmp_dir=str(made / ".step_1.tmp-ab-1"), rank=1, world_size=2)
    entry = WriteEntry("model", "rank_1/model.pt", TorchSerialization(), {"w": torch.ones(2)})
    storage = RemovedByRank0AfterTheMarker(LocalFileSystemStorageConfig(use_direct_io=False))
    with pytest.raises(CommitError, match=r"runs/\.step_1\.tmp-ab-1, which the save's rank 0 created or found"):
        _write_local_files(storage, WriteRequest(plan, [entry]), Commit(storage, plan.target()))
    assert os.listdir(tmp_path) == []
