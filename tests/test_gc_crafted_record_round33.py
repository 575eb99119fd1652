"""A record of a save's files whose "files" is not a list of names is not ours.

gc of a dead save's prefix on a store that records no writer per object deletes the names its records list.
A record (`.incomplete.<hash>.<rank>`) holding `{"files": "abc"}` was read as the names a, b, c: a user's files
of those names were deleted, and so was the record. Now such a record is refused as not ours (crafted, or
damaged): none of its names is deleted, and it is left in place, named at WARNING.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import pytest

from tests.test_objstore_round21 import _dead_pid
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.commit import Claim, record_name
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")


@pytest.mark.parametrize("files", ["abc", ["a", "b", "c", 7], {"a": 1, "b": 2, "c": 3}], ids=["str", "int", "dict"])
def test_a_record_whose_files_is_no_list_of_names_is_not_ours(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, files: object
) -> None:
    url = f"file://{tmp_path}/run"
    storage = FsspecStorageConfig(url=url).create_storage()
    (tmp_path / "run" / "x").mkdir(parents=True)
    token = ".x.tmp-0123456789ab-1"
    claim = Claim(token, "0123456789ab", socket.gethostname(), _dead_pid(), time.time(), records=True)
    storage.write(Path("x") / INCOMPLETE_MARKER, claim.to_bytes())
    storage.write(Path("x") / "model_0.pt", b"half a tensor")
    storage.write(Path("x") / record_name(token, 0), json.dumps({"files": ["model_0.pt"]}).encode())
    crafted = record_name(token, 1)
    storage.write(Path("x") / crafted, json.dumps({"files": files}).encode())
    for name in "abc":
        storage.write(Path("x") / name, b"a user's")
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        report = collect_garbage(url, storage, unowned_after_s=0)
    assert [Path(lo.path).name for lo in report.removed] == ["x"], report
    assert sorted(os.listdir(tmp_path / "run" / "x")) == [crafted, "a", "b", "c"]
    assert crafted in caplog.text, caplog.text
