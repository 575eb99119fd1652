"""Saves, round 14: ids, layouts and metrics a save accepted and then mishandled. docs/durability.md: "Nothing
that is not ours is ever replaced"; a returned save "is complete and durable"; bad input "is rejected before
anything is written, with the key in the message".

What each case did before:
* a user's folder holding a file named `.incomplete` (a download tool's) was taken for a failed save of
  ours and replaced: every file in it deleted, `overwrite=False` or not;
* `metrics={"loss": nan}` committed a manifest with the NaN constant, which every load and listing refused
  as damaged (a resume skipped it); an int of 400 digits raised a bare OverflowError;
* the retention pass that follows a save deleted that very checkpoint when the policy ranked it out (a run
  restarted at step 0 beside step_1000 and step_2000, keep_last=2; an id without a step);
* ids named `.x` committed checkpoints no listing shows, and gc removes those named like its temporaries;
* `//` walked the whole filesystem before a PermissionError; an id name over 255 bytes wrote every byte, then
  failed at the rename with ENAMETOOLONG;
* layout paths `manifest.json/x.bin`, `a/../x.bin` and `.` failed mid-save with IsADirectoryError /
  RuntimeError naming no item, the first leaving a directory gc could not remove;
* a load through a symlinked parent did not wait for this manager's save of that checkpoint in flight.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.memory_storage import Control
from tests.test_lifecycle_attacks import WAIT_S, _loaded, _manager, _state
from torch_checkpointing import CheckpointManager, ItemSpec, RetentionPolicy, list_checkpoints
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CommitError, ConfigError


def _sync(**config: object) -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), **config))  # type: ignore[arg-type]


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_user_folder_holding_a_file_named_incomplete_is_refused_not_replaced(tmp_path: Path, overwrite: bool) -> None:
    user = tmp_path / "results"
    (user / "sub").mkdir(parents=True)
    (user / ".incomplete").write_bytes(b"")
    (user / "precious.txt").write_text("a week of results\n")
    (user / "sub" / "data.csv").write_text("1,2,3\n")
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(overwrite=overwrite))
    with CheckpointManager(config) as m, pytest.raises(CommitError, match=r"not a checkpoint.*precious\.txt"):
        m.save(str(user), {"model": {"w": torch.ones(2)}})
    assert (user / "precious.txt").read_text() == "a week of results\n"
    assert (user / "sub" / "data.csv").exists()


def test_a_folder_holding_only_our_marker_is_still_replaced(tmp_path: Path) -> None:
    """What an in-place delete of ours, killed after every file but the marker, leaves at an id."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".incomplete").write_bytes(b"")
    with _sync() as m:
        m.save(str(tmp_path / "ck"), {"model": {"w": torch.ones(2)}})
        assert torch.equal(m.load(str(tmp_path / "ck"), into={"model": None})["model"]["w"], torch.ones(2))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_metric_commits_a_checkpoint_that_loads_and_lists(tmp_path: Path, value: float) -> None:
    with _sync() as m:
        m.save(str(tmp_path / "step_1"), {"model": {"w": torch.ones(2)}}, metrics={"loss": value, "acc": 0.5})
        assert torch.equal(m.load(str(tmp_path / "step_1"), into={"model": None})["model"]["w"], torch.ones(2))
    (info,) = list_checkpoints(str(tmp_path))
    assert info.metrics is not None and info.metrics["acc"] == 0.5
    loss = info.metrics["loss"]
    assert (math.isnan(loss) and math.isnan(value)) or loss == value
    json.loads((tmp_path / "step_1" / "manifest.json").read_text(), parse_constant=_refuse_constant)


def _refuse_constant(name: str) -> None:
    raise AssertionError(f"the manifest holds the non-standard JSON constant {name}")


def test_a_metric_no_float_holds_is_refused_naming_it(tmp_path: Path) -> None:
    with _sync() as m, pytest.raises(ConfigError, match=r"'loss'.*digits"):
        m.save(str(tmp_path / "step_1"), {"model": {"w": torch.ones(2)}}, metrics={"loss": 10**400})
    assert not (tmp_path / "step_1").exists()


def test_the_retention_pass_after_a_save_never_deletes_that_checkpoint(tmp_path: Path) -> None:
    policy = RetentionPolicy(keep_last=2)
    with _sync() as m:
        for step in (1000, 2000):
            m.save(str(tmp_path / f"step_{step}"), {"model": {"w": torch.ones(2)}})
    with _sync(retention=policy) as m:
        for name in ("step_10", "final"):
            m.save(str(tmp_path / name), {"model": {"w": torch.ones(2)}})
            m._retention.wait(WAIT_S)  # type: ignore[union-attr]
            assert (tmp_path / name / "manifest.json").exists(), f"{name} was deleted by its own retention pass"


@pytest.mark.parametrize("name", [".last", ".best.trash-999999-ab", ".final.tmp-abc-1", ".old_best_999999"])
def test_an_id_whose_name_starts_with_a_dot_is_refused(tmp_path: Path, name: str) -> None:
    with _sync() as m, pytest.raises(ConfigError, match=r"starts with '\.'"):
        m.save(str(tmp_path / name), {"model": {"w": torch.ones(2)}})
    assert not (tmp_path / name).exists()


def test_an_id_name_over_255_bytes_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    name = "s" * 256
    with _sync() as m, pytest.raises(ConfigError, match=r"256 bytes.*255"):
        m.save(str(tmp_path / name), {"model": {"w": torch.ones(1 << 20)}})
    assert list(tmp_path.iterdir()) == []


def test_the_double_slash_root_is_refused_like_the_root() -> None:
    with _sync() as m, pytest.raises(ConfigError, match="names no directory"):
        m.save("//", {"model": {"w": torch.ones(2)}})


@pytest.mark.parametrize("path", ["manifest.json/x.bin", ".incomplete/x.bin", "a/../x.bin", "a/..", "."])
def test_a_layout_path_the_writer_cannot_take_is_refused_naming_the_item(tmp_path: Path, path: str) -> None:
    items = {"x": ItemSpec(layout=LayoutInfo(path, TorchSerialization()))}
    with _sync(items=items) as m, pytest.raises(ConfigError, match=r"key 'x'"):
        m.save(str(tmp_path / "ck"), {"x": torch.ones(2)})
    assert list(tmp_path.iterdir()) == []


def test_a_load_through_a_symlinked_parent_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    control = Control(tmp_path / "control")
    manager = _manager(control)
    try:
        manager.save(str(tmp_path / "real" / "ck"), _state(1.0)).result(WAIT_S)
        control.set_delay(1.0)
        future = manager.save(str(tmp_path / "real" / "ck"), _state(2.0))
        assert _loaded(manager, os.path.join(tmp_path, "alias", "ck")) == 2.0
        assert future.done()
    finally:
        control.reset()
        manager.close()


def test_safetensors_serialization_has_the_static_helpers_api_surface_lists() -> None:
    """API_SURFACE §4: `SafetensorsSerialization.prepare_tensors_for_save(data)` and `unflatten_to_target`."""
    from torch_checkpointing.checkpoint_layout import SafetensorsSerialization

    data = {"a": {"b": torch.ones(1), "c": [torch.zeros(1), torch.ones(2)]}, "t": (torch.ones(3),)}
    flat = SafetensorsSerialization.prepare_tensors_for_save(data)
    assert sorted(flat) == ["a.b", "a.c.0", "a.c.1", "t.0"]
    back = SafetensorsSerialization.unflatten_to_target(flat, {"a": {"b": None, "c": [None, None]}})
    assert torch.equal(back["a"]["c"][1], torch.ones(2)) and torch.equal(back["a"]["b"], torch.ones(1))


def test_unflatten_to_target_gives_none_for_missing_list_leaves_and_the_templates_sequence_type() -> None:
    """API_SURFACE §4: re-nesting walks the template; "list/tuple parent -> `type(t)(...)` with `None` for missing
    leaves", dict parents keep only the leaves found, a leaf template takes `flat.get(prefix)`. The public helper
    handed the engine's internal MISSING placeholder back (where a load gives None) and lists for tuples."""
    from collections import namedtuple

    from torch_checkpointing.checkpoint_layout import SafetensorsSerialization

    pair = namedtuple("pair", "x y")
    one = torch.ones(1)
    flat = {"a.b": one, "a.c.0": one, "t.0": one, "p.0": one}
    template = {"a": {"b": None, "c": [None, None], "z": None}, "t": (None, None), "p": pair(None, None)}
    back = SafetensorsSerialization.unflatten_to_target(flat, template)
    assert back["a"]["c"][1] is None and back["a"]["c"][0] is one
    assert "z" not in back["a"]
    assert type(back["t"]) is tuple and back["t"] == (one, None)
    assert type(back["p"]) is pair and back["p"].x is one and back["p"].y is None
    assert SafetensorsSerialization.unflatten_to_target({}, None) is None
    assert SafetensorsSerialization.unflatten_to_target({"x": one}, [None, [None]]) == [None, [None]]


def test_the_releases_metadata_version_is_refused_saying_what_it_is() -> None:
    from torch_checkpointing.distributed_metadata import DistributedMetadata

    with pytest.raises(ValueError, match=r"'1\.0' is the published release's format.*metadata\.pkl"):
        DistributedMetadata.from_dict({"version": "1.0", "world_size": 1, "metadata": {}})
