"""Which directory refused a lookup is found by the lookups themselves, not by `os.access` and `os.path.isdir`.

`os.access` says yes to root for every directory (though /proc, a security module or a FUSE mount still refuse
root), and a link that cannot be followed (`/proc/<pid>/root` of a process this one may not trace) is no
`isdir`: the PermissionError of a lookup under it named a directory below the closed one, whose "fix" (chmod
u+rx on it) could not help. A process made non-dumpable, looked at by one without CAP_SYS_PTRACE, is such a link.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

CHECK = """
import sys
from pathlib import Path
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
try:
    storage.exists(Path(sys.argv[1]))
except PermissionError as exc:
    print("REFUSED", exc)
else:
    print("LOOKED")
"""

HIDDEN = "import ctypes, sys, time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); print('ready', flush=True); time.sleep(120)"


@pytest.fixture
def untraceable_pid() -> Iterator[int]:
    """A process that set itself non-dumpable (PR_SET_DUMPABLE 0): its /proc links need CAP_SYS_PTRACE."""
    child = subprocess.Popen([sys.executable, "-c", HIDDEN], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        yield child.pid
    finally:
        child.kill()
        child.wait(timeout=30)


def _without_ptrace() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root needs setpriv (util-linux) to look without CAP_SYS_PTRACE")
    return ["setpriv", "--bounding-set", "-sys_ptrace"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/<pid>/root is Linux's")
def test_a_lookup_under_a_link_that_cannot_be_followed_names_the_link(untraceable_pid: int) -> None:
    closed = f"/proc/{untraceable_pid}/root"
    path = f"{closed}/tmp/run/step_1/manifest.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [*_without_ptrace(), sys.executable, "-c", CHECK, path], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    if done.stdout.startswith("LOOKED"):
        pytest.skip(f"this kernel lets a process without CAP_SYS_PTRACE follow {closed}")
    said = done.stdout
    assert f"looking into {closed}." in said and f"permission on {closed} " in said, said
