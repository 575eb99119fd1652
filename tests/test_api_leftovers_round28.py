"""Round 28: public-API leftovers.

* A listing under an fsspec `file://` root named each checkpoint `file://tmp/run/step_1`: the path lost its
  leading slash (the URL names host `tmp`), so the `CheckpointInfo.path` a resume hands to `load`, the CLI or
  fsspec named another place.
* The public `from_dict` of the sharding records (`DTensorShardingMetadata`, `DeviceMeshSpec`, the placements,
  `GlobalObjectMetadata`, `DistributedItemMetadata`, `DistributedMetadata`) given a dict that lacks a field raised
  a bare `KeyError: 'global_shape'`, one whose `type` is a list `TypeError: unhashable type`, and every other
  bad value a plain `ValueError`: each is now a `ConfigError` naming the field.
* The sharding records' constructors took anything: `DeviceMeshSpec("cpu", 2, [0, 1])` raised "'int' object is
  not iterable", `DTensorShardingMetadata(4, ...)` "object of type 'int' has no len()", one given a mesh dict
  an AttributeError about `mesh_shape`, `ShardSpec("a")` built and failed later comparing 'int' and 'str',
  `get_device_mesh_spec("cpu", [[2]], ...)` "unhashable type", and `DistributedMetadata({}, 10**12)` tried to
  build a set of 10**12 ranks. Each now refuses its argument naming the field; lists are taken as the tuples
  the fields are (a list-built record compared unequal to, and hashed unlike, the tuple-built one).
* Retention under an fsspec `file://` root deleted nothing (see its test).
* `DTensorShardingMetadata.replicated(t, 10**9)` built a tuple of 10**9 ranks; `DeviceMeshSpec.from_mesh` took a
  float tensor (truncating its ranks), split a str of names into letters, and raised AttributeError for a
  list; `compute_local_shard_info` of a rank outside the mesh was a plain ValueError; `should_reshard` given no
  metadata an AttributeError about `items`.
"""

from __future__ import annotations

import copy
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import (
    CheckpointError,
    CheckpointManager,
    ConfigError,
    FsspecStorageConfig,
    RetentionPolicy,
    latest_checkpoint,
    list_checkpoints,
)
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.distributed_metadata import (
    CheckpointMetadata,
    DistributedItemMetadata,
    DistributedMetadata,
    GlobalObjectMetadata,
    ShardingMetadata,
)
from torch_checkpointing.dtensor_metadata import (
    DeviceMeshSpec,
    DTensorShardingMetadata,
    ShardSpec,
    StridedShardSpec,
    get_device_mesh_spec,
)
from torch_checkpointing.dtensor_resharder import DTensorResharder, compute_local_shard_info
from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.storage import local_path_of


def _file_url_run(tmp_path: Path) -> tuple[str, FsspecStorageConfig]:
    url = f"file://{tmp_path / 'run'}"
    config = FsspecStorageConfig(url=url)
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
        m.save(f"{url}/step_1", {"model": {"w": torch.ones(2)}})
    return url, config


def test_a_checkpoint_listed_under_a_file_url_root_keeps_its_absolute_path(tmp_path: Path) -> None:
    url, config = _file_url_run(tmp_path)
    storage = config.create_storage()
    latest = latest_checkpoint(url, storage=storage)
    assert latest is not None
    assert latest.path == f"{url}/step_1"
    assert local_path_of(latest.path) == str(tmp_path / "run" / "step_1")
    assert [c.path for c in list_checkpoints(url, storage=storage)] == [f"{url}/step_1"]


def test_a_leftover_under_a_file_url_root_is_named_by_its_absolute_path(tmp_path: Path) -> None:
    url, config = _file_url_run(tmp_path)
    (tmp_path / "run" / ".old_step_1_999999").mkdir()  # what a replace killed between its renames leaves
    leftovers = list_leftovers(url, storage=config.create_storage())
    assert [lo.path for lo in leftovers] == [f"{url}/.old_step_1_999999"]


def test_a_listing_warning_under_a_file_url_root_names_the_absolute_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, config = _file_url_run(tmp_path)
    damaged = tmp_path / "run" / "step_3"
    damaged.mkdir()
    (damaged / "manifest.json").write_bytes(b'{"kind": "torch_checkpointing.manifest", ')
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        list_checkpoints(url, storage=config.create_storage())
    skipped = [r.getMessage().split(",")[0] for r in caplog.records if r.getMessage().startswith("Skipping")]
    assert skipped == [f"Skipping {url}/step_3"]


_MESH = {"device_type": "cpu", "mesh_shape": [1], "mesh_data": [0], "mesh_dim_names": None}
_SHARDING = {"global_shape": [4], "dtype": "torch.float32", "stride": [1], "mesh_spec": _MESH, "placements": []}
_SHARDING["placements"] = [{"type": "Shard", "dim": 0}]
_PACKED = {"type": "DTensorShardingMetadata", "data": _SHARDING}
_GROUP = {"sharding_metadata": _PACKED, "ranks": [0]}
_ITEM = {"nested_path_to_metadata": {'["w"]': [_GROUP]}, "rank_to_layout_info": {"0": None}}
_RECORDS: list[tuple[str, Any, dict[str, Any]]] = [
    ("DTensorShardingMetadata", DTensorShardingMetadata.from_dict, _SHARDING),
    ("DeviceMeshSpec", DeviceMeshSpec.from_dict, _MESH),
    ("ShardSpec", ShardSpec.from_dict, {"type": "Shard", "dim": 0}),
    ("StridedShardSpec", StridedShardSpec.from_dict, {"type": "StridedShard", "dim": 0, "split_factor": 2}),
    ("GlobalObjectMetadata", GlobalObjectMetadata.from_dict, _GROUP),
    ("DistributedItemMetadata", DistributedItemMetadata.from_dict, _ITEM),
    (
        "DistributedMetadata",
        DistributedMetadata.from_dict,
        {"metadata": {"m": _ITEM}, "world_size": 1, "version": "3.0"},
    ),
    ("packed ShardingMetadata", ShardingMetadata._unpack, _PACKED),
]
_REQUIRED = [
    pytest.param(from_dict, good, field, id=f"{name}-{field}")
    for name, from_dict, good in _RECORDS
    for field in good
    if field not in ("type", "mesh_dim_names", "data") or (name == "packed ShardingMetadata" and field == "type")
]


@pytest.mark.parametrize(("from_dict", "good", "field"), _REQUIRED)
def test_a_sharding_record_without_a_field_is_a_config_error_naming_it(from_dict: Any, good: dict, field: str) -> None:
    from_dict(copy.deepcopy(good))  # the whole record reads
    record = {k: v for k, v in copy.deepcopy(good).items() if k != field}
    with pytest.raises(ConfigError, match=re.escape(repr(field))):
        from_dict(record)


_WRONG = [None, "x", -1, 10**30, [], [[1]], 1.5, True]


@pytest.mark.parametrize(
    ("from_dict", "good", "field"),
    [
        pytest.param(f, g, k, id=f"{n}-{k}")
        for n, f, g in _RECORDS
        for k in g
        if not (k == "type" and n != "packed ShardingMetadata")
    ],
)
def test_a_sharding_record_with_a_wrong_value_is_a_config_error_naming_the_field(
    from_dict: Any, good: dict, field: str
) -> None:
    for wrong in _WRONG:
        record = {**copy.deepcopy(good), field: wrong}
        try:
            from_dict(record)
        except ConfigError as exc:
            assert field in str(exc), (wrong, str(exc))
        except CheckpointError as exc:  # a name no engine writes (damage), or a newer engine's (a newer torch's dtype)
            assert field == "dtype" and field in str(exc), (wrong, str(exc))
        except Exception as exc:
            pytest.fail(f"{field}={wrong!r}: {type(exc).__name__}: {exc}")


_MESH_SPEC = DeviceMeshSpec("cpu", (2,), (0, 1))


def _sharding(**changed: Any) -> DTensorShardingMetadata:
    fields = {"global_shape": (4,), "dtype": "torch.float32", "stride": (1,), "mesh_spec": _MESH_SPEC}
    return DTensorShardingMetadata(**{**fields, "placements": (ShardSpec(0),), **changed})


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: ShardSpec("a"), "dim"),
        (lambda: ShardSpec(None), "dim"),
        (lambda: ShardSpec(True), "dim"),
        (lambda: StridedShardSpec(0, 0), "split_factor"),
        (lambda: StridedShardSpec("a", 2), "dim"),
        (lambda: StridedShardSpec(0, None), "split_factor"),
        (lambda: DeviceMeshSpec("cpu", 2, [0, 1]), "mesh_shape"),
        (lambda: DeviceMeshSpec("cpu", None, None), "mesh_shape"),
        (lambda: DeviceMeshSpec("cpu", (2,), None), "mesh_data"),
        (lambda: DeviceMeshSpec("cpu", (2,), (0, "a")), "mesh_data"),
        (lambda: DeviceMeshSpec("cpu", (1,), (-5,)), "mesh_data"),
        (lambda: DeviceMeshSpec("cpu", (-1, -1), (0,)), "mesh_shape"),
        (lambda: DeviceMeshSpec("cpu", (0,), ()), "mesh_shape"),
        (lambda: DeviceMeshSpec(3, (1,), (0,)), "device_type"),
        (lambda: DeviceMeshSpec("cpu", (1,), (0,), "dp"), "mesh_dim_names"),
        (lambda: DeviceMeshSpec("cpu", (1,), (0,), ("a", "b")), "mesh_dim_names"),
        (lambda: get_device_mesh_spec("cpu", 2, [0, 1]), "mesh_shape"),
        (lambda: get_device_mesh_spec("cpu", [[2]], [0, 1]), "mesh_shape"),
        (lambda: get_device_mesh_spec([], (1,), (0,)), "device_type"),
        (lambda: _sharding(global_shape=4), "global_shape"),
        (lambda: _sharding(global_shape=None), "global_shape"),
        (lambda: _sharding(global_shape=(-4,)), "global_shape"),
        (lambda: _sharding(stride=(1, 2)), "stride"),
        (lambda: _sharding(stride="1"), "stride"),
        (lambda: _sharding(dtype=None), "dtype"),
        (lambda: _sharding(dtype="bogus"), "dtype"),
        (lambda: _sharding(mesh_spec=None), "mesh_spec"),
        (lambda: _sharding(mesh_spec=_MESH_SPEC.to_dict()), "mesh_spec"),
        (lambda: _sharding(placements=ShardSpec(0)), "placements"),
        (lambda: _sharding(placements=None), "placements"),
        (lambda: _sharding(placements=("Shard",)), "placements"),
        (lambda: _sharding(placements=(ShardSpec("a"),)), "dim"),
        (lambda: GlobalObjectMetadata(None, (0,)), "sharding_metadata"),
        (lambda: GlobalObjectMetadata(_sharding(), 0), "ranks"),
        (lambda: GlobalObjectMetadata(_sharding(), (-1,)), "ranks"),
        (lambda: DistributedItemMetadata(None, {}), "nested_path_to_metadata"),
        (lambda: DistributedItemMetadata({}, None), "rank_to_layout_info"),
        (
            lambda: DistributedItemMetadata({("w",): [GlobalObjectMetadata(_sharding(), (0,))]}, {0: "w.pt"}),
            "rank_to_layout_info",
        ),
        (
            lambda: DistributedItemMetadata({("w",): GlobalObjectMetadata(_sharding(), (0,))}, {}),
            "nested_path_to_metadata",
        ),
        (lambda: DistributedItemMetadata({"ab": [GlobalObjectMetadata(_sharding(), (0,))]}, {}), "nested path"),
        (lambda: DistributedItemMetadata({0: [GlobalObjectMetadata(_sharding(), (0,))]}, {}), "nested path"),
        (lambda: DistributedMetadata(None, 1), "metadata"),
        (lambda: DistributedMetadata({"a": None}, 1), "metadata"),
        (lambda: DistributedMetadata({}, "1"), "world_size"),
        (lambda: DistributedMetadata({}, 0), "world_size"),
        (lambda: DistributedMetadata({}, -1), "world_size"),
        (lambda: DistributedMetadata({}, 1, version=3), "version"),
        (lambda: CheckpointMetadata(None), "distributed_metadata"),
        (lambda: CheckpointMetadata(DistributedMetadata({}, 1), [1]), "local_metadata"),
    ],
)
def test_a_sharding_record_built_from_a_wrong_argument_is_refused_naming_it(build: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        build()


def test_a_sharding_record_built_from_lists_equals_the_one_built_from_tuples() -> None:
    listed = DTensorShardingMetadata([4], "torch.float32", [1], DeviceMeshSpec("cpu", [2], [0, 1]), [ShardSpec(0)])
    assert listed == _sharding()
    assert hash(listed) == hash(_sharding())
    assert DTensorShardingMetadata.from_dict(listed.to_dict()) == listed
    assert GlobalObjectMetadata(listed, [0, 1]) == GlobalObjectMetadata(_sharding(), (0, 1))


_HUGE_WORLD = """
import resource, sys
from torch_checkpointing.distributed_metadata import DistributedMetadata
from torch_checkpointing.errors import ConfigError
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), vm + (512 << 20)))
try:
    DistributedMetadata({}, 10**12)
except ConfigError as exc:
    print("refused:", exc)
except MemoryError:
    print("MemoryError")
"""


def test_a_distributed_metadata_of_a_huge_world_size_is_refused_before_it_allocates() -> None:
    done = subprocess.run([sys.executable, "-c", _HUGE_WORLD], capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith("refused:") and "world_size" in done.stdout, done.stdout + done.stderr


def test_retention_under_a_file_url_root_deletes_what_it_does_not_keep(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Retention's delete renames a checkpoint to a trash name; on a `file://` root that rename copied each file
    to a directory not yet made and failed ("rename failed: [Errno 2] No such file or directory: '.../run/
    .step_1.trash-.../model_0.pt'"), so every checkpoint was kept and the disk filled, with a WARNING per save."""
    url = f"file://{tmp_path / 'run'}"
    storage = FsspecStorageConfig(url=url)
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(), storage_config=storage, retention=RetentionPolicy(keep_last=1)
    )
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"), CheckpointManager(config) as manager:
        for step in (1, 2, 3):
            manager.save(f"{url}/step_{step}", {"model": {"w": torch.full((2,), float(step)), "b": [torch.ones(1)]}})
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_3"]
    assert [c.path for c in list_checkpoints(url, storage=storage.create_storage())] == [f"{url}/step_3"]
    assert not [r.getMessage() for r in caplog.records if "could not delete" in r.getMessage()]


_HUGE_REPLICATED = """
import resource, torch
from torch_checkpointing.dtensor_metadata import DTensorShardingMetadata
from torch_checkpointing.errors import ConfigError
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
try:
    DTensorShardingMetadata.replicated(torch.ones(2), 10**9)
except ConfigError as exc:
    print("refused:", exc)
except MemoryError:
    print("MemoryError")
"""


def test_replicated_metadata_of_a_world_size_no_save_can_have_is_refused_before_it_allocates() -> None:
    done = subprocess.run([sys.executable, "-c", _HUGE_REPLICATED], capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith("refused:") and "world_size" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("mesh", "names", "field"),
    [
        ([[0, 1]], None, "mesh"),
        (None, None, "mesh"),
        (torch.tensor([0.5, 1.0]), None, "mesh"),  # was truncated to ranks (0, 1)
        (torch.tensor([[0, 1]]), "dp", "mesh_dim_names"),  # was split into ('d', 'p')
    ],
)
def test_a_mesh_from_no_integer_rank_tensor_or_str_names_is_refused_naming_it(
    mesh: Any, names: Any, field: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        DeviceMeshSpec.from_mesh("cpu", mesh, names)


def test_local_shard_info_of_a_rank_outside_the_mesh_is_a_config_error_naming_the_mesh() -> None:
    for rank in (-1, 2, 10**30):
        with pytest.raises(ConfigError, match=r"not in the device mesh \(0, 1\)"):
            compute_local_shard_info(_sharding(), rank)


@pytest.mark.parametrize(("source", "target"), [(1, {}), ({}, {}), (None, [1]), (None, 2)])
def test_should_reshard_given_no_metadata_is_a_config_type_error(source: Any, target: Any) -> None:
    item = DistributedItemMetadata({}, {0: None})
    with pytest.raises(ConfigTypeError, match="should_reshard"):
        DTensorResharder().should_reshard(item if source is None else source, target)


@pytest.mark.parametrize("url", ["", "runs/exp1", "/abs/runs/exp1", "bucket/run", "s3:bucket/run"])
def test_an_fsspec_config_from_a_url_without_a_scheme_is_refused_when_built(url: str) -> None:
    """`from_url` of a path that names no store gave a config of no protocol, which refused every local id only
    at the first save (where the guide promises a config's faults when it is built)."""
    with pytest.raises(ConfigError, match=r"names no store: .*'s3://bucket/run'.*LocalFileSystemStorageConfig"):
        FsspecStorageConfig.from_url(url)
