"""gc's age of an object-store leftover when a store's time stamp is spelled in a way Python's own reader does
not take, or cannot be read at all.

The age of a trash or aside copy on an object store is the newest modification time of the objects under its
prefix. Before, an object whose stamp could not be read was dropped from that newest-of, so the copy's age was
that of its other, older objects: a copy holding one young object counted as old, and gc removed it. And the
stamp was read with `datetime.fromisoformat`, whose grammar changes with the Python version: RFC 3339 allows
`t`/`z` in lower case, any number of fraction digits, and HTTP stores give RFC 1123 dates; on Python 3.10
(which pyproject allows) a fraction of 1, 2, 4, 5 or 9 digits was unreadable too. Such a copy's age was unknown
for ever and it was never collected. The stores are the fsspec memory filesystems of the round-26 test, whose
listings carry a given library's fields, read through the same `FsspecStorage` path.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_object_store_ages_round26 import HOUR_AGO, _store
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.names import host_tag, trash_name
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

_UTC = datetime.datetime.fromtimestamp(HOUR_AGO, tz=datetime.timezone.utc).replace(microsecond=123456)
_IST = _UTC.astimezone(datetime.timezone(datetime.timedelta(hours=5, minutes=30)))
_WHEN = _UTC.timestamp()

# Spellings of one instant an hour ago, each as a store or a proxy in front of it may give it.
_SPELLINGS = {
    "lower-case-t-z": _UTC.strftime("%Y-%m-%dt%H:%M:%S.%fz"),
    "nanoseconds": _UTC.strftime("%Y-%m-%dT%H:%M:%S.%f") + "789Z",
    "two-digit-fraction": _UTC.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-4] + "Z",
    "offset-without-colon": _IST.strftime("%Y-%m-%dT%H:%M:%S.%f%z"),
    "offset-with-colon": _IST.isoformat(),
    "space-separator": _UTC.strftime("%Y-%m-%d %H:%M:%S.%f+00:00"),
    "rfc1123": _UTC.strftime("%a, %d %b %Y %H:%M:%S GMT"),
    "basic-format": _UTC.strftime("%Y%m%dT%H%M%SZ"),  # ISO 8601's basic form, read by fromisoformat on 3.11+
}


def _gc_run(
    tmp_path: Path, stamp: Callable[[dict[str, Any]], dict[str, Any]], label: str
) -> tuple[Any, str, float | None, Any]:
    """A committed checkpoint that another host moved aside to a trash name, on a `gs` store stamped by
    `stamp`; gc with `unowned_after_s=60`. Returns (filesystem, trash URL, its age as read, gc report)."""
    fs = _store("gs", stamp)()
    bucket = f"stamps-{label}-{time.monotonic_ns()}"
    other = "0badc0de" if host_tag() != "0badc0de" else "0badc0df"
    trash = trash_name("step_1", 4242, "abcdef01", other)
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(tmp_path / "step_1"), {"model": {"w": torch.ones(4)}})
    for file in sorted((tmp_path / "step_1").iterdir()):
        fs.pipe(f"/{bucket}/run/{trash}/{file.name}", file.read_bytes())
    storage = FsspecStorageConfig(url=f"gs://{bucket}", filesystem=fs).create_storage()
    root = f"gs://{bucket}/run"
    changed = storage.changed_at(Path(f"{root}/{trash}"))
    return fs, f"{root}/{trash}", changed, collect_garbage(root, storage, unowned_after_s=60)


@pytest.mark.parametrize("spelling", sorted(_SPELLINGS))
def test_gc_reads_every_spelling_of_a_stores_time_stamp(spelling: str, tmp_path: Path) -> None:
    text = _SPELLINGS[spelling]

    def stamp(info: dict[str, Any]) -> dict[str, Any]:
        return {**info, "updated": text}

    fs, trash, changed, report = _gc_run(tmp_path, stamp, spelling)
    assert changed is not None and abs(changed - _WHEN) < 1.0, (text, changed, _WHEN)  # RFC 1123: whole seconds
    assert [lo.path for lo in report.removed] == [trash], report
    assert fs.find(trash.replace("gs:/", "")) == []


def test_an_unreadable_stamp_never_makes_a_young_copy_old(tmp_path: Path) -> None:
    """One object (written just now) whose stamp cannot be read, beside objects an hour old: the copy's age is
    unknown, so gc keeps it, and says why. Before, the unreadable one was left out, the copy read as an hour
    old, and gc removed it; and a copy of unknown age was kept as "0s old", at INFO, for ever."""

    def stamp(info: dict[str, Any]) -> dict[str, Any]:
        young = info["name"].endswith("manifest.json")
        return {**info, "updated": "just now" if young else _SPELLINGS["offset-with-colon"]}

    fs, trash, changed, report = _gc_run(tmp_path, stamp, "unreadable")
    assert changed is None, changed
    assert report.removed == [], report
    assert [lo.path for lo, _ in report.kept] == [trash], report
    assert fs.find(trash.replace("gs:/", "")) != []
    why = report.kept[0][1]
    assert "age could not be told" in why and "0s old" not in why, why  # not a young copy that passes on its own


def _spelled(instant: float) -> dict[str, str]:
    """`instant` in the ISO 8601 and HTTP forms that name a span, not an instant: a day, a week, an hour, a
    minute (whole seconds are left to the spellings above)."""
    at = datetime.datetime.fromtimestamp(instant, tz=datetime.timezone.utc)
    return {
        "date-only": at.strftime("%Y-%m-%d"),
        "basic-date": at.strftime("%Y%m%d"),
        "week": at.strftime("%G-W%V"),
        "week-day": at.strftime("%G-W%V-%u"),
        "hour": at.strftime("%Y-%m-%dT%HZ"),
        "minutes": at.strftime("%Y-%m-%dT%H:%MZ"),
        "basic-minutes": at.strftime("%Y%m%dT%H%MZ"),
        "rfc1123-minutes": at.strftime("%a, %d %b %Y %H:%M GMT"),
    }


_SPANS = sorted(_spelled(0.0))


@pytest.mark.parametrize("spelling", _SPANS)
def test_a_stamp_that_names_a_span_never_makes_a_young_copy_old(spelling: str, tmp_path: Path) -> None:
    """A stamp precise to the day (or week, hour, minute) was read as the span's first instant: a copy moved aside
    just now with a date-only stamp read as up to a day old (a week, for a week date), and gc removed it. It is
    read as the span's last instant (or not at all): never older than the copy is."""
    written = time.time()
    text = _spelled(written)[spelling]

    def stamp(info: dict[str, Any]) -> dict[str, Any]:
        return {**info, "updated": text}

    fs, trash, changed, report = _gc_run(tmp_path, stamp, f"young-{spelling}")
    assert changed is None or changed >= written - 1.0, (text, changed, written)
    assert report.removed == [], report
    assert fs.find(trash.replace("gs:/", "")) != []


@pytest.mark.parametrize("spelling", [s for s in _SPANS if not s.startswith("week")])
def test_a_stamp_that_names_a_span_long_past_is_collected(spelling: str, tmp_path: Path) -> None:
    """Read as its span's last instant, a copy stamped days ago is still collected (as e556ad9 meant it)."""
    text = _spelled(time.time() - 3 * 86400)[spelling]

    def stamp(info: dict[str, Any]) -> dict[str, Any]:
        return {**info, "updated": text}

    fs, trash, changed, report = _gc_run(tmp_path, stamp, f"old-{spelling}")
    assert changed is not None and changed < time.time() - 86400, (text, changed)
    assert [lo.path for lo in report.removed] == [trash], report
    assert fs.find(trash.replace("gs:/", "")) == []
