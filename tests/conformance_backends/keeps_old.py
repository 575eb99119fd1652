"""A backend whose save over an existing id returns normally and writes nothing: the old checkpoint stays.

A silent failure: the clauses that save over a committed id must fail on it, not pass by construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from tests.conformance_backends import alias_engine_modules, engine_name, existing_id
from torch_checkpointing import CheckpointManager as EngineManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

alias_engine_modules(__name__)


class CheckpointManager(EngineManager):
    def save(self, checkpoint_id: str, checkpoint: Mapping[str, Any], **kwargs: Any) -> Future[Any] | None:
        if not existing_id(checkpoint_id):
            return super().save(checkpoint_id, checkpoint, **kwargs)
        if isinstance(self.config.save, SyncCheckpointSaverConfig):
            return None
        done: Future[Any] = Future()
        done.set_result(None)
        return done


def __getattr__(name: str) -> Any:
    return engine_name(name)
