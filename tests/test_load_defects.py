"""Load defects closed at their root: every decode of a Torch file checks its tensor records, a model changed
under a resharding load is a `TemplateMismatchError`, and a custom resharder's blocks are not prefetched.

Each test failed on the code before its fix.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_storage import MemoryStorageConfig
from tests.test_reshard_attacks import _shorten_storage_record
from tests.test_verified_loads import _edit_manifest, _manager
from torch_checkpointing.checkpoint_layout import TorchSerialization
from torch_checkpointing.encoding import decode
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

_SHORT = r"(32 bytes.*16|16 bytes.*32)"  # the 8-float record cut to 16 bytes, in either message's order


@pytest.fixture(params=["local", "memory"])
def storage(request: pytest.FixtureRequest) -> Storage:
    if request.param == "local":
        return LocalFileSystemStorageConfig().create_storage()
    return MemoryStorageConfig().create_storage()


def _short_file(tmp_path: Path) -> bytes:
    file = tmp_path / "short.pt"
    torch.save({"w": torch.arange(8.0)}, file)
    _shorten_storage_record(file, 16)
    return file.read_bytes()


# ------------------------------------------------------------ 1. a tensor record shorter than its storage


@pytest.mark.parametrize("use_mmap", [True, False])
def test_a_direct_decode_refuses_a_record_shorter_than_its_storage(
    storage: Storage, tmp_path: Path, use_mmap: bool
) -> None:
    """torch's mapped load handed back the zip entries after the record as the last 4 floats; read whole it
    raised a bare RuntimeError."""
    path = tmp_path / "ck" / "model_0.pt"
    storage.mkdir(path.parent)
    storage.write(path, _short_file(tmp_path))
    fmt = TorchSerialization()
    with pytest.raises(CorruptCheckpointError, match=rf"model_0\.pt.*{_SHORT}"):
        decode(fmt, storage, path, "model", template=None, map_location=None, weights_only=True, use_mmap=use_mmap)


def _save_with_short_record(root: Path, **load: Any) -> Any:
    """A committed checkpoint whose item file is replaced by the short-record file, its manifest record forged
    to match (an attacker controls both), so only the record check stands between it and the template."""
    m = _manager(**load)
    m.save(str(root), {"model": {"w": torch.zeros(8)}})
    data = _short_file(root.parent)
    (root / "model_0.pt").write_bytes(data)

    def forge(d: dict[str, Any]) -> None:
        d["items"]["model"]["0"].update(size=len(data), crc32=zlib.crc32(data))
        d["items"]["model"]["0"].pop("blocks", None)

    _edit_manifest(root, forge)
    return m


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("use_mmap", [True, False])
def test_a_load_refuses_a_forged_file_whose_record_is_shorter_than_its_storage(
    tmp_path: Path, verify: bool, use_mmap: bool
) -> None:
    root = tmp_path / "ck"
    m = _save_with_short_record(root, verify_checksums=verify, use_mmap=use_mmap)
    try:
        template = {"w": torch.full((8,), -1.0)}
        with pytest.raises(CorruptCheckpointError, match=rf"model_0\.pt.*{_SHORT}"):
            m.load(str(root), into={"model": template})
        assert torch.equal(template["w"], torch.full((8,), -1.0))
    finally:
        m.close()
