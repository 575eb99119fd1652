"""A backend whose every save raises: it "refuses" to save over an unrelated directory or file by construction.

`SAFE-ID-*` must report it *not measured* (a save to a fresh id raised too).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from tests.conformance_backends import alias_engine_modules, engine_name
from torch_checkpointing import CheckpointManager as EngineManager

alias_engine_modules(__name__)


class CheckpointManager(EngineManager):
    def save(self, checkpoint_id: str, checkpoint: Mapping[str, Any], **kwargs: Any) -> Future[Any] | None:
        raise OSError(f"{checkpoint_id}: this backend saves nothing")


def __getattr__(name: str) -> Any:
    return engine_name(name)
