"""`python -m benchmarks --out PATH`: a PATH that exists and cannot be written (a directory, a file set
immutable) is refused before any section runs, as round 32 made an unwritable folder be.

Only `--out`'s folder was probed: `--out` naming a directory, or an immutable results file, ran every section and
then ended in a traceback (IsADirectoryError, PermissionError) with the figures lost.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, out: Path) -> subprocess.CompletedProcess[str]:
    args = ["--sections", "scale", "--scale-dp", "2", "--scale-layers", "1", "--runs", "1"]
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args, "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,  # a run that is not refused takes a minute or so here; this only stops a hang
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _refused_before_measuring(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "--out" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "targets pass" not in out.stdout, "the sections ran before the refusal"


def test_an_out_path_that_is_a_directory_is_refused_before_measuring(tmp_path: Path) -> None:
    (tmp_path / "results.json").mkdir()
    _refused_before_measuring(_run(tmp_path, tmp_path / "results.json"))


def test_an_immutable_results_file_is_refused_before_measuring(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text("{}\n")
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(results)]).returncode != 0:
        pytest.skip("chattr +i is not available on this filesystem or to this user")
    try:
        out = _run(tmp_path, results)
    finally:
        subprocess.run(["chattr", "-i", str(results)], check=True)
    _refused_before_measuring(out)
    assert results.read_text() == "{}\n"
