"""Rank functions for the engine's multi-rank tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import os
import resource
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed as dist

from tests.memory_storage import Control, RecordingStorageConfig
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo, RawSerialization
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


def _config(async_save: bool, **kw: Any) -> CheckpointManager.Config:
    cfg = CheckpointManager.Config.with_async_save() if async_save else CheckpointManager.Config.with_sync_save()
    for k, v in kw.items():
        setattr(cfg, k, v)
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return cfg


def commit_protocol(root: str) -> dict[str, Any]:
    """Sync and async saves on every rank: per-rank files, one manifest, futures done only after the commit."""
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank}
    items = {"misc": ItemSpec(requires_copy=False, layout=LayoutInfo("rank_{rank}/misc.json", JsonSerialization()))}
    for mode in ("sync", "async"):
        manager = CheckpointManager(_config(mode == "async", items=items))
        target = Path(root) / mode
        state = {"w": torch.full((4,), float(rank))}
        fut = manager.save(str(target), {"model": state, "misc": {"rank": rank, "step": 3}})
        if fut is not None:
            fut.result(timeout=120)
        # Once our own save is done, the whole checkpoint must be visible and complete.
        out[f"{mode}_manifest_seen"] = (target / "manifest.json").exists()
        out[f"{mode}_files"] = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
        dist.barrier()
        got = manager.load(str(target), into={"model": {"w": torch.zeros(4)}, "misc": None})
        out[f"{mode}_loaded_ok"] = bool(torch.equal(got["model"]["w"], state["w"])) and got["misc"] == {
            "rank": rank,
            "step": 3,
        }
        manager.close()
    # A layout without {rank}: one file, written once by rank 0, read by every rank; a warning on rank 0.
    manager = CheckpointManager(
        _config(False, items={"misc": ItemSpec(layout=LayoutInfo("misc.json", JsonSerialization()))})
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(str(Path(root) / "fixed"), {"misc": {"rank": rank}})
    out["fixed_warned"] = [str(w.message) for w in caught]
    out["fixed_files"] = sorted(
        str(p.relative_to(Path(root) / "fixed")) for p in (Path(root) / "fixed").rglob("*") if p.is_file()
    )
    out["fixed_loaded"] = manager.load(str(Path(root) / "fixed"), into={"misc": None})["misc"]
    # Two different keys resolving to one path across ranks are refused before anything is written.
    clash = {"a": ItemSpec(layout=LayoutInfo("a_{rank}.json", JsonSerialization()))}
    manager2 = CheckpointManager(_config(False, items=clash))
    key = "a" if rank == 0 else "b"
    if rank != 0:
        manager2.config.items = {"b": ItemSpec(layout=LayoutInfo("a_0.json", JsonSerialization()))}
    try:
        manager2.save(str(Path(root) / "collide"), {key: {"rank": rank}})
        out["collision"] = "no error"
    except (ValueError, RuntimeError) as exc:
        out["collision"] = str(exc)
    out["collide_exists"] = (Path(root) / "collide").exists()
    # A payload refused on one rank is refused on every rank, naming that rank; nobody waits in a collective.
    bad_key = "ok" if rank != 1 else "not ok"
    manager3 = CheckpointManager(_config(False))
    try:
        manager3.save(str(Path(root) / "refused"), {bad_key: 1})
        out["refused"] = "no error"
    except (ValueError, RuntimeError) as exc:
        out["refused"] = f"{type(exc).__name__}: {exc}"
    out["refused_exists"] = (Path(root) / "refused").exists()
    manager3.close()
    manager.close()
    manager2.close()
    return out


def _release_once_the_others_gave_up(control: Control, root: Path, blocked_in: list[int]) -> None:
    blocked_in.append(control.wait_blocked(120))
    others = [root / f"gave_up_{r}" for r in range(dist.get_world_size()) if r != dist.get_rank()]
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    control.reset()


def dead_rank(root: str) -> dict[str, Any]:
    """Rank 1 agrees on the plan, then its write hangs: the others fail within the timeout, naming it, and
    nothing is committed. (Rank 1's storage blocks in its item file until the others gave up.)"""
    rank = dist.get_rank()
    cfg = _config(False)
    cfg.save.wait_timeout_secs = 5
    control = Control(Path(root) / f"control_{rank}")
    cfg.storage_config = RecordingStorageConfig(control_dir=str(control.root))
    blocked_in: list[int] = []
    if rank == 1:
        control.block("x_1.pt")
        release = threading.Thread(
            target=_release_once_the_others_gave_up, args=(control, Path(root), blocked_in), daemon=True
        )
        release.start()
    manager = CheckpointManager(cfg)
    out: dict[str, Any] = {"rank": rank}
    target = Path(root) / "ck"
    try:
        manager.save(str(target), {"x": torch.ones(1)})
        out["error"] = None
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    Path(root, f"gave_up_{rank}").touch()
    out["blocked"] = blocked_in == [os.getpid()]  # rank 1's write did hang, in this (the sync saver's) process
    out["exists"] = target.exists()
    return out


def process_local_saves(bucket: str) -> dict[str, str]:
    """A sync and an async save on every rank to `bucket` (a `memory://` url, which each process has its own of):
    what each raised, and what this rank's memory:// holds of the id afterwards."""
    out: dict[str, str] = {}
    for mode, saver in (("sync", SyncCheckpointSaverConfig()), ("async", AsyncCheckpointSaverConfig())):
        cfg = CheckpointManager.Config(save=saver, storage_config=FsspecStorageConfig(url=bucket))
        with CheckpointManager(cfg) as manager:
            try:
                manager.save(f"{mode}/step_1", {"w": torch.ones(2)})
                out[mode] = "no error"
            except Exception as exc:
                cause = exc.__cause__
                out[mode] = f"{type(exc).__name__} (from {type(cause).__name__}): {exc}"
        out[f"{mode}_left"] = str(fsspec.filesystem("memory").exists(f"{bucket}/{mode}"))
    return out


def process_local_load(bucket: str) -> str:
    """A collective load from `bucket` (a `memory://` url) where only rank 0's memory:// holds something under the
    id (a manifest of another tool): what this rank raised."""
    if dist.get_rank() == 0:
        fsspec.filesystem("memory").pipe(f"{bucket}/load/step_1/manifest.json", b"{}")
    cfg = CheckpointManager.Config(storage_config=FsspecStorageConfig(url=bucket))
    with CheckpointManager(cfg) as manager:
        try:
            manager.load("load/step_1", {"w": torch.zeros(2)})
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "no error"


def commit_checks(root: str) -> dict[str, Any]:
    """One launch for every commit-protocol check (starting ranks costs seconds)."""
    out = commit_protocol(str(Path(root) / "commit"))
    out["dead"] = dead_rank(str(Path(root) / "dead"))
    out["process_local"] = process_local_saves(f"memory://{Path(root).name}-{uuid.uuid4().hex[:8]}/runs")
    out["process_local"]["load"] = process_local_load(f"memory://{Path(root).name}-load")  # one name on every rank
    return out


def _lowest_free_descriptor() -> int:
    """The number the next open would get: as the limit of open files, no open succeeds until a lower one is
    closed. (A count of those open left room wherever the numbers had gaps: in the full run, the descriptor-short
    rank of `mixed` sometimes loaded.)"""
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)
    return probe


def shortage_on_one_rank(root: str, kind: str) -> str:
    """A collective load of an intact checkpoint where only rank 1 is short of a resource: `descriptors` (its
    limit of open files, soft and hard, leaves 4 beyond those open) or `memory` (its file is a sparse 1 TiB one in
    a checkpoint without a manifest, which no machine's memory holds); `mixed` (3 ranks or more): rank 1 short of
    memory and rank 2 of descriptors. What this rank raised, as "Type: message"."""
    rank = dist.get_rank()
    target = Path(root) / "ck"
    short_of_memory = rank == 1 and kind in ("memory", "mixed")
    short_of_descriptors = rank == (2 if kind == "mixed" else 1) and kind in ("descriptors", "mixed")
    items: dict[str, ItemSpec] = {}
    state: dict[str, Any] = {}
    if kind in ("memory", "mixed"):
        items["blob"] = ItemSpec(layout=LayoutInfo("blob_{rank}.bin", RawSerialization()))
        state["blob"] = b"x"
    if kind in ("descriptors", "mixed"):
        state.update({f"k{i}": {"t": torch.ones(3)} for i in range(12)})
    with CheckpointManager(_config(False, items=items)) as manager:
        manager.save(str(target), state)
        manager.load(str(target))  # every import a load needs, made while descriptors are there
        dist.barrier()
        if short_of_descriptors:
            limit = len(os.listdir("/proc/self/fd")) + 4 if kind == "descriptors" else _lowest_free_descriptor()
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))  # the hard one too: the load cannot raise it
        if short_of_memory:
            os.truncate(target / "blob_1.bin", 1 << 40)  # no disk used
        if rank == 0 and kind in ("memory", "mixed"):
            (target / "manifest.json").unlink()  # nothing vouches for the file's size
        dist.barrier()
        try:
            manager.load(str(target))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "loaded"
