"""A backend that refuses an async save over an existing id in its writer, as the published 0.1.1 does.

The refusal comes from the save's Future, and ``close()`` raises it once more, which 0.1.1's manager does
too (it waits on its last write). A durability clause must report that refusal as *not measured*.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from tests.conformance_backends import alias_engine_modules, engine_name, existing_id
from torch_checkpointing import CheckpointManager as EngineManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig

alias_engine_modules(__name__)


class CheckpointManager(EngineManager):
    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._async = config is not None and isinstance(config.save, AsyncCheckpointSaverConfig)
        self._refused: BaseException | None = None

    def save(self, checkpoint_id: str, checkpoint: Mapping[str, Any], **kwargs: Any) -> Future[Any] | None:
        if not existing_id(checkpoint_id):
            return super().save(checkpoint_id, checkpoint, **kwargs)
        error = FileExistsError(f"{checkpoint_id} already exists: this backend never replaces a checkpoint")
        if not self._async:
            raise error
        self._refused = error
        refused: Future[Any] = Future()
        refused.set_exception(error)
        return refused

    def close(self) -> None:
        super().close()
        error, self._refused = self._refused, None
        if error is not None:
            raise error


def __getattr__(name: str) -> Any:
    return engine_name(name)
