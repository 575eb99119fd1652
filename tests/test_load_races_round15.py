"""A load while the same id is replaced by another save (found in round 15 by real processes racing; here the
replace is put at the exact moment, with real saves on a real filesystem).

* A load without templates read the item list from one manifest and the files from the directory it then
  pinned: a replace between the two returned the new checkpoint without an item the old one listed, silently.
* A load whose pinned directory was deleted before it looked for the manifest took it for a legacy checkpoint
  without one: with only optional items it returned {} and restored nothing, with a legacy-format warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, CorruptCheckpointError, ItemSpec
from torch_checkpointing import checkpoint_manager as manager_module
from torch_checkpointing.read_context import CheckpointReadContext


def _sync(**items: ItemSpec) -> CheckpointManager:
    config = CheckpointManager.Config.with_sync_save()
    config.items = dict(items)
    return CheckpointManager(config)


def test_a_load_without_templates_raced_by_a_replace_refuses_instead_of_dropping_items(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = str(tmp_path / "same")
    with _sync() as saver, _sync() as loader:
        saver.save(ckpt, {"model": {"w": torch.ones(2)}, "opt": {"step": 1}})
        real = manager_module.self_describing_layouts

        def then_replaced(*args: Any, **kwargs: Any) -> Any:
            layouts = real(*args, **kwargs)
            saver.save(ckpt, {"model": {"w": torch.full((2,), 2.0)}})  # another save replaces the id now
            return layouts

        monkeypatch.setattr(manager_module, "self_describing_layouts", then_replaced)
        with pytest.raises(CorruptCheckpointError, match="replaced while this load ran"):
            loader.load(ckpt)
        monkeypatch.undo()
        assert sorted(loader.load(ckpt)) == ["model"]  # a retry loads what is there now, whole


def test_a_load_whose_pinned_directory_was_deleted_refuses_instead_of_restoring_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = str(tmp_path / "same")
    optional = {"model": ItemSpec(required=False), "opt": ItemSpec(required=False)}
    with _sync(**optional) as saver, _sync(**optional) as loader:
        saver.save(ckpt, {"model": {"w": torch.ones(2)}, "opt": {"step": 1}})
        real, calls = CheckpointReadContext._exists, [0]

        def replaced_after_the_open(self: CheckpointReadContext, name: str) -> bool:
            calls[0] += 1
            if calls[0] == 1:  # the directory is pinned; before its manifest is looked for, it is replaced
                saver.save(ckpt, {"model": {"w": torch.full((2,), 2.0)}, "opt": {"step": 2}})
            return real(self, name)

        monkeypatch.setattr(CheckpointReadContext, "_exists", replaced_after_the_open)
        template = {"model": {"w": torch.zeros(2)}, "opt": None}
        with pytest.raises(CorruptCheckpointError, match="replaced or deleted while this load ran"):
            loader.load(ckpt, into=template)
        assert torch.equal(template["model"]["w"], torch.zeros(2))
        monkeypatch.undo()
        loaded = loader.load(ckpt, into=template)
        assert torch.equal(template["model"]["w"], torch.full((2,), 2.0)) and loaded["opt"] == {"step": 2}
