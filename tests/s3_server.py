"""A real S3 API server on loopback for the object-storage tests: moto's standalone server in a subprocess.

The tests start and stop it themselves (a session fixture), on a port picked at run time, every step bounded
by a timeout. Nothing here mocks an S3 call: the storage talks HTTP to a server process, exactly as it would
to a real store. A subprocess (not moto's in-process thread) keeps the server off the test process's GIL and
lets spawned writer processes and ranks reach it too.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.memory_storage import free_port
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

__all__ = [
    "TEST_PART_SIZE",
    "RecordingStorageConfig",
    "S3Server",
    "SlowPartsStorageConfig",
    "instrumented_s3",
    "logged_gets",
    "missing_s3_packages",
    "s3_server",
    "start_s3_server",
]

TEST_PART_SIZE = 5 << 20  # S3's smallest part: small test files still take the multipart path
_START_TIMEOUT_S = 90.0  # ends once the server answers; moto's imports take seconds, more under coverage
_STOP_TIMEOUT_S = 10.0


def missing_s3_packages() -> list[str]:
    """The packages the S3 tests need that are not installed (the `s3` and `test` extras pull them in)."""
    wanted = {"fsspec": "fsspec", "s3fs": "s3fs", "moto": "moto[server]", "flask": "moto[server]"}
    return sorted({pkg for mod, pkg in wanted.items() if importlib.util.find_spec(mod) is None})


@dataclass
class S3Server:
    """A running moto server; `config()` gives a storage config (with a fresh bucket) that reaches it."""

    port: int
    process: subprocess.Popen[bytes]
    log_path: str

    @property
    def endpoint(self) -> str:
        """The server's URL; a test that puts a proxy in front of it uses `port`."""
        return f"http://127.0.0.1:{self.port}"

    def client_env(self) -> dict[str, str]:
        """The environment variables a job on a real store would have (its ranks and writer processes inherit
        them): this server's endpoint and the test credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def storage_options(self) -> dict[str, Any]:
        return {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
            "skip_instance_cache": True,
        }

    def config(self, bucket: str | None = None, **kwargs: Any) -> FsspecStorageConfig:
        """A config for `s3://<bucket>` (a new bucket unless one is named); kwargs go to the config."""
        name = bucket or f"ckpt-{uuid.uuid4().hex[:12]}"
        kwargs.setdefault("part_size", TEST_PART_SIZE)
        config = FsspecStorageConfig(url=f"s3://{name}", storage_options=self.storage_options(), **kwargs)
        if bucket is None:
            self.make_bucket(name)
        return config

    def make_bucket(self, name: str) -> None:
        storage = FsspecStorage(FsspecStorageConfig(protocol="s3", storage_options=self.storage_options()))
        storage.fs.call_s3("create_bucket", Bucket=name)  # us-east-1: no location constraint

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(_STOP_TIMEOUT_S)


def instrumented_s3(storage_options: dict[str, Any], **hooks: Any) -> Any:
    """An `InstrumentedS3FileSystem` reaching the same server as `storage_options`; see its docstring for hooks."""
    from tests.s3_instrumented import InstrumentedS3FileSystem  # s3fs is an optional extra

    return InstrumentedS3FileSystem(**storage_options, **hooks)


def logged_gets(gets_log: str | Path, pid: int | None = None) -> list[tuple[str, int, int]]:
    """(key, start, end) of the GETs an `InstrumentedS3FileSystem` logged, of one process when `pid` is given."""
    if not Path(gets_log).exists():
        return []
    rows = [line.split("\t") for line in Path(gets_log).read_text().splitlines() if line]
    return [(key, int(a), int(b)) for p, key, a, b in rows if pid is None or int(p) == pid]


@dataclass
class SlowPartsStorageConfig(FsspecStorageConfig):
    """The real S3 storage, pausing after each uploaded part and touching `signal_file` once one is up.

    For kill tests: the killer waits for the signal file, so the kill lands while an upload is in flight. The
    uploads themselves are real requests to the server.
    """

    signal_file: str = ""
    part_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.filesystem is None:
            self.filesystem = instrumented_s3(
                self.storage_options, signal_file=self.signal_file, part_delay_s=self.part_delay_s
            )
        super().__post_init__()


@dataclass
class RecordingStorageConfig(FsspecStorageConfig):
    """The real storage, recording the (object, start, end) of every GET it issues: in `storage.gets` within
    the process, and in the file `gets_log` (if set) across processes (see `logged_gets`)."""

    gets_log: str = ""

    def __post_init__(self) -> None:
        if self.filesystem is None:
            self.filesystem = instrumented_s3(self.storage_options, gets_log=self.gets_log)
        super().__post_init__()

    def create_storage(self) -> FsspecStorage:
        return _RecordingStorage(self)


class _RecordingStorage(FsspecStorage):
    def __init__(self, config: FsspecStorageConfig) -> None:
        super().__init__(config)
        self._since = len(self.fs.gets)  # the config's filesystem, shared by every storage built from it

    @property
    def gets(self) -> list[tuple[str, int, int]]:
        """The GETs issued since this storage was built."""
        return self.fs.gets[self._since :]  # type: ignore[no-any-return]


def _ready(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


def start_s3_server(log_dir: str, attempts: int = 3, env: dict[str, str] | None = None) -> S3Server:
    """Start `python -m moto.server` on 127.0.0.1 and a free port; retried if another process takes the port.
    `env`: the server's environment (a skewed clock: `tests/clock_skew.py`), this process's by default."""
    last = ""
    for _ in range(attempts):
        port = free_port()
        log_path = os.path.join(log_dir, f"moto-{port}.log")
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={
                    **(os.environ if env is None else env),
                    "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing",
                },
            )
        server = S3Server(port, process, log_path)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None:
            if _ready(server.endpoint):
                return server
            time.sleep(0.1)
        server.stop()
        with open(log_path, "rb") as log:
            last = log.read()[-2000:].decode("utf-8", "replace")
    raise RuntimeError(f"moto server did not start after {attempts} attempts; last log:\n{last}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto server for the test session; tests/conftest.py registers it (`pytest_plugins`): name it to use it."""
    missing = missing_s3_packages()
    if missing:
        pytest.skip(f"the S3 tests need {', '.join(missing)}: pip install 'torch-checkpointing[s3,test]'")
    server = start_s3_server(str(tmp_path_factory.mktemp("moto")))
    try:
        yield server
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    """Run a server until interrupted, printing the environment that points a process at it.

    For running the conformance suite or the simulator against S3 by hand:
    ``python -m tests.s3_server --bucket ckpt`` then, in another shell, the printed exports and
    ``pytest conformance --storage-url s3://ckpt/run``.
    """
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m tests.s3_server", description="Run a local S3 server (moto).")
    parser.add_argument("--bucket", default="conformance", help="bucket to create (default: conformance)")
    args = parser.parse_args(argv)
    missing = missing_s3_packages()
    if missing:
        print(f"needs {', '.join(missing)}: pip install 'torch-checkpointing[s3,test]'", file=sys.stderr)
        return 2
    server = start_s3_server(tempfile.mkdtemp(prefix="moto-"))
    try:
        server.make_bucket(args.bucket)
        print("export " + " ".join(f"{k}={v}" for k, v in server.client_env().items()))
        print(f"# bucket s3://{args.bucket} (server log {server.log_path}); Ctrl-C stops it", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while server.process.poll() is None:
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
