"""`verify`'s progress bar shows the checkpoint's name as data (round 34).

The bar's description was the raw directory name given to rich as markup: a checkpoint named
`[bold red]x` was drawn as a bold red `x`, and an escape sequence in a name went to the terminal as it was,
where the tables and every other line show names escaped (`\\x1b`) and never as markup.
"""

from __future__ import annotations

import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 120  # the CLI takes seconds (importing torch); this only stops a hang

pytest.importorskip("rich")


def _stderr_on_a_terminal(argv: list[str]) -> str:
    """What the CLI writes to stderr when stderr is a terminal (where the progress bar is drawn)."""
    controller, terminal = pty.openpty()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "torch_checkpointing", *argv],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm", "COLUMNS": "200"},
            stdout=subprocess.PIPE,
            stderr=terminal,
            timeout=LAUNCH_TIMEOUT_S,
            check=True,
        )
        assert b"OK" in done.stdout, done.stdout
        os.close(terminal)
        terminal = -1
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the terminal's other end is closed and all was read
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "replace")
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)


@pytest.mark.parametrize(
    ("name", "shown"),
    [("[bold red]x", "[bold red]x"), ("a\x1b[31mred", "a\\x1b[31mred")],
)
def test_the_progress_bar_shows_a_checkpoint_name_as_data(tmp_path: Path, name: str, shown: str) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(tmp_path / "ck"), {"model": {"w": torch.ones(1024)}})
    shutil.move(tmp_path / "ck", tmp_path / name)
    drawn = _stderr_on_a_terminal(["verify", str(tmp_path / name)])
    assert f"verify {shown}" in drawn, drawn
    assert "\x1b[31mred" not in drawn, drawn
