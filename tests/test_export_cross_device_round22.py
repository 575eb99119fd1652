"""Round 22: an HF export whose output folder lies on another file system than the folder it sits in.

That is the usual place to export to in a container (a Docker volume, a mounted disk: the output folder is a
mount point), or a symbolic link `hf_model -> /mnt/scratch/hf_model`. The export was staged beside the output
folder and its files renamed into it, and a rename cannot cross file systems: every export there failed with
EXDEV, and an overwrite first removed the earlier export's index (its shard names were the new ones), so the
earlier export there stopped being one (docs/operations.md promises that it stays whole).

The second file system is a real one: a tmpfs mounted for the test (as root), else /dev/shm where it is one.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import INDEX_FILE_NAME, export_hf, import_hf

SHARD = 40  # bytes: one shard per tensor below (32, 16 bytes): both exports take the same shard names


def _save(path: Path, model: dict[str, torch.Tensor]) -> Path:
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(str(path), {"model": model})
    return path


def _mounted(where: Path) -> bool:
    where.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", os.fspath(where)],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture
def other_fs(tmp_path: Path) -> Iterator[Path]:
    """A folder on another file system than `tmp_path`."""
    volume = tmp_path / "volume"
    if _mounted(volume):
        try:
            yield volume
        finally:
            subprocess.run(["umount", "-l", os.fspath(volume)], capture_output=True, timeout=30, check=False)
        return
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system here: cannot mount a tmpfs, and /dev/shm is none")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        yield Path(folder)


def _model(base: float) -> dict[str, torch.Tensor]:
    return {"a": torch.arange(8.0) + base, "b": torch.arange(4.0) + base}


def _assert_export_of(out: Path, model: dict[str, torch.Tensor]) -> None:
    assert import_hf(out).keys() == model.keys()
    for name, value in import_hf(out).items():
        assert torch.equal(value, model[name]), name
    for shard in out.glob("*.safetensors"):
        for name, value in load_file(shard).items():  # the safetensors library reads each shard too
            assert torch.equal(value, model[name]), name


def _output(other_fs: Path, tmp_path: Path, via: str) -> tuple[Path, Path]:
    """The output folder as the export is given it (the mount point itself, or a link to a folder there), and
    the folder it is."""
    if via == "mount point":
        return other_fs, other_fs
    (other_fs / "hf").mkdir()
    link = tmp_path / "hf"
    link.symlink_to(other_fs / "hf")
    return link, other_fs / "hf"


# Failed before round 22 with OSError ("Invalid cross-device link"): into the mount point, at the first export;
# through the link, at the overwrite of an export made through the folder's own path, which had already removed
# that earlier export's index (the folder held a lone shard).
@pytest.mark.parametrize("via", ["mount point", "symbolic link"])
def test_an_export_into_a_folder_on_another_file_system_publishes_and_overwrites(
    tmp_path: Path, other_fs: Path, via: str
) -> None:
    first = _save(tmp_path / "first", _model(0.0))
    second = _save(tmp_path / "second", _model(100.0))
    out, real = _output(other_fs, tmp_path, via)
    (real / "config.json").write_text("{}")  # the user's own file beside the export
    export_hf(first, "model", real, max_shard_size=SHARD)
    _assert_export_of(real, _model(0.0))
    export_hf(second, "model", out, max_shard_size=SHARD, overwrite=True)
    _assert_export_of(real, _model(100.0))
    names = sorted(os.listdir(real))
    assert names == ["config.json", *[f"model-0000{k}-of-00002.safetensors" for k in (1, 2)], INDEX_FILE_NAME]
    assert not [n for n in os.listdir(tmp_path) if ".export-tmp-" in n]


def test_a_failed_overwrite_on_another_file_system_leaves_the_earlier_export_whole(
    tmp_path: Path, other_fs: Path
) -> None:
    """The staging folder (inside the output, on its file system) goes with a failed export; nothing else does."""
    first = _save(tmp_path / "first", _model(0.0))
    export_hf(first, "model", other_fs, max_shard_size=SHARD)
    before = {p.name: p.read_bytes() for p in other_fs.iterdir()}
    damaged = _save(tmp_path / "damaged", _model(100.0))
    shard = next(damaged.glob("model_*"))
    data = bytearray(shard.read_bytes())
    data[-30] ^= 0xFF  # inside the zip's records: the checksum check refuses it
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        export_hf(damaged, "model", other_fs, max_shard_size=SHARD, overwrite=True)
    assert {p.name: p.read_bytes() for p in other_fs.iterdir()} == before
    _assert_export_of(other_fs, _model(0.0))
