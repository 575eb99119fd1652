"""Round 17 attacks on the object-store backend, against a real S3 server (moto on loopback, tests/s3_server.py).

* A user's folder under a run whose `.incomplete` is another program's file (a download tool's progress, neither
  empty nor a save's claim): gc deleted it with the user's files (on S3 any `.incomplete` made a prefix "an
  unfinished save of ours" whose claim was "dead"), and a save of that id took it over and wrote among them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.errors import CommitError
from torch_checkpointing.retention import collect_garbage

# ------------------------------------------------------------------------------------ foreign objects under a run


def test_a_users_folder_with_another_programs_incomplete_file_is_never_collected_or_saved_into(
    s3_server: S3Server,
) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    user = {"run/downloads/.incomplete": b"downloaded 45% of dataset.tar", "run/downloads/dataset.tar.part": b"x" * 64}
    for key, data in user.items():
        storage.write(Path(key), data)
    (leftover,) = list_leftovers(f"{config.url}/run", storage)
    assert not leftover.recognised, leftover
    report = collect_garbage(f"{config.url}/run", storage)
    assert not report.removed and not report.failed, report
    assert "not a marker of ours" in report.kept[0][1]
    with sync_manager(config) as manager, pytest.raises(CommitError, match="not a marker of ours"):
        manager.save("run/downloads", state(2.0))
    for key, data in user.items():  # every byte of the user's folder is still there, and nothing else
        assert storage.read(Path(key)) == data, key
    assert sorted(storage.ls(Path("run/downloads"))) == [".incomplete", "dataset.tar.part"]
    with sync_manager(config) as manager:
        assert float(manager.load("run/step_1")["model"]["w"][0]) == 1.0
