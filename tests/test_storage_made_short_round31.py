"""A store's client made while this process is out of descriptors names the store (round 31).

Making an `FsspecStorage`'s filesystem (importing fsspec and the client, starting fsspec's event loop) ran before
any call's error scope opened: `latest_checkpoint("s3://bucket/run")` while out of descriptors raised a bare
`OSError: [Errno 24] Too many open files: '.../fsspec/__init__.py'` (or with no file at all, from the event
loop's pipe), with no word of the store or of the fix. The shortage is real: a child that holds every
descriptor it may open, listing a real S3 server (moto, in its own process).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.descriptor_limits import OUT_OF_DESCRIPTORS
from tests.s3_server import S3Server

_CHILD = r"""
import os, sys
from torch_checkpointing import latest_checkpoint
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig
url, made = sys.argv[1], sys.argv[2]
if made == "imported":  # the client's modules loaded before: the event loop's pipe is what fails
    import s3fs  # noqa: F401
held = hold_every_descriptor()
calls = {
    "latest": lambda: latest_checkpoint(url),
    "config": lambda: FsspecStorageConfig(url=url).create_storage(),
}
report(calls)
for fd in held:
    os.close(fd)
print("after", latest_checkpoint(url))
"""


@pytest.fixture(scope="module", params=["fresh", "imported"])
def outcomes(request: pytest.FixtureRequest, s3_server: S3Server) -> tuple[str, dict[str, str]]:
    """The store's URL, and what each call out of descriptors did: "done", or the error's type, errno, notes."""
    if not sys.platform.startswith("linux"):
        pytest.skip("descriptors are held until the limit: Linux's")
    url = s3_server.config().url
    args = [sys.executable, "-c", OUT_OF_DESCRIPTORS + _CHILD, url, request.param]
    env = {**os.environ, **s3_server.client_env()}
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "after None", lines  # the store answers once descriptors are back (an empty bucket)
    return url, dict(line.split(" ", 1) for line in lines[:-1])


@pytest.mark.parametrize("call", ["latest", "config"])
def test_a_shortage_making_the_client_names_the_store(outcomes: tuple[str, dict[str, str]], call: str) -> None:
    """Defect: "latest OSError 24 [Errno 24] Too many open files: '.../fsspec/__init__.py' NOTES " (fresh) and
    "latest OSError 24 [Errno 24] Too many open files NOTES " (imported): no note, no store."""
    url, said = outcomes
    assert said[call] == "done" or said[call].startswith("OSError 24 "), said
    if said[call] != "done":
        assert f"client for {url}" in said[call] and "raise the process's limit" in said[call], said
