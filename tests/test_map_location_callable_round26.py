"""A callable `map_location` that fails is the caller's error, never a damaged checkpoint (round 26).

torch.load calls a callable `map_location` on each storage as it reads the file. Before, whatever the callable
raised (or a value that is no storage, which torch then choked on) came out as the checkpoint's damage:
`UndecodableFileError` "the file is damaged or crafted. Load an earlier checkpoint" (a `ValueError`, a `KeyError`,
`storage.cuda()` on a machine without CUDA), or `CorruptCheckpointError` "not a readable Torch file" (a
`RuntimeError`, with the engine's own wrapper in the message). A caller that falls back to an earlier checkpoint,
or deletes damaged ones, acted on an intact checkpoint. Now it is a `ConfigError` naming the argument, the
callable's own exception as its cause, and the caller's templates are left as they were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError, ConfigError
from torch_checkpointing.schema import ItemSpec


class _Mine(Exception):
    """The caller's own bug, raised from inside its callable."""


def _raises(exc: BaseException) -> Any:
    def place(storage: Any, location: str) -> Any:
        raise exc

    return place


_FAILING = {
    "ValueError": _raises(ValueError("my own bug")),
    "KeyError": _raises(KeyError("cuda:7")),
    "RuntimeError": _raises(RuntimeError("my own runtime bug")),
    "own exception": _raises(_Mine("mine")),
    "returns an int": lambda storage, location: 5,
    "returns a tensor": lambda storage, location: torch.zeros(3),
}


def _manager() -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            items={"model": ItemSpec(), "extra": ItemSpec()},
            save=SyncCheckpointSaverConfig(),
            load=CheckpointLoaderConfig(),
        )
    )


@pytest.mark.parametrize("templated", [False, True])
@pytest.mark.parametrize("case", sorted(_FAILING))
def test_a_failing_map_location_callable_is_the_callers_error(tmp_path: Path, case: str, templated: bool) -> None:
    """Defect: UndecodableFileError / CorruptCheckpointError (a CheckpointError: "damaged or crafted")."""
    root = str(tmp_path / "ck")
    into = {"model": {"w": torch.zeros(3)}, "extra": {"b": torch.zeros(2)}}
    with _manager() as m:
        m.save(root, {"model": {"w": torch.ones(3)}, "extra": {"b": torch.ones(2)}})
        with pytest.raises(ConfigError) as caught:
            m.load(root, into=into if templated else None, map_location=_FAILING[case])
        assert not isinstance(caught.value, CheckpointError), caught.value
        message = str(caught.value)
        assert "map_location" in message and "model_0.pt" in message, message
        assert "damaged" not in message.replace("not found damaged", ""), message
        assert "_MetaWatch" not in message, message
        if case != "returns an int" and case != "returns a tensor":
            assert caught.value.__cause__ is not None, caught.value
        assert not any(t.any() for sd in into.values() for t in sd.values()), into  # nothing was filled
        # the checkpoint is intact: the same load with a working callable restores it
        loaded = m.load(root, into=into if templated else None, map_location=lambda storage, location: storage)
    assert torch.equal((into if templated else loaded)["model"]["w"], torch.ones(3))


def test_a_callable_returning_none_still_means_the_default_place(tmp_path: Path) -> None:
    """torch.load reads None from the callable as "where it was saved": that keeps working."""
    root = str(tmp_path / "ck")
    with _manager() as m:
        m.save(root, {"model": {"w": torch.ones(3)}, "extra": {"b": torch.ones(2)}})
        loaded = m.load(root, map_location=lambda storage, location: None)
    assert torch.equal(loaded["model"]["w"], torch.ones(3))


_SAVE_TAGGED = """
import sys, torch, torch.serialization
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.schema import ItemSpec
# this process tags its CPU storages with a location no other torch knows (a foreign or crafted file's)
torch.serialization.register_package(1, lambda s: "nowhere" if s.device.type == "cpu" else None, lambda s, loc: None)
items = {"model": ItemSpec(), "extra": ItemSpec()}
config = CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig())
with CheckpointManager(config) as m:
    m.save(sys.argv[1], {"model": {"w": torch.ones(3)}, "extra": {"b": torch.ones(2)}})
"""


@pytest.mark.parametrize("templated", [False, True])
@pytest.mark.parametrize("map_location", [None, {"cuda:1": "cpu"}], ids=["none", "dict"])
def test_a_stored_location_torch_cannot_restore_is_no_callers_error(
    tmp_path: Path, map_location: Any, templated: bool
) -> None:
    """A dict map_location is applied by the engine's own watch (a callable) when templates are filled: a stored
    location that dict leaves alone, which torch cannot restore here, is the file's (as with map_location=None or
    without templates), never a ConfigError telling the caller to "fix the callable" it never passed.

    Defect: with templates, ConfigError "load(map_location={'cuda:1': 'cpu'}) raised RuntimeError: don't know how
    to restore data location ... (tagged with nowhere) ... the checkpoint was not found damaged. Fix the callable"."""
    import subprocess
    import sys

    root = str(tmp_path / "ck")
    subprocess.run([sys.executable, "-c", _SAVE_TAGGED, root], check=True, timeout=120)
    into = {"model": {"w": torch.zeros(3)}, "extra": {"b": torch.zeros(2)}}
    with _manager() as m, pytest.raises(CheckpointError) as caught:
        m.load(root, into=into if templated else None, map_location=map_location)
    message = str(caught.value)
    assert "model_0.pt" in message and "tagged with nowhere" in message, message
    assert "callable" not in message and "_MetaWatch" not in message, message
    assert not any(t.any() for sd in into.values() for t in sd.values()), into


def _out_of_memory(storage: Any, location: str) -> Any:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


_SAVE_THEN_LOAD_OUT_OF_MEMORY = """
import sys, torch, torch.serialization
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.schema import ItemSpec
items = {"model": ItemSpec(), "extra": ItemSpec()}
config = CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig())
with CheckpointManager(config) as m:
    m.save(sys.argv[1], {"model": {"w": torch.ones(3)}, "extra": {"b": torch.ones(2)}})
    def full(storage, location):  # the device a storage is restored onto is full, as torch says it
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    torch.serialization.register_package(0, lambda s: None, full)
    into = {"model": {"w": torch.zeros(3)}, "extra": {"b": torch.zeros(2)}}
    try:
        m.load(sys.argv[1], into=into if sys.argv[2] == "1" else None)
    except BaseException as exc:
        print(type(exc).__name__, isinstance(exc, CheckpointError), exc)
"""


@pytest.mark.parametrize("templated", [False, True])
def test_a_device_out_of_memory_is_neither_damage_nor_the_callers_error(tmp_path: Path, templated: bool) -> None:
    """The device a stored tensor is restored onto has no room (torch.OutOfMemoryError, raised in torch's own
    restore or in a callable map_location's storage.cuda()): the checkpoint is intact and the argument is right;
    what a caller catches to retry elsewhere (torch.OutOfMemoryError) must come out as it is.

    Defect: through a callable, ConfigError "... raised OutOfMemoryError ... Fix the callable"; through torch's
    own restore, CorruptCheckpointError "not a readable Torch file: CUDA out of memory" (damage, which a caller
    that deletes damaged checkpoints acts on)."""
    import subprocess
    import sys

    root = str(tmp_path / "ck")
    into = {"model": {"w": torch.zeros(3)}, "extra": {"b": torch.zeros(2)}}
    with _manager() as m:
        m.save(root, {"model": {"w": torch.ones(3)}, "extra": {"b": torch.ones(2)}})
        with pytest.raises(torch.OutOfMemoryError):
            m.load(root, into=into if templated else None, map_location=_out_of_memory)
    assert not any(t.any() for sd in into.values() for t in sd.values()), into
    done = subprocess.run(
        [sys.executable, "-c", _SAVE_THEN_LOAD_OUT_OF_MEMORY, str(tmp_path / "other"), "1" if templated else "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.startswith("OutOfMemoryError False CUDA out of memory"), (done.stdout, done.stderr[-2000:])
