"""An `.incomplete` marker or a record of a save's files holding JSON nested deeper than Python's parser recurses.

`Claim.parse`, `manifest.claim_token` (so `our_marker`) and gc's reader of records caught what `json.loads`
raises for bytes that are no JSON (ValueError), but not the RecursionError it raises for `[[[[...` a few
thousand levels deep: a crafted marker of 10 KB, or a record, failed the whole gc pass with a bare
RecursionError, and no other dead save under the root was collected. Such bytes are no claim and no record of
ours: the marker's folder is kept as another program's, the record is named and left, as for any other bytes
that are not ours, and the rest of the pass goes on.

Real files, and the real S3 server (tests/s3_server.py) for the store that claims ids in place.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import pytest

from tests.s3_server import S3Server
from tests.test_objstore_round21 import _dead_pid
from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.commit import Claim, record_name
from torch_checkpointing.manifest import INCOMPLETE_MARKER, MAX_MARKER_BYTES, claim_token, our_marker
from torch_checkpointing.retention import collect_garbage

pytest.importorskip("fsspec")

_DEPTH = 20_000  # far past any recursion limit, and still a marker-sized file
_DEEP = "[" * _DEPTH + "]" * _DEPTH
_CLAIM = '{{"token": {token}, "uid": "u", "host": "h", "pid": 1, "created": 1.0{extra}}}'
_DEEP_MARKERS = [
    pytest.param(_DEEP.encode(), id="array"),
    pytest.param(_CLAIM.format(token=_DEEP, extra="").encode(), id="token"),
    pytest.param(_CLAIM.format(token='"t"', extra=f', "x": {_DEEP}').encode(), id="extra"),
]


@pytest.mark.parametrize("marker", _DEEP_MARKERS)
def test_a_deeply_nested_marker_is_no_claim(marker: bytes) -> None:
    assert len(marker) < MAX_MARKER_BYTES
    assert Claim.parse(marker) is None
    assert claim_token(marker) is None
    assert not our_marker(marker)


@pytest.mark.parametrize("marker", _DEEP_MARKERS)
def test_gc_keeps_a_deeply_nested_markers_folder_and_collects_the_rest(s3_server: S3Server, marker: bytes) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    storage.write(Path("run/crafted/.incomplete"), marker)
    storage.write(Path("run/crafted/notes.txt"), b"a user's")
    storage.write(Path("run/dead/.incomplete"), b"")  # an earlier version's save, dead before it wrote a file
    report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=0.0)
    assert [Path(lo.path).name for lo in report.removed] == ["dead"], report
    assert [Path(lo.path).name for lo, _ in report.kept] == ["crafted"], report
    assert storage.read(Path("run/crafted/notes.txt")) == b"a user's"


def test_a_deeply_nested_record_is_not_ours(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = f"file://{tmp_path}/run"
    storage = FsspecStorageConfig(url=url).create_storage()
    (tmp_path / "run" / "x").mkdir(parents=True)
    token = ".x.tmp-0123456789ab-1"
    claim = Claim(token, "0123456789ab", socket.gethostname(), _dead_pid(), time.time(), records=True)
    storage.write(Path("x") / INCOMPLETE_MARKER, claim.to_bytes())
    storage.write(Path("x") / "model_0.pt", b"half a tensor")
    storage.write(Path("x") / record_name(token, 0), json.dumps({"files": ["model_0.pt"]}).encode())
    crafted = record_name(token, 1)
    storage.write(Path("x") / crafted, f'{{"files": {_DEEP}}}'.encode())
    storage.write(Path("x") / "notes.txt", b"a user's")
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        report = collect_garbage(url, storage, unowned_after_s=0)
    assert [Path(lo.path).name for lo in report.removed] == ["x"], report
    assert sorted(os.listdir(tmp_path / "run" / "x")) == [crafted, "notes.txt"]
    assert crafted in caplog.text, caplog.text
