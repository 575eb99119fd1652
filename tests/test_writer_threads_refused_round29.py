"""A writer process the OS refuses a thread says so, and the next save works (round 29).

The async writer started its own threads (the SIGTERM taker, the trainer watch) with a bare `Thread.start()`
before its set-up: refused a thread, it died with `RuntimeError: can't start new thread` on its stderr, and the
trainer read only an EOF: the save failed with "failed to start: EOFError: . ... guard your script's entry point
with `if __name__ == '__main__':`", blaming the script. The refusal here is real: a writer spawned under an
address-space limit (RLIMIT_AS) smaller than its threads' default stack (RLIMIT_STACK, read by the new process
at its start), which still imports torch; the trainer's own threads took their stack size at its start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_TRAINER = r"""
import os, resource, sys, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig


def save(manager, root, name):
    try:
        manager.save(os.path.join(root, name), {"t": {"x": torch.ones(4)}}).result(timeout=300)
        print(name, "saved")
    except Exception as exc:
        print(name, type(exc).__name__, "ulimit" in str(exc), "__main__" in str(exc), repr(str(exc)[:400]))


def main():
    root = sys.argv[1]
    stack, space = resource.getrlimit(resource.RLIMIT_STACK), resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_STACK, (64 << 30, stack[1]))
    resource.setrlimit(resource.RLIMIT_AS, (32 << 30, space[1]))
    manager = CheckpointManager(CheckpointManager.Config(save=AsyncCheckpointSaverConfig()))
    try:
        save(manager, root, "s1")
    finally:
        resource.setrlimit(resource.RLIMIT_STACK, stack)
        resource.setrlimit(resource.RLIMIT_AS, space)
    # The failed start already spawned the next writer, perhaps before the limits were lifted: that one may be
    # refused too, and says so; the one after is spawned without them.
    save(manager, root, "s2")
    save(manager, root, "s3")
    manager.close()


if __name__ == "__main__":
    main()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and RLIMIT_STACK are read as on Linux")
def test_a_writer_refused_a_thread_is_a_memory_error_and_the_next_save_works(tmp_path: Path) -> None:
    """Defect: "s1 CheckpointError False True 'Checkpoint writer process failed to start: EOFError: . The writer
    is spawned and re-imports your main module: guard your script's entry point ...'"."""
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}  # the writer's BLAS pool would be refused too, noisily
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()[-3:]
    outcomes = [line.split(" ", 4)[1:4] for line in lines]
    assert outcomes[0] == ["MemoryError", "True", "False"], done.stdout
    assert outcomes[1] in (["saved"], ["MemoryError", "True", "False"]) and outcomes[2] == ["saved"], done.stdout
    assert not (tmp_path / "s1").exists() and (tmp_path / "s3").is_dir()
