"""A `requires_copy=False` item travels to the async writer process out of band: its tensors' bytes are written to
the pipe from their own memory, never copied into a pickle on the trainer's side, and arrive whole.

Before, the item was pickled in band (every storage copied into the pickle under the GIL, the pickle copied
again into the message, both again in the writer): a 1 GiB no-copy save took 6-12 s to durable against 1 s for
a staged one, and the trainer held two more copies of the payload while it travelled.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.probes import fresh_json
from tests.test_value_fidelity_harness import TORCH_DTYPES, Gen, tensor_bits
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.errors import WriterProcessDied
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

_MIB = 1024 * 1024


def _no_copy_manager(**config: Any) -> CheckpointManager:
    conf = CheckpointManager.Config.with_async_save()
    conf.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    conf.items = {"model": ItemSpec(requires_copy=False)}
    for name, value in config.items():
        setattr(conf, name, value)
    return CheckpointManager(conf)


def test_every_dtype_view_and_tie_arrives_whole(tmp_path: Path) -> None:
    g = Gen(11, TORCH_DTYPES)
    model: dict[str, Any] = {}
    for dtype in TORCH_DTYPES:
        t = g.bits((4, 3), dtype)
        model[str(dtype)] = {"t": t, "view": t.t(), "tail": t[2:], "empty": g.bits((0,), dtype)}
    base = torch.arange(12.0)
    model["a"] = model["b"] = base
    model["slice"] = base[3:7]
    model["param"] = torch.nn.Parameter(torch.ones(3))
    model["meta"] = {"step": 7, "name": "x"}
    with_attr = torch.zeros(2)
    with_attr.note = "kept"  # type: ignore[attr-defined]
    model["attr"] = with_attr
    manager = _no_copy_manager()
    try:
        manager.save(os.fspath(tmp_path / "c"), {"model": model}).result(timeout=120)
        back = manager.load(os.fspath(tmp_path / "c"))["model"]
    finally:
        manager.close()
    for dtype in TORCH_DTYPES:
        for key, t in model[str(dtype)].items():
            got = back[str(dtype)][key]
            assert got.dtype == dtype and got.shape == t.shape and tensor_bits(got) == tensor_bits(t), (dtype, key)
    assert torch.equal(back["a"], base) and back["a"] is back["b"], "one tensor under two keys came back as two"
    assert torch.equal(back["slice"], base[3:7])
    assert torch.equal(back["param"], torch.ones(3)) and back["meta"] == {"step": 7, "name": "x"}
    assert torch.equal(back["attr"], torch.zeros(2))


_PEAK_PROBE = """
import json, os, sys
import torch
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

def peak_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

if __name__ == "__main__":
    conf = CheckpointManager.Config.with_async_save()
    conf.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    conf.items = {"model": ItemSpec(requires_copy=False)}
    manager = CheckpointManager(conf)
    manager.save(sys.argv[1] + "/warm", {"model": {"w": torch.ones(10)}}).result(timeout=120)
    payload = {"w": torch.ones(64 * 1024 * 1024), "v": torch.zeros(32 * 1024 * 1024)}  # 384 MiB
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from the current one
    before = peak_mib()
    manager.save(sys.argv[1] + "/big", {"model": payload}).result(timeout=300)
    grew = peak_mib() - before
    back = manager.load(sys.argv[1] + "/big")["model"]
    manager.close()
    print(json.dumps({"grew_mib": grew, "same": bool(torch.equal(back["w"], payload["w"]))}))
"""


def test_the_trainer_does_not_copy_the_payload_while_it_travels(tmp_path: Path) -> None:
    """Before: the trainer's peak grew by twice the payload (the pickle, and the message holding it)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs /proc/self/clear_refs to reset the peak resident size")
    out = fresh_json(_PEAK_PROBE, os.fspath(tmp_path), timeout=300)
    assert out["same"]
    assert out["grew_mib"] < 96, f"the trainer's peak grew by {out['grew_mib']:.0f} MiB for a 384 MiB payload"


def test_a_writer_killed_while_the_bytes_travel_never_hangs_the_save_and_the_next_one_works(tmp_path: Path) -> None:
    manager = _no_copy_manager()
    try:
        manager.save(os.fspath(tmp_path / "warm"), {"model": {"w": torch.ones(4)}}).result(timeout=120)
        writer_pid = manager.writer_pid
        assert writer_pid is not None
        big = {"w": torch.ones(128 * _MIB // 4), "v": torch.ones(128 * _MIB // 4)}
        future = manager.save(os.fspath(tmp_path / "killed"), {"model": big})
        os.kill(writer_pid, signal.SIGKILL)
        try:  # killed while the bytes travel, or (a slow trainer) before they left: a restarted writer took them
            future.result(timeout=120)
        except WriterProcessDied:
            assert not (tmp_path / "killed").exists()
        else:
            assert torch.equal(manager.load(os.fspath(tmp_path / "killed"))["model"]["v"], big["v"])
        manager.save(os.fspath(tmp_path / "after"), {"model": {"w": torch.arange(5.0)}}).result(timeout=120)
        back = manager.load(os.fspath(tmp_path / "after"))["model"]
        assert torch.equal(back["w"], torch.arange(5.0))
    finally:
        manager.close()


def limit_address_space(extra_mib: int) -> None:
    """The writer's `subprocess_init_fn`: room for `extra_mib` MiB more address space than it has now."""
    with open("/proc/self/status") as status:
        size_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = (size_kib * 1024) + extra_mib * _MIB
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def test_a_writer_without_memory_for_the_bytes_fails_that_save_and_stays_in_step(tmp_path: Path) -> None:
    """The writer reads every byte the trainer sent even when it cannot hold them, so the next request on the
    pipe starts where it should: the failed save is reported with its MemoryError, and the next one commits."""
    manager = _no_copy_manager(subprocess_init_fn=limit_address_space, subprocess_init_args=(256,))
    try:
        manager.save(os.fspath(tmp_path / "small"), {"model": {"w": torch.ones(4)}}).result(timeout=120)
        big = {"w": torch.ones(384 * _MIB // 4)}
        started = time.monotonic()
        with pytest.raises(MemoryError):
            manager.save(os.fspath(tmp_path / "big"), {"model": big}).result(timeout=120)
        assert time.monotonic() - started < 120
        assert not (tmp_path / "big").exists()
        manager.save(os.fspath(tmp_path / "after"), {"model": {"w": torch.arange(3.0)}}).result(timeout=120)
        assert torch.equal(manager.load(os.fspath(tmp_path / "after"))["model"]["w"], torch.arange(3.0))
    finally:
        manager.close()
