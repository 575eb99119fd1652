"""A backend that refuses every save over an existing id (as the published 0.1.1 does): ``FileExistsError``.

Clauses that kill, fill or race a save over a committed id must report it *not measured*, never passed.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from tests.conformance_backends import alias_engine_modules, engine_name, existing_id
from torch_checkpointing import CheckpointManager as EngineManager

alias_engine_modules(__name__)


class CheckpointManager(EngineManager):
    def save(self, checkpoint_id: str, checkpoint: Mapping[str, Any], **kwargs: Any) -> Future[Any] | None:
        if existing_id(checkpoint_id):
            raise FileExistsError(f"{checkpoint_id} already exists: this backend never replaces a checkpoint")
        return super().save(checkpoint_id, checkpoint, **kwargs)


def __getattr__(name: str) -> Any:
    return engine_name(name)
