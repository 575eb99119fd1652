"""A prune whose removal failed after the rename names the trash folder it left, and the CLI exits 1.

Real refusal: `chattr +i` on a file of the checkpoint pruned (EPERM, even for root). Before, the rename to the
trash name worked, the removal did not, and `PruneReport`/`prune --json` listed the checkpoint as deleted and
named nothing left; the CLI exited 0, and only a WARNING on stderr said a folder was left behind.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.cli import main
from torch_checkpointing.retention import RetentionPolicy, prune


@pytest.fixture
def blocked_run(tmp_path: Path) -> Iterator[Path]:
    """A run of two checkpoints whose older one holds an immutable file."""
    root = tmp_path / "run"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in (1, 2):
            manager.save(str(root / f"step_{step}"), {"m": {"x": torch.ones(2)}}, step=step)
    blocked = root / "step_1" / "m_0.pt"
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(blocked)]).returncode != 0:
        pytest.skip("chattr +i is not available on this filesystem or to this user")
    try:
        yield root
    finally:
        for path in root.glob("*step_1*/m_0.pt"):
            subprocess.run(["chattr", "-i", str(path)], check=True)


def _trash(root: Path) -> str:
    (trash,) = [p for p in root.iterdir() if p.name.startswith(".step_1.trash-")]
    return str(trash)


def test_the_report_names_the_trash_left(blocked_run: Path) -> None:
    report = prune(blocked_run, RetentionPolicy(keep_last=1))
    assert [c.name for c in report.deleted] == ["step_1"], report  # no checkpoint any more either way
    ((path, why),) = report.trash_left
    assert path == _trash(blocked_run) and "chattr -i" in why, report


def test_the_cli_names_the_trash_left_and_exits_1(blocked_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "prune", str(blocked_run), "--keep-last", "1"]) == 1
    out = json.loads(capsys.readouterr().out)
    ((left,),) = [out["trash_left"]]
    assert left["path"] == _trash(blocked_run) and "chattr -i" in left["reason"], out


def test_the_cli_text_names_the_trash_left(blocked_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prune", str(blocked_run), "--keep-last", "1"]) == 1
    assert f"TRASH LEFT {_trash(blocked_run)}:" in capsys.readouterr().out
