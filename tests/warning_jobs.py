"""Rank functions for test_deliberate_warnings (importable by the launcher's spawned ranks)."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


@contextmanager
def said_about(word: str) -> Iterator[list[str]]:
    """Every warning (Python warning or `torch_checkpointing` log record) mentioning `word`, none filtered."""
    heard: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING and word in record.getMessage():
                heard.append(record.getMessage())

    handler = Catch()
    logger = logging.getLogger("torch_checkpointing")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield heard
        heard.extend(str(w.message) for w in caught if word in str(w.message))
    finally:
        logger.removeHandler(handler)


def _manager(layout: LayoutInfo) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            items={"config": ItemSpec(layout=layout)},
            save=SyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def _count_over_saves(root: str, name: str, layout: LayoutInfo, saves: int = 3) -> tuple[int, Any]:
    with said_about("'config'") as heard:
        manager = _manager(layout)
        for step in range(saves):
            manager.save(os.path.join(root, f"{name}_{step}"), {"config": {"lr": 0.1, "step": step}})
        loaded = manager.load(os.path.join(root, f"{name}_{saves - 1}"), into={"config": None})["config"]
        manager.close()
    return len(heard), loaded


def shared_layout_warnings(root: str, make_replicated: Callable[[str, Any], LayoutInfo] | None) -> dict[str, Any]:
    """Per rank: how many warnings three saves of a {rank}-less item raised, plain and declared replicated."""
    plain, plain_loaded = _count_over_saves(root, "plain", LayoutInfo("config.json", JsonSerialization()))
    out: dict[str, Any] = {"rank": dist.get_rank(), "plain": plain, "plain_loaded": plain_loaded}
    if make_replicated is not None:
        declared, declared_loaded = _count_over_saves(
            root, "declared", make_replicated("config.json", JsonSerialization())
        )
        out.update(declared=declared, declared_loaded=declared_loaded)
    return out
