"""An existing `--json` file the simulator cannot write is refused before any rank is launched.

The check probed only the file's folder (a probe created in it): a report file set immutable (`chattr +i`;
read-only to another user the same way) passed, the whole run went by, and then writing the report failed with
a traceback ("PermissionError: [Errno 1] Operation not permitted"), the results lost.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _immutable(path: Path) -> bool:
    """Set `path` immutable; False where this filesystem or user cannot (tmpfs, no CAP_LINUX_IMMUTABLE)."""
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def test_an_existing_report_file_that_cannot_be_written_is_refused_first(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text("last run's report\n")
    if not _immutable(report):
        pytest.skip("chattr +i is not available on this filesystem or to this user")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "simulator", "--world", "1", "--json", str(report)],
            capture_output=True,
            text=True,
            timeout=600,  # a run that is not refused takes ~30 s here; this only stops a hang
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
    finally:
        subprocess.run(["chattr", "-i", str(report)], check=True)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--json" in out.stderr and "cannot be written" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert report.read_text() == "last run's report\n"
    assert not list(tmp_path.glob("simulator-*")), "a refused run left its temporary directory behind"


def test_an_existing_report_file_that_can_be_written_is_kept_until_the_run_ends(tmp_path: Path) -> None:
    """The probe opens it without truncating: a refused run for another reason leaves the old report whole."""
    report = tmp_path / "report.json"
    report.write_text("last run's report\n")
    out = subprocess.run(
        [sys.executable, "-m", "simulator", "--world", "1", "--json", str(report), "--timeout", "nan"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--timeout" in out.stderr, out.stderr
    assert report.read_text() == "last run's report\n"
