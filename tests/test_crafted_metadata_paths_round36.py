"""Sharding metadata that records a tensor the saved files do not hold (round 36).

A resharded load took metadata.json's nested paths for the checkpoint's content: a crafted entry (an extra
path, a `..` name, both with the manifest's checksum forged to match) that no template entry receives was
reported as "in the checkpoint but not in the template", a `TemplateMismatchError` blaming the caller's
model, though no saved file holds it. It is damage, named as such (metadata.json, the path), before anything
is restored, whatever `strict` says.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_verified_loads import AlwaysReshard, _manager, _reshard_save, _rewrite_metadata
from torch_checkpointing import ItemSpec
from torch_checkpointing.errors import CorruptCheckpointError


def _record_also(name: str) -> Any:
    """An edit of metadata.json recording `name` beside `w`, with `w`'s layout."""

    def edit(d: dict[str, Any]) -> None:
        paths = d["metadata"]["model"]["nested_path_to_metadata"]
        paths[f'["{name}"]'] = paths['["w"]']

    return edit


@pytest.mark.parametrize("name", ["bias", ".."])
@pytest.mark.parametrize("strict", [True, False])
def test_a_path_only_the_metadata_records_is_damage_not_a_template_mismatch(
    tmp_path: Path, name: str, strict: bool
) -> None:
    root, _ = _reshard_save(tmp_path)
    _rewrite_metadata(root, _record_also(name))
    target = torch.full((4096,), -1.0)
    m = _manager({"model": ItemSpec(resharder=AlwaysReshard())})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            with pytest.raises(CorruptCheckpointError, match=rf"metadata\.json.*model::{name}.*model_0\.pt"):
                m.load(str(root), into={"model": {"w": target}}, strict=strict)
    finally:
        m.close()
    assert bool((target == -1.0).all()), "a refused load restored something"


def test_a_template_without_a_saved_tensor_is_still_told_as_a_template_mismatch(tmp_path: Path) -> None:
    """Pins what held: a tensor the saved file does hold, left out of the template, is the caller's to fix."""
    value = torch.arange(8.0)
    m = _manager({"model": ItemSpec(resharder=AlwaysReshard())})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            m.save(str(tmp_path / "ck"), {"model": {"w": value, "bias": value + 1}})
            loaded = m.load(str(tmp_path / "ck"), into={"model": {"w": torch.zeros(8)}}, strict=False)
            with pytest.raises(Exception, match=r"not in the template \['model::bias'\]") as raised:
                m.load(str(tmp_path / "ck"), into={"model": {"w": torch.zeros(8)}}, strict=True)
    finally:
        m.close()
    assert not isinstance(raised.value, CorruptCheckpointError)
    assert torch.equal(loaded["model"]["w"], value)
