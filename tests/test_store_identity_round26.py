"""A storage built from the environment reaches the store the environment names when it is built.

`fsspec.filesystem("s3")` hands back one cached filesystem per set of options, and the options of a store
configured from the environment are empty: a process that built a storage for one endpoint, changed
AWS_ENDPOINT_URL (or its credentials) and built another got the first store's client. A process talking to two
stores (a copy from one to the other, a test harness, a notebook) then read and wrote the wrong one, silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.s3_server import S3Server, missing_s3_packages, start_s3_server
from torch_checkpointing.discovery import storage_for
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")

_BUCKET = "one-name-on-two-stores"


@pytest.fixture
def second_server(tmp_path: Path) -> Iterator[S3Server]:
    server = start_s3_server(str(tmp_path))
    try:
        yield server
    finally:
        server.stop()


def _point_at(monkeypatch: pytest.MonkeyPatch, server: S3Server) -> None:
    for name, value in server.client_env().items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("build", ["storage_for", "config"])
def test_a_storage_built_after_the_endpoint_changed_reaches_the_new_store(
    s3_server: S3Server, second_server: S3Server, monkeypatch: pytest.MonkeyPatch, build: str
) -> None:
    """Defect: the second storage wrote into the first store (the marker below appeared there, not in B)."""
    for server in (s3_server, second_server):
        server.make_bucket(_BUCKET)
    marker = Path(f"s3://{_BUCKET}/run/marker")

    def storage() -> Storage:
        if build == "storage_for":
            return storage_for(f"s3://{_BUCKET}/run")
        return FsspecStorageConfig(protocol="s3").create_storage()

    _point_at(monkeypatch, s3_server)
    first = storage()
    assert not first.exists(marker)  # in use before the switch, as a job's storage is
    _point_at(monkeypatch, second_server)
    second = storage()
    second.write(marker, b"B")
    assert not first.exists(marker), "the storage built for the first endpoint sees the second store's object"
    _point_at(monkeypatch, s3_server)
    assert not storage().exists(marker), "a storage built for the first endpoint again reached the second store"
    _point_at(monkeypatch, second_server)
    assert storage().read(marker) == b"B"


def test_a_storage_first_used_after_the_endpoint_changed_still_reaches_its_own_store(
    s3_server: S3Server, second_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: botocore read AWS_ENDPOINT_URL at the storage's first request, not when it was built, so a
    manager's storage built for A and first used once the variable named B wrote into B."""
    for server in (s3_server, second_server):
        server.make_bucket(_BUCKET)
    marker = Path(f"s3://{_BUCKET}/run/first-use")
    _point_at(monkeypatch, s3_server)
    built_for_a = storage_for(f"s3://{_BUCKET}/run")
    _point_at(monkeypatch, second_server)
    built_for_a.write(marker, b"A")
    assert not storage_for(f"s3://{_BUCKET}/run").exists(marker), "the object landed in B"
    _point_at(monkeypatch, s3_server)
    assert storage_for(f"s3://{_BUCKET}/run").read(marker) == b"A"


def test_storages_of_one_store_share_one_client(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect (of the first fix above, which gave every storage a filesystem of its own): each storage_for(),
    latest_checkpoint() and manager on S3 set up a new client, 170-200 ms each (storage_for + exists: 6 ms
    before, 80 ms after, on the test server). Storages naming one store, in one environment, share one client;
    a changed environment (the test above) or other options get another."""
    _point_at(monkeypatch, s3_server)
    s3_server.make_bucket(_BUCKET)

    def client(storage: Storage) -> object:
        return storage._backend("s3").fs  # type: ignore[attr-defined]

    first = client(storage_for(f"s3://{_BUCKET}/run"))
    assert client(storage_for(f"s3://{_BUCKET}/other")) is first
    assert client(FsspecStorageConfig(protocol="s3").create_storage()) is first
    assert client(FsspecStorageConfig(protocol="s3", storage_options={"anon": False}).create_storage()) is not first
    monkeypatch.setenv("AWS_PROFILE", "another")
    assert client(storage_for(f"s3://{_BUCKET}/run")) is not first  # credentials chosen by the environment
