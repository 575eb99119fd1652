"""Custom resharders are all-or-nothing among themselves (round 24, issue #10).

A custom resharder's own `load` copies into its template as it reads. Run in item order, one that failed left
the templates of the items before it filled (and its own partly filled): the load raised, but had changed the
caller's objects. Every template must hold what it held before when any item fails, whatever the resharders
did to it (filled it in place, added or removed entries).
"""

from __future__ import annotations

import warnings
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.resharding import Resharder

pytestmark = pytest.mark.filterwarnings("ignore:Item '.*' has plain \\(non-DTensor\\) tensors")


class _Filling(Resharder):
    """Fills every template tensor with the saved one (read whole through `storage`), adds an entry, then
    raises where `fail` says: after it has written into its template, as a failing user resharder does."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return DTensorResharder().extract_sharding_metadata(item_key, item_value)

    def should_reshard(self, source_metadata: Any, target_metadata: Any) -> bool:
        return source_metadata is not None

    def load(
        self, source_path: Path, item_key: str, target_metadata: Any, source_metadata: Any, target: Any, storage: Any
    ) -> list[Any]:
        import io

        saved = torch.load(io.BytesIO(storage.read(source_metadata.get_file_path(0, source_path, item_key))))
        for name, tensor in saved.items():
            target[name].copy_(tensor)
        target["added"] = torch.ones(1)
        target["nested"]["x"].fill_(9.0)
        target["nested"]["list"].append(3)
        target["nested"]["queue"].popleft().fill_(5.0)
        if self.fail:
            raise RuntimeError(f"resharder of {item_key} failed after filling its template")
        return []


def _templates() -> dict[str, Any]:
    nested = lambda: {"x": torch.zeros(2), "list": [1, 2], "queue": deque([torch.ones(3)])}  # noqa: E731
    return {k: {"w": torch.full((8,), -1.0), "nested": nested()} for k in ("a", "b")}


def test_a_failing_custom_resharder_leaves_every_template_as_it_was(tmp_path: Path) -> None:
    config = CheckpointManager.Config.with_sync_save()
    config.items = {"a": ItemSpec(resharder=_Filling(False)), "b": ItemSpec(resharder=_Filling(True))}
    manager = CheckpointManager(config)
    try:
        manager.save(str(tmp_path / "ck"), {k: {"w": torch.arange(8.0)} for k in ("a", "b")})
        templates = _templates()
        w_a, x_b = templates["a"]["w"], templates["b"]["nested"]["x"]
        with pytest.raises(RuntimeError, match="resharder of b failed"):
            manager.load(str(tmp_path / "ck"), templates)
    finally:
        manager.close()
    expected = _templates()
    for key in ("a", "b"):
        assert sorted(templates[key]) == sorted(expected[key]), f"entries of {key!r} changed"
        assert torch.equal(templates[key]["w"], expected[key]["w"]), f"{key!r} was filled by the failed load"
        assert torch.equal(templates[key]["nested"]["x"], expected[key]["nested"]["x"])
        assert templates[key]["nested"]["list"] == [1, 2]
        queue = templates[key]["nested"]["queue"]
        assert len(queue) == 1 and torch.equal(queue[0], torch.ones(3))
    assert templates["a"]["w"] is w_a and templates["b"]["nested"]["x"] is x_b  # the caller's own objects
