"""Public entry points refuse a wrong kind of argument with a `ConfigTypeError` that names it, round 27.

API_SURFACE §2.2 takes `CheckpointManager(config: Config | None = None)`; `latest_checkpoint` and
`list_checkpoints` take an optional `Storage`. A wrong object there (a dict of fields, a preset not called, a
saver config, a StorageConfig where its storage was meant) failed deep inside with an `AttributeError` naming
an attribute the caller never used, or with a `ConfigTypeError` about a field (`Config.items ... got
builtin_function_or_method`) the caller never set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torch_checkpointing import CheckpointManager, ItemSpec, SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigTypeError

_CONFIG_MISTAKES: dict[str, tuple[Any, str]] = {
    "a dict of its fields": ({"items": {}}, r"got dict.*CheckpointManager\.Config\(\*\*fields\)"),
    "a preset not called": (CheckpointManager.Config.with_sync_save, r"with_sync_save\(\)"),
    "the Config class itself": (CheckpointManager.Config, r"an instance.*CheckpointManager\.Config\(\)"),
    "a saver config": (SyncCheckpointSaverConfig(), r"got SyncCheckpointSaverConfig.*Config\(save=\.\.\.\)"),
    "a directory": ("runs/ckpt", r"got str.*checkpoint id"),
}


@pytest.mark.parametrize("mistake", sorted(_CONFIG_MISTAKES))
def test_a_manager_built_from_something_other_than_a_config_is_refused_naming_the_argument(mistake: str) -> None:
    """Before: AttributeError "'str' object has no attribute 'items'" (a path, a preset not called, a saver
    config), or ConfigTypeError "Config.items must be a Mapping ..., got builtin_function_or_method" (a dict)."""
    value, fix = _CONFIG_MISTAKES[mistake]
    with pytest.raises(ConfigTypeError, match=r"^CheckpointManager\(config=\.\.\.\) must be a CheckpointManager\.Conf"):
        CheckpointManager(value)
    with pytest.raises(ConfigTypeError, match=fix):
        CheckpointManager(value)


def test_a_config_subclass_is_still_a_config(tmp_path: Path) -> None:
    class Mine(CheckpointManager.Config):
        pass

    with CheckpointManager(Mine(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(tmp_path / "a"), {"step": 1})
        assert manager.load(str(tmp_path / "a"), into={"step": None}) == {"step": 1}


def _public_path_calls() -> dict[str, Callable[[Any, Any], object]]:
    """Every public function that takes a root or checkpoint path and an optional `storage=`."""
    from torch_checkpointing import RetentionPolicy, latest_checkpoint, list_checkpoints, retention
    from torch_checkpointing.hf import export_hf, iter_item_tensors

    policy = RetentionPolicy(keep_last=1)
    return {
        "latest_checkpoint": lambda root, storage: latest_checkpoint(root, storage),
        "list_checkpoints": lambda root, storage: list_checkpoints(root, storage),
        "retention.prune": lambda root, storage: retention.prune(root, policy, storage),
        "retention.apply_retention": lambda root, storage: retention.apply_retention(root, policy, storage),
        "retention.collect_garbage": lambda root, storage: retention.collect_garbage(root, storage),
        "retention.delete_checkpoint": lambda root, storage: retention.delete_checkpoint(root, storage),
        "hf.iter_item_tensors": lambda root, storage: next(iter_item_tensors(root, "model", storage=storage)),
        "hf.export_hf": lambda root, storage: export_hf(root, "model", "unused_out_dir", storage=storage),
    }


@pytest.mark.parametrize("call", sorted(_public_path_calls()))
def test_a_storage_config_passed_as_storage_is_refused_naming_create_storage(call: str, tmp_path: Path) -> None:
    """`storage=` takes a `Storage`; its config is the likely mix-up. Before: AttributeError
    "'LocalFileSystemStorageConfig' object has no attribute 'isdir'" (or 'exists', 'stream_read')."""
    from torch_checkpointing import LocalFileSystemStorageConfig

    with pytest.raises(
        ConfigTypeError,
        match=r"storage= must be a Storage.*got LocalFileSystemStorageConfig.*"
        r"\.create_storage\(\)",
    ):
        _public_path_calls()[call](str(tmp_path), LocalFileSystemStorageConfig())
    with pytest.raises(ConfigTypeError, match=r"storage= must be a Storage.*got str"):
        _public_path_calls()[call](str(tmp_path), "memory")


@pytest.mark.parametrize("call", sorted(_public_path_calls()))
@pytest.mark.parametrize("root", [5, None, b"runs"], ids=["int", "None", "bytes"])
def test_a_path_of_the_wrong_type_is_refused_naming_it(call: str, root: object) -> None:
    """Before: TypeError "expected str, bytes or os.PathLike object, not int", or for bytes "cannot use a string
    pattern on a bytes-like object" from inside the URL check."""
    with pytest.raises(ConfigTypeError, match=rf"must be a str or os\.PathLike path.*got {type(root).__name__}"):
        _public_path_calls()[call](root, None)


def _documented_exception_names() -> set[str]:
    """The exception types docs/guide.md's "Errors at a glance" table and docs/durability.md name in backticks."""
    import builtins
    import re

    docs = Path(__file__).resolve().parents[1] / "docs"
    text = (docs / "guide.md").read_text() + (docs / "durability.md").read_text()
    names = set(re.findall(r"`(?:torch_checkpointing\.errors\.)?([A-Z][A-Za-z]*(?:Error|Died))`", text))
    others = ("PicklingError", "UnpicklingError", "DistNetworkError")  # pickle's and torch's
    return {n for n in names if not hasattr(builtins, n) and n not in others}


def test_every_exception_type_the_docs_name_is_importable_from_the_package() -> None:
    """Callers catch what the docs tell them by name. Before: the guide's table says a cycle or too deep a
    nesting raises `NestingError`, which `torch_checkpointing` neither exported nor listed in `errors`: only
    `torch_checkpointing.traversal`, a module no document names, had it."""
    import torch_checkpointing
    from torch_checkpointing import errors

    named = _documented_exception_names()
    assert "NestingError" in named and "ConfigTypeError" in named, named
    assert sorted(n for n in named if n not in errors.__all__ or n not in torch_checkpointing.__all__) == []
    for name in named:
        assert issubclass(getattr(torch_checkpointing, name), Exception)


def test_the_nesting_error_raised_by_a_save_is_the_public_one(tmp_path: Path) -> None:
    import torch_checkpointing

    cycle: dict[str, Any] = {"a": 1}
    cycle["self"] = cycle
    with (
        CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager,
        pytest.raises(torch_checkpointing.NestingError, match=r"'v::self' contains itself") as raised,
    ):
        manager.save(str(tmp_path / "a"), {"v": cycle})
    assert isinstance(raised.value, ValueError)


def test_public_signatures_name_the_types_they_take_and_return() -> None:
    """mypy strict passes, but `Any` on a public signature checks nothing for the caller. These held `Any`
    where API_SURFACE names the type (§4 `prepare_tensors_for_save(data) -> dict[str, Tensor]`, §7.1
    `write(self, path, data: Buffer)`) or the value always is one (`CheckpointManager.rank_info`)."""
    import inspect

    from torch_checkpointing import SafetensorsSerialization, Storage

    def annotation(func: Callable[..., object], name: str = "return") -> object:
        signature = inspect.signature(func)  # the annotations as written: the layouts module loads no torch
        return signature.return_annotation if name == "return" else signature.parameters[name].annotation

    assert annotation(SafetensorsSerialization.prepare_tensors_for_save) == "dict[str, torch.Tensor]"
    assert annotation(SafetensorsSerialization.unflatten_to_target, "flat") == "Mapping[str, torch.Tensor]"
    assert annotation(Storage.write, "data") == "Buffer"
    from torch_checkpointing import RetentionPolicy

    root = next(f for f in dataclasses.fields(RetentionPolicy) if f.name == "root")
    assert root.type == "str | os.PathLike[str] | None", root.type  # a Path root was taken, but mypy refused it
    rank_info = CheckpointManager.rank_info.fget
    assert rank_info is not None and annotation(rank_info) == "RankInfo"


def test_the_engine_calls_remap_path_as_the_storage_docstrings_now_say(tmp_path: Path) -> None:
    """`Storage`'s docstring said "Never called by the engine: `glob`, `remap_path`, ..." and `remap_path`'s
    "the engine never calls it", so a custom backend could leave it raising; retention calls it to tell which
    checkpoints `protect` names (for a store with no local paths), and commit and load messages name paths by it.
    """
    from tests.memory_storage import MemoryStorage, MemoryStorageConfig
    from torch_checkpointing import RetentionPolicy, Storage, retention

    config = MemoryStorageConfig()
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)) as m:
        for step in (1, 2, 3):
            m.save(f"run/step_{step}", {"step": step})
    mapped: list[Path] = []

    class Naming(MemoryStorage):
        def remap_path(self, path: Path) -> str:
            mapped.append(Path(path))
            return super().remap_path(path)

    report = retention.prune("run", RetentionPolicy(keep_last=1), Naming(config.store), protect=["run/step_1"])
    assert [Path(c.path).name for c in report.deleted] == ["step_2"]
    assert Path("run/step_1") in mapped  # the engine called it, to match `protect`
    never_called = (Storage.__doc__ or "").split("Never called by the engine:")[-1]
    assert "remap_path" not in never_called, never_called
    assert "never calls" not in (Storage.remap_path.__doc__ or ""), Storage.remap_path.__doc__


def test_the_writer_config_docstring_says_its_barrier_fields_are_ignored() -> None:
    """`CheckpointWriterConfig`'s docstring promised "barrier timeout and barrier between ranks"; both fields
    are ignored (a FutureWarning when set): the ranks of a save commit together whatever they hold."""
    from torch_checkpointing import CheckpointWriterConfig

    with pytest.warns(FutureWarning, match="barrier_config is ignored"):
        CheckpointWriterConfig(barrier_config=object())  # type: ignore[arg-type]
    doc = " ".join((CheckpointWriterConfig.__doc__ or "").split())
    assert "barrier_config" in doc and "ignored" in doc, doc


@pytest.mark.parametrize(
    ("filesystem", "fix"),
    [("s3", r"got str"), ({"key": "x"}, r"got dict"), ("class", r"got the class MemoryFileSystem; pass an instance")],
)
def test_an_fsspec_config_refuses_a_filesystem_that_is_none(filesystem: object, fix: str) -> None:
    """`FsspecStorageConfig(filesystem=...)` takes an fsspec filesystem instance. Before: a protocol name, a dict
    of options failed with AttributeError "'str' object has no attribute 'protocol'", and the class itself was
    taken as if it were one (its methods then called unbound, at the first request)."""
    from fsspec.implementations.memory import MemoryFileSystem

    from torch_checkpointing import FsspecStorageConfig

    value = MemoryFileSystem if filesystem == "class" else filesystem
    with pytest.raises(ConfigTypeError, match=r"FsspecStorageConfig\.filesystem must be an fsspec filesystem.*" + fix):
        FsspecStorageConfig(url="memory://bucket/run", filesystem=value)
    assert FsspecStorageConfig(url="memory://bucket/run", filesystem=MemoryFileSystem()).protocol == "memory"


def _public_members() -> list[tuple[str, object]]:
    """Every public method and property of the classes `torch_checkpointing.__all__` names (nested ones too)."""
    import inspect

    import torch_checkpointing

    members: list[tuple[str, object]] = []
    for name in torch_checkpointing.__all__:
        owner = getattr(torch_checkpointing, name)
        if not inspect.isclass(owner) or issubclass(owner, BaseException):
            continue
        nested = [v for v in vars(owner).values() if inspect.isclass(v) and v.__module__.startswith("torch_")]
        for cls in [owner, *nested]:
            for attr, raw in vars(cls).items():
                if not attr.startswith("_") and (
                    callable(raw) or isinstance(raw, (classmethod, staticmethod, property))
                ):
                    members.append((f"{cls.__qualname__}.{attr}", getattr(cls, attr)))
    return members


def test_every_public_method_says_what_it_does() -> None:
    """`help()` is the reference a user reads. Before: 33 public methods had no docstring, own or inherited,
    among them `CheckpointManager.Config.build`/`with_sync_save`/`with_async_save` and every abstract method a
    custom `Storage` must implement (`stream_read`, `ls`, `getsize`, `rename`, ...: what to return, what to
    raise when nothing is there)."""
    import inspect

    undocumented = sorted(name for name, member in _public_members() if not inspect.getdoc(member))
    assert undocumented == []


def test_an_fsspec_storage_refuses_an_id_it_cannot_place_with_a_config_error() -> None:
    """A manager said so with a ConfigError, but the storage itself (its construction from a config whose `url`
    and `protocol` disagree, and every public function given it, such as `latest_checkpoint`) raised a bare
    ValueError: "Bad input gets a specific exception from errors.py" held for one entry point only."""
    from torch_checkpointing import FsspecStorageConfig, latest_checkpoint
    from torch_checkpointing.errors import ConfigError

    with pytest.raises(ConfigError, match=r"is a memory:// path, but this storage talks to file://"):
        FsspecStorageConfig(url="memory://bucket/run", protocol="file").create_storage()
    storage = FsspecStorageConfig(protocol="memory").create_storage()
    with pytest.raises(ConfigError, match=r"'run' has no URL scheme .* no url root"):
        latest_checkpoint("run", storage)
    with pytest.raises(ConfigError, match=r"'file:///srv/run' is a file:// URL, which the storage passed"):
        latest_checkpoint("file:///srv/run", storage)


@dataclasses.dataclass
class _Settings:
    lr: float
    warmup: int = 100


def test_a_json_field_that_took_its_default_is_not_called_a_template_entry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A load with no template (`into=None`) of a JSON item whose file lacks a field of the declared class
    warned "1 template entr(ies) not in the checkpoint, left as they were ...: ['cfg::warmup']": there was no
    template, and nothing was left as it was; the field took its default. strict=True still refuses it."""
    import logging

    from torch_checkpointing import JsonSerialization, LayoutInfo, TemplateMismatchError

    items = {"cfg": ItemSpec(layout=LayoutInfo("cfg.json", JsonSerialization(_Settings)))}
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), items=items)
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "a"), {"cfg": {"lr": 0.5}})  # a dict lacking the defaulted field
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            assert manager.load(str(tmp_path / "a"))["cfg"] == _Settings(0.5)
        said = [r.getMessage() for r in caplog.records if "cfg::warmup" in r.getMessage()]
        assert len(said) == 1 and "template entr" not in said[0], said
        assert "took their defaults" in said[0], said
        with pytest.raises(TemplateMismatchError, match=r"cfg::warmup"):
            manager.load(str(tmp_path / "a"), strict=True)
