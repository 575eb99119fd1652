"""A close() interrupted (Ctrl-C) while it waits for the writer process leaves no writer to hang the exit.

close() takes the writer out of its process object, sends it Stop and waits (bounded) for its answer, killing
it past the timeout. A real SIGINT landing in that wait raised out of close() with the writer neither killed nor
reaped, and no one left to: the manager was closed, its exit hook gone. A writer that does not answer (stopped,
stuck) then hung the interpreter's exit for good, in multiprocessing's join of its daemon children, which only
SIGTERMs them. Run in a child interpreter, with a real SIGSTOP and a real SIGINT.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# spawning the writer imports torch twice (seconds each on a loaded two-core machine); only stops a hang
_EXIT_HANG_S = 180

_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, torch
    from torch_checkpointing import CheckpointManager, AsyncCheckpointSaverConfig
    from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    if __name__ == "__main__":
        process = CheckpointProcessConfig(subprocess_shutdown_timeout_secs=3600)
        config = CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(wait_timeout_secs=60, process_config=process),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
        manager = CheckpointManager(config)
        manager.save(sys.argv[1], {"m": {"x": torch.ones(3)}}).result(300)
        pid = manager.writer_pid
        print(pid, flush=True)
        os.kill(pid, signal.SIGSTOP)  # a writer that answers nothing: close() waits for its answer to Stop
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            manager.close()
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """
)


def test_an_interrupted_close_leaves_no_stopped_writer_to_hang_the_exit(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out, err = tmp_path / "out", tmp_path / "err"  # files: a writer left behind holds a pipe open for good
    with out.open("wb") as stdout, err.open("wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "a")], stdout=stdout, stderr=stderr, env=env
        )
    try:
        child.wait(_EXIT_HANG_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    lines = out.read_text().split()
    writer = int(lines[0]) if lines and lines[0].isdigit() else None
    if writer is not None and _exists(writer):
        os.kill(writer, 9)  # what the engine left behind, so that this test leaves nothing
    assert "interrupted" in lines, (lines, err.read_text()[-2000:])
    assert child.returncode == 0, f"the script did not exit (rc {child.returncode}): {err.read_text()[-2000:]}"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
