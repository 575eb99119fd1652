"""A backend whose every load raises: damaged checkpoints "raise" too, which shows nothing about detection.

The corruption and crafted-file clauses must report it *not measured* (an undamaged copy does not load).
"""

from __future__ import annotations

from typing import Any

from tests.conformance_backends import alias_engine_modules, engine_name
from torch_checkpointing import CheckpointManager as EngineManager
from torch_checkpointing.errors import CorruptCheckpointError

alias_engine_modules(__name__)


class CheckpointManager(EngineManager):
    def load(self, checkpoint_id: str, *args: Any, **kwargs: Any) -> Any:
        raise CorruptCheckpointError(f"{checkpoint_id}: this backend loads nothing")


def __getattr__(name: str) -> Any:
    return engine_name(name)
