"""Load defects closed at their root: every decode of a Torch file checks its tensor records, a model changed
under a resharding load is a `TemplateMismatchError`, and a custom resharder's blocks are not prefetched.

Each test failed on the code before its fix.
"""

from __future__ import annotations

import os
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.memory_storage import MemoryStorageConfig
from tests.s3_server import RecordingStorageConfig, S3Server, logged_gets
from tests.test_reshard_attacks import _shorten_storage_record
from tests.test_reshard_plans import make_md
from tests.test_verified_loads import AlwaysReshard, _edit_manifest, _manager, _reshard_save
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization, TorchSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import GlobalObjectMetadata
from torch_checkpointing.dtensor_metadata import ReplicateSpec
from torch_checkpointing.dtensor_resharder import DTensorResharder, compute_load_plans
from torch_checkpointing.encoding import decode
from torch_checkpointing.errors import CheckpointError, CorruptCheckpointError, TemplateMismatchError
from torch_checkpointing.schema import ItemSpec
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


# ------------------------------------------------------------ 2. a model changed under a resharding load


def test_a_changed_model_under_a_resharding_load_is_a_template_mismatch(tmp_path: Path) -> None:
    """It escaped the loader as a bare ValueError, outside `except CheckpointError`; it stays a ValueError."""
    root, _ = _reshard_save(tmp_path)
    m = _manager({"model": ItemSpec(resharder=AlwaysReshard())})
    target = torch.full((4095,), -1.0)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            with pytest.raises(TemplateMismatchError, match=r"model.*\bw\b.*\(4096,\).*\(4095,\).*load into") as info:
                m.load(str(root), into={"model": {"w": target}})
    finally:
        m.close()
    assert isinstance(info.value, ValueError) and isinstance(info.value, CheckpointError)
    assert torch.equal(target, torch.full((4095,), -1.0))


@pytest.mark.parametrize("groups", [1, 2], ids=["indexed", "brute-force"])
def test_the_planner_refuses_a_changed_global_shape_as_a_template_mismatch(groups: int) -> None:
    """Both planners (one group per path is indexed; several take the brute-force route) raise it."""
    src = make_md((4,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    dst = make_md((5,), torch.float32, ((1,), (0,), (ReplicateSpec(),)))
    source = [GlobalObjectMetadata(src, (0,)) for _ in range(groups)]
    with pytest.raises(TemplateMismatchError, match=r"layer\.w.*\(4,\).*\(5,\)"):
        compute_load_plans(("layer", "w"), dst, source, 0)


# ------------------------------------------------------------ 3. a custom resharder's blocks are not prefetched


class OwnLoad(AlwaysReshard):
    """A DTensorResharder subclass with its own `load`: the load must call it, and only it reads the blocks."""

    def load(
        self, source_path: Path, item_key: str, target_metadata: Any, source_metadata: Any, target: Any, storage: Any
    ) -> list[Any]:
        self.loads = getattr(self, "loads", 0) + 1
        return super().load(source_path, item_key, target_metadata, source_metadata, target, storage)


def _s3_manager(resharder: DTensorResharder, config: RecordingStorageConfig) -> CheckpointManager:
    items = {"model": ItemSpec(resharder=resharder, layout=_S3_LAYOUT)}
    return CheckpointManager(
        CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), storage_config=config)
    )


_S3_LAYOUT = LayoutInfo("model/{rank}.safetensors", SafetensorsSerialization())
_N = 1 << 20  # float32 elements: 4 MiB, many checksummed blocks


def _bytes_fetched(config: RecordingStorageConfig, resharder: DTensorResharder) -> int:
    """Load tensor 'a' through `resharder`; the bytes this process fetched from the item file."""
    target = {"a": torch.zeros(_N)}
    before = len(logged_gets(config.gets_log, os.getpid()))
    with _s3_manager(resharder, config) as m, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        m.load("ck", into={"model": target}, strict=False)
    assert torch.equal(target["a"], torch.arange(_N, dtype=torch.float32))
    gets = logged_gets(config.gets_log, os.getpid())[before:]
    return sum(end - start for key, start, end in gets if key.endswith("model/0.safetensors"))


def test_a_resharder_with_its_own_load_fetches_its_blocks_once(s3_server: S3Server, tmp_path: Path) -> None:
    """Its blocks were fetched (and held to the end of the load) by the check phase, then fetched again by its
    own `load`: twice the bytes of the engine's own resharder."""
    base = s3_server.config()
    config = RecordingStorageConfig(
        url=base.url, storage_options=base.storage_options, part_size=base.part_size, gets_log=str(tmp_path / "g")
    )
    values = {"a": torch.arange(_N, dtype=torch.float32), "b": torch.zeros(_N)}
    with _s3_manager(AlwaysReshard(), config) as m, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        m.save("ck", {"model": values})
    planned = _bytes_fetched(config, AlwaysReshard())
    own = OwnLoad()
    fetched = _bytes_fetched(config, own)
    assert own.loads == 1
    assert 4 * _N <= fetched <= planned, (fetched, planned)
