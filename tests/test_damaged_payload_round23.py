"""A damaged byte inside a tensor's payload, in a block of its own, on the read paths that memory-map a Torch
file and check it block by block (round 23).

docs/operations.md: "`diff` and `export` also check every byte they read against its checksums and stop with
an error naming the file". The byte is flipped in place, the manifest left as committed (a disk's damage, not
an attacker's): the file's header blocks still match, only the block holding that tensor byte does not.

What each case did before: `export_hf` of a Torch item (and `cli export`) read the tensor straight from the
mapping (`FlatTensors` handed out the mapped tensor without checking its blocks) and exported the damaged
value (500007.97 where 500000.0 was saved), reporting success. A load and `verify` refused the same file.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import export_hf, iter_item_tensors

REPO = Path(__file__).resolve().parents[1]
N = 1 << 20  # float32s: 4 MiB, sixteen 256 KiB checksum blocks
DAMAGED = 500_000  # the element whose byte is flipped, far from the zip header's block


def _damaged_checkpoint(root: Path) -> Path:
    """A committed Torch item of one large tensor, one payload byte flipped on disk afterwards."""
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(str(root), {"model": {"w": torch.arange(N, dtype=torch.float32)}})
    path = root / "model_0.pt"
    data = bytearray(path.read_bytes())
    at = bytes(data).find(struct.pack("<f", float(DAMAGED)))
    assert at > 256 * 1024, at  # not in the block the zip directory's check covers
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    return root


def test_export_of_a_torch_item_with_a_damaged_payload_block_is_refused(tmp_path: Path) -> None:
    """Defect: the export succeeded and its shard held the damaged value."""
    root = _damaged_checkpoint(tmp_path / "ck")
    with pytest.raises(CorruptCheckpointError, match=r"model_0\.pt.*CRC32"):
        export_hf(root, "model", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_cli_export_of_a_torch_item_with_a_damaged_payload_block_fails(tmp_path: Path) -> None:
    """Defect: `torch-checkpointing export` exited 0 and wrote the damaged value."""
    root = _damaged_checkpoint(tmp_path / "ck")
    command = ["export", str(root), "--item", "model", "--to", "hf", str(tmp_path / "hf")]
    done = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stdout
    assert "model_0.pt" in done.stderr and "CRC32" in done.stderr, done.stderr
    assert not (tmp_path / "hf").exists()


def test_iterating_a_torch_items_tensors_checks_the_blocks_each_tensor_reads(tmp_path: Path) -> None:
    """Defect: `iter_item_tensors` (what `cli diff` compares a resharded item's tensors by) yielded the damaged
    tensor."""
    root = _damaged_checkpoint(tmp_path / "ck")
    with pytest.raises(CorruptCheckpointError, match=r"model_0\.pt"):
        dict(iter_item_tensors(root, "model"))
