"""Operations defects found in round 15, each with the test that failed before its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torch_checkpointing.cli import main


def test_verify_json_of_a_path_that_is_no_checkpoint_names_the_kind_of_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every other --json error document carries "kind"; verify's own (a missing path) had none."""
    assert main(["--json", "verify", str(tmp_path / "missing")]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["kind"] == "FileNotFoundError" and "missing" in doc["error"]
