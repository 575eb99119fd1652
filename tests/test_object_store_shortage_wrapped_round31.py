"""A store client's error that wraps this process's own shortage is that shortage, not the store's failure (round 31).

Round 30 let a shortage raised as itself through the object store's error scope. Out of file descriptors, the
client says it in its own words: botocore's `EndpointConnectionError` around aiohttp's connect error (errno 24), or
`HTTPClientError` around the `OSError`. Each was an `ObjectStoreError` telling the user to check the endpoint URL,
a `CheckpointError` for an intact checkpoint. The shortage here is real: a child that holds every descriptor its
limit allows, talking to a real S3 server (moto, in its own process).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.descriptor_limits import OUT_OF_DESCRIPTORS
from tests.s3_server import S3Server

_CHILD = r"""
import os, resource, sys, torch
from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig
options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "skip_instance_cache": True}
storage = FsspecStorageConfig(url=sys.argv[1], storage_options=options)
config = CheckpointManager.Config(
    save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig(), storage_config=storage
)
path = f"{sys.argv[1]}/ck"
m = CheckpointManager(config)
listing = storage.create_storage()
m.save(path, {"t": {"x": torch.ones(8)}})
m.load(path)
list_checkpoints(sys.argv[1], listing)  # every import and client, made with descriptors to spare
n = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 40, n + 40))  # the hard one too: a load may raise the soft one
held = hold_every_descriptor()
calls = {
    "save": lambda: m.save(f"{sys.argv[1]}/ck2", {"t": {"x": torch.ones(8)}}),
    "load": lambda: m.load(path),
    "list": lambda: list_checkpoints(sys.argv[1], listing),
}
report(calls)
for fd in held:
    os.close(fd)
print("after", m.load(path)["t"]["x"].sum().item())
"""


@pytest.fixture(scope="module")
def outcomes(s3_server: S3Server) -> dict[str, str]:
    """What each call out of descriptors did: its name -> "done", or the exception's type, errno and message."""
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/self/fd is Linux's")
    args = [sys.executable, "-c", OUT_OF_DESCRIPTORS + _CHILD, s3_server.config().url]
    env = {**os.environ, **s3_server.client_env()}
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "after 8.0", lines  # the checkpoint is intact, and loads once descriptors are back
    return dict(line.split(" ", 1) for line in lines[:-1])


@pytest.mark.parametrize("call", ["save", "load", "list"])
def test_a_wrapped_descriptor_shortage_is_an_oserror_of_its_errno(outcomes: dict[str, str], call: str) -> None:
    """Out of descriptors, each call succeeds or raises an `OSError` with errno 24 that says so.

    Defect: "load ObjectStoreError None 'lookup of s3://.../ck failed: EndpointConnectionError: Could not connect
    to the endpoint URL: ... (the store cannot be reached at its endpoint: check AWS_ENDPOINT_URL ...'"; "list
    ObjectStoreError None 'lookup of s3://... failed: HTTPClientError: An HTTP Client raised an unhandled
    exception: [Errno 24] Too many open files'"."""
    said = outcomes[call]
    assert said == "done" or said.startswith("OSError 24 "), outcomes
    assert "AWS_ENDPOINT_URL" not in said, outcomes
