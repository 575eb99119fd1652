"""`torch_checkpointing.__all__` says exactly what is public, and every name in it is importable and documented.

Also: the names the published release exposed at the top level stay importable (not in `__all__`), and
importing the package starts no process and no thread.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from typing import Any

import pytest

import torch_checkpointing
from tests.probes import fresh_json, modules_after, run_fresh

PUBLIC = sorted(torch_checkpointing.__all__)

# API_SURFACE §1: importable from the top level for old code; internals, so not in `__all__`.
COMPATIBILITY = [
    "Barrier",
    "BarrierConfig",
    "TCPStoreBarrier",
    "TCPStoreBarrierConfig",
    "make_async_checkpoint_saver",
    "make_sync_checkpoint_saver",
    "CheckpointLoader",
    "AsyncCheckpointSaver",
    "CheckpointSaver",
    "SyncCheckpointSaver",
    "CheckpointWriter",
    "CheckpointMetadata",
    "DistributedMetadata",
    "GlobalObjectMetadata",
    "ItemMetadata",
    "_PlacementSpec",
    "DeviceMeshSpec",
    "DTensorShardingMetadata",
    "get_device_mesh_spec",
    "ReplicateSpec",
    "ShardSpec",
    "DefaultMetadataManager",
    "MetadataManager",
    "LoadPlan",
    "ReshardingInfo",
    "CheckpointStager",
    "DefaultStager",
    "RankInfo",
    "STATE_DICT",
]
# What user code needs, from the top level (the list; FsspecStorageConfig joins when it exists).
REQUIRED_PUBLIC = [
    "CheckpointManager",
    "ItemSpec",
    "LayoutInfo",
    "TorchSerialization",
    "JsonSerialization",
    "RawSerialization",
    "SafetensorsSerialization",
    "Resharder",
    "DTensorResharder",
    "DefaultResharder",
    "LocalFileSystemStorageConfig",
    "FsspecStorageConfig",
    "SyncCheckpointSaverConfig",
    "AsyncCheckpointSaverConfig",
    "CheckpointLoaderConfig",
    "CheckpointError",
    "__version__",
    "get_version",
    "Version",
]
INTERNALS = ["TCPStoreBarrier", "TCPStoreBarrierConfig", "_PlacementSpec", "CheckpointWriter", "DefaultStager"]


def _own_docstring(obj: Any) -> str | None:
    """The docstring the object itself declares (not a dataclass's generated signature, not a base's)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not doc or not doc.strip():
        return None
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc.startswith(obj.__name__ + "("):
        return None  # dataclasses write "Name(field: type = ...)" when the class has no docstring
    return str(doc)


def test_all_is_sorted_unique_and_public() -> None:
    assert len(set(torch_checkpointing.__all__)) == len(torch_checkpointing.__all__)
    private = [n for n in PUBLIC if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]
    assert private == []
    assert [n for n in INTERNALS if n in PUBLIC] == []


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_is_importable_and_documented(name: str) -> None:
    module = importlib.import_module("torch_checkpointing")
    obj = getattr(module, name)
    if name == "__version__":
        assert isinstance(obj, str) and obj
        return
    assert _own_docstring(obj), f"torch_checkpointing.{name} has no docstring of its own"


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, Any] = {}
    exec("from torch_checkpointing import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == PUBLIC


@pytest.mark.parametrize("name", REQUIRED_PUBLIC)
def test_user_facing_names_are_public(name: str) -> None:
    assert name in PUBLIC


@pytest.mark.parametrize("name", COMPATIBILITY)
def test_published_release_names_stay_importable(name: str) -> None:
    assert hasattr(torch_checkpointing, name)


def test_every_checkpoint_error_is_public() -> None:
    """Callers catch these by name: each `CheckpointError` subclass the package defines is in `__all__`."""
    for info in pkgutil.walk_packages(torch_checkpointing.__path__, "torch_checkpointing."):
        if not info.name.endswith(".__main__"):  # running it would parse pytest's argv
            importlib.import_module(info.name)
    seen: list[type] = [torch_checkpointing.CheckpointError]
    found = set()
    while seen:
        cls = seen.pop()
        seen.extend(cls.__subclasses__())
        if cls.__module__.startswith("torch_checkpointing.") and not cls.__name__.startswith("_"):
            found.add(cls.__name__)
    assert sorted(found - set(PUBLIC)) == []


def test_default_resharder_is_the_dtensor_resharder() -> None:
    assert torch_checkpointing.DefaultResharder is torch_checkpointing.DTensorResharder


def test_public_names_are_the_module_objects() -> None:
    """The top level re-exports; it does not define look-alikes."""
    from torch_checkpointing.checkpoint_layout import LayoutInfo
    from torch_checkpointing.dtensor_resharder import DTensorResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    assert torch_checkpointing.LayoutInfo is LayoutInfo
    assert torch_checkpointing.DTensorResharder is DTensorResharder
    assert torch_checkpointing.LocalFileSystemStorageConfig is LocalFileSystemStorageConfig


def test_import_starts_no_process_and_no_thread() -> None:
    code = (
        "import multiprocessing, threading\n"
        "before = threading.active_count()\n"
        "import torch_checkpointing\n"
        "for name in dir(torch_checkpointing): getattr(torch_checkpointing, name)  # every lazy name imported\n"
        "assert multiprocessing.active_children() == [], multiprocessing.active_children()\n"
        "assert threading.active_count() == before, threading.enumerate()\n"
    )
    run_fresh(code)


def test_package_import_is_lazy_and_every_top_level_name_resolves() -> None:
    """Names load on first use (PEP 562): the bare import loads no torch, and every public and published name,
    looked up in a fresh interpreter, comes from its module and is listed by dir()."""
    names = PUBLIC + COMPATIBILITY
    code = (
        "import json, sys\n"
        "import torch_checkpointing as t\n"
        "bare = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch_checkpointing.'))\n"
        f"names = {names!r}\n"
        "where = {n: getattr(getattr(t, n), '__module__', None) for n in names}\n"
        "print(json.dumps({'bare': bare, 'where': where, 'dir': dir(t)}))\n"
    )
    report = fresh_json(code)
    # Only the two pure-Python leaves: the version, and the errors (whose names the lazy table takes from there).
    assert report["bare"] == ["torch_checkpointing.errors", "torch_checkpointing.version"]
    assert [n for n in names if n not in report["dir"]] == []
    assert sorted(report["where"]) == sorted(names)  # getattr raised on none of them
    assert report["where"]["CheckpointManager"] == "torch_checkpointing.checkpoint_manager"


def test_unknown_top_level_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        torch_checkpointing.NoSuchThing  # noqa: B018
    assert torch_checkpointing.errors.CommitError is torch_checkpointing.CommitError  # submodules resolve too


def test_writer_process_module_loads_only_the_write_path() -> None:
    """The spawned writer imports `checkpoint_process` (to unpickle its entry point): not the manager, loader,
    resharders, barriers or retention, which it never runs."""
    loaded = {
        m
        for m in modules_after("import torch_checkpointing.checkpoint_process")
        if m.startswith("torch_checkpointing.")
    }
    not_needed = [
        "checkpoint_manager",
        "checkpoint_loader",
        "checkpoint_saver",
        "dtensor_resharder",
        "barriers",
        "retention",
        "discovery",
        "source_reader",
        "hf",
        "cli",
    ]
    assert [m for m in not_needed if f"torch_checkpointing.{m}" in loaded] == []
    assert "torch_checkpointing.checkpoint_writer" in loaded


def test_writer_pid_names_the_async_writer_process(tmp_path: Any) -> None:
    """The read-only pid for monitoring: the writer process of an async manager, None for a sync one."""
    import os

    from torch_checkpointing import CheckpointManager, LocalFileSystemStorageConfig

    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as sync_manager:
        assert sync_manager.writer_pid is None
    config = CheckpointManager.Config.with_async_save()
    config.storage_config = storage
    with CheckpointManager(config) as manager:
        written = manager.save(str(tmp_path / "step_1"), {"x": 1})
        assert written is not None
        written.result(timeout=120)  # the writer is up: it wrote this checkpoint
        pid = manager.writer_pid
        assert isinstance(pid, int) and pid != os.getpid()
        with open(f"/proc/{pid}/stat") as stat:  # a child of this process (the spawned writer)
            assert int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
