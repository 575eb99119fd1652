"""Docs audit, round 16: the CLI lines of docs/operations.md run as written, and its exit codes hold.

tests/test_docs_examples.py runs every ```python block but only lints ```bash blocks; the operations page's
command block and its flags were checked by nobody. Spec (operations.md, The command line): "`python -m
torch_checkpointing` and the `torch-checkpointing` console script run the same commands", and its exit codes.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.docs_snippets import ROOT, blocks
from torch_checkpointing import CheckpointManager
from torch_checkpointing.cli import build_parser, main

OPERATIONS = ROOT / "docs" / "operations.md"


def _make_run(root: Path) -> None:
    """The run the page's commands name: runs/exp1 with step_000200 and step_000300 (and two more to prune)."""
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        for step in (100, 200, 300, 400):
            state = {"model": {"w": torch.full((4, 4), float(step)), "b": torch.ones(3)}}
            manager.save(str(root / f"runs/exp1/step_{step:06d}"), state, metrics={"loss": 1000.0 / step})


def _command_lines() -> list[str]:
    (block,) = [b for b in blocks(OPERATIONS) if b.lang == "bash"]
    return [line.split("  #")[0].strip() for line in block.code.splitlines() if line.strip()]


def test_every_command_line_of_operations_md_runs_with_its_documented_exit_code(tmp_path: Path) -> None:
    """Exit codes: 0 done, 1 for `diff` that found a difference (step_000200 and step_000300 differ)."""
    _make_run(tmp_path)
    lines = _command_lines()
    assert len(lines) == 8, lines
    for line in lines:
        # The console script as the module, so the test does not depend on the install's scripts dir.
        shell = line.replace("torch-checkpointing", f"{sys.executable} -m torch_checkpointing")
        done = subprocess.run(shell, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        expected = 1 if line.startswith("torch-checkpointing diff") else 0
        assert done.returncode == expected, f"{line!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "hf_model" / "model.safetensors.index.json").is_file()


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    found = {s for a in parser._actions for s in a.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _flags(sub)
    return found


def test_every_flag_operations_md_names_exists() -> None:
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", OPERATIONS.read_text(encoding="utf-8")))
    assert named - _flags(build_parser()) == set()


def test_verify_of_a_missing_path_answers_1_as_operations_md_says(tmp_path: Path) -> None:
    """operations.md: "1: ... `verify` found ... (or its path is not a committed checkpoint: missing, a file,
    or no manifest)"; the old page listed "no such directory" under 2 only."""
    assert "missing, a file, or no\n  manifest" in OPERATIONS.read_text(encoding="utf-8")
    assert main(["verify", str(tmp_path / "missing")]) == 1
    assert main(["inspect", str(tmp_path / "missing")]) == 2
