"""Round 25: gc aged a temporary directory of another host's save by the directory's own mtime.

A directory's mtime changes when an entry is made in it, not when a file in it is written: a save on another
node that made its files and then wrote into them (one large file, or files in a rank's subdirectory) for longer
than `unowned_after_s` read as that old, and this host's gc removed the temporary under the live save. Its age
is now that of the newest thing written in it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.clock_skew import stated_age_s
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage

# A save's temporary whose owner lock is not on this host (written from another node).
_OTHER_HOSTS_TMP = ".step_1.tmp-feedbeef-1"

_WRITER = """
import sys, time
with open(sys.argv[1], "ab") as f:
    while True:
        f.write(b"x" * 4096)
        f.flush()
        time.sleep(0.05)
"""


def _started_at(tmp: Path, seconds_ago: float) -> None:
    """Every entry in `tmp` and `tmp` itself last changed `seconds_ago`, as when a save made them then."""
    then = time.time() - seconds_ago
    for where, dirs, files in os.walk(tmp, topdown=False):
        for name in (*dirs, *files):
            os.utime(os.path.join(where, name), (then, then))
    os.utime(tmp, (then, then))


def _temporary(root: Path, data: str) -> tuple[Path, Path]:
    tmp = root / _OTHER_HOSTS_TMP
    (tmp / Path(data).parent).mkdir(parents=True)
    (tmp / INCOMPLETE_MARKER).write_bytes(b"")
    (tmp / data).write_bytes(b"")
    return tmp, tmp / data


def test_gc_keeps_another_hosts_temporary_while_its_save_writes_a_file(tmp_path: Path) -> None:
    for data in ("model_0.pt", "rank_1/model_1.pt"):  # in the temporary itself, and in a directory below it
        root = tmp_path / data.replace("/", "_")
        tmp, file = _temporary(root, data)
        _started_at(tmp, 10_000)  # the save made its files long ago (on its node) ...
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(file)])  # ... and is writing one still
        try:
            deadline = time.monotonic() + 30
            while time.time() - os.path.getmtime(file) > 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            report = collect_garbage(root, unowned_after_s=3600)
            assert writer.poll() is None
        finally:
            writer.kill()
            writer.wait(30)
        assert report.removed == [] and tmp.is_dir(), (data, report)
        assert [k.path for k, _ in report.kept] == [str(tmp)], report
        assert report.kept[0][1].startswith("owner unknown on this host and only "), report.kept
        assert stated_age_s(report.kept[0][1]) < 600, report.kept  # not 10,000 s


def test_gc_collects_another_hosts_temporary_once_nothing_in_it_was_written_for_long(tmp_path: Path) -> None:
    tmp, _ = _temporary(tmp_path, "rank_1/model_1.pt")
    _started_at(tmp, 10_000)
    assert [Path(lo.path) for lo in collect_garbage(tmp_path, unowned_after_s=3600).removed] == [tmp]
    assert not tmp.exists()
