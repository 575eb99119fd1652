"""Round 17: loads never return wrong data. Neighbours of issue 10's points that earlier fixes missed.

Each test failed on the code before its fix.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.cli import main as cli_main
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import export_hf
from torch_checkpointing.schema import ItemSpec


def _manager(items: dict[str, ItemSpec] | None = None, **load: Any) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            items=items or {}, save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig(**load)
        )
    )


@pytest.fixture
def mgr() -> Iterator[CheckpointManager]:
    m = _manager()
    yield m
    m.close()


def _edit_manifest(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    d = json.loads((root / "manifest.json").read_text())
    edit(d)
    (root / "manifest.json").write_text(json.dumps(d))


# ------------------------------------------------------------ 1. a recorded format no load reads


_BAD_FORMATS = [
    {"type": "Bogus"},
    {"type": None},
    {"type": "SafetensorsSerialization", "metadata": 5},
    {"type": "SafetensorsSerialization", "metadata": {"a": 1}},
]


@pytest.mark.parametrize("fmt", _BAD_FORMATS, ids=["unknown", "null", "metadata-int", "metadata-value-int"])
def test_a_load_without_templates_refuses_a_recorded_format_naming_the_manifest_field(
    mgr: CheckpointManager, tmp_path: Path, fmt: dict[str, Any]
) -> None:
    """The self-describing load turned the record into a format with the config's parser: a bare `ConfigError`
    ("Unknown SerializationFormat type"), a caller's error that named no file, for a damaged manifest."""
    root = tmp_path / "ck"
    mgr.save(str(root), {"model": {"w": torch.ones(3)}})
    _edit_manifest(root, lambda d: d["items"]["model"]["0"].update(format=fmt))
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json: field 'items\.model\.0\.format'.*model_0\.pt"):
        mgr.load(str(root))


def test_export_and_diff_refuse_a_recorded_format_naming_the_manifest_field(
    mgr: CheckpointManager, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`export --to hf` and `diff` read the record the same way and raised the same bare `ConfigError`."""
    root, other = tmp_path / "ck", tmp_path / "other"
    mgr.save(str(root), {"model": {"w": torch.ones(3)}})
    mgr.save(str(other), {"model": {"w": torch.ones(3)}})
    _edit_manifest(root, lambda d: d["items"]["model"]["0"].update(format={"type": "Bogus"}))
    with pytest.raises(CorruptCheckpointError, match=r"field 'items\.model\.0\.format'"):
        export_hf(str(root), "model", str(tmp_path / "out"))
    assert cli_main(["diff", str(root), str(other)]) == 2
    assert "field 'items.model.0.format'" in capsys.readouterr().err
