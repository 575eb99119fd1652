"""A write on fsspec `file://` that fails midway (a full disk, here RLIMIT_FSIZE) leaves no partial file.

`FsspecStorage.write` of a file up to one part was one `pipe_file`, which on `file://` writes in place: a
write refused midway left the bytes before the refusal under the file's name. A save whose manifest write
failed so left a truncated `manifest.json` beside its claim: listed as "a damaged checkpoint", named by gc as
"left in place ... not written by this save", and every later save of the id was refused ("its manifest.json
is not a torch_checkpointing manifest") until a person deleted it. The stream writer already dropped what a
failed write left (`_FsspecFileWriter._discard`); `write` now goes through it there.

A real process under a real RLIMIT_FSIZE (SIGXFSZ ignored, so the write fails with EFBIG), on real files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_objstore_round22 import REPO, _env
from torch_checkpointing import CheckpointManager, FsspecStorageConfig, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")

_LIMIT = 10_000  # bytes: each item's file is under it, the manifest of 60 items is not

_UNDER_LIMIT = r"""
import json, resource, signal, sys
from pathlib import Path
args = json.loads(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (args["limit"], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
import torch
from torch_checkpointing import CheckpointManager, FsspecStorageConfig
from torch_checkpointing.config import SyncCheckpointSaverConfig
config = FsspecStorageConfig(url=args["url"])
try:
    if args["what"] == "write":
        config.create_storage().write(Path("big.bin"), b"x" * args["size"])
    elif args["what"] == "stream":
        with config.create_storage().stream_write(Path("big.bin")) as stream:
            for _ in range(args["size"] // 3000):
                stream.write(b"x" * 3000)
    else:
        state = {f"item{i}": {"w": torch.arange(2.0)} for i in range(60)}
        with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
            m.save("step_1", state)
except Exception as exc:
    print("RAISED", type(exc).__name__, exc)
"""


def _under_limit(what: str, url: str, size: int = 0) -> str:
    args = json.dumps({"what": what, "url": url, "limit": _LIMIT, "size": size})
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_LIMIT, args], cwd=REPO, env=_env(), capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    return done.stdout.decode()


@pytest.mark.parametrize("size", [_LIMIT + 2_000, 3 * _LIMIT], ids=["a-part-buffered", "all-written-through"])
@pytest.mark.parametrize("what", ["write", "stream"])
def test_a_write_refused_midway_leaves_no_partial_file(tmp_path: Path, what: str, size: int) -> None:
    """A stream of small writes fails where its buffer is flushed; closing it to discard it flushes again and
    failed again: that bare OSError replaced the upload's error, and the partial file was left."""
    out = _under_limit(what, f"file://{tmp_path}", size)
    assert "RAISED ObjectStoreError" in out and "big.bin" in out, out
    assert os.listdir(tmp_path) == []


def test_a_save_whose_manifest_write_failed_leaves_the_id_to_the_next_save(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/run"
    out = _under_limit("save", url)
    assert "RAISED" in out and "manifest.json" in out, out
    storage = FsspecStorageConfig(url=url).create_storage()
    assert not list_checkpoints(url, storage)
    report = collect_garbage(url, storage, unowned_after_s=0)
    assert not report.failed, report
    assert not (tmp_path / "run" / "step_1" / "manifest.json").exists()
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=FsspecStorageConfig(url=url))
    with CheckpointManager(config) as manager:
        manager.save("step_1", {"model": {"w": torch.arange(3.0)}})
    assert [Path(info.path).name for info in list_checkpoints(url, storage)] == ["step_1"]


_OPEN_REFUSED = r"""
import gc, logging, sys
from pathlib import Path
from torch_checkpointing import FsspecStorageConfig
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
storage = FsspecStorageConfig(url=sys.argv[1]).create_storage()
try:
    storage.write(Path("no/such/folder.bin"), b"x")
except Exception as exc:
    print("RAISED", type(exc).__name__, exc)
gc.collect()  # the half-made stream, its traceback dropped, is finalized
print("COLLECTED")
"""


def test_a_stream_that_could_not_open_is_dropped_quietly(tmp_path: Path) -> None:
    """Its open refused (no such folder), the half-made stream was closed by the finalizer, whose close reached
    for the file it never opened: a second "upload ... failed: AttributeError ... '_inner'" at WARNING."""
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_REFUSED, f"file://{tmp_path}"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        timeout=120,
    )
    out = done.stdout.decode()
    assert "RAISED ObjectStoreError" in out and "FileNotFoundError" in out and "COLLECTED" in out, out
    assert "AttributeError" not in out + done.stderr.decode(), out
    assert os.listdir(tmp_path) == []
