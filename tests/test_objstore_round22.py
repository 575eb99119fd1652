"""Round 22: object stores that record no writer per object (fsspec `file://`, `memory://`; GCS and Azure the
same way), where a save's ranks name what they write in records beside its claim (round 21).

* A save that took over the claim of a killed save of the same id committed with the killed save's records
  and files still under it: files its manifest does not list, which nothing ever deleted (the marker, which
  gc looks for, was gone once the new save committed).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_objstore_round21 import _KILLED_SAVE_CHILD, USER, _entries, _root_url
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.manifest import INCOMPLETE_MARKER

pytest.importorskip("fsspec")

REPO = Path(__file__).resolve().parent.parent
_CHILD_TIMEOUT_S = 120


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _killed_save(url: str, ckpt: str, user: dict[str, bytes] = USER) -> None:
    """A trainer SIGKILLed mid-save (after its uploads and the `user`'s files, before any manifest)."""
    args = {"url": url, "id": ckpt, "user": {rel: data.decode() for rel, data in user.items()}}
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE_CHILD, json.dumps(args)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        timeout=_CHILD_TIMEOUT_S,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode(errors="replace")[-3000:]


def _plain_manager(url: str) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url))
    )


def test_a_save_that_takes_over_a_killed_saves_claim_removes_that_saves_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The killed save wrote `rank_0/model.safetensors`, `optim_0.pt`, `x_0.pt` and its record; the next save of
    the id (another job: the killed one's owner lock is free) writes only `model_0.pt`. Before, the committed
    checkpoint kept the killed save's record and its three files for good; now they go at the commit (named at
    WARNING by URL), and the user's files, which no record names, stay."""
    url, ckpt = _root_url("file", tmp_path), "step_1"
    _killed_save(url, ckpt)
    storage = FsspecStorageConfig(url=url).create_storage()
    dead_files, _ = _entries(storage, ckpt)
    assert {"optim_0.pt", "x_0.pt", "rank_0/model.safetensors"} <= dead_files, dead_files
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    with _plain_manager(url) as manager:
        manager.save(ckpt, {"model": {"w": torch.arange(3.0)}})
        restored = manager.load(ckpt)
    assert set(restored) == {"model"}
    assert torch.equal(restored["model"]["w"], torch.arange(3.0))
    files, dirs = _entries(storage, ckpt)
    assert files == {"manifest.json", "model_0.pt", *USER}, files
    assert dirs == {"eval"}, dirs  # the killed save's `rank_0/` went with its file, the user's `eval/` stays
    assert not [name for name in files if name.startswith(INCOMPLETE_MARKER)], files
    assert f"{url}/{ckpt}/optim_0.pt" in caplog.text, caplog.text  # what went is named, by URL
    for rel in USER:
        assert storage.read(Path(ckpt) / rel) == USER[rel]


@pytest.mark.parametrize("store", ["memory", "file"])
def test_a_conditional_replace_or_delete_off_s3_leaves_a_marker_that_changed(store: str, tmp_path: Path) -> None:
    """Off S3 there is no ETag, and `replace_object` / `delete_object` ignored the version they were given: gc's
    delete of the claim it had judged dead removed the claim a new save had put there since (and a takeover
    replaced it), so that save's commit failed on "no longer holds the id" and left its files behind. They now
    compare the marker's bytes with the version read (a check, then the act: not atomic, see docs)."""
    storage = FsspecStorageConfig(url=_root_url(store, tmp_path)).create_storage()
    marker = Path("step_3") / INCOMPLETE_MARKER
    storage.mkdir(marker.parent)
    assert storage.create_object(marker, b'{"claim": "dead"}')
    judged = storage.read_object(marker)
    assert judged is not None
    assert storage.replace_object(marker, b'{"claim": "new save"}', judged[1])  # the new save's takeover
    assert not storage.replace_object(marker, b'{"claim": "third"}', judged[1])
    assert not storage.delete_object(marker, judged[1])
    assert storage.read(marker) == b'{"claim": "new save"}'
    current = storage.read_object(marker)
    assert current is not None and current[1] != judged[1]
    assert storage.delete_object(marker, current[1]) and not storage.exists(marker)
    assert not storage.replace_object(marker, b'{"claim": "fourth"}', current[1])  # gone: nothing is made
    assert not storage.exists(marker)
