"""The sharding metadata's size and CRC in the manifest come as a pair, or the metadata goes unchecked (issue #10).

The writer records `metadata_size` and `metadata_crc32` together with `metadata_file`; manifests written before
they existed have neither, and their metadata is read unchecked. The reader checked the metadata only when both
were there and said nothing otherwise: a manifest that lost one of the two (damaged, or crafted to skip the
check) had its metadata read unverified under `verify_checksums=True`, and a resharding load of a rewritten
metadata.json succeeded. Now one without the other, or either without `metadata_file`, is a
`CorruptCheckpointError` naming the field.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_verified_loads import _edit_manifest, _reshard_load, _reshard_save
from torch_checkpointing import CorruptCheckpointError


def _drop(*fields: str) -> Any:
    def edit(d: dict[str, Any]) -> None:
        for name in fields:
            del d[name]

    return edit


def _no_metadata_file(d: dict[str, Any]) -> None:
    d["metadata_file"] = None


@pytest.mark.parametrize(
    ("craft", "field"),
    [(_drop("metadata_crc32"), "metadata_crc32"), (_drop("metadata_size"), "metadata_size")],
    ids=["crc-dropped", "size-dropped"],
)
def test_a_metadata_record_missing_half_is_refused_not_left_unchecked(tmp_path: Path, craft: Any, field: str) -> None:
    """Defect: the rewritten metadata.json loaded unverified (no error) once one of the two fields was gone."""
    root, _ = _reshard_save(tmp_path)
    metadata = root / "metadata.json"
    metadata.write_text(metadata.read_text() + " ")  # rewritten after the commit: its CRC no longer matches
    _edit_manifest(root, craft)
    with warnings.catch_warnings(), pytest.raises(CorruptCheckpointError) as caught:
        warnings.filterwarnings("ignore", message=".*plain.*")
        _reshard_load(root)
    assert "manifest.json" in str(caught.value) and field in str(caught.value), str(caught.value)


def test_a_metadata_record_without_its_file_is_refused(tmp_path: Path) -> None:
    """Defect: a size and CRC left without the metadata_file they describe loaded as if absent."""
    root, _ = _reshard_save(tmp_path)
    _edit_manifest(root, _no_metadata_file)
    with pytest.raises(CorruptCheckpointError, match="metadata_file"):
        _reshard_load(root)


def test_a_manifest_from_before_the_metadata_record_still_loads(tmp_path: Path) -> None:
    """Pins the older form (metadata_file, neither field): read, as before, unchecked."""
    root, value = _reshard_save(tmp_path)
    _edit_manifest(root, _drop("metadata_size", "metadata_crc32"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        _, target = _reshard_load(root)
    assert torch.equal(target, value)
