"""The CLI's text output, through the real command (`python -m torch_checkpointing`), as an operator reads it.

Before: `prune --keep-best --metric NAME` where no checkpoint records NAME said why twice, once as the
`torch_checkpointing` logger's WARNING on stderr and once as the `warning:` line on stdout; and a name holding
an undecodable byte (`ckpt-\\xff` as the text output shows it) looked exactly like a name holding the four
characters backslash, x, f, f.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300  # a loaded 2-core machine takes ~15 s to import torch
BYTE_NAME = os.fsdecode(b"ckpt-\xff")  # a directory name that is not UTF-8
LITERAL_NAME = "ckpt-\\xff"  # the four characters \, x, f, f: a name that is UTF-8
MISSPELT = "keep_best by metric 'lsos'"  # how the note about a metric no checkpoint records begins


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("round22") / "run"
    saves = [("step_1", 0.5), (BYTE_NAME, 0.4), (LITERAL_NAME, 0.3), ("step_4", 0.2)]
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step, (name, loss) in enumerate(saves, 1):
            manager.save(
                str(run / name), {"model": {"w": torch.full((4,), float(step))}}, step=step, metrics={"loss": loss}
            )
    return run


def _cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    done = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", *args],
        cwd=REPO,
        capture_output=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    return done


def test_prune_says_once_that_no_checkpoint_records_the_metric(root: Path) -> None:
    """Text output: the note once, on stdout beside the deletions it explains (failed before: also on stderr,
    logged). With --json it is the document's field, and stderr may say it once for whoever watches."""
    argv = ["prune", str(root), "--keep-last", "1", "--keep-best", "1", "--metric", "lsos", "--dry-run"]
    done = _cli(*argv)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert (out + err).count(MISSPELT) == 1, f"stdout:\n{out}\nstderr:\n{err}"
    assert f"warning: {MISSPELT}" in out and "would delete" in out, out
    done = _cli("--json", *argv)
    assert done.stdout.decode().count(MISSPELT) == 1 and done.stderr.decode().count(MISSPELT) <= 1, done


def test_text_output_tells_an_undecodable_byte_from_a_literal_backslash(root: Path) -> None:
    """`ckpt-\\xff` is the byte 0xff; a name holding a backslash shows it doubled (`ckpt-\\\\xff`), as `ls -b`
    and Python's repr do (failed before: both rows read `ckpt-\\xff`)."""
    out = _cli("ls", str(root)).stdout.decode()
    names = [line.split()[0] for line in out.splitlines() if line.strip().startswith("ckpt-")]
    assert sorted(names) == ["ckpt-\\\\xff", "ckpt-\\xff"], out
    pruned = _cli("prune", str(root), "--keep-last", "1", "--dry-run").stdout.decode()
    assert "ckpt-\\xff, ckpt-\\\\xff" in pruned, pruned
    listed = json.loads(_cli("--json", "ls", str(root)).stdout)["checkpoints"]
    by_step = {entry["step"]: entry for entry in listed}  # --json: the same string, told apart by `name_hex`
    assert by_step[2]["name"] == by_step[3]["name"] == LITERAL_NAME, listed
    assert bytes.fromhex(by_step[2]["name_hex"]) == os.fsencode(BYTE_NAME) and "name_hex" not in by_step[3]
