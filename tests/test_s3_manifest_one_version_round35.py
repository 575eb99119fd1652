"""A checkpoint's manifest on S3 is read as one version of the object.

Its size came from a HEAD and its bytes from a later ranged GET of that many bytes: a manifest replaced between
the two (the id saved again after a delete, another process's move putting a copy back) was read as the first
bytes of the new version, a truncated JSON, and a healthy checkpoint was refused as damaged (or, replaced by a
smaller one, as a read that failed). The replace here is a real server-side copy, made between the HEAD and
the GET of the load's own requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec.asyn
import pytest
import s3fs
import torch

from tests.s3_server import S3Server
from tests.test_s3_attacks import sync_manager
from torch_checkpointing.manifest import MANIFEST_FILE_NAME
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

pytest.importorskip("s3fs")


class _ReplacedAfterHead(s3fs.S3FileSystem):  # type: ignore[misc]
    """Before the first GET of `victim`'s manifest (after the HEAD that sized it), copies every object of `source`
    over `victim` (a real server-side copy, the manifest last), as a save of the id in another process would."""

    def __init__(self, *args: Any, source: str = "", victim: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source, self.victim, self.replaced = source, victim, False
        self.manifest = f"{victim.split('/', 1)[1]}/{MANIFEST_FILE_NAME}"  # its key, without the bucket

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "get_object" and not self.replaced and kwargs.get("Key", "").endswith(self.manifest):
            self.replaced = True  # the read has sized the manifest (a HEAD, or this GET's own answer)
            keys = sorted(await self._find(self.source), key=lambda k: k.endswith(MANIFEST_FILE_NAME))
            for key in keys:
                await self._cp_file(key, self.victim + key[len(self.source) :])
        return await super()._call_s3(method, *args, **kwargs)

    def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """s3fs's own `call_s3` wraps its `_call_s3`, not this one's."""
        return fsspec.asyn.sync(self.loop, self._call_s3, method, *args, **kwargs)


def _state(seed: float, items: int) -> dict[str, Any]:
    """`items` items (a manifest record each), every tensor full of `seed`."""
    return {f"layer_{i}": {"w": torch.full((100,), seed)} for i in range(items)}


@pytest.mark.parametrize("items", [1, 5], ids=["smaller", "larger"])
def test_a_manifest_replaced_between_its_head_and_its_get_loads_one_version(s3_server: S3Server, items: int) -> None:
    config = s3_server.config()
    bucket = config.url.removeprefix("s3://")
    with sync_manager(config) as manager:
        manager.save("run/step_1", _state(1.0, 3))
        manager.save("run/step_2", _state(2.0, items))
    storage = config.create_storage()
    sizes = [storage.getsize(Path(f"run/step_{n}/{MANIFEST_FILE_NAME}")) for n in (1, 2)]
    assert sizes[0] != sizes[1], sizes  # the race is one a reader can tell

    racing = FsspecStorageConfig(
        url=config.url,
        part_size=config.part_size,
        filesystem=_ReplacedAfterHead(
            **config.storage_options, source=f"{bucket}/run/step_2", victim=f"{bucket}/run/step_1"
        ),
    )
    with sync_manager(racing) as manager:
        loaded = manager.load("run/step_1")
    assert racing.filesystem.replaced
    seed = float(loaded["layer_0"]["w"][0])
    assert seed in (1.0, 2.0), seed
    assert sorted(loaded) == sorted(_state(seed, 3 if seed == 1.0 else items)), sorted(loaded)
    assert all(bool((item["w"] == seed).all()) for item in loaded.values())


class _GrownBeforeGet(s3fs.S3FileSystem):  # type: ignore[misc]
    """Before the first GET of `victim`, PUTs `replacement` over it (a real PUT): after the read's HEAD."""

    def __init__(self, *args: Any, victim: str = "", replacement: bytes = b"", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.victim, self.replacement, self.replaced = victim, replacement, False

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if (
            method == "get_object"
            and not self.replaced
            and f"{kwargs.get('Bucket')}/{kwargs.get('Key')}" == self.victim
        ):
            self.replaced = True
            await self._pipe_file(self.victim, self.replacement)
        return await super()._call_s3(method, *args, **kwargs)

    def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return fsspec.asyn.sync(self.loop, self._call_s3, method, *args, **kwargs)


@pytest.mark.parametrize("grown", [True, False], ids=["larger", "smaller"])
def test_a_whole_read_of_an_object_replaced_after_its_head_is_one_version(s3_server: S3Server, grown: bool) -> None:
    """`read()` sized the object by a HEAD and fetched that many bytes: replaced by a larger one in between,
    it returned the new version's first bytes as the whole object, silently (a load without checksums took
    them for the tensor)."""
    config = s3_server.config()
    key = f"{config.url.removeprefix('s3://')}/run/blob.bin"
    old, new = b"a" * 1000, b"b" * (2000 if grown else 500)
    config.create_storage().write(Path("run/blob.bin"), old)
    racing = FsspecStorageConfig(
        url=config.url,
        part_size=config.part_size,
        filesystem=_GrownBeforeGet(**config.storage_options, victim=key, replacement=new),
    )
    data = racing.create_storage().read(Path("run/blob.bin"))
    assert racing.filesystem.replaced
    assert data in (old, new), (len(data), data[:4])
