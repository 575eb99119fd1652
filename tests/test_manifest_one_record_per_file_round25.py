"""A manifest listing one file under two records is refused (issue #10), as a JSON object naming a key twice is.

The writer never lists a path twice (`_check_distinct` refuses the save), but the reader looked records up in a
dict by path and kept the last one silently: one item was checked against another item's record. A manifest
whose item `b` lists `a`'s file (with `a`'s size and CRC) loaded without templates returned `b` holding `a`'s
values, no error; a `metadata_file` naming an item's file replaced that item's record with the sharding
metadata's, and the load blamed the caller's config ("written as None"). Now `parse_manifest` (every reader)
refuses such a manifest naming the file and both records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_verified_loads import _edit_manifest, _manager
from torch_checkpointing import CorruptCheckpointError, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization

ITEMS = {key: ItemSpec(layout=LayoutInfo(f"{key}.pt", TorchSerialization())) for key in ("a", "b")}


def _save(root: Path) -> None:
    with _manager(ITEMS) as manager:
        manager.save(str(root), {"a": {"w": torch.zeros(2)}, "b": {"w": torch.ones(2)}})


def _b_lists_the_file_of_a(d: dict[str, Any]) -> None:
    a, b = d["items"]["a"]["0"], d["items"]["b"]["0"]
    b.update(path="./" + a["path"], size=a["size"], crc32=a["crc32"], blocks=a.get("blocks"))


def _metadata_names_the_file_of_a(d: dict[str, Any]) -> None:
    d.update(metadata_file="a.pt", metadata_size=d["items"]["a"]["0"]["size"], metadata_crc32=0)


@pytest.mark.parametrize("craft", [_b_lists_the_file_of_a, _metadata_names_the_file_of_a], ids=["item", "metadata"])
@pytest.mark.parametrize("templates", [True, False], ids=["into", "self-describing"])
def test_a_manifest_listing_one_file_twice_is_refused_naming_it(tmp_path: Path, craft: Any, templates: bool) -> None:
    """Defect: without templates, `b` came back holding `a`'s values; a metadata_file over `a.pt` was blamed on
    the caller's config."""
    root = tmp_path / "ck"
    _save(root)
    _edit_manifest(root, craft)
    into = {"a": {"w": torch.full((2,), -1.0)}, "b": {"w": torch.full((2,), -1.0)}}
    with _manager(ITEMS if templates else {}) as manager, pytest.raises(CorruptCheckpointError) as caught:
        manager.load(str(root), into=into if templates else None)
    message = str(caught.value)
    assert "manifest.json" in message and "'a.pt'" in message and "twice" in message, message
    assert all(bool((item["w"] == -1.0).all()) for item in into.values())
