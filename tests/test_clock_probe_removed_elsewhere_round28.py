"""A clock probe another process removed first is no failure to remove it (round 28).

A probe of the store's clock (`store_now`) is made and removed at once; gc on another host may take it for a
killed prober's and remove it in between (its maker's pid names no process there). This process's removal then
finds nothing, and said so at WARNING: "Could not remove the clock probe ... delete it by hand", of a file that
was gone. The probe is where it should be, gone: nothing is said above DEBUG. Any other failure still warns.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fsspec
import pytest

from torch_checkpointing.storage import base_storage, fsspec_storage
from torch_checkpointing.storage.base_storage import clock_probe_name


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_local_probe_removed_by_another_process_is_not_warned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect: WARNING "Could not remove the clock probe ... ([Errno 2] No such file or directory ...)"."""
    probe = tmp_path / clock_probe_name()
    fstat = os.fstat

    def removed_meanwhile(fd: int) -> os.stat_result:
        if probe.exists():
            probe.unlink()  # another host's gc, between the probe's create and its removal
        return fstat(fd)

    monkeypatch.setattr(os, "fstat", removed_meanwhile)
    with caplog.at_level(logging.DEBUG, logger="torch_checkpointing"):
        when = base_storage._probe_named(str(probe))
    monkeypatch.undo()
    assert when is not None and not probe.exists()
    assert _warnings(caplog) == []


def test_a_local_probe_that_cannot_be_removed_is_still_warned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The guard from the other side: a removal that fails (a directory at the name meanwhile) says so."""
    probe = tmp_path / clock_probe_name()
    fstat = os.fstat

    def replaced_meanwhile(fd: int) -> os.stat_result:
        if probe.is_file():
            probe.unlink()
            probe.mkdir()
        return fstat(fd)

    monkeypatch.setattr(os, "fstat", replaced_meanwhile)
    with caplog.at_level(logging.DEBUG, logger="torch_checkpointing"):
        base_storage._probe_named(str(probe))
    monkeypatch.undo()
    assert [w for w in _warnings(caplog) if "Could not remove the clock probe" in w], caplog.records


def test_a_probe_object_deleted_by_another_process_is_not_warned(caplog: pytest.LogCaptureFixture) -> None:
    """On a store whose delete of a missing object says so (GCS, `file://`: FileNotFoundError; S3 answers 204).
    Defect: WARNING "Could not delete the clock probe ...: an empty object; ... delete it by hand"."""
    fs = fsspec.filesystem("memory")
    probe = f"/round28-{os.getpid()}/{clock_probe_name()}"

    class DeletedMeanwhile:
        def __getattr__(self, name: str) -> Any:
            return getattr(fs, name)

        def info(self, path: str) -> dict[str, Any]:
            found = fs.info(path)
            fs.rm_file(path)  # another host's gc, between the probe's read and its delete
            return {**found, "mtime": 1.0}

    backend = SimpleNamespace(io=DeletedMeanwhile(), url=lambda p: f"memory://{p}")
    with caplog.at_level(logging.DEBUG, logger="torch_checkpointing"):
        fsspec_storage._probe_modified(backend, probe)  # type: ignore[arg-type]
    assert not fs.exists(probe)
    assert _warnings(caplog) == []
