"""The conformance suite's report paths are checked when the session starts, not after every clause has run.

`--clause-report` and `--clause-report-md` were written in the terminal summary: a path nothing can be written
at (a missing or read-only folder, a directory, an immutable file) ended the run, a full one included, in a
traceback ("FileNotFoundError: [Errno 2] No such file or directory: '/proc/nope/report.json'") with the
results lost; and a `--compare-report` that does not exist was found only after a full run, by a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    test = "conformance/test_schema.py::test_itemspec_defaults"  # one quick clause
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", test, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
    )


@pytest.mark.parametrize("flag", ["--clause-report", "--clause-report-md"])
@pytest.mark.parametrize("where", ["/proc/nope/report", "{tmp}"])  # no folder there; a directory
def test_a_report_path_that_cannot_be_written_is_a_usage_error_before_any_test(
    tmp_path: Path, flag: str, where: str
) -> None:
    out = _run(tmp_path, flag, where.replace("{tmp}", str(tmp_path)))
    text = out.stdout + out.stderr
    assert out.returncode == 4, text[-3000:]  # pytest's usage error
    assert flag in text and "Traceback" not in text and "1 passed" not in text, text[-3000:]


def test_a_missing_compare_report_is_a_usage_error_before_any_test(tmp_path: Path) -> None:
    out = _run(tmp_path, "--compare-report", str(tmp_path / "ours.json"))
    text = out.stdout + out.stderr
    assert out.returncode == 4 and "--compare-report" in text and "1 passed" not in text, text[-3000:]


def test_writable_report_paths_are_written(tmp_path: Path) -> None:
    out = _run(tmp_path, "--clause-report", str(tmp_path / "r.json"), "--clause-report-md", str(tmp_path / "r.md"))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert (tmp_path / "r.json").stat().st_size and (tmp_path / "r.md").stat().st_size
