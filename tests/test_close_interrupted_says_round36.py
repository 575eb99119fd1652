"""A close() interrupted (Ctrl-C) while the last async save is still being written says what it does next.

close() waits for the last save; a Ctrl-C there ends that wait, and close() then stops the writer, which first
waits (up to `subprocess_shutdown_timeout_secs`, an hour here) for the write in progress to commit or be
discarded. Before, nothing was logged in that wait: the Ctrl-C seemed ignored, for up to the whole timeout,
with no word that a second Ctrl-C kills the writer. Real child interpreter, real SIGSTOP and SIGINTs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

_START_S = 180  # spawning the writer imports torch twice: seconds each on a loaded two-core machine
_SAID_S = 30
_EXIT_S = 60

_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, torch
    from torch_checkpointing import CheckpointManager, AsyncCheckpointSaverConfig
    from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    if __name__ == "__main__":
        process = CheckpointProcessConfig(subprocess_shutdown_timeout_secs=3600)
        config = CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(wait_timeout_secs=3600, process_config=process),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
        manager = CheckpointManager(config)
        manager.save(sys.argv[1] + "/a", {"m": {"x": torch.ones(3)}}).result(300)
        os.kill(manager.writer_pid, signal.SIGSTOP)  # the next write stays in progress
        manager.save(sys.argv[1] + "/b", {"m": {"x": torch.ones(3)}})
        print(manager.writer_pid, flush=True)
        try:
            manager.close()
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """
)


def test_an_interrupted_close_says_it_waits_for_the_write_and_a_second_interrupt_kills(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        child = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=stdout, stderr=stderr, env=env)
    writer = None
    try:
        writer = _await(lambda: _first_int(out.read_text()), _START_S)
        time.sleep(1.0)  # close() is in its wait for the last save
        child.send_signal(signal.SIGINT)
        said = _await(lambda: "interrupted" in err.read_text() or None, _SAID_S)
        assert said, f"nothing said within {_SAID_S} s of the Ctrl-C: {err.read_text()[-2000:]}"
        text = err.read_text()
        assert "subprocess_shutdown_timeout_secs" in text and "again" in text, text[-2000:]
        assert str(tmp_path / "b") in text, text[-2000:]
        child.send_signal(signal.SIGINT)
        child.wait(_EXIT_S)
        assert "interrupted" in out.read_text().split(), err.read_text()[-2000:]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if writer is not None:
            _kill(writer)


def _await(probe, timeout_s: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.1)
    return None


def _first_int(text: str) -> int | None:
    words = text.split()
    return int(words[0]) if words and words[0].isdigit() else None


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
