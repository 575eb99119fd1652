"""A shortage is told as one where torch appends its C++ backtrace to its errors (TORCH_SHOW_CPP_STACKTRACES=1).

A refused allocation is recognised by the words that end torch's message ("... Error code 12 (Cannot allocate
memory)"). With TORCH_SHOW_CPP_STACKTRACES=1, set when debugging a job, torch appends its C++ backtrace after them,
and a load short of memory said "is not a readable Torch file" (CorruptCheckpointError): a caller that deletes
damaged checkpoints, or falls back to an earlier one, acted on an intact checkpoint. torch reads the variable once,
so each case runs in a process of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_LAUNCH_BOUND_S = 300  # a few seconds expected; this only stops a hang


def _run(code: str, tmp_path: Path) -> str:
    env = {**os.environ, "TORCH_SHOW_CPP_STACKTRACES": "1", "TORCH_DISABLE_ADDR2LINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=_LAUNCH_BOUND_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_load_short_of_memory_is_a_memory_error_with_the_cpp_backtrace_shown(tmp_path: Path) -> None:
    """Defect: CorruptCheckpointError: File .../model_0.pt for item 'model' is not a readable Torch file: [enforce
    fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: ... (Cannot allocate memory)
    C++ CapturedTraceback: ..."""
    said = _run(
        """
        import os, resource, sys, torch
        from torch_checkpointing import CheckpointManager
        root, n = sys.argv[1], 16 << 20  # 64 MiB of float32
        config = CheckpointManager.Config().with_sync_save()
        config.load.use_mmap, config.load.verify_checksums = False, False  # torch.load allocates each tensor
        manager = CheckpointManager(config)
        manager.save(os.path.join(root, "c1"), {"model": {"w": torch.ones(n)}})
        template = {"model": {"w": torch.zeros(n)}}
        manager.load(os.path.join(root, "c1"), template)  # its threads, started before the limit
        with open("/proc/self/status") as f:
            used = int(next(line for line in f if line.startswith("VmSize")).split()[1]) * 1024
        # room to read the file (64 MiB), not to allocate its tensor as well
        resource.setrlimit(resource.RLIMIT_AS, (used + (96 << 20), resource.RLIM_INFINITY))
        try:
            manager.load(os.path.join(root, "c1"), template)
            print("loaded")
        except BaseException as exc:
            print(type(exc).__name__, str(exc).splitlines()[0])
        """,
        tmp_path,
    )
    assert said.startswith("MemoryError Out of memory reading"), said
    assert "item 'model'" in said and "not found damaged" in said, said


def test_torchs_refused_allocation_with_its_backtrace_is_a_shortage(tmp_path: Path) -> None:
    """Defect: UndecodableFileError "... cannot be decoded (RuntimeError: ... (Cannot allocate memory)
    C++ CapturedTraceback: ...); the file is damaged or crafted"."""
    said = _run(
        """
        import torch
        from torch_checkpointing.errors import undecodable
        try:
            torch.empty(1 << 50, dtype=torch.uint8)  # a petabyte: refused by torch's CPU allocator
        except RuntimeError as refused:
            assert "CapturedTraceback" in str(refused) or "Exception raised from" in str(refused), str(refused)
            try:
                error = undecodable("f.pt", "item 'model'", refused)
                print(type(error).__name__)
            except MemoryError as exc:
                print("MemoryError", str(exc).splitlines()[0][:200])
        """,
        tmp_path,
    )
    assert said.startswith("MemoryError Out of memory reading f.pt"), said


def test_a_record_named_like_a_shortage_stays_damage_with_the_backtrace_shown(tmp_path: Path) -> None:
    """What the backtrace's removal must not do: take text in a crafted file's record name, before torch's own
    backtrace, for torch's words."""
    said = _run(
        """
        import torch
        from torch_checkpointing.errors import undecodable
        try:
            torch.empty(-1)  # any error of torch's, for its backtrace
        except RuntimeError as exc:
            backtrace = str(exc)[str(exc).index("\\n"):]
        crafted = "failed locating file data/x: Cannot allocate memory (12)\\nC++ CapturedTraceback:\\n#0 y: not found"
        print(type(undecodable("f.pt", "item 'model'", RuntimeError(crafted + backtrace))).__name__)
        """,
        tmp_path,
    )
    assert said == "UndecodableFileError", said
