"""Load wording found in round 16, each with the test that failed before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, CorruptCheckpointError


@pytest.mark.parametrize("with_into", [False, True], ids=["self-describing", "into"])
def test_a_missing_checkpoint_is_named_as_the_api_surface_says_with_or_without_into(
    tmp_path: Path, with_into: bool
) -> None:
    """API_SURFACE §2.4.4: "Checkpoint directory missing → FileNotFoundError("Checkpoint path <id> does not
    exist.")". A load without into= (the manifest describes the items) said "<id>: no such directory." instead."""
    missing = tmp_path / "step7"
    kwargs = {"into": {"w": torch.zeros(2)}} if with_into else {}
    with CheckpointManager() as manager, pytest.raises(FileNotFoundError) as caught:
        manager.load(str(missing), **kwargs)
    assert str(caught.value).startswith(f"Checkpoint path {missing} does not exist."), str(caught.value)


@pytest.mark.parametrize("with_into", [False, True], ids=["self-describing", "into"])
def test_a_load_whose_pinned_directory_is_deleted_says_it_lost_a_race_and_to_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_into: bool
) -> None:
    """Issue 10.8: "a load that loses the race raises, and a retry succeeds". When the directory a load pinned
    is removed under it (another process replaced the id), its item files vanish; the load said "listed in the
    checkpoint's manifest but missing: the checkpoint was damaged, or ..." although the pinned directory being
    gone says for certain it was the race, which a retry resolves."""
    import shutil

    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.read_context import CheckpointReadContext

    path = tmp_path / "step1"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(path), {"w": torch.arange(4.0)})
        real_open = CheckpointReadContext._open

        def open_then_lose_the_race(self: CheckpointReadContext) -> None:
            real_open(self)
            shutil.rmtree(path)  # what a replace of the id does to the directory this load holds

        monkeypatch.setattr(CheckpointReadContext, "_open", open_then_lose_the_race)
        template = torch.zeros(4)
        kwargs = {"into": {"w": template}} if with_into else {}
        with pytest.raises(CorruptCheckpointError) as caught:
            manager.load(str(path), **kwargs)
        said = str(caught.value)
        assert "was replaced or deleted while this load ran" in said and "directory it opened is gone" in said, said
        assert "Retry the load" in said, said
        assert torch.equal(template, torch.zeros(4))


def test_an_hf_import_into_a_partial_dtensor_says_load_and_copies_nothing(mesh: object, tmp_path: Path) -> None:
    """import_hf's docstring: a template that does not fit "raises TemplateMismatchError before anything is
    copied". A Partial DTensor template was refused while filling, in the save's words ("... before saving"),
    after the tensors before it had been filled."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor, Partial

    from torch_checkpointing import TemplateMismatchError
    from torch_checkpointing.hf import import_hf

    save_file({"a": torch.ones(4), "b": torch.full((4,), 2.0)}, str(tmp_path / "model.safetensors"))
    first = torch.zeros(4)
    partial = DTensor.from_local(torch.zeros(4), mesh, [Partial()])  # type: ignore[arg-type]
    with pytest.raises(TemplateMismatchError) as caught:
        import_hf(tmp_path, into={"a": first, "b": partial})
    said = str(caught.value)
    assert "'b'" in said or " b " in said or "at b" in said, said
    assert "load target" in said and "before saving" not in said, said
    assert torch.equal(first, torch.zeros(4)), "a tensor was filled before the refusal"


@pytest.mark.parametrize("world_size", [2**32 + 1, 10**400], ids=["2**32+1", "400 digits"])
def test_a_crafted_world_size_is_refused_as_the_manifest_s_field(tmp_path: Path, world_size: int) -> None:
    """Issue 10.11: a malformed manifest raises CorruptCheckpointError naming the file and the field. A
    `world_size` past what any job has (the sharding metadata refuses past 2**20) was accepted, and the load
    then blamed the caller's job ("Item 'model' was saved by 1000...0 rank(s)") in a TemplateMismatchError."""
    import json

    from torch_checkpointing.config import SyncCheckpointSaverConfig

    path = tmp_path / "c"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(path), {"model": {"w": torch.ones(2)}})
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["world_size"] = world_size
        (path / "manifest.json").write_text(json.dumps(manifest))
        for kwargs in ({}, {"into": {"model": {"w": torch.zeros(2)}}}):
            with pytest.raises(CorruptCheckpointError) as caught:
                manager.load(str(path), **kwargs)
            said = str(caught.value)
            assert "manifest.json" in said and "'world_size'" in said, said


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"keep_last": "3"}, "ConfigTypeError"),
        ({"keep_last": 2.0}, "ConfigTypeError"),
        ({"keep_last": -1}, "ConfigError"),
        ({"keep_every_n_steps": 0}, "ConfigError"),
        ({"keep_best": 1}, "ConfigError"),
        ({"keep_best": 1, "metric": 3}, "ConfigTypeError"),
        ({"mode": "avg"}, "ConfigError"),
        ({"unowned_after_s": -5}, "ConfigError"),
        ({"unowned_after_s": "1h"}, "ConfigTypeError"),
        ({"collect_garbage": "yes"}, "ConfigTypeError"),
        ({"root": 5}, "ConfigTypeError"),
    ],
)
def test_a_retention_policy_field_the_engine_cannot_use_is_a_config_error(fields: dict, error: str) -> None:
    """guide.md's errors table: a configuration field the engine cannot use is a ConfigError (ConfigTypeError,
    also a TypeError, for a wrong type), raised where it is given. RetentionPolicy raised a bare ValueError, and
    took a metric, a root or collect_garbage of any type (failing later, inside the retention pass)."""
    from torch_checkpointing import ConfigError, RetentionPolicy

    with pytest.raises(ConfigError) as caught:
        RetentionPolicy(**fields)
    assert type(caught.value).__name__ == error, (type(caught.value), caught.value)
    assert "RetentionPolicy." in str(caught.value), str(caught.value)
