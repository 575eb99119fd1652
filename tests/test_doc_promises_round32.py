"""Promises of docs/simulator.md, docs/conformance.md, docs/packaging.md and docs/api_differences.md that no
test held, each checked against the real thing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("flag", "target"),
    [("--keep", "/proc/simulator-keep"), ("--json", "/proc/simulator-report.json")],
)
def test_simulator_refuses_an_output_path_no_process_can_write_before_launching(
    tmp_path: Path, flag: str, target: str
) -> None:
    """docs/simulator.md: "2 for bad arguments (a `--keep DIR` that cannot be written is refused before any rank
    starts)". The check asked `os.access`, which says yes to root for any folder: under /proc (no process may
    create anything there) `--keep` ended in a FileNotFoundError traceback with exit code 1, and `--json` ran
    every scenario first, then lost the report to a traceback."""
    assert Path("/proc").is_dir(), "needs procfs"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "simulator", "--world", "1", "--scenario", "layouts", flag, target],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert flag in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "VERDICT" not in out.stdout, "the ranks were launched before the refusal"
    assert not list(tmp_path.glob("simulator-*")), "a refused run left its temporary directory behind"
