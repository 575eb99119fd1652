"""A listing or load on a store that is no local filesystem never probes a local folder's clock.

The age of a copy a replace moved aside (is it a live replace between its renames?) and the start of the process
with its pid were read with `local_store_now(copy.parent)` before the copy's own stamp. On an object store (or
`memory://`) that path is no local folder: with an id relative to the store's url root (`run/step_1`, as a
manager's ids are) it named `./run` in the caller's working directory, and `latest_checkpoint` made its clock
probe there, in a user's folder that has nothing to do with the store (on NFS a named `.clock-probe-` file),
and took that folder's clock for the store's. Where no probe could be made there it said, at INFO, that "the
clock of the store at <cwd>/run cannot be read".
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest

from torch_checkpointing.discovery import latest_checkpoint
from torch_checkpointing.names import aside_name, host_tag, new_nonce
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


def test_latest_on_a_remote_store_with_a_copy_aside_probes_no_local_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").write_text("a user's file that happens to be called run")  # no probe can be made in it
    storage = FsspecStorageConfig(url=f"memory://probe-place-{new_nonce()}").create_storage()
    live = subprocess.Popen(["sleep", "60"])  # a live replace of this host, between its renames
    try:
        aside = Path("run") / aside_name("step_1", live.pid, new_nonce(), host_tag())
        storage.write(aside / "manifest.json", b"{}")
        with caplog.at_level(logging.DEBUG, logger="torch_checkpointing"):
            assert latest_checkpoint("run", storage) is None
    finally:
        live.kill()
        live.wait(timeout=30)
    local = [r.getMessage() for r in caplog.records if str(tmp_path) in r.getMessage()]
    assert local == [], local
    assert os.listdir(tmp_path) == ["run"]
