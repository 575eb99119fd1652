"""A save's claim (the JSON in an `.incomplete` marker) holding a number no claim of ours holds.

`Claim.parse` read the marker with Python's lenient `json.loads`, which takes the bare `NaN`/`Infinity` tokens
and turns `1e999` into an infinite float. A pid of `1e999` or `Infinity` then failed gc and every save of the
id with a bare `OverflowError` (int() of an infinite float); a `created` of `NaN` or `Infinity` made a claim
whose age ("nans old") never passes 24 h, so the id was refused to every later save, forever. A claim whose
fields cannot be read is no claim (a `pid` of "x" already was): gc collects it and a save takes the id over.

Against the real moto server (tests/s3_server.py): on an object store a save claims its id in place.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.s3_server import S3Server
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig, list_checkpoints
from torch_checkpointing.commit import Claim
from torch_checkpointing.retention import collect_garbage

_CLAIM = '{{"token": "t", "uid": "u", "host": "h", "pid": {pid}, "created": {created}}}'
_UNREADABLE = [
    pytest.param("1e999", "1.0", id="pid-1e999"),
    pytest.param("Infinity", "1.0", id="pid-Infinity"),
    pytest.param("1", "NaN", id="created-NaN"),
    pytest.param("1", "Infinity", id="created-Infinity"),
    pytest.param("1", "1e999", id="created-1e999"),
]


@pytest.mark.parametrize(("pid", "created"), _UNREADABLE)
def test_a_claim_holding_a_non_finite_number_is_no_claim(pid: str, created: str) -> None:
    assert Claim.parse(_CLAIM.format(pid=pid, created=created).encode()) is None
    assert Claim.parse(_CLAIM.format(pid="12", created="1.5").encode()) is not None  # the same claim, readable


@pytest.mark.parametrize(("pid", "created"), _UNREADABLE)
def test_gc_collects_and_a_save_takes_over_such_a_claim(s3_server: S3Server, pid: str, created: str) -> None:
    gc_collects_and_a_save_takes_over(s3_server, _CLAIM.format(pid=pid, created=created).encode())


def gc_collects_and_a_save_takes_over(s3_server: S3Server, marker: bytes) -> None:
    """A dead claim `marker` on two ids: gc collects the one, a save takes the other over and commits."""
    config = s3_server.config()
    storage = config.create_storage()
    storage.write(Path("gc/step_1/.incomplete"), marker)
    storage.write(Path("save/step_1/.incomplete"), marker)
    report = collect_garbage(f"{config.url}/gc", unowned_after_s=0.0, storage=storage)
    assert [leftover.path for leftover in report.removed] == [f"{config.url}/gc/step_1"], report
    manager_config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)
    with CheckpointManager(manager_config) as manager:
        manager.save("save/step_1", {"m": {"x": torch.ones(2)}}, step=1)
    assert [info.step for info in list_checkpoints(f"{config.url}/save", storage)] == [1]
