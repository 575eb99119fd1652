"""`load()` gives back exactly what was saved, or `save()` refuses the value naming the item, the path and the
fix: the defects the value-fidelity harness (`test_value_fidelity_harness.py`) led to.

Each test here failed before its fix:

* `JsonSerialization(cls=...)` rebuilt each field by calling its annotation on the JSON value, so a value the
  annotation could not take back exactly was changed on load (2.7 in a field annotated `int` loaded as 2, a
  str in a field annotated `bool` as True, an int under `float` as a float), and one it could not take at all
  (None under `int`, a list where a dataclass is declared) was committed and then failed every load;
* a leaf JSON cannot hold was refused with json's own words, which name its type but not where it sits;
* an Enum member (an IntEnum, a str Enum) where no annotation rebuilds it, and a str Enum dict key, loaded
  back as the bare int or str.

Template tensors sharing memory are in `test_value_fidelity_tied.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    SafetensorsSerialization,
    SerializationFormat,
)
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import IncompleteCheckpointError
from torch_checkpointing.json_dataclass import from_jsonable
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


class Mode(enum.IntEnum):
    TRAIN = 1
    EVAL = 2


class Tag(str, enum.Enum):
    BEST = "best"


@dataclass
class Inner:
    x: int = 0


@dataclass
class Config:
    steps: int = 0
    lr: float = 0.1
    resume: bool = False
    name: str = ""
    inner: Inner = field(default_factory=Inner)
    maybe: Inner | None = None
    mode: Mode = Mode.TRAIN
    tag: Tag = Tag.BEST
    many: list[Inner] = field(default_factory=list)


def manager_for(fmt: SerializationFormat, *, async_save: bool = False) -> CheckpointManager:
    save = AsyncCheckpointSaverConfig() if async_save else SyncCheckpointSaverConfig()
    return CheckpointManager(
        CheckpointManager.Config(
            items={"cfg": ItemSpec(layout=LayoutInfo("cfg_{rank}.bin", fmt))},
            save=save,
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def _save(manager: CheckpointManager, where: Path, value: Any) -> None:
    """A save that has committed (or failed) on return, in either mode: an async refusal comes from the writer
    process, through the write Future."""
    write = manager.save(str(where), {"cfg": value})
    if write is not None:
        write.result(timeout=120)


def round_trip(fmt: SerializationFormat, value: Any, where: Path, into: Any = None, async_save: bool = False) -> Any:
    """Save `value` as item 'cfg' in `fmt`, then load it back into `into`."""
    with manager_for(fmt, async_save=async_save) as manager:
        _save(manager, where, value)
        return manager.load(str(where), into={"cfg": into})["cfg"]


# ------------------------------------------------------------------------------------------ JSON with cls


@pytest.mark.parametrize(
    ("value", "field_name"),
    [
        (Config(steps=2.7), "steps"),  # type: ignore[arg-type]  # int(2.7) is 2
        (Config(resume="false"), "resume"),  # type: ignore[arg-type]  # bool("false") is True
        (Config(name=5), "name"),  # type: ignore[arg-type]  # str(5) is "5"
        (Config(steps=None), "steps"),  # type: ignore[arg-type]  # int(None): every load failed
        (Config(inner=None), "inner"),  # type: ignore[arg-type]  # no Inner from null: every load failed
        (Config(many=[[1]]), "many"),  # type: ignore[list-item]  # no Inner from a list
        ({"steps": 1.5}, "steps"),  # a dict payload is rebuilt as the declared dataclass too
    ],
)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_json_cls_refuses_a_field_its_annotation_would_not_give_back(
    value: Any, field_name: str, async_save: bool, tmp_path: Path
) -> None:
    where = tmp_path / "ck"
    with manager_for(JsonSerialization(cls=Config), async_save=async_save) as manager:
        with pytest.raises(ValueError, match=rf"(?s)item 'cfg'.*{field_name}.*annotat"):
            _save(manager, where, value)
        with pytest.raises((IncompleteCheckpointError, FileNotFoundError)):
            manager.load(str(where))


def test_json_cls_refuses_a_value_that_is_not_an_object_for_a_dataclass(tmp_path: Path) -> None:
    match = r"item 'cfg'.*expected a JSON object for Config"
    with manager_for(JsonSerialization(cls=Config)) as manager, pytest.raises(ValueError, match=match):
        manager.save(str(tmp_path / "ck"), {"cfg": [1, 2]})


def test_json_cls_keeps_an_int_under_a_float_annotation(tmp_path: Path) -> None:
    """PEP 484 lets an int stand where a float is annotated; it was saved as an int and comes back as one."""
    out = round_trip(JsonSerialization(cls=Config), Config(lr=1), tmp_path / "ck")
    assert out == Config(lr=1) and type(out.lr) is int


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_json_cls_rebuilds_what_its_annotations_take_back_exactly(async_save: bool, tmp_path: Path) -> None:
    value = Config(
        steps=3, lr=0.5, resume=True, name="n\x00é", inner=Inner(4), maybe=Inner(5), mode=Mode.EVAL, many=[Inner(6)]
    )
    out = round_trip(JsonSerialization(cls=Config), value, tmp_path / "ck", async_save=async_save)
    assert out == value
    assert type(out.mode) is Mode and type(out.tag) is Tag and type(out.maybe) is Inner


@pytest.mark.parametrize(
    ("data", "field_name"),
    [({"steps": 2.7}, "steps"), ({"resume": "false"}, "resume"), ({"name": 5}, "name"), ({"steps": 2.0}, "steps")],
)
def test_json_cls_load_refuses_a_file_value_its_annotation_would_change(data: dict[str, Any], field_name: str) -> None:
    """A file written elsewhere (by hand, by another tool) whose value the annotation would change is refused
    naming the field, not rebuilt as a different value."""
    with pytest.raises(ValueError, match=rf"item 'cfg'\.{field_name}: the field is annotated"):
        from_jsonable(Config, data, "item 'cfg'")


# ------------------------------------------------------------------------------------------ JSON leaves


@pytest.mark.parametrize(
    ("value", "path", "kind"),
    [
        ({"a": {"b": {1, 2}}}, "cfg::a.b", "builtins.set"),
        ({"a": [1, b"x"]}, "cfg::a.1", "builtins.bytes"),
        ({"a": (torch.ones(1),)}, "cfg::a.0", "torch.Tensor"),
        (Config(name=1j), "cfg::name", "builtins.complex"),  # type: ignore[arg-type]
    ],
)
def test_json_refuses_a_leaf_it_cannot_hold_naming_its_path(value: Any, path: str, kind: str, tmp_path: Path) -> None:
    match = rf"the value at '{path}' is a {kind}, which is not JSON serializable"
    with manager_for(JsonSerialization()) as manager, pytest.raises(TypeError, match=match):
        manager.save(str(tmp_path / "ck"), {"cfg": value})


# ------------------------------------------------------------------------------------------- JSON enums


@pytest.mark.parametrize(
    ("value", "path", "match"),
    [
        ({"mode": Mode.EVAL}, "cfg::mode", "Mode.EVAL, which JSON holds as 2"),
        ({"run": [{"tag": Tag.BEST}]}, "cfg::run.0.tag", "Tag.BEST, which JSON holds as 'best'"),
        (Mode.TRAIN, "cfg", "Mode.TRAIN"),
    ],
)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_json_refuses_an_enum_member_that_would_load_back_bare(
    value: Any, path: str, match: str, async_save: bool, tmp_path: Path
) -> None:
    """Without an annotation to rebuild it, an IntEnum or str Enum member loaded back as its bare int or str
    (`is Mode.EVAL` then silently false); a declared dataclass field of the Enum type still takes it back."""
    with manager_for(JsonSerialization(), async_save=async_save) as manager:
        with pytest.raises(ValueError, match=rf"item 'cfg'.*the value at '{path}' is {match}"):
            _save(manager, tmp_path / "ck", value)
        with pytest.raises((IncompleteCheckpointError, FileNotFoundError)):
            manager.load(str(tmp_path / "ck"))


def test_json_refuses_an_enum_dict_key(tmp_path: Path) -> None:
    match = r"dict key <Tag.BEST: 'best'> at 'Tag.BEST' is a Tag.*load back as 'best'"
    with manager_for(JsonSerialization()) as manager, pytest.raises(TypeError, match=match):
        manager.save(str(tmp_path / "ck"), {"cfg": {Tag.BEST: 1}})


@dataclass
class Loose:
    anything: Any = None


def test_json_cls_refuses_an_enum_member_under_a_field_that_does_not_rebuild_it(tmp_path: Path) -> None:
    match = r"'cfg::anything' is Mode.EVAL"
    with manager_for(JsonSerialization(cls=Loose)) as manager, pytest.raises(ValueError, match=match):
        manager.save(str(tmp_path / "ck"), {"cfg": Loose(anything=Mode.EVAL)})


@dataclass
class Derived:
    base: int = 1
    double: int = field(init=False)
    tags: frozenset[str] | None = None

    def __post_init__(self) -> None:
        self.double = 2 * self.base


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_json_cls_refuses_a_field_the_constructor_does_not_take_back(async_save: bool, tmp_path: Path) -> None:
    """A `field(init=False)` is set by `__post_init__` on load: a saved instance holding another value there
    loaded back with the recomputed one."""
    value = Derived(base=3)
    value.double = 7
    match = r"item 'cfg'.*'cfg::double' would load back as another value"
    with (
        manager_for(JsonSerialization(cls=Derived), async_save=async_save) as manager,
        pytest.raises(ValueError, match=match),
    ):
        _save(manager, tmp_path / "ck", value)
    assert round_trip(JsonSerialization(cls=Derived), Derived(base=3), tmp_path / "ok") == Derived(base=3)


def test_json_cls_refuses_a_field_rebuilt_as_a_type_json_cannot_hold(tmp_path: Path) -> None:
    value = Derived()
    value.tags = ["a"]  # type: ignore[assignment]  # saved as a list, rebuilt as a frozenset
    with manager_for(JsonSerialization(cls=Derived)) as manager, pytest.raises(ValueError, match="cannot hold"):
        manager.save(str(tmp_path / "ck"), {"cfg": value})


# -------------------------------------------------------------------------------------- safetensors names


@pytest.mark.parametrize(
    ("value", "paths"),
    [
        ({0: torch.ones(1), "0": torch.zeros(1)}, r"\(0,\) and \('0',\)"),
        ({"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)}, r"\('a', 'b'\) and \('a.b',\)"),
        ({"l": [torch.ones(1)], "l.0": torch.zeros(1)}, r"\('l', 0\) and \('l.0',\)"),
    ],
)
def test_safetensors_names_both_paths_that_would_load_as_one(value: Any, paths: str, tmp_path: Path) -> None:
    """Two distinct keys never load as one: the save refuses them naming both paths (it named only the dotted
    name, and blamed a '.' where an int key met a str key)."""
    match = rf"item 'cfg' flatten to the same key .*the paths {paths}"
    with manager_for(SafetensorsSerialization()) as manager, pytest.raises(ValueError, match=match):
        manager.save(str(tmp_path / "ck"), {"cfg": value})
