"""The async writer when its trainer goes away without a word (SIGKILL, SIGTERM, an OOM kill).

Before: a trainer killed with a reply of its writer still unread in its end of the pipe (a save under way)
left the writer a ConnectionResetError, not an EOFError, at its next read; it died with multiprocessing's
"Process ckpt-writer: Traceback ... ConnectionResetError: [Errno 104] Connection reset by peer" on the job's
stderr, which reads as a crash of the checkpointing in every preempted job's log. Now the writer ends quietly,
as it does on EOF: nobody is left to answer, and nothing of the save was committed behind the trainer's back.

The trainer here is a process that starts the writer, leaves its `Ready` unread (what a trainer killed with a
reply in flight leaves), and closes its end: the writer's next read then gets ECONNRESET every time.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300  # a loaded 2-core machine takes ~15 s to import torch (twice: trainer and writer)

TRAINER = """
import multiprocessing as mp
import sys
from torch_checkpointing.checkpoint_process import _noop, _writer_main
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    mine, its = ctx.Pipe()
    args = (its, LocalFileSystemStorageConfig(), {}, _noop, ())
    writer = ctx.Process(target=_writer_main, args=args, name="ckpt-writer")
    writer.start()
    its.close()
    assert mine.poll(240), "the writer never said Ready"
    mine.close()  # with its Ready unread: the writer's next recv() gets ECONNRESET, not EOF
    writer.join(60)
    print("writer exit code", writer.exitcode, flush=True)
"""


def test_a_writer_whose_trainer_went_with_a_reply_unread_ends_without_a_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-c", TRAINER], cwd=REPO, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "ConnectionResetError" not in done.stderr, done.stderr
    assert "writer exit code 0" in done.stdout, done.stdout + done.stderr
