"""A whole read on S3 (`read()`, and a manifest's `read_sized`) from a store that ignores `If-Match`.

The read sizes the object by a HEAD, then GETs that many bytes held to the HEAD's ETag (`If-Match`). A store that
does not honour the condition (some S3-compatible servers, proxies) answers with the version there now: replaced
by a larger one in between, its first bytes came back as the whole old object, silently. The GET's answer names
the version it served (its `ETag`): one that is not the HEAD's is read again, as a refused condition is.
The replace is a real PUT to the real server, made between the read's HEAD and its GET.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.s3_server import S3Server
from tests.test_s3_manifest_one_version_round35 import _GrownBeforeGet
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

pytest.importorskip("s3fs")


class _IgnoresIfMatch(_GrownBeforeGet):
    """`_GrownBeforeGet` on a store that ignores a GET's `If-Match` (the client sends none)."""

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "get_object":
            kwargs.pop("IfMatch", None)
        return await super()._call_s3(method, *args, **kwargs)


@pytest.mark.parametrize("how", ["read", "read_sized"])
def test_a_read_from_a_store_ignoring_if_match_is_one_version(s3_server: S3Server, how: str) -> None:
    config = s3_server.config()
    key = f"{config.url.removeprefix('s3://')}/run/blob.bin"
    old, new = b"a" * 1000, b"b" * 2000
    config.create_storage().write(Path("run/blob.bin"), old)
    racing = FsspecStorageConfig(
        url=config.url,
        part_size=config.part_size,
        filesystem=_IgnoresIfMatch(**config.storage_options, victim=key, replacement=new),
    )
    storage = racing.create_storage()
    if how == "read":
        data = storage.read(Path("run/blob.bin"))
    else:
        size, got = storage.read_sized(Path("run/blob.bin"), 10_000)
        assert got is not None and size == len(got), (size, got if got is None else len(got))
        data = got
    assert racing.filesystem.replaced
    assert data in (old, new), (len(data), data[:4])
