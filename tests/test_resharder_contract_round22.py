"""Round 22: a custom resharder whose `load` does not fill the template's tensors in place.

The contract (`Resharder.load`, configuring_checkpoints.md): `load` fills `target` in place, so the caller's
tensors (a model's parameters, reached through `into={"model": model.state_dict()}`) hold the checkpoint's
values afterwards. A `load` that assigned new tensors into the template dict (`target[name] = saved[name]`),
removed an entry, or resized a tensor returned normally: the load reported success, even a strict one, while
the caller's tensors kept what they held before (the model resumed from its initial weights), with no error
and no log line.

Now a removed entry counts as not filled (a strict load refuses it, a non-strict one names it), and a replaced
or resized tensor is logged at WARNING naming the resharder, the item, the paths and the fix. Those are not
refused: the API returns the `into` object itself, so the returned mapping holds what the resharder put there,
which state that changes size across world sizes (a dataloader's) may legitimately need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_verified_loads import WholeFileResharder
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.resharding import Resharder

pytestmark = pytest.mark.filterwarnings("ignore:Item '.*' has plain \\(non-DTensor\\) tensors")


class _Reads(WholeFileResharder):
    """A custom resharder reading its item's one torch file whole; subclasses differ in how they fill."""

    def fill(self, target: dict[str, Any], saved: dict[str, torch.Tensor]) -> None:
        for name, value in saved.items():
            target[name].copy_(value)


class Assigns(_Reads):
    def fill(self, target: dict[str, Any], saved: dict[str, torch.Tensor]) -> None:
        target.update(saved)  # new tensor objects in the template dict: the caller's are left as they were


class Removes(_Reads):
    def fill(self, target: dict[str, Any], saved: dict[str, torch.Tensor]) -> None:
        target["b"].copy_(saved["b"])
        del target["a"]


class Resizes(_Reads):
    def fill(self, target: dict[str, Any], saved: dict[str, torch.Tensor]) -> None:
        target["a"].resize_(3).copy_(saved["a"][:3])
        target["b"].copy_(saved["b"])


def _manager(resharder: Resharder) -> CheckpointManager:
    items = {"model": ItemSpec(resharder=resharder), "other": ItemSpec()}
    return CheckpointManager(
        CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig())
    )


def _payload() -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {"a": torch.arange(8.0) + 1, "b": torch.arange(4.0) + 1}, "other": {"x": torch.ones(2)}}


def test_a_resharder_filling_in_place_restores_the_callers_tensors(tmp_path: Path) -> None:
    """The guard: the well-behaved resharder loads, into the very tensors the caller holds."""
    with _manager(_Reads()) as m:
        m.save(str(tmp_path / "ck"), _payload())
        a, b = torch.zeros(8), torch.zeros(4)
        loaded = m.load(str(tmp_path / "ck"), into={"model": {"a": a, "b": b}, "other": {"x": torch.zeros(2)}})
    assert loaded["model"]["a"] is a and torch.equal(a, _payload()["model"]["a"])
    assert torch.equal(b, _payload()["model"]["b"])


# Failed before round 22: every load returned normally with no log line, with `a` still all zeros.
@pytest.mark.parametrize(("resharder", "how"), [(Assigns, "replaced"), (Resizes, "resized")])
def test_a_resharder_replacing_or_resizing_a_templates_tensor_is_named_at_warning(
    tmp_path: Path, resharder: type[_Reads], how: str, caplog: pytest.LogCaptureFixture
) -> None:
    with _manager(resharder()) as m:
        m.save(str(tmp_path / "ck"), _payload())
        a, x = torch.zeros(8), torch.zeros(2)
        with caplog.at_level("WARNING", logger="torch_checkpointing"):
            loaded = m.load(str(tmp_path / "ck"), into={"model": {"a": a, "b": torch.zeros(4)}, "other": {"x": x}})
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "in place" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert f"{resharder.__name__}.load for item 'model'" in said[0] and f"'model::a' {how}" in said[0], said
    assert "copy_" in said[0], said
    expected = _payload()["model"]["a"]
    assert torch.equal(loaded["model"]["a"], expected if how == "replaced" else expected[:3])  # what it put there
    assert torch.equal(x, torch.ones(2))


# Failed before round 22: both loads returned normally, the entry gone from the result, with no log line.
def test_a_resharder_removing_a_templates_tensor_leaves_it_not_restored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with _manager(Removes()) as m:
        m.save(str(tmp_path / "ck"), _payload())
        with pytest.raises(CheckpointError, match="model::a"):
            m.load(
                str(tmp_path / "ck"),
                into={"model": {"a": torch.zeros(8), "b": torch.zeros(4)}, "other": {"x": torch.zeros(2)}},
                strict=True,
            )
        with caplog.at_level("WARNING", logger="torch_checkpointing"):
            m.load(
                str(tmp_path / "ck"),
                into={"model": {"a": torch.zeros(8), "b": torch.zeros(4)}, "other": {"x": torch.zeros(2)}},
            )
    assert "model::a" in caplog.text, caplog.text
