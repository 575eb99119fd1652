"""Round 27: a claim marker's create on `file://` raised where O_TMPFILE worked but its link through /proc did not.

`_create_local` makes the marker in one step: its bytes go into an unnamed O_TMPFILE file, linked under the
marker's name through `/proc/self/fd/N`. Whether that works was judged once, at import, from O_TMPFILE and a
/proc directory being there. Where the link is refused all the same (an LSM's EPERM, /proc unmounted or replaced
since the import, as in a sandbox that hides it), the create raised, and with it every save to the id: the
hidden-name way every filesystem without O_TMPFILE takes was never tried. Now a refused link takes that way.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from torch_checkpointing.storage import fsspec_storage
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

pytest.importorskip("fsspec")
if not fsspec_storage._HAS_TMPFILE_LINKS:
    pytest.skip("O_TMPFILE links through /proc are not used on this system", allow_module_level=True)


def _create_twice(root: Path) -> tuple[bool, bool, bytes, list[str]]:
    """Two creates of one marker: what each was told, what the marker holds, what else is in its folder."""
    storage = FsspecStorageConfig(url=f"file://{root}").create_storage()
    storage.mkdir(Path("ck"))
    first = storage.create_object(Path("ck/.incomplete"), b"claim one")
    second = storage.create_object(Path("ck/.incomplete"), b"claim two")
    return first, second, (root / "ck" / ".incomplete").read_bytes(), sorted(os.listdir(root / "ck"))


def test_a_marker_whose_link_through_proc_is_refused_is_created_through_a_hidden_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: PermissionError [Errno 1] out of create_object (wrapped as the store's error), no marker made.
    real_link = os.link
    refused: list[str] = []

    def link(src: Any, dst: Any, **kw: Any) -> None:
        if str(src).startswith("/proc/self/fd/"):  # what an LSM that forbids linking /proc's fds does
            refused.append(str(src))
            raise PermissionError(errno.EPERM, "Operation not permitted", str(src))
        real_link(src, dst, **kw)

    monkeypatch.setattr(fsspec_storage.os, "link", link)
    assert _create_twice(tmp_path) == (True, False, b"claim one", [".incomplete"])
    assert refused, "the O_TMPFILE way was not tried"


_HIDDEN_PROC = """
import os, subprocess, sys
from pathlib import Path
from torch_checkpointing.storage import fsspec_storage  # judged at import: /proc is there
assert fsspec_storage._HAS_TMPFILE_LINKS
subprocess.run(["mount", "-t", "tmpfs", "none", "/proc"], check=True)  # this mount namespace's alone
assert not os.path.exists("/proc/self/fd")
sys.path.insert(0, sys.argv[2])
from test_marker_create_fallback_round27 import _create_twice
print(repr(_create_twice(Path(sys.argv[1]))))
"""


def test_a_marker_created_after_proc_went_away_is_created_through_a_hidden_name(tmp_path: Path) -> None:
    # Before: FileNotFoundError [Errno 2] '/proc/self/fd/N' out of create_object. A real /proc hidden after the
    # import, in a mount namespace of the child's own (needs unshare and mount rights: skipped without them).
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("no unshare(1) or mount(8) here")
    if subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode != 0:
        pytest.skip("no right to make a mount namespace here")
    script = tmp_path / "hide_proc.py"
    script.write_text(textwrap.dedent(_HIDDEN_PROC))
    (tmp_path / "root").mkdir()
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo}
    done = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            sys.executable,
            str(script),
            str(tmp_path / "root"),
            str(Path(__file__).parent),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == repr((True, False, b"claim one", [".incomplete"])), done.stdout
