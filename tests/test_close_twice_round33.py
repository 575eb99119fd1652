"""close() called while another thread's close() of the same manager is under way waits for it (round 33).

close() "waits for the last write, then stops the writer". A second close() (the main thread's, at the end of
a script, beside one a watchdog or signal-handling thread started) returned at once, seeing the manager marked
closed, while the first still waited for the last write. The script then ended; the first close() ran on a
daemon thread, interpreter exit stopped it, and the last checkpoint was lost with nothing said: no error, no
WARNING. Now the second close() waits for the first (bounded by the same timeouts), so the script ends once
the checkpoint is committed.

A real script in a real interpreter, a real writer process: the outcome is the checkpoint on disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import os, sys, threading, time, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

def main():
    root = sys.argv[1]
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    manager = CheckpointManager(config)
    manager.save(os.path.join(root, "step_0"), {"m": {"x": torch.ones(10)}}, step=0).result(120)
    started = threading.Event()
    original = manager._saver.wait

    def wait(timeout):  # the first close() is now waiting for the last write
        started.set()
        return original(timeout)

    manager._saver.wait = wait
    big = torch.ones(100_000_000)  # 400 MB: its write is still going when the second close() is called
    write = manager.save(os.path.join(root, "step_1"), {"m": {"x": big}}, step=1)
    threading.Thread(target=manager.close, daemon=True).start()
    assert started.wait(120)
    manager.close()
    print("second close returned; write done:", write.done(), flush=True)

if __name__ == "__main__":
    main()
"""


def test_a_second_close_waits_for_the_first_so_the_last_save_is_committed(tmp_path: Path) -> None:
    script = tmp_path / "two_closes.py"
    script.write_text(_SCRIPT)
    root = tmp_path / "run"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, str(script), str(root)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "write done: True" in done.stdout, done.stdout + done.stderr[-3000:]
    assert sorted(os.listdir(root)) == ["step_0", "step_1"], done.stderr[-3000:]


_IN_A_CALLBACK = """
import os, sys, threading, time, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

def main():
    root = sys.argv[1]
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    manager = CheckpointManager(config)
    state = {"w": torch.arange(1000.0)}
    first = manager.save(os.path.join(root, "a"), state)
    ended = threading.Event()

    def callback(future):  # runs on the thread that hands the write of "b" to the writer
        try:
            time.sleep(0.5)  # the main thread's close() is under way, waiting for "b"
            manager.close()
        finally:
            ended.set()

    first.add_done_callback(callback)
    manager.save(os.path.join(root, "b"), state)  # queued behind the callback
    manager.close()
    assert ended.wait(60)
    print("closed", sorted(os.listdir(root)), flush=True)

if __name__ == "__main__":
    main()
"""


def test_a_close_in_a_done_callback_beside_a_close_under_way_does_not_wait_for_itself(tmp_path: Path) -> None:
    """Waiting for the close() under way there hung for good: that close() waited for the write of "b", queued on
    the callback's own thread behind the callback."""
    script = tmp_path / "in_a_callback.py"
    script.write_text(_IN_A_CALLBACK)
    root = tmp_path / "run"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        done = subprocess.run(
            [sys.executable, str(script), str(root)], env=env, capture_output=True, text=True, timeout=150
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"hung: {exc.stderr!r}") from None
    assert done.returncode == 0 and "closed ['a', 'b']" in done.stdout, done.stdout + done.stderr[-3000:]
