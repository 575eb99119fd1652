"""`JsonSerialization(cls=...)` rebuilds every annotation it can from the JSON `json` wrote.

NamedTuples: the rebuild called `Span([1, 4, "a"])` instead of `Span(1, 4, "a")`, so every save of one was
refused with "missing 1 required positional argument", blaming values of the annotated type.
Fixed-length tuples (`tuple[Inner, int]`), `Sequence[Inner]` and `Mapping[str, Inner]`: the dataclasses inside
were left as dicts, and the load returned them so without a word.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import pytest

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo
from torch_checkpointing.json_dataclass import RebuildGaps, from_jsonable
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


class Span(NamedTuple):
    start: int
    stop: int
    label: str = ""


Plain = collections.namedtuple("Plain", ["a", "b"])


@dataclass
class Holder:
    span: Span | None
    plain: Plain


def _roundtrip(tmp_path: Path, cls: type, value: Any) -> Any:
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    config.items = {"v": ItemSpec(layout=LayoutInfo("v.json", JsonSerialization(cls)))}
    with CheckpointManager(config) as manager:
        manager.save(str(tmp_path / "c"), {"v": value})
        return manager.load(str(tmp_path / "c"), into={"v": None})["v"]


@pytest.mark.parametrize(
    ("cls", "value"),
    [(Span, Span(1, 4, "a")), (Holder, Holder(Span(0, 1), Plain(1, [2, 3]))), (Holder, Holder(None, Plain(0, 0)))],
    ids=["namedtuple", "fields", "optional-none"],
)
def test_a_named_tuple_round_trips_as_its_type(tmp_path: Path, cls: type, value: Any) -> None:
    out = _roundtrip(tmp_path, cls, value)
    assert type(out) is cls and out == value
    if isinstance(out, Holder):
        assert out.span is None or type(out.span) is Span
        assert type(out.plain) is Plain


@dataclass
class Inner:
    x: int


@dataclass
class Annotated:
    pair: tuple[Inner, int]
    seen: Sequence[Inner]
    named: Mapping[str, Inner]
    pairs: list[tuple[Inner, Inner]]


def test_dataclasses_inside_tuple_sequence_and_mapping_annotations_are_rebuilt(tmp_path: Path) -> None:
    value = Annotated((Inner(1), 2), [Inner(3)], {"k": Inner(4)}, [(Inner(5), Inner(6))])
    out = _roundtrip(tmp_path, Annotated, value)
    assert out == value
    inner = [out.pair[0], out.seen[0], out.named["k"], *out.pairs[0]]
    assert all(type(x) is Inner for x in inner), out


def test_a_fixed_tuple_of_the_wrong_length_names_the_problem() -> None:
    with pytest.raises(ValueError, match="3 JSON values for a tuple of 2"):
        from_jsonable(tuple[Inner, int], [{"x": 1}, 2, 3], "v")


def test_fields_past_the_end_of_the_list_take_their_defaults_and_are_reported() -> None:
    gaps = RebuildGaps()
    assert from_jsonable(Span, [1, 2], "v", gaps) == Span(1, 2, "")
    assert gaps.defaulted == [(2,)]


@pytest.mark.parametrize(("data", "words"), [([1], "missing required field(s) ['stop']"), ([1, 2, "x", 4], "4 JSON")])
def test_a_list_that_does_not_fit_the_fields_names_the_problem(data: list[Any], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        from_jsonable(Span, data, "v")


class Point(NamedTuple):
    x: int
    y: int


@dataclass
class Loose:
    """Annotations the rebuild cannot follow to a type: a union of two types, Any, object."""

    either: Inner | int = 0
    anything: Any = None
    obj: object = None
    plain: tuple[int, ...] = ()


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (Loose(either=Inner(1)), "v::either"),
        (Loose(anything=Inner(2)), "v::anything"),
        (Loose(obj=[Inner(3)]), "v::obj.0"),
        (Loose(anything=Span(1, 2)), "v::anything"),
        (Loose(plain=Point(1, 2)), "v::plain"),
    ],
    ids=["union", "any", "object-list", "namedtuple-in-any", "namedtuple-as-tuple"],
)
def test_a_typed_value_the_annotation_would_not_rebuild_is_refused_at_save(
    tmp_path: Path, value: Loose, where: str
) -> None:
    """Before, these saved, and the load returned the dataclass or NamedTuple as a dict or list, without a word
    (load returned another value than the one committed)."""
    with pytest.raises(ValueError, match=f"'{where}'"):
        _roundtrip(tmp_path, Loose, value)
    assert not (tmp_path / "c").exists()


def test_values_the_annotations_rebuild_still_save(tmp_path: Path) -> None:
    value = Loose(either=5, anything={"a": [1, 2]}, obj="s", plain=(1, 2))
    assert _roundtrip(tmp_path, Loose, value) == value


T = TypeVar("T")


@dataclass
class Box(Generic[T]):
    """A generic dataclass: its fields are annotated with the type variable the user's annotation binds."""

    item: T
    items: list[T]
    maybe: T | None = None


@dataclass
class Boxes:
    inners: Box[Inner]
    ints: Box[int]
    spans: list[Box[Span]]


def test_a_generic_dataclass_annotated_with_its_parameters_is_rebuilt(tmp_path: Path) -> None:
    """Defect: a field annotated `Box[Inner]` was refused at save ("'v::inners' is a Box, which the annotation
    there does not rebuild ... annotate that field Box", which it is); before that check, it loaded back as a
    dict without a word. The annotation names the type and its parameter: both are rebuilt."""
    value = Boxes(Box(Inner(1), [Inner(2)], Inner(3)), Box(4, [5]), [Box(Span(0, 1), [], None)])
    out = _roundtrip(tmp_path, Boxes, value)
    assert out == value
    rebuilt = [out.inners.item, *out.inners.items, out.inners.maybe, out.spans[0].item]
    assert [type(x) for x in rebuilt] == [Inner, Inner, Inner, Span], out
    assert type(out.inners) is Box and type(out.spans[0]) is Box


def _local_classes() -> tuple[type, type, type]:
    """Classes defined in a function: under `from __future__ import annotations` their annotations are strings
    naming `LocalInner`, which no module namespace holds."""

    @dataclass
    class LocalInner:
        x: int

    @dataclass
    class LocalOuter:
        inner: LocalInner

    class LocalPair(NamedTuple):
        first: LocalInner

    return LocalInner, LocalOuter, LocalPair


@pytest.mark.parametrize("which", ["dataclass", "namedtuple"])
def test_an_annotation_naming_a_type_out_of_reach_is_refused_naming_the_item(tmp_path: Path, which: str) -> None:
    """Defect: typing.get_type_hints' bare NameError ("name 'LocalInner' is not defined") came out of save(),
    naming neither the item nor the class whose annotations could not be read, nor what to do."""
    inner, outer, pair = _local_classes()
    cls, value = (outer, outer(inner(1))) if which == "dataclass" else (pair, pair(inner(1)))
    with pytest.raises(ValueError, match=r"item 'v'|'v'") as caught:
        _roundtrip(tmp_path, cls, value)
    assert "LocalInner" in str(caught.value) and cls.__name__ in str(caught.value) and "module" in str(caught.value)
    assert not (tmp_path / "c").exists()
