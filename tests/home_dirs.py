"""A fresh home directory and a working directory beside it, for tests of how paths starting with `~` are read."""

from __future__ import annotations

from pathlib import Path

import pytest


def home_and_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """`tmp_path/home` as HOME and `tmp_path/work` as the working directory, both made empty."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return home, work
