"""The CLI's operations (`ls`, `inspect`, `prune`, `diff`, `gc`, `export`) as an operator runs them, through the
real command (`python -m torch_checkpointing`).

Before: `--json` wrote a NaN or infinite metric (a diverged loss, which `save(metrics=...)` takes and the manifest
records as the string "NaN") as the bare tokens `NaN` and `Infinity`, which are not JSON: `jq` and every strict
parser refused the whole document.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300  # a loaded 2-core machine takes ~15 s to import torch


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("round28") / "run"
    metrics = [{"loss": float("nan"), "acc": float("inf")}, {"loss": 1.0, "acc": float("-inf")}]
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step, recorded in enumerate(metrics, 1):
            manager.save(str(run / f"step_{step}"), {"model": {"w": torch.ones(4)}}, step=step, metrics=recorded)
    return run


def _cli(*args: str, expect: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    )
    assert done.returncode == expect, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _strict(text: str) -> Any:
    """Parse as a strict JSON parser (jq, JavaScript's JSON.parse) does: no NaN/Infinity tokens."""

    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    "argv",
    [["ls", "{root}"], ["inspect", "{root}/step_1"], ["prune", "{root}", "--keep-last", "1", "--dry-run"]],
    ids=["ls", "inspect", "prune"],
)
def test_json_output_writes_non_finite_metrics_as_the_manifest_does(root: Path, argv: list[str]) -> None:
    """Failed before: "ValueError: Infinity is not JSON" for each (`"acc": Infinity, "loss": NaN` on stdout)."""
    doc = _strict(_cli("--json", *(a.format(root=root) for a in argv)).stdout)
    found = json.dumps(doc)
    assert '"loss": "NaN"' in found and '"acc": "Infinity"' in found, found
