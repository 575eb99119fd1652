"""A refusal names the operation that met it, not a load or an export (round 36).

`iter_item_tensors` (what `torch-checkpointing diff` reads a resharded item by) shares the export's checks and
the shared readers: its refusals said "Cannot export ... nothing was exported". A damaged file met by an export
or by `iter_item_tensors` was refused with a load's fix ("Load an earlier checkpoint", "Nothing was loaded; load
an intact checkpoint"), and a damaged zip directory read through the verifying context named the file and the
fix twice ("... load an earlier checkpoint. Load an earlier checkpoint.").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.crafted_files import replace_item_file
from tests.test_cli import _cli
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import export_hf, iter_item_tensors


def _save(checkpoint: Path, state: dict[str, Any]) -> Path:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(checkpoint), {"model": state})
    return checkpoint


def _flipped(tmp_path: Path) -> Path:
    """A byte of the file changed after the save: it fails its checksum."""
    checkpoint = _save(tmp_path / "step_1", {"w": torch.ones(100)})
    data = bytearray((checkpoint / "model_0.pt").read_bytes())
    data[-300] ^= 0xFF
    (checkpoint / "model_0.pt").write_bytes(bytes(data))
    return checkpoint


def _cut(tmp_path: Path) -> Path:
    """The zip cut short, its checksum made to match."""
    checkpoint = _save(tmp_path / "step_1", {"w": torch.ones(100)})
    replace_item_file(checkpoint, (checkpoint / "model_0.pt").read_bytes()[:300])
    return checkpoint


def _garbage(tmp_path: Path) -> Path:
    checkpoint = _save(tmp_path / "step_1", {"w": torch.ones(100)})
    replace_item_file(checkpoint, b"garbage" * 50)
    return checkpoint


def _export(checkpoint: Path, out: Path) -> None:
    export_hf(str(checkpoint), "model", str(out))


def _iterate(checkpoint: Path, out: Path) -> None:
    list(iter_item_tensors(str(checkpoint), "model"))


_READERS: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "export": (_export, "export"),
    "iter_item_tensors": (_iterate, "read"),
}


@pytest.mark.parametrize("damaged", [_flipped, _cut, _garbage], ids=["flipped", "cut", "garbage"])
@pytest.mark.parametrize("reader", sorted(_READERS))
def test_damage_met_by_a_reader_names_its_fix(tmp_path: Path, reader: str, damaged: Callable[[Path], Path]) -> None:
    checkpoint = damaged(tmp_path)
    read, verb = _READERS[reader]
    with pytest.raises(CorruptCheckpointError) as refused:
        read(checkpoint, tmp_path / "hf")
    said = str(refused.value)
    assert "load" not in said.lower().replace("loader", ""), said
    assert verb in said.lower() and str(checkpoint / "model_0.pt") in said, said
    assert said.count(str(checkpoint / "model_0.pt")) == 1, said  # named once, its fix said once


@pytest.mark.parametrize(
    "state",
    [{"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, {"s": torch.eye(3).to_sparse()}],
    ids=["one_name_twice", "sparse"],
)
def test_iter_item_tensors_refuses_without_naming_an_export(tmp_path: Path, state: dict[str, Any]) -> None:
    checkpoint = _save(tmp_path / "step_1", state)
    with pytest.raises(ValueError, match="model") as refused:
        list(iter_item_tensors(str(checkpoint), "model"))
    said = str(refused.value)
    assert "export" not in said.lower() and "iter_item_tensors" in said, said
    with pytest.raises(ValueError, match="Cannot export") as exported:  # the export keeps its own words
        export_hf(str(checkpoint), "model", str(tmp_path / "hf"))
    assert "nothing was exported" in str(exported.value).lower(), exported.value


def test_cli_diff_of_a_damaged_checkpoint_names_no_load(tmp_path: Path) -> None:
    damaged = _garbage(tmp_path)
    intact = _save(tmp_path / "step_2", {"w": torch.ones(100)})
    done = _cli("diff", str(damaged), str(intact))
    assert done.returncode == 2, done
    said = done.stderr
    assert str(damaged / "model_0.pt") in said and "damaged" in said, said
    assert "load" not in said.lower().replace("loader", ""), said
