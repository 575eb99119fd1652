"""A file read whole into one `bytes` is held once (round 26).

A raw item comes back as the file's bytes. Before, every whole read of a local file went through a buffer that
was then copied into `bytes`, so the load's peak memory grew by twice the file: a 256 MiB raw item cost
512 MiB, and a checkpoint without a manifest holding a sparse 3 GiB file (no disk used) cost 6 GiB of memory.
The bytes are now read straight into the object the load returns.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import pytest

from tests.test_crafted_round9 import in_child
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_layout import LayoutInfo, RawSerialization
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.read_context import _pread_all
from torch_checkpointing.schema import ItemSpec

_SIZE = 256 << 20


def _manager(verify: bool | None = None) -> CheckpointManager:
    item = ItemSpec(layout=LayoutInfo("blob_{rank}.bin", RawSerialization()))
    return CheckpointManager(
        CheckpointManager.Config(
            items={"blob": item},
            save=SyncCheckpointSaverConfig(),
            load=CheckpointLoaderConfig(verify_checksums=verify),
        )
    )


def raw_load_growth(root: str, verify: bool | None) -> dict[str, Any]:
    """(child side) Load the raw item: how much the peak memory grew, and what came back."""
    with _manager(verify) as m:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        blob = m.load(root)["blob"]
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"grown_mib": grown // 1024, "type": type(blob).__name__, "size": len(blob), "tail": blob[-4:].hex()}


def _saved(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    with _manager() as m:
        m.save(str(root), {"blob": b"\x00" * (_SIZE - 4) + b"tail"})
    return root


@pytest.mark.parametrize("verify", [None, True, False])
def test_a_raw_item_is_held_once_when_loaded(tmp_path: Path, verify: bool | None) -> None:
    """Defect: the load's peak memory grew by 512 MiB (twice the 256 MiB file)."""
    root = _saved(tmp_path)
    outcome = in_child(f"raw_load_growth({str(root)!r}, {verify!r})", __name__)
    assert (outcome["type"], outcome["size"], outcome["tail"]) == ("bytes", _SIZE, b"tail".hex()), outcome
    assert outcome["grown_mib"] < 1.5 * (_SIZE >> 20), outcome


def test_a_sparse_file_without_a_manifest_is_held_once(tmp_path: Path) -> None:
    """A checkpoint without a manifest (loaded unverified, with a warning) whose raw file was made a sparse file
    of the same size: nothing bounds it but the file, and before it cost twice its size."""
    root = _saved(tmp_path)
    (root / "manifest.json").unlink()
    blob = root / "blob_0.bin"
    blob.unlink()
    with open(blob, "wb") as f:
        f.truncate(_SIZE)
    outcome = in_child(f"raw_load_growth({str(root)!r}, None)", __name__)
    assert (outcome["type"], outcome["size"], outcome["tail"]) == ("bytes", _SIZE, "00000000"), outcome
    assert outcome["grown_mib"] < 1.5 * (_SIZE >> 20), outcome


def test_a_file_shorter_than_its_read_is_named(tmp_path: Path) -> None:
    """The one-read path keeps the refusal of a file cut short meanwhile (after a first, partial read)."""
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _pread_all(fd, 2, 8, str(path)) == b"x" * 8
        with pytest.raises(CorruptCheckpointError, match=r"short\.bin ended after 10 bytes; expected 14"):
            _pread_all(fd, 2, 12, str(path))
    finally:
        os.close(fd)


_OVER_ONE_READ = (2 << 30) + (64 << 20)  # past the most one read(2) gives on Linux (2 GiB less 4 KiB)


def test_a_file_past_one_read_is_held_once(tmp_path: Path) -> None:
    """The one-read path holds for a file one read(2) gives whole; Linux gives at most 2 GiB less 4 KiB per read.
    Defect: a sparse 2.06 GiB raw file (a checkpoint without a manifest) still cost twice its size (the first
    read's 2 GiB, the rest in a buffer, then both copied into one `bytes`): {'grown_mib': 4608, ...}."""
    root = _saved(tmp_path)
    (root / "manifest.json").unlink()
    blob = root / "blob_0.bin"
    blob.unlink()
    with open(blob, "wb") as f:
        f.seek(_OVER_ONE_READ - 4)
        f.write(b"tail")
    outcome = in_child(f"raw_load_growth({str(root)!r}, None)", __name__)
    assert (outcome["type"], outcome["size"], outcome["tail"]) == ("bytes", _OVER_ONE_READ, b"tail".hex()), outcome
    assert outcome["grown_mib"] < 1.5 * (_OVER_ONE_READ >> 20), outcome
