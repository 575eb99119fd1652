"""Operations defects found in round 15, each with the test that failed before its fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, RetentionPolicy
from torch_checkpointing.cli import main
from torch_checkpointing.config import SyncCheckpointSaverConfig


def test_verify_json_of_a_path_that_is_no_checkpoint_names_the_kind_of_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every other --json error document carries "kind"; verify's own (a missing path) had none."""
    assert main(["--json", "verify", str(tmp_path / "missing")]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["kind"] == "FileNotFoundError" and "missing" in doc["error"]


def test_the_pass_after_a_save_keeps_it_when_the_policy_root_is_spelt_otherwise_than_the_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An absolute policy root, ids relative to the working directory: the checkpoint just saved was deleted."""
    monkeypatch.chdir(tmp_path)
    retention = RetentionPolicy(keep_last=1, root=str(tmp_path / "run"))
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), retention=retention)
    with CheckpointManager(config) as manager:
        for step in (1000, 2000, 0):  # a run restarted at step 0
            manager.save(f"run/step_{step}", {"model": {"w": torch.full((2,), float(step))}})
    assert sorted(os.listdir(tmp_path / "run")) == ["step_0", "step_2000"]


def _wait_until_torch_is_loading(pid: int, timeout_s: float = 60.0) -> bool:
    """True once the process has mapped libtorch (its `import torch` is under way: the seconds a user's Ctrl-C
    lands in), False if it ended or the timeout passed first."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False
        if "libtorch" in maps:
            return True
        time.sleep(0.002)
    return False


def test_a_ctrl_c_while_the_cli_starts_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """operations.md: "130: interrupted (Ctrl-C), one line on stderr, no traceback". Before, a Ctrl-C in the
    first seconds (while the CLI imported torch) printed a traceback through __main__.py. The signal is sent
    once the process is seen importing torch (its maps name libtorch), not after a fixed delay: under coverage
    on a loaded machine a fixed 0.2 s landed in Python's own start, before any of this package ran."""
    import signal
    import subprocess
    import sys

    (tmp_path / "run").mkdir()
    hit = 0
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch_checkpointing", "ls", str(tmp_path / "run")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        loading = _wait_until_torch_is_loading(proc.pid)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert loading, ("the CLI never loaded torch", proc.returncode, err)
        assert "Traceback" not in err, err
        if proc.returncode == 130:
            hit += 1
            assert len(err.strip().splitlines()) == 1 and "interrupted" in err, err
    assert hit, "no Ctrl-C landed while the CLI started"
