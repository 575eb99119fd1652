"""Every read of an object store gives up after `FsspecStorageConfig.request_timeout_s`.

`stream_read` (what `torch-checkpointing verify` reads a file of an object store through) opened fsspec's own
file on the unbounded filesystem: against a server that accepts the connection and never answers, the open's
HEAD and every GET waited on the client's own timeouts and retries (minutes), whatever `request_timeout_s`
said; its errors while reading were the client's bare ones, naming no checkpoint. It now reads with the
storage's bounded, named ranged GETs.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("s3fs")

_TIMEOUT_S = 1.0
_BOUND_S = 60.0  # only stops a hang: an answer comes within a few request timeouts


@pytest.fixture
def stalled_port() -> Iterator[int]:
    """A server on 127.0.0.1 that accepts every connection and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed at the test's end
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        for conn in held:
            conn.close()


_READER = """
import sys
from pathlib import Path
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.storage.base_storage import ReadArgs
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

options = {{"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:{port}",
           "client_kwargs": {{"region_name": "us-east-1"}}, "skip_instance_cache": True}}
storage = FsspecStorage(FsspecStorageConfig(url="s3://stalled/run", storage_options=options,
                                            request_timeout_s={timeout}))
try:
    with storage.stream_read(Path("step_1/model.bin"), ReadArgs(pre_read_full_file=False)) as stream:
        stream.read(1 << 20)
except ObjectStoreError as exc:
    print("ObjectStoreError:", exc)
"""


def test_a_stream_from_a_server_that_never_answers_gives_up_after_the_request_timeout(stalled_port: int) -> None:
    code = textwrap.dedent(_READER.format(port=stalled_port, timeout=_TIMEOUT_S))
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"stream_read still waiting after {_BOUND_S} s (request_timeout_s={_TIMEOUT_S})")
    assert done.returncode == 0, done.stderr
    assert "ObjectStoreError:" in done.stdout, done.stdout + done.stderr
    assert "s3://stalled/run/step_1/model.bin" in done.stdout
    assert "request_timeout_s" in done.stdout
    assert "check that the endpoint is up" in done.stdout, done.stdout  # and what to do about it


def test_two_streams_of_one_memory_object_each_read_all_of_it() -> None:
    """fsspec's memory:// open for reading hands out the stored file itself: a second reader's open moved the
    first one's position, and the first read the start of the object twice (a `verify` beside a load)."""
    from pathlib import Path

    from torch_checkpointing.storage.base_storage import ReadArgs
    from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

    storage = FsspecStorage(FsspecStorageConfig(url=f"memory://round35-{threading.get_ident()}-streams"))
    data = bytes(range(256)) * 16
    storage.write(Path("model.bin"), data)
    args = ReadArgs(pre_read_full_file=False)
    with storage.stream_read(Path("model.bin"), args) as first:
        head = first.read(1000)
        with storage.stream_read(Path("model.bin"), args) as second:
            assert second.read(len(data) + 1) == data
        assert head + first.read(len(data)) == data
