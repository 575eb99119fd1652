"""A load refuses, before copying a byte, a file larger than the memory it could be copied into.

Every local file a load reads whole is first copied into an anonymous in-memory file (`cold_read.private_copy`,
so that what a load returns never maps the checkpoint's file). That copy is memory RLIMIT_AS does not count, and
nothing compared it with the memory there is: a checkpoint without a manifest (nothing vouches for its sizes)
holding a sparse 1 TiB file (no disk used) made the load copy zeros until the machine ran out (a 6 GiB one took
18 s and 6 GiB of RAM; larger ones end in the OOM killer), where it should say at once that the file cannot fit.
The old code's copy is stopped here by RLIMIT_FSIZE (it applies to writes into the in-memory file), so the test
never fills this machine's memory.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_LOAD = """
import os, resource, signal, sys, time, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_layout import LayoutInfo, RawSerialization, TorchSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.schema import ItemSpec
path, name, fmt = sys.argv[1], sys.argv[2], RawSerialization() if sys.argv[2] == "blob.bin" else TorchSerialization()
items = {"blob": ItemSpec(layout=LayoutInfo(name, fmt))}
config = CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig())
with CheckpointManager(config) as m:
    m.save(path, {"blob": b"x" if sys.argv[2] == "blob.bin" else {"t": torch.ones(3)}})
    os.remove(os.path.join(path, "manifest.json"))  # no manifest: nothing vouches for the file's size
    os.truncate(os.path.join(path, name), 1 << 40)  # sparse: 1 TiB, no disk used
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 20, resource.RLIM_INFINITY))  # the old code's copy stops here
    start = time.monotonic()
    try:
        m.load(path)
        print("loaded")
    except (CheckpointError, MemoryError, OSError) as exc:
        said = "named" if os.path.join(path, name) in str(exc) else "-"
        print(type(exc).__name__, said, round(time.monotonic() - start, 1), repr(str(exc)))
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "memfd_create"), reason="the copy is made only where memfd is")
@pytest.mark.parametrize("name", ["blob.bin", "blob.pt"])
def test_a_file_larger_than_memory_is_refused_before_its_copy(tmp_path: Path, name: str) -> None:
    """Defect: the copy ran until RLIMIT_FSIZE stopped it at 256 MiB ("OSError - ... [Errno 27] File too large");
    without that limit, until the machine's memory ran out."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, str(tmp_path / "ck"), name], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kind, said, _seconds, message = done.stdout.strip().splitlines()[-1].split(" ", 3)
    assert (kind, said) == ("MemoryError", "named"), done.stdout
    assert "not found damaged" in message and "1099511627776" in message, message
