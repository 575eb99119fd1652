"""close() and save() called from a save Future's done-callback.

Callbacks of an async save's Future run on the engine's comm thread, the one thread that hands each write to
the writer process. A close() there ("close once the last save is durable") while another save was queued
behind it waited for that save, which could only run after the callback returned: close() hung, and the queued
save's Future never resolved. Run in a child process, since the old code hangs for good.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent(
    """
    import sys, threading, torch
    from torch_checkpointing import CheckpointManager

    if __name__ == "__main__":
        root, action = sys.argv[1], sys.argv[2]
        manager = CheckpointManager(CheckpointManager.Config.with_async_save())
        state = {"w": torch.arange(1000.0)}
        first = manager.save(f"{root}/a", state)
        done, outcome = threading.Event(), []

        def callback(future):
            try:
                if action == "close":
                    manager.close()
                else:  # a save from the callback, with one already queued behind it
                    outcome.append(manager.save(f"{root}/c", {"w": torch.arange(3.0)}))
            except BaseException as exc:
                outcome.append(exc)
            finally:
                done.set()

        first.add_done_callback(callback)
        second = manager.save(f"{root}/b", state)  # queued behind the callback on the comm thread
        assert done.wait(120), "the call in the done-callback hung"  # after the first save, writer spawn included
        second.result(120)
        if action == "save":
            outcome[0].result(60)
            manager.close()
        loaded = CheckpointManager(CheckpointManager.Config.with_sync_save()).load(f"{root}/b", into={"w": None})
        assert torch.equal(loaded["w"], state["w"])
        print("ok", outcome if action == "close" else "", flush=True)
    """
)


@pytest.mark.parametrize("action", ["close", "save"])
def test_close_or_save_in_a_done_callback_with_a_save_queued_behind_it(tmp_path: Path, action: str) -> None:
    script = tmp_path / "callback.py"
    script.write_text(_SCRIPT)
    try:
        run = subprocess.run(
            [sys.executable, str(script), str(tmp_path), action], capture_output=True, text=True, timeout=150
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung: {exc.stdout!r} {exc.stderr!r}")
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
