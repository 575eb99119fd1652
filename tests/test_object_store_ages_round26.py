"""gc's age of another host's leftover on Azure and GCS, read from the info dicts adlfs and gcsfs return.

gc keeps a trash it cannot tie to a live process (another host's) until it is `unowned_after_s` old, and on an
object store that age is the newest modification time of the objects under its prefix. Only s3fs's spelling
(`LastModified`, a datetime) and a numeric `mtime` were read: adlfs names it `last_modified` (a datetime) and
gcsfs `updated` (an RFC 3339 string; newer releases add `mtime` as a datetime). There the age was 0 for ever
and another host's trash was never collected. The stores below are fsspec memory filesystems under the `gs`
and `az` protocols whose listings carry exactly those fields, read through the same `FsspecStorage` path.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.names import host_tag, trash_name
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

HOUR_AGO = time.time() - 3600.0
_WHEN = datetime.datetime.fromtimestamp(HOUR_AGO, tz=datetime.timezone.utc)
_RFC3339 = _WHEN.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"  # as the GCS JSON API writes `updated`


def _adlfs(info: dict[str, Any]) -> dict[str, Any]:
    return {**info, "last_modified": _WHEN, "creation_time": _WHEN}


def _gcsfs_old(info: dict[str, Any]) -> dict[str, Any]:
    return {**info, "updated": _RFC3339, "timeCreated": _RFC3339}


def _gcsfs_new(info: dict[str, Any]) -> dict[str, Any]:
    return {**_gcsfs_old(info), "mtime": _WHEN, "ctime": _WHEN}


class _StampedFS(MemoryFileSystem):  # type: ignore[misc]
    """A memory filesystem whose file entries carry another library's time fields (and not memory's own)."""

    protocol: ClassVar[tuple[str, ...]] = ("gs",)
    cachable = False
    stamp: ClassVar[Callable[[dict[str, Any]], dict[str, Any]]] = staticmethod(_adlfs)

    def _stamped(self, info: dict[str, Any]) -> dict[str, Any]:
        if info.get("type") != "file":
            return info
        if ".clock-probe-" in info["name"]:  # gc's probe of the store's clock, written now: stamped now
            return {**info, "mtime": info["created"]}
        return type(self).stamp({k: v for k, v in info.items() if k != "created"})

    def _as_bucket_key(self, info: dict[str, Any]) -> dict[str, Any]:
        return self._stamped({**info, "name": info["name"].lstrip("/")})  # `bucket/key`, as those libraries name

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        found = super().ls(path, detail=True, **kwargs)
        return [self._as_bucket_key(i) for i in found] if detail else [i["name"].lstrip("/") for i in found]

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        detail = kwargs.pop("detail", False)
        found = super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=True, **kwargs)
        out = {name.lstrip("/"): self._as_bucket_key(info) for name, info in found.items()}
        return out if detail else sorted(out)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._as_bucket_key(super().info(path, **kwargs))


def _store(protocol: str, stamp: Callable[[dict[str, Any]], dict[str, Any]]) -> type[_StampedFS]:
    return type(f"Stamped_{protocol}", (_StampedFS,), {"protocol": (protocol,), "stamp": staticmethod(stamp)})


@pytest.mark.parametrize(
    ("protocol", "stamp"),
    [("az", _adlfs), ("gs", _gcsfs_old), ("gs", _gcsfs_new)],
    ids=["adlfs-last_modified", "gcsfs-updated", "gcsfs-mtime"],
)
def test_gc_ages_another_hosts_trash_by_the_stores_own_time_field(
    protocol: str, stamp: Callable[[dict[str, Any]], dict[str, Any]], tmp_path: Path
) -> None:
    fs = _store(protocol, stamp)()
    bucket = f"ages-{protocol}-{stamp.__name__.strip('_')}-{time.monotonic_ns()}"
    other = "0badc0de" if host_tag() != "0badc0de" else "0badc0df"
    trash = trash_name("step_1", 4242, "abcdef01", other)
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(tmp_path / "step_1"), {"model": {"w": torch.ones(4)}})
    for file in sorted((tmp_path / "step_1").iterdir()):  # a committed checkpoint that another host moved aside
        fs.pipe(f"/{bucket}/run/{trash}/{file.name}", file.read_bytes())
    storage = FsspecStorageConfig(url=f"{protocol}://{bucket}", filesystem=fs).create_storage()
    root = f"{protocol}://{bucket}/run"
    changed = storage.changed_at(Path(f"{root}/{trash}"))
    assert changed is not None and abs(changed - HOUR_AGO) < 1.0, (changed, HOUR_AGO)
    report = collect_garbage(root, storage, unowned_after_s=60)
    assert [lo.path for lo in report.removed] == [f"{root}/{trash}"], report
    assert fs.find(f"/{bucket}/run") == []
