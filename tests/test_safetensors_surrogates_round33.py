"""A safetensors file's names are UTF-8: a tensor name or a metadata entry holding a lone surrogate is refused
naming it, not a bare UnicodeEncodeError.

A dict key holding a lone surrogate (a str decoded with errors="surrogatepass", or built by hand) is saved by
TorchSerialization and JsonSerialization; under SafetensorsSerialization the save failed, sync and async, with
"UnicodeEncodeError: 'utf-8' codec can't encode character '\\ud800' ... surrogates not allowed" naming neither
the item nor the key, and `SafetensorsSerialization(metadata={"a\\ud800": "b"})` was taken, to fail every save.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from torch_checkpointing import (
    AsyncCheckpointSaverConfig,
    CheckpointManager,
    ItemSpec,
    SafetensorsSerialization,
    SyncCheckpointSaverConfig,
    list_checkpoints,
)
from torch_checkpointing.checkpoint_layout import LayoutInfo
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.hf import export_hf


@pytest.mark.parametrize("saver", [SyncCheckpointSaverConfig, AsyncCheckpointSaverConfig])
@pytest.mark.parametrize("lone", ["\ud800", "\udc80"])  # the second: a non-UTF-8 byte, as surrogateescape reads it
def test_a_tensor_name_holding_a_lone_surrogate_is_refused_naming_it(
    tmp_path: Path, saver: type[SyncCheckpointSaverConfig | AsyncCheckpointSaverConfig], lone: str
) -> None:
    layout = LayoutInfo("m_{rank}.safetensors", SafetensorsSerialization())
    config = CheckpointManager.Config(save=saver(), items={"m": ItemSpec(layout=layout)})
    with CheckpointManager(config) as manager:
        named = re.escape(f"item 'm': its key {'a.x' + lone!r}")
        with pytest.raises(ConfigError, match=f"{named}.*lone surrogate") as caught:
            done = manager.save(str(tmp_path / "ck"), {"m": {"a": {f"x{lone}": torch.ones(2)}}}, step=1)
            if done is not None:
                done.result()
        assert not isinstance(caught.value, UnicodeError)
        manager.save(str(tmp_path / "ok"), {"m": {"a": {"x": torch.ones(2)}}}, step=2)
    assert [info.step for info in list_checkpoints(tmp_path)] == [2]


@pytest.mark.parametrize("metadata", [{"a\ud800": "b"}, {"a": "b\udfff"}, {"a": "b\udc80"}])
def test_metadata_holding_a_lone_surrogate_is_refused_when_built(metadata: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"SafetensorsSerialization metadata.*lone surrogate"):
        SafetensorsSerialization(metadata=metadata)


def test_export_hf_of_a_tensor_named_with_a_lone_surrogate_is_refused_naming_it(tmp_path: Path) -> None:
    """The item is a TorchSerialization one (it saves); its export is safetensors, whose names are UTF-8."""
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(tmp_path / "ck"), {"m": {"ok": torch.ones(1), "x\udc80": torch.ones(2)}}, step=1)
    with pytest.raises(ConfigError, match=r"Cannot export .*'x\\udc80'.*lone surrogate.*nothing was exported"):
        export_hf(tmp_path / "ck", "m", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
