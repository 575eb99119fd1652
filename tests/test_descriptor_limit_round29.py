"""Putting back the soft limit of open files never lowers it below what the job set itself meanwhile.

Loads raise the soft RLIMIT_NOFILE and the last one in flight puts it back. A job that set its own limit while a
load was in flight keeps it; before, a second load that raised the limit again (past the job's) made the last
load put back the limit from before the first, below what the job had set.
"""

from __future__ import annotations

from pathlib import Path

from tests.descriptor_limits import run_under_256

_SCRIPT = """
from torch_checkpointing.read_context import CheckpointReadContext, ReadPolicy
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    for name in ("a", "b"):
        m.save(f"{root}/{name}", items(150))
first = CheckpointReadContext(storage, f"{root}/a", ReadPolicy()).__enter__()
print("raised by the first:", soft(), flush=True)
mine = soft() + 100
resource.setrlimit(resource.RLIMIT_NOFILE, (mine, hard))  # the job sets its own, a load in flight
second = CheckpointReadContext(storage, f"{root}/b", ReadPolicy()).__enter__()
print("raised by the second:", soft(), flush=True)
second.close()
first.close()
print("the job's own:", mine, "after both:", soft(), flush=True)
assert soft() >= mine, f"put back to {soft()}, below the {mine} the job set"
"""


def test_a_limit_set_while_a_load_is_in_flight_is_never_lowered(tmp_path: Path) -> None:
    out = run_under_256(_SCRIPT, tmp_path, hard_at_least=4096)
    assert "raised by the second" in out, out


_CTRL_C_WHILE_RAISING = """
import logging, os, signal

class CtrlC(logging.Handler):  # Ctrl-C comes as the load says it raised the limit
    def emit(self, record):
        if "Raised this process's soft limit" in record.getMessage():
            os.kill(os.getpid(), signal.SIGINT)

with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    m.save(f"{root}/big", items(150))
    logger = logging.getLogger("torch_checkpointing")
    logger.setLevel(logging.INFO)
    ctrl_c = CtrlC()
    logger.addHandler(ctrl_c)
    try:
        m.load(f"{root}/big")
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    logger.removeHandler(ctrl_c)
    print("after the interrupted load:", soft(), flush=True)
    m.load(f"{root}/big")
    print("after the next load:", soft(), flush=True)
"""


def test_a_load_interrupted_as_it_raised_the_limit_leaves_it_to_be_put_back(tmp_path: Path) -> None:
    out = run_under_256(_CTRL_C_WHILE_RAISING, tmp_path, hard_at_least=4096)
    assert "interrupted" in out, out
    assert "after the interrupted load: 256" in out, out
    assert "after the next load: 256" in out, out
