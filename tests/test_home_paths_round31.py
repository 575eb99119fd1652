"""A `~` path means the home directory everywhere it is taken, as a save's id does (round 31).

`save("~/run/step_2")` writes under the home directory and the Python readers expand `~` too; but the CLI took
its path arguments literally ("~/run: no such directory" from `ls`, `verify`, `prune`, `gc`, `inspect`, `diff`,
where a shell leaves `~` alone: quoted, or after `=`), and export_hf's output directory `~/hf` was written as a
folder named '~' under the working directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.home_dirs import home_and_work
from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.cli import main
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Steps 1 and 2 saved as '~/run/step_N', HOME a fresh directory; the working directory holds no 'run'."""
    home, _ = home_and_work(tmp_path, monkeypatch)
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig())
    with CheckpointManager(config) as manager:
        for step in (1, 2):
            manager.save(f"~/run/step_{step}", {"m": {"x": torch.ones(2)}})
    return home


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "~/run"],
        ["inspect", "~/run/step_1"],
        ["verify", "~/run/step_1"],
        ["diff", "~/run/step_1", "~/run/step_2"],
        ["gc", "~/run", "--dry-run"],
        ["prune", "~/run", "--keep-last", "1", "--dry-run"],
    ],
    ids=lambda argv: argv[0],
)
def test_the_cli_expands_a_home_path(home: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Defect: exit 2 (1 for verify), "~/run: no such directory"."""
    assert main(argv) == 0, capsys.readouterr()
    assert "no such directory" not in capsys.readouterr().err


def test_the_cli_prunes_under_the_home_directory(home: Path) -> None:
    assert main(["prune", "~/run", "--keep-last", "1"]) == 0
    assert [info.step for info in list_checkpoints(home / "run")] == [2]


def test_the_cli_leaves_a_url_alone(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`file://~/run` names the host '~': refused as before, not read as the home directory."""
    assert main(["ls", "file://~/run"]) != 0
    assert "host" in capsys.readouterr().err


def test_export_hf_writes_under_the_home_directory(home: Path) -> None:
    """Defect: `export_hf(..., "~/hf")` wrote a folder named '~' under the working directory."""
    from torch_checkpointing.hf import export_hf, import_hf

    export_hf("~/run/step_1", "m", "~/hf")
    assert (home / "hf" / "model.safetensors.index.json").is_file()
    assert not Path("~").exists()
    assert torch.equal(import_hf("~/hf")["x"], torch.ones(2))
