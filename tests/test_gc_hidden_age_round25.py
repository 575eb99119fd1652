"""Round 25: gc aged a hidden directory of another host (a `.trash-` of its retention) by its mtime.

A rename does not change a directory's mtime: a checkpoint written three days ago and moved to its trash name a
moment ago by another host's retention (still checking it, and about to put it back if it was re-saved meanwhile)
read as three days old, past `unowned_after_s`, and this host's gc removed it under that retention. Its age is
now taken from when it got its name (a rename sets the ctime), as the put-back of an aside copy already was.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from tests.clock_skew import stated_age_s
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.names import host_tag, trash_name
from torch_checkpointing.retention import collect_garbage


def _written_days_ago(directory: Path, days: float) -> None:
    then = time.time() - days * 86400
    for where, _, files in os.walk(directory):
        for name in files:
            os.utime(os.path.join(where, name), (then, then))
        os.utime(where, (then, then))


def test_gc_keeps_a_trash_another_host_made_a_moment_ago_from_an_old_checkpoint(tmp_path: Path) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(tmp_path / "step_1"), {"model": {"w": torch.ones(3)}})
    _written_days_ago(tmp_path / "step_1", 3)
    other = "0badc0de" if host_tag() != "0badc0de" else "0badc0df"
    trash = tmp_path / trash_name("step_1", 4242, "abcdef01", other)
    os.rename(tmp_path / "step_1", trash)  # another host's retention, just now
    report = collect_garbage(tmp_path)  # the default age: 24 h
    assert trash.is_dir(), report
    assert [k.path for k, _ in report.kept] == [str(trash)], report
    assert stated_age_s(report.kept[0][1]) < 60, report.kept  # not 3 days
    assert collect_garbage(tmp_path, unowned_after_s=0).removed and not trash.exists()
