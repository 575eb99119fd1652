"""Multi-rank checkpoints on object storage, with real gloo ranks (the simulator's launcher) and a real S3 server.

* two ranks save (sync and async) into one S3 prefix and load back their own shards;
* DTensor state saved by 2 ranks is resharded onto 3 (DTensorResharder), reading from S3;
* several machines without a shared disk (each rank's store is its own local root): the commit refuses,
  naming the ranks whose files the committing rank cannot see.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from simulator.launcher import launch
from tests.s3_server import RecordingStorageConfig, S3Server, logged_gets
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo, SafetensorsSerialization
from torch_checkpointing.checksum import BLOCK_SIZE
from torch_checkpointing.config import AsyncCheckpointSaverConfig, CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import CommitError
from torch_checkpointing.manifest import MANIFEST_FILE_NAME
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

pytestmark = pytest.mark.multirank

MISC = ItemSpec(requires_copy=False, layout=LayoutInfo("rank_{rank}/misc.json", JsonSerialization()))


def two_ranks_save_and_load(config: FsspecStorageConfig, root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        save = AsyncCheckpointSaverConfig() if mode == "async" else SyncCheckpointSaverConfig()
        with CheckpointManager(CheckpointManager.Config(items={"misc": MISC}, save=save, storage_config=config)) as m:
            target = f"{root}/{mode}/step_1"
            state = {"w": torch.full((1000,), float(rank))}
            future = m.save(target, {"model": state, "misc": {"rank": rank}})
            if future is not None:
                future.result(timeout=120)
            out[f"{mode}_committed"] = config.create_storage().exists(Path(target) / MANIFEST_FILE_NAME)
            dist.barrier()
            got = m.load(target, into={"model": {"w": torch.zeros(1000)}, "misc": None})
            out[f"{mode}_loaded"] = bool(torch.equal(got["model"]["w"], state["w"])) and got["misc"] == {"rank": rank}
    return out


def test_two_ranks_save_and_load_on_s3(s3_bucket: FsspecStorageConfig, two_rank_runs: list[dict[str, Any]]) -> None:
    config = s3_bucket
    for report in (run["two"] for run in two_rank_runs):
        assert report == {"sync_committed": True, "sync_loaded": True, "async_committed": True, "async_loaded": True}
    files = sorted(config.create_storage().ls(Path("runs/two/sync/step_1")))
    assert files == [MANIFEST_FILE_NAME, "model_0.pt", "model_1.pt", "rank_0", "rank_1"]


# ------------------------------------------------------------------------------------------ resharding 2 -> 3

ROWS, COLS = 600, 64  # uneven on 2 and 3 ranks is not needed; 150 KiB per tensor


def full_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {"w": torch.randn(ROWS, COLS, generator=gen), "b": torch.randn(ROWS, generator=gen)}


def dtensors(zeros: bool) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = full_state()
    return {k: distribute_tensor(torch.zeros_like(v) if zeros else v, mesh, [Shard(0)]) for k, v in full.items()}


def reshard_items() -> dict[str, ItemSpec]:
    st = LayoutInfo("model/{rank}.safetensors", SafetensorsSerialization())
    return {"model": ItemSpec(resharder=DTensorResharder(), layout=st), "optim": ItemSpec(resharder=DTensorResharder())}


def reshard_save(config: FsspecStorageConfig, ckpt: str) -> None:
    manager = CheckpointManager(
        CheckpointManager.Config(items=reshard_items(), save=SyncCheckpointSaverConfig(), storage_config=config)
    )
    with manager:
        manager.save(ckpt, {"model": dtensors(zeros=False), "optim": {"exp_avg": dtensors(zeros=False)}})


def reshard_load(config: RecordingStorageConfig, ckpt: str) -> dict[str, Any]:
    """Load twice: verified (the default), then unverified, counting the bytes fetched from the model files."""
    out: dict[str, Any] = {}
    done = len(logged_gets(config.gets_log, os.getpid()))
    for verify in (True, False):
        load = CheckpointLoaderConfig(verify_checksums=verify)
        manager = CheckpointManager(
            CheckpointManager.Config(
                items=reshard_items(), save=SyncCheckpointSaverConfig(), load=load, storage_config=config
            )
        )
        with manager:
            targets = {"model": dtensors(zeros=True), "optim": {"exp_avg": dtensors(zeros=True)}}
            manager.load(ckpt, into=targets)
            want = dtensors(zeros=False)
            ok = all(torch.equal(targets["model"][k].to_local(), want[k].to_local()) for k in want)
            ok = ok and all(torch.equal(targets["optim"]["exp_avg"][k].to_local(), want[k].to_local()) for k in want)
        gets = logged_gets(config.gets_log, os.getpid())[done:]
        done += len(gets)
        out[f"ok_{verify}"] = ok
        out[f"model_bytes_{verify}"] = sum(end - start for key, start, end in gets if "/model/" in key)
    return out


def test_dtensor_state_saved_by_two_ranks_reshards_onto_three_from_s3(
    s3_bucket: FsspecStorageConfig, two_rank_runs: list[dict[str, Any]], tmp_path: Path
) -> None:
    config = s3_bucket
    assert all(run["reshard_saved"] for run in two_rank_runs), two_rank_runs
    recording = RecordingStorageConfig(
        url=config.url,
        storage_options=config.storage_options,
        part_size=config.part_size,
        gets_log=str(tmp_path / "gets.log"),
    )
    reports = launch(reshard_load, 3, args=(recording, "runs/reshard/step_1"), timeout=240)
    assert all(r["ok_True"] and r["ok_False"] for r in reports), reports
    files = config.create_storage()
    saved = sum(files.getsize(Path(f"runs/reshard/step_1/model/{r}.safetensors")) for r in range(2))
    verified = [r["model_bytes_True"] for r in reports]
    unverified = [r["model_bytes_False"] for r in reports]
    # Without verification each new rank fetches only its third of the rows (plus headers) with ranged GETs.
    assert all(0 < f < saved / 2 for f in unverified), (unverified, saved)
    assert sum(unverified) < saved * 1.1, (unverified, saved)
    # A verified load widens each ranged read to the checksummed blocks it touches (at most one block more at
    # each end) and checks those; it no longer downloads whole files. Each rank reads w and b from at most two
    # source files, plus their headers.
    ranges = 2 * 2
    assert all(v <= u + (2 * ranges + 2) * BLOCK_SIZE for v, u in zip(verified, unverified, strict=True)), (
        verified,
        unverified,
    )


# ------------------------------------------------------------------------------------------ no shared disk


def separate_disks(root: str) -> dict[str, Any]:
    """Every rank's store is its own local root: rank 0 cannot see rank 1's files."""
    rank = dist.get_rank()
    config = FsspecStorageConfig(url=f"file://{root}/node{rank}")
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
        try:
            m.save("runs/step_1", {"model": {"w": torch.ones(4)}})
        except CommitError as exc:
            return {"error": str(exc), "failures": exc.failures}
    return {"error": None}


def test_ranks_files_invisible_to_the_committing_rank_fail_the_commit_naming_them(
    two_rank_runs: list[dict[str, Any]], disks_root: Path
) -> None:
    for report in (run["separate"] for run in two_rank_runs):
        error = report["error"]
        assert error is not None, "the commit succeeded although rank 0 cannot see rank 1's files"
        # Named at the commit (rank 0 cannot see rank 1's files), or earlier: rank 1 does not find the directory
        # rank 0 made for the save (a mkdir of one level, as on every store since round 25).
        assert "files of rank(s) [1] (model_1.pt)" in error or "failed on rank(s) [1]" in error, error
        assert "cannot see" in error or "not visible" in error or "not a node-local disk" in error, error
    assert not (disks_root / "node0" / "runs" / "step_1" / MANIFEST_FILE_NAME).exists()


# ------------------------------------------------------------------------------------------ one 2-rank launch


def every_two_rank_run(config: FsspecStorageConfig, disks: str) -> dict[str, Any]:
    """The 2-rank parts of the tests above in one launch (ranks are seconds each to start), each part's
    result under its own name; the shared-disk-less commit last, as it is meant to fail."""
    out: dict[str, Any] = {"two": two_ranks_save_and_load(config, "runs/two")}
    reshard_save(config, "runs/reshard/step_1")
    out["reshard_saved"] = True
    out["separate"] = separate_disks(disks)
    return out


@pytest.fixture(scope="module")
def disks_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("separate_disks")


@pytest.fixture(scope="module")
def s3_bucket(s3_server: S3Server) -> FsspecStorageConfig:
    """The bucket the shared launch saves into, which the tests then read."""
    return s3_server.config()


@pytest.fixture(scope="module")
def two_rank_runs(s3_bucket: FsspecStorageConfig, disks_root: Path) -> list[dict[str, Any]]:
    return launch(every_two_rank_run, 2, args=(s3_bucket, str(disks_root)), timeout=480)
