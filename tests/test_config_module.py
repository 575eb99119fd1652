"""The configuration dataclasses live in `torch_checkpointing.config`, which imports no torch and no writer stack."""

from __future__ import annotations

import torch_checkpointing
from tests.probes import modules_after

# A fresh interpreter imports the config module the way user code does, through the package (whose names load
# lazily), and reports what landed in sys.modules.
_PROBE = """
import torch_checkpointing.config as config
config.CheckpointWriterConfig(); config.CheckpointProcessConfig()
"""

_HEAVY = [
    "torch",
    "multiprocessing",
    "torch_checkpointing.checkpoint_process",
    "torch_checkpointing.checkpoint_writer",
    "torch_checkpointing.staging",
    "torch_checkpointing.barriers",
]


def test_config_module_imports_no_torch_and_no_writer_stack() -> None:
    # What the interpreter itself starts with here is not the config's doing (e.g. a coverage startup hook in CI
    # imports multiprocessing), so only the modules the import adds count.
    bare = modules_after("")
    added = modules_after(_PROBE) - bare
    assert [name for name in _HEAVY if name in added] == []


def test_old_modules_re_export_the_same_classes() -> None:
    from torch_checkpointing import checkpoint_process, checkpoint_writer, config, staging

    assert staging.CheckpointStagerConfig is config.CheckpointStagerConfig
    assert checkpoint_writer.CheckpointWriterConfig is config.CheckpointWriterConfig
    assert checkpoint_process.CheckpointProcessConfig is config.CheckpointProcessConfig
    assert torch_checkpointing.CheckpointStagerConfig is config.CheckpointStagerConfig


def test_stager_config_defaults_follow_cuda() -> None:
    import torch

    from torch_checkpointing.config import CheckpointStagerConfig

    cfg = CheckpointStagerConfig()
    assert cfg.use_pinned_memory is torch.cuda.is_available()
    assert cfg.use_non_blocking_copy is torch.cuda.is_available()
