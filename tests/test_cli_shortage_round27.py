"""A command short of memory is the command's error (exit 2), never exit 1, which `verify || rm` reads as damage.

`main` turned the engine's errors into exit 2 but not `MemoryError`: one raised while `verify` checked a file, or
while `diff` decoded an item, left `main` uncaught, and the interpreter exited 1 with a traceback, the code a
script deleting damaged checkpoints acts on. The shortage here is real: a child under RLIMIT_AS, stepped up until
the commands succeed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_COMMANDS_UNDER_LIMITS = """
import contextlib, io, resource, sys, torch
from torch_checkpointing import CheckpointManager, cli
from torch_checkpointing.config import SyncCheckpointSaverConfig
root = sys.argv[1]
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    m.save(root, {"blob": bytes(192 << 20), "t": {"x": torch.ones(3)}})

def run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            return str(cli.main(argv)), err.getvalue()
        except BaseException as exc:  # what the interpreter would print as a traceback, exiting 1
            return f"uncaught-{type(exc).__name__}", repr(exc)

commands = [["verify", root], ["diff", root, root], ["inspect", root]]
for argv in commands:
    assert run(argv)[0] == "0", run(argv)  # every import a command needs, with memory to spare
base = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
for room in range(0, 513, 64):  # MiB of address space beyond what the process holds
    for argv in commands:
        resource.setrlimit(resource.RLIMIT_AS, (base + room * 2**20, resource.RLIM_INFINITY))
        try:
            code, said = run(argv)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print(room, argv[0], code, repr(said.strip()[:200]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's")
def test_a_command_out_of_memory_exits_2_saying_so(tmp_path: Path) -> None:
    """Every run under a limit ends 0 or 2, and a 2 says what went wrong; never uncaught (exit 1).

    Defect: "0 verify uncaught-MemoryError 'MemoryError()'" and "256 diff uncaught-MemoryError 'MemoryError(\\"Out
    of memory reading .../blob_0.pt ...\\")'": the interpreter's exit 1."""
    done = subprocess.run(
        [sys.executable, "-c", _COMMANDS_UNDER_LIMITS, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert any(line.split()[2] != "0" for line in lines), f"no limit was low enough to show anything: {lines}"
    wrong = [line for line in lines if line.split()[2] not in ("0", "2")]
    wrong += [line for line in lines if line.split()[2] == "2" and ("error: " not in line or "error: '" in line)]
    assert not wrong, "\n".join(wrong)
