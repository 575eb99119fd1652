"""The CLI on checkpoints saved with a user's own resharder, whose metadata class the CLI process never imports.

Before: `verify` said "FAILED metadata.json: Sharding metadata ... is malformed (... Unknown ShardingMetadata type
...)" and exited 1 for a healthy checkpoint, and `inspect` and `diff` stopped with exit 2 on it: every checkpoint of
the design document's custom resharding read as damaged to the tools. The engine never imports what a checkpoint
names, so the tools must take such metadata as it is stored.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import ShardingMetadata
from torch_checkpointing.resharding import Resharder

REPO = Path(__file__).resolve().parents[1]
TYPE = "Round19CliLoaderPosition"


@dataclass(frozen=True)
class _Position(ShardingMetadata, type_name=TYPE):
    rank: int
    world_size: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> _Position:
        return cls(int(d["rank"]), int(d["world_size"]))

    @property
    def equivalent_ranks(self) -> tuple[int, ...] | None:
        return None


class _LoaderResharder(Resharder):
    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[Any, Any]:
        return {("position",): _Position(0, 1)}

    def load(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("not loaded here")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("custom_sharding")
    items = {"loader": ItemSpec(resharder=_LoaderResharder())}
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), items=items)) as manager:
        for name, position in (("a", 3), ("b", 3), ("c", 4)):
            manager.save(str(root / name), {"loader": {"position": position, "seen": torch.arange(4.0)}, "step": 1})
    return root


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own: it has not imported this module, so `TYPE` is registered nowhere there."""
    cmd = [sys.executable, "-m", "torch_checkpointing", "--json", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_verify_finds_a_healthy_checkpoint_intact(saved: Path) -> None:
    proc = _cli("verify", str(saved / "a"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True, report


def test_inspect_shows_the_custom_sharding_as_stored(saved: Path) -> None:
    proc = _cli("inspect", str(saved / "a"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert TYPE in proc.stdout, proc.stdout


def test_diff_compares_checkpoints_with_custom_sharding(saved: Path) -> None:
    same = _cli("diff", str(saved / "a"), str(saved / "b"))
    assert same.returncode == 0, same.stdout + same.stderr
    assert json.loads(same.stdout)["identical"] is True
    differs = _cli("diff", str(saved / "a"), str(saved / "c"))
    assert differs.returncode == 1, differs.stdout + differs.stderr
    rows = json.loads(differs.stdout)["differences"]
    assert [(r["item"], r["status"]) for r in rows] == [("loader", "differs")], rows


def test_export_takes_an_item_of_a_custom_resharder_as_saved(saved: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    proc = _cli("export", str(saved / "a"), "--item", "loader", "--to", "hf", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (shard,) = out.glob("*.safetensors")
    assert torch.equal(load_file(shard)["seen"], torch.arange(4.0))
