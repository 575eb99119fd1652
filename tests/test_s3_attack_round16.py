"""Round 16 attacks on the object-store backend, as real processes against a real S3 server (moto on loopback).

* A save SIGKILLed at varied moments (first save, and a refused overwrite of a committed id) leaves nothing
  a load accepts and never damages the earlier checkpoint.
* A load racing a delete and re-save of its id, in another process, returns one save's data whole or raises
  a CheckpointError: never a mix of the two.
  Before, a load that looked while the new save was starting (the id's prefix empty, then its `.incomplete`
  marker up) raised NotADirectoryError "run/x is a file, not a directory": a wrong diagnosis, no retry hint.
* A trainer SIGKILLed during an async save to S3 leaves the id committed whole or not loadable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs
import torch

from tests.s3_server import TEST_PART_SIZE, S3Server
from tests.test_s3_attacks import sync_manager
from torch_checkpointing import latest_checkpoint, list_checkpoints
from torch_checkpointing.errors import CheckpointError, IncompleteCheckpointError
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

REPO = Path(__file__).resolve().parent.parent
N = 3 * TEST_PART_SIZE // 4  # float32s: a file of three parts, uploaded and read with several requests


def big_state(value: float) -> dict[str, Any]:
    """Items whose every element is `value`: a load that mixes two saves shows two values."""
    return {
        "model": {"w": torch.full((N,), value), "b": torch.full((10,), value)},
        "optim": {"m": torch.full((N // 3,), value)},
        "meta": {"value": value},
    }


def assert_one_save(got: dict[str, Any], values: set[float]) -> float:
    """Every tensor and the metadata carry one single value, one of `values`: no mix of two saves."""
    seen = {float(t.unique().item()) for t in (got["model"]["w"], got["model"]["b"], got["optim"]["m"])}
    assert len(seen) == 1 and seen == {got["meta"]["value"]} and seen <= values, seen
    return seen.pop()


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _config_args(config: FsspecStorageConfig) -> dict[str, Any]:
    return {"url": config.url, "storage_options": config.storage_options, "part_size": config.part_size}


SAVING_CHILD = """
import json, sys
from pathlib import Path
from tests.test_s3_attack_round16 import big_state
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

def main():
    a = json.loads(sys.argv[1])
    save = AsyncCheckpointSaverConfig() if a["async"] else SyncCheckpointSaverConfig()
    config = FsspecStorageConfig(**a["config"])
    with CheckpointManager(CheckpointManager.Config(save=save, storage_config=config)) as m:
        state = big_state(a["value"])
        Path(a["started"]).touch()
        try:
            out = m.save(a["id"], state)
            if a["async"]:
                Path(a["started"] + ".queued").touch()
                out.result(timeout=300)
            print("SAVED", flush=True)
        except Exception as exc:
            print("FAILED", type(exc).__name__, exc, flush=True)

if __name__ == "__main__":
    main()
"""


def _killed_save(
    config: FsspecStorageConfig, tmp: Path, checkpoint_id: str, value: float, delay_s: float, use_async: bool = False
) -> str:
    """Run a save of `checkpoint_id` in a child process and SIGKILL it `delay_s` after it starts saving."""
    started = tmp / f"started-{time.monotonic_ns()}"
    args = {"config": _config_args(config), "id": checkpoint_id, "value": value, "started": str(started)}
    args["async"] = use_async
    child = subprocess.Popen(
        [sys.executable, "-c", SAVING_CHILD, json.dumps(args)],
        cwd=REPO,
        env=_child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay_s)
        child.kill()
    finally:
        out = child.communicate(timeout=60)[0].decode(errors="replace")
    return out


def _load_or_refuse(config: FsspecStorageConfig, checkpoint_id: str, value: float) -> bool:
    """True if the id loads (it must be that save, whole); False if the load refuses it: a CheckpointError, or
    FileNotFoundError when nothing of the save is there."""
    with sync_manager(config) as manager:
        try:
            got = manager.load(checkpoint_id)
        except (CheckpointError, FileNotFoundError):
            return False
    assert_one_save(got, {value})
    return True


@pytest.mark.parametrize("delay_s", [0.0, 0.3, 0.8, 1.5, 3.0])
def test_a_first_save_killed_at_any_moment_leaves_nothing_loadable_and_the_earlier_checkpoint_whole(
    s3_server: S3Server, tmp_path: Path, delay_s: float
) -> None:
    """A save killed midway must never leave something load() accepts, nor damage an earlier checkpoint."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", big_state(1.0))
    _killed_save(config, tmp_path, "run/step_2", 2.0, delay_s)
    committed = _load_or_refuse(config, "run/step_2", 2.0)
    assert _load_or_refuse(config, "run/step_1", 1.0)
    names = [c.name for c in list_checkpoints(f"{config.url}/run", config.create_storage())]
    assert names == (["step_1", "step_2"] if committed else ["step_1"])


@pytest.mark.parametrize("delay_s", [0.0, 0.2, 0.6])
def test_an_overwrite_killed_at_any_moment_leaves_the_committed_checkpoint_whole(
    s3_server: S3Server, tmp_path: Path, delay_s: float
) -> None:
    """An object store refuses to overwrite a committed id; a save of it killed midway must not damage it."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", big_state(1.0))
    _killed_save(config, tmp_path, "run/step_1", 2.0, delay_s)
    assert _load_or_refuse(config, "run/step_1", 1.0)
    latest = latest_checkpoint(f"{config.url}/run", config.create_storage())
    assert latest is not None and latest.name == "step_1"


@pytest.mark.parametrize("delay_s", [0.0, 1.0, 2.5])
def test_a_trainer_killed_during_an_async_save_leaves_the_id_whole_or_refused(
    s3_server: S3Server, tmp_path: Path, delay_s: float
) -> None:
    """An async save whose trainer is SIGKILLed: the writer process must not leave a half checkpoint."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", big_state(1.0))
    _killed_save(config, tmp_path, "run/step_2", 2.0, delay_s, use_async=True)
    time.sleep(3.0)  # an orphaned writer, if any, has had time to go on
    _load_or_refuse(config, "run/step_2", 2.0)
    assert _load_or_refuse(config, "run/step_1", 1.0)


RESAVING_CHILD = """
import json, sys, time
from pathlib import Path
from tests.test_s3_attack_round16 import big_state
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.retention import delete_checkpoint
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

a = json.loads(sys.argv[1])
config = FsspecStorageConfig(**a["config"])
storage = config.create_storage()
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
    value = 1.0
    while not Path(a["stop"]).exists():
        value = 3.0 - value
        assert delete_checkpoint(a["url_id"], storage)
        m.save(a["id"], big_state(value))
        Path(a["saved"]).touch()
print("RESAVED", flush=True)
"""


def test_a_load_racing_a_delete_and_resave_returns_one_save_or_raises(s3_server: S3Server, tmp_path: Path) -> None:
    """A load racing another process that replaces the id (an object store cannot overwrite, so: delete, then
    save) returns one save's data whole or raises a CheckpointError; it never mixes the two."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/x", big_state(1.0))
    stop, saved = tmp_path / "stop", tmp_path / "saved"
    args = {"config": _config_args(config), "id": "run/x", "url_id": f"{config.url}/run/x"}
    args.update(stop=str(stop), saved=str(saved))
    child = subprocess.Popen(
        [sys.executable, "-c", RESAVING_CHILD, json.dumps(args)],
        cwd=REPO,
        env=_child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    loaded, refused = 0, []
    try:
        deadline = time.monotonic() + 120
        while not saved.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with sync_manager(config) as manager:
            end = time.monotonic() + 25
            while time.monotonic() < end and child.poll() is None:
                try:
                    got = manager.load("run/x")
                except (CheckpointError, FileNotFoundError) as exc:  # between the delete and the save: no id
                    refused.append(f"{type(exc).__name__}: {exc}")
                    continue
                assert_one_save(got, {1.0, 2.0})
                loaded += 1
    finally:
        stop.touch()
        out = child.communicate(timeout=120)[0].decode(errors="replace")
    assert "RESAVED" in out, out[-3000:]
    assert loaded + len(refused) > 3, (loaded, refused)
    assert all("run/x" in why for why in refused), sorted({why[:200] for why in refused})


class StartingSaveS3FileSystem(s3fs.S3FileSystem):  # type: ignore[misc]
    """Right after the first "is it a prefix?" lookup of `trigger` answers, creates `trigger/.incomplete`
    through a second, plain client (a real PUT): another process's save of the id starting between two of a
    load's requests."""

    def __init__(self, *args: Any, trigger: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trigger = trigger
        self._plain = s3fs.S3FileSystem(*args, **kwargs)
        self.created = False

    def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The storage's "is it a prefix?" is its own listing of `trigger/` (s3fs's `isdir` hid a NoSuchBucket)."""
        out = fsspec.asyn.sync(self.loop, self._call_s3, method, *args, **kwargs)
        bucket, _, key = self.trigger.partition("/")
        looked = method == "list_objects_v2" and (kwargs.get("Bucket"), kwargs.get("Prefix")) == (bucket, key + "/")
        if looked and not self.created:
            self.created = True
            self._plain.pipe_file(f"{self.trigger}/.incomplete", b"")
            self.invalidate_cache()
        return out


def test_a_load_that_looks_as_a_save_of_the_id_starts_says_incomplete_not_a_file(s3_server: S3Server) -> None:
    """Defect: `require_directory` asked "a prefix?" (no: nothing there yet), then "anything?" (yes: the new
    save's marker) and concluded "run/x is a file, not a directory". The id holds a save being written:
    the load must say it is incomplete (a CheckpointError), as it does once the marker is there."""
    config = s3_server.config()
    trigger = config.create_storage().remap_path(Path("run/x")).split("://", 1)[1]
    fs = StartingSaveS3FileSystem(**s3_server.storage_options(), trigger=trigger)
    racing = FsspecStorageConfig(url=config.url, part_size=config.part_size, filesystem=fs)
    with sync_manager(racing) as manager, pytest.raises(IncompleteCheckpointError, match="run/x"):
        manager.load("run/x")
    assert fs.created
