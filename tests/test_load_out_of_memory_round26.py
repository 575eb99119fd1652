"""A machine out of memory during a load is a `MemoryError`, never a damaged checkpoint nor the caller's error.

torch's CPU allocator and its mmap of a file say "no room" as a plain RuntimeError ("DefaultCPUAllocator: can't
allocate memory", "unable to mmap ... Cannot allocate memory (12)"), and the loader's decode handlers took it for
the file's damage (`UndecodableFileError`: "the file is damaged or crafted"), or, inside a callable map_location,
for the caller's bug (`ConfigError`: "Fix the callable"). A caller that deletes damaged checkpoints, or falls back
to an earlier one, acted on an intact checkpoint. The shortage here is real: a child under RLIMIT_AS.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_LOAD_UNDER_LIMITS = """
import resource, sys, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization, TorchSerialization
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError, ConfigError
from torch_checkpointing.schema import ItemSpec
fmt = SafetensorsSerialization() if sys.argv[2] == "safetensors" else TorchSerialization()
items = {"model": ItemSpec(layout=LayoutInfo("model_{rank}.bin", fmt))}
config = CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig())
place = (lambda storage, location: storage.clone()) if sys.argv[2] == "copying callable" else None
with CheckpointManager(config) as m:
    m.save(sys.argv[1], {"model": {"w": torch.ones(64, 1024, 1024)}})  # 256 MiB
    base = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    for room in range(64, 2049, 32):  # MiB of address space beyond what the process holds (64: not the file)
        resource.setrlimit(resource.RLIMIT_AS, (base + room * 2**20, resource.RLIM_INFINITY))
        try:
            m.load(sys.argv[1], map_location=place)
            print(room, "loaded")
            break
        except (CheckpointError, ConfigError, MemoryError) as exc:
            said = "shortage-said" if "not found damaged" in str(exc) else "-"  # the message's end: paths are long
            print(room, type(exc).__name__, isinstance(exc, (CheckpointError, ConfigError)), said, str(exc)[:200])
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's")
@pytest.mark.parametrize("case", ["safetensors", "copying callable"])
def test_a_load_out_of_memory_is_memory_error_not_damage(tmp_path: Path, case: str) -> None:
    """Each limit from the file's size up, until the load succeeds: every failure must be a MemoryError.

    Defect: with the room for the file's mapping but not for more, a safetensors load said
    UndecodableFileError "unable to mmap ... Cannot allocate memory (12) ... the file is damaged or crafted", and a
    callable copying each storage said ConfigError "raised RuntimeError: ... DefaultCPUAllocator: can't allocate
    memory ... Fix the callable"."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_UNDER_LIMITS, str(tmp_path / "ck"), case],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stdout.splitlines()
    assert lines and lines[-1].endswith("loaded"), (done.stdout, done.stderr[-2000:])  # the checkpoint is intact
    refusals = [line for line in lines[:-1] if " MemoryError False " not in line]
    assert not refusals, lines  # every failure under a limit was the shortage, never damage nor a wrong argument
    if case == "copying callable":  # its copy needs room beyond the mapping at every run; the mmap window varies
        assert any(" shortage-said " in line for line in lines), "\n".join(lines)  # the decoder saw a shortage
