"""The soft limit of open files a load raised is put back once no load is in flight.

A load holds every local file it reads open, so it raises the soft RLIMIT_NOFILE to what it needs. Before, the
limit stayed raised for the process's life: a job's own lower limit (its guard against a descriptor leak, what
its children inherit) was gone after its first large load. It is not put back at the end of each load: another
load in flight on another thread holds its files open under the raised limit, and its next open would fail.
"""

from __future__ import annotations

from pathlib import Path

from tests.descriptor_limits import run_under_256

_SCRIPT = """
import logging
from torch_checkpointing.read_context import CheckpointReadContext, ReadPolicy
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(message)s")
storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    m.save(f"{root}/big", items(150))
    m.save(f"{root}/small", {"k": {"t": torch.ones(3)}})
    out = m.load(f"{root}/big")
    assert all(float(out[f"k{i}"]["t"][0]) == i for i in range(150))
    print("after one load:", soft(), flush=True)
    with CheckpointReadContext(storage, f"{root}/small", ReadPolicy()):  # a load in flight meanwhile
        m.load(f"{root}/big")
        print("after a load, another in flight:", soft(), flush=True)
    print("after the last:", soft(), flush=True)
    with CheckpointReadContext(storage, f"{root}/big", ReadPolicy()):
        raised = soft()
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised + 7, hard))  # the job sets its own meanwhile
    print("set meanwhile, kept:", soft() == raised + 7, flush=True)
"""


def test_the_raised_soft_limit_is_put_back_once_no_load_is_in_flight(tmp_path: Path) -> None:
    out = run_under_256(_SCRIPT, tmp_path, hard_at_least=2048)
    assert "LOG INFO Raised this process's soft limit of open files" in out, out
    # Before: "after one load: 462" and so on, raised for good.
    assert "after one load: 256" in out, out
    raised = next(line for line in out.splitlines() if line.startswith("after a load, another in flight:"))
    assert int(raised.rsplit(" ", 1)[1]) > 256, out  # the small load still in flight keeps it
    assert "after the last: 256" in out, out
    assert "set meanwhile, kept: True" in out, out
    assert "LOG INFO Put this process's soft limit of open files (RLIMIT_NOFILE) back from " in out, out


_TWO_AT_ONCE = """
from torch_checkpointing.read_context import CheckpointReadContext, ReadPolicy
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    m.save(f"{root}/big", items(150))
    m.save(f"{root}/mid", items(90))
storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
# Two loads in flight (as on two threads): both open their checkpoints, then both check their files.
with CheckpointReadContext(storage, f"{root}/big", ReadPolicy()) as big:
    with CheckpointReadContext(storage, f"{root}/mid", ReadPolicy()) as mid:
        for ctx in (big, mid):
            for record in ctx.manifest.files:  # each read whole into a copy of its own, as a load without templates
                ctx.start_whole(record.path, record.key, private=True)
            ctx.wait_verified()
            for record in ctx.manifest.files:
                ctx.storage_view().read(ctx.root / record.path)
        print("both checked", flush=True)
print("after both:", soft(), flush=True)
"""


def test_two_loads_in_flight_each_find_room_for_their_files(tmp_path: Path) -> None:
    # Before: the second load found room beside the first's few descriptors open so far, and did not raise the
    # limit for its own: "OSError: [Errno 24] Out of file descriptors reading …/mid/k…_0.pt" (18 of 60 loads of
    # four threads failed so, two after the first fix).
    out = run_under_256(_TWO_AT_ONCE, tmp_path, hard_at_least=2048)
    assert "both checked" in out, out
    assert "after both: 256" in out, out
