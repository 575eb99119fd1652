"""A load from an object store short of memory is a `MemoryError`, as a load from local files is (round 30).

The object store's error scope turned every exception of a download into an `ObjectStoreError` ("download of
... failed: MemoryError: "): a `CheckpointError`, which a caller that deletes damaged checkpoints, or falls back
to an earlier one, acts on, for the process's own shortage. The shortage here is real: a child under RLIMIT_AS,
stepped down until the load fails, loading from a real S3 server (moto, in its own process).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.s3_server import S3Server

_LOADS_UNDER_LIMITS = r"""
import os, resource, sys, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig
options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "skip_instance_cache": True}
storage = FsspecStorageConfig(url=sys.argv[1], storage_options=options, part_size=5 << 20)
saver, loader = SyncCheckpointSaverConfig(), CheckpointLoaderConfig()
config = CheckpointManager.Config(save=saver, load=loader, storage_config=storage)
path = f"{sys.argv[1]}/ck"
with CheckpointManager(config) as m:
    m.save(path, {"t": {"x": torch.ones(8 << 20)}, "blob": bytes(32 << 20)})
    m.load(path)  # every import a load needs, with memory to spare
    for room in range(128, -1, -8):  # MiB of address space beyond what the process holds
        base = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (base + room * 2**20, resource.RLIM_INFINITY))
        try:
            m.load(path)
            said = "loaded"
        except BaseException as exc:
            said = f"{type(exc).__name__} {'not found damaged' in str(exc)} {str(exc)[:300]!r}"
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print(room, said, flush=True)
    state = m.load(path)
    print("after", state["blob"] == bytes(32 << 20))
"""


@pytest.fixture(scope="module")
def loads_under_limits(s3_server: S3Server) -> list[str]:
    """What each load under a stepped limit did, then "after" and whether the load without it is whole."""
    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_AS and /proc/self/statm are Linux's")
    args = [sys.executable, "-c", _LOADS_UNDER_LIMITS, s3_server.config().url]
    env = {**os.environ, **s3_server.client_env()}
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "after True", lines  # the checkpoint is intact
    assert any(" MemoryError True " in line for line in lines), lines  # some limit refused the load something
    return lines[:-1]


def test_a_record_refused_its_bytes_is_not_called_damage(loads_under_limits: list[str]) -> None:
    """torch's binding, refused the bytes of a record, says so in pybind11's words.

    Defect: "CorruptCheckpointError False \"File s3:/.../ck/blob_0.pt for item 'blob' is not a readable Torch
    file: Could not allocate bytes object!\"" (at 9 limits of 16)."""
    damage = [line for line in loads_under_limits if "CorruptCheckpointError" in line]
    assert not damage, loads_under_limits


def test_a_download_short_of_memory_is_a_memory_error(loads_under_limits: list[str]) -> None:
    """Every load under a limit loads, or fails with a `MemoryError` saying the checkpoint was not found damaged.

    Defect: "16 ObjectStoreError False 'download of s3://.../ck/blob_0.pt failed: MemoryError: '"."""
    outcomes = {tuple(line.split(" ", 3)[1:3]) for line in loads_under_limits}
    assert outcomes <= {("loaded",), ("MemoryError", "True")}, loads_under_limits
