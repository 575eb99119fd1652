"""Every out-of-memory failure of a load names the checkpoint and says it was not found damaged.

Round 26 made a shortage a `MemoryError` wherever torch or the OS worded it as a RuntimeError or an OSError, but a
`MemoryError` that Python itself raised (the bytes of a raw item, the text of a JSON item) or a decoder raised with
its own words (safetensors' "Cannot allocate memory (os error 12)") left `load()` as it was: `MemoryError()` with
no message at all, naming neither the checkpoint nor the file, nor saying that nothing was found damaged. The
shortage here is real: a child under RLIMIT_AS, stepped up until the load succeeds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_LOAD_UNDER_LIMITS = """
import resource, sys
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo, RawSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.schema import ItemSpec
raw = sys.argv[2] == "raw"
fmt = RawSerialization() if raw else JsonSerialization()
items = {"blob": ItemSpec(layout=LayoutInfo("blob.bin", fmt))}
config = CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig())
with CheckpointManager(config) as m:
    m.save(sys.argv[1], {"blob": bytes(192 << 20) if raw else {"text": "x" * (96 << 20)}})
    m.load(sys.argv[1])  # every import a load needs
    base = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    for room in range(0, 2049, 64):  # MiB of address space beyond what the process holds
        resource.setrlimit(resource.RLIMIT_AS, (base + room * 2**20, resource.RLIM_INFINITY))
        try:
            m.load(sys.argv[1])
            print(room, "loaded")
            break
        except (CheckpointError, MemoryError) as exc:
            said = "named" if sys.argv[1] in str(exc) and "not found damaged" in str(exc) else "-"
            print(room, type(exc).__name__, said, repr(str(exc)[:200]))
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's")
@pytest.mark.parametrize("fmt", ["raw", "json"])
def test_a_load_out_of_memory_always_says_so(tmp_path: Path, fmt: str) -> None:
    """Defect: "0 MemoryError - ''" for every limit below what the load needs: a bare MemoryError()."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_UNDER_LIMITS, str(tmp_path / "ck"), fmt],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines and lines[-1].endswith("loaded"), (done.stdout, done.stderr[-2000:])
    failures = lines[:-1]
    assert failures, "no limit was low enough to fail the load: the test shows nothing"
    wrong = [line for line in failures if " MemoryError named " not in line]
    assert not wrong, "\n".join(wrong)
