"""The spawned writer process imports the write path only: the package's names load on first use, so
unpickling the writer's entry point (in `checkpoint_process`) does not pull in the manager, the loader, the
resharders or the operations on committed checkpoints, which the writer never runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Modules the writer process never runs; importing them would only cost its start-up time and memory.
NOT_IN_THE_WRITER = [
    "torch_checkpointing.checkpoint_manager",
    "torch_checkpointing.checkpoint_loader",
    "torch_checkpointing.checkpoint_saver",
    "torch_checkpointing.dtensor_resharder",
    "torch_checkpointing.metadata_manager",
    "torch_checkpointing.barriers",
    "torch_checkpointing.retention",
    "torch_checkpointing.discovery",
    "torch_checkpointing.source_reader",
    "torch_checkpointing.hf",
    "torch_checkpointing.cli",
]


def record_modules(path: str) -> None:
    """The writer's init function: writes down what the writer process has imported when it starts."""
    Path(path).write_text(json.dumps(sorted(sys.modules)))


def test_spawned_writer_imports_only_the_write_path(tmp_path: Path) -> None:
    from torch_checkpointing.checkpoint_process import CheckpointProcess, CheckpointProcessConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    out = tmp_path / "modules.json"
    process = CheckpointProcess(
        LocalFileSystemStorageConfig(use_direct_io=False),
        CheckpointProcessConfig(subprocess_init_timeout_secs=120),
        record_modules,
        (str(out),),
    )
    try:
        process.wait_ready()
    finally:
        process.close()
    loaded = set(json.loads(out.read_text()))
    assert "torch_checkpointing.checkpoint_process" in loaded and "torch_checkpointing.checkpoint_writer" in loaded
    assert [m for m in NOT_IN_THE_WRITER if m in loaded] == []
