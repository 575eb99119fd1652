"""Where an item lands on disk (`LayoutInfo`) and how it is encoded (`SerializationFormat`).

These are declarations only; each format's codec (encode, decode, open as a resharding source) lives in
`codecs.py`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from typing_extensions import Self

from torch_checkpointing.config import integer_as_int
from torch_checkpointing.errors import ConfigError, ConfigTypeError, CorruptCheckpointError, unknown_to_this_engine
from torch_checkpointing.schema_constants import RANK_PLACEHOLDER

if TYPE_CHECKING:  # this module loads no torch: a config names its layouts before any tensor exists
    from collections.abc import Mapping

    import torch


class SerializationFormat(ABC):
    """Base of the four shipped formats. The writer supports only those four: a new subclass is refused."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """The format as the manifest records it: `{"type": <class name>}` plus its options."""

    @classmethod
    @abstractmethod
    def from_dict(cls, d: dict[str, Any]) -> SerializationFormat:
        """The format `to_dict` recorded (`serialization_format_from_dict` picks the class by `type`)."""


class _OptionlessFormat(SerializationFormat):
    """A format without options: recorded as its type name alone, rebuilt from nothing else."""

    _TYPE_NAME: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self._TYPE_NAME}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        return cls()


@dataclass(frozen=True)
class TorchSerialization(_OptionlessFormat):
    """`torch.save` / `torch.load`: arbitrary picklable state (read back with torch's safe loader by default)."""

    _TYPE_NAME: ClassVar[str] = "TorchSerialization"


@dataclass(frozen=True)
class JsonSerialization(SerializationFormat):
    """Pretty-printed JSON with sorted keys; `cls` (a dataclass) is rebuilt on read."""

    cls: type | None = None

    def __post_init__(self) -> None:
        if self.cls is not None and not isinstance(self.cls, type):
            raise ConfigTypeError(
                f"JsonSerialization.cls must be a class (a dataclass to rebuild on read) or None, got "
                f"{self.cls!r}; pass the class itself, e.g. JsonSerialization(MyConfig)."
            )

    def to_dict(self) -> dict[str, Any]:
        name = None if self.cls is None else f"{self.cls.__module__}.{self.cls.__qualname__}"
        return {"type": "JsonSerialization", "cls": name}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JsonSerialization:
        name = _format_options(cls, d).get("cls")
        if not name:
            return cls()
        if not isinstance(name, str):
            raise ConfigTypeError(f"JsonSerialization 'cls' must be a dotted class name (str), got {name!r}")
        # Qualified names of nested classes contain dots: import the longest importable module prefix.
        parts = name.split(".")
        for split in range(len(parts) - 1, 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            for attr in parts[split:]:
                obj = getattr(obj, attr, None)
                if obj is None:
                    module, attrs = ".".join(parts[:split]), ".".join(parts[split:])
                    raise ConfigError(
                        f"JsonSerialization: module {module!r} has no class {attrs!r} (from {name!r}); make the "
                        f"class importable under that name"
                    )
            return cls(obj)
        raise ConfigError(f"JsonSerialization: cannot import class {name!r}; make its module importable")


@dataclass(frozen=True)
class RawSerialization(_OptionlessFormat):
    """Bytes written as they are."""

    _TYPE_NAME: ClassVar[str] = "RawSerialization"


@dataclass(frozen=True, eq=False)
class SafetensorsSerialization(SerializationFormat):
    """Tensor-only safetensors file; nested containers are flattened to dotted keys."""

    metadata: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.metadata is None:
            return
        if not isinstance(self.metadata, dict):
            raise ConfigTypeError(
                f"SafetensorsSerialization metadata must be a dict[str, str], got {type(self.metadata).__name__}"
            )
        bad = [(k, v) for k, v in self.metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ConfigTypeError(
                f"SafetensorsSerialization metadata keys and values must be str (safetensors contract); "
                f"offending entries: {bad!r}. Convert them with str() first."
            )
        for text in (t for entry in self.metadata.items() for t in entry):
            try:
                text.encode("utf-8")  # the file's header is UTF-8: a lone surrogate failed every save, unnamed
            except UnicodeEncodeError as exc:
                raise ConfigError(
                    f"SafetensorsSerialization metadata {text!r} holds {text[exc.start]!r}, a lone surrogate "
                    f"that a safetensors header (UTF-8) cannot hold; remove it."
                ) from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SafetensorsSerialization):
            return NotImplemented
        return self.metadata == other.metadata

    def __hash__(self) -> int:
        return hash(frozenset((self.metadata or {}).items()))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": "SafetensorsSerialization"}
        if self.metadata is not None:
            d["metadata"] = dict(self.metadata)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SafetensorsSerialization:
        return cls(metadata=_format_options(cls, d).get("metadata"))

    @staticmethod
    def prepare_tensors_for_save(data: Any) -> dict[str, torch.Tensor]:
        """The flat `dotted name -> tensor` dict a file of this format holds for `data` (API_SURFACE §4)."""
        from torch_checkpointing.safetensors_tree import flatten_tensors

        return flatten_tensors(data)

    @staticmethod
    def unflatten_to_target(flat: Mapping[str, torch.Tensor], target: Any) -> Any:
        """`flat` (a file's `name -> tensor` dict) re-nested in the shape of `target` (API_SURFACE §4): None for a
        list/tuple parent's missing leaves, list/tuple parents of the template's type."""
        from torch_checkpointing.safetensors_tree import unflatten_for_caller

        return unflatten_for_caller(flat, target)


SUPPORTED_FORMATS: tuple[type[SerializationFormat], ...] = (
    TorchSerialization,
    JsonSerialization,
    RawSerialization,
    SafetensorsSerialization,
)
_BY_NAME = {f.__name__: f for f in SUPPORTED_FORMATS}


def _format_options(fmt: type[SerializationFormat], d: object) -> dict[str, Any]:
    """`d` when it is the dict `to_dict()` writes; else a `ConfigTypeError` naming the format (a format given no
    dict raised AttributeError: 'NoneType' object has no attribute 'get')."""
    if not isinstance(d, dict):
        raise ConfigTypeError(
            f"{fmt.__name__}.from_dict takes the dict its to_dict() writes (e.g. {fmt().to_dict()!r}), got "
            f"{type(d).__name__} {d!r:.80}"
        )
    return d


def serialization_format_from_dict(d: dict[str, Any]) -> SerializationFormat:
    if not isinstance(d, dict):
        raise ConfigTypeError(
            f"A serialization format dict must be a dict such as {{'type': 'TorchSerialization'}}, got {d!r}"
        )
    kind = d.get("type")
    fmt = _BY_NAME.get(kind) if isinstance(kind, str) else None
    if fmt is None:
        raise ConfigError(f"Unknown SerializationFormat type: {kind} (known: {', '.join(_BY_NAME)})")
    return fmt.from_dict(d)


def untrusted_format_from_dict(d: Any, where: str) -> SerializationFormat:
    """A format as a checkpoint records it, with any JSON class name dropped: checkpoint data is untrusted
    input, so nothing named in it is imported (such items load as plain JSON).

    A record no format reads (an unknown `type`, options of the wrong type) is the checkpoint's defect, not the
    caller's: a `CorruptCheckpointError` naming `where` (the file and field), never the `ConfigError` a bad
    config gets (a load without templates, `export` and `diff` raised that bare, naming nothing)."""
    kind = d.get("type") if isinstance(d, dict) else None
    if isinstance(d, dict) and not (isinstance(kind, str) and kind in _BY_NAME):
        raise unknown_to_this_engine(where, "the serialization format", kind)
    try:
        if not isinstance(d, dict):
            raise ConfigTypeError(f"a format record must be an object such as {{'type': 'TorchSerialization'}}: {d!r}")
        return serialization_format_from_dict({k: v for k, v in d.items() if k != "cls"})
    except ConfigError as exc:
        raise CorruptCheckpointError(
            f"{where} records a serialization format no load reads ({exc}); the checkpoint was written by another "
            f"tool or engine version, or its manifest is damaged or crafted."
        ) from None


@dataclass(frozen=True)
class LayoutInfo:
    """One item's file: `file_path` relative to the checkpoint directory (may hold `{rank}`), and its format."""

    file_path: str
    serialization_format: SerializationFormat

    def __post_init__(self) -> None:
        # Only the type here: what the path may name (not empty, inside the checkpoint, no engine file) is checked
        # when an item is resolved, where the message can name the item's key.
        if not isinstance(self.file_path, str):
            raise ConfigTypeError(
                f"LayoutInfo.file_path must be a str relative to the checkpoint (e.g. 'model_{{rank}}.pt'), "
                f"got {self.file_path!r}"
            )
        fmt = self.serialization_format
        if isinstance(fmt, type) and issubclass(fmt, SerializationFormat):
            raise ConfigTypeError(
                f"LayoutInfo({self.file_path!r}).serialization_format must be an instance: pass {fmt.__name__}(), "
                f"not the class {fmt.__name__}"
            )
        if not isinstance(fmt, SerializationFormat):
            raise ConfigTypeError(
                f"LayoutInfo({self.file_path!r}).serialization_format must be a SerializationFormat such as "
                f"TorchSerialization() or SafetensorsSerialization(), got {fmt!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """`{"file_path": ..., "serialization_format": <the format's to_dict()>}`, as manifests record it."""
        return {"file_path": self.file_path, "serialization_format": self.serialization_format.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayoutInfo:
        """The layout `to_dict` recorded; ConfigError when `d` lacks either field or names an unknown format."""
        fields = ("file_path", "serialization_format")
        if not isinstance(d, dict) or any(k not in d for k in fields):
            raise ConfigError(
                f"LayoutInfo.from_dict needs a dict with 'file_path' and 'serialization_format'; got {d!r}"
            )
        return cls(d["file_path"], serialization_format_from_dict(d["serialization_format"]))

    def for_rank(self, rank: int) -> LayoutInfo:
        """`{rank}` filled in; every other brace-delimited text stays literal."""
        return LayoutInfo(self.file_path.replace(RANK_PLACEHOLDER, str(rank)), self.serialization_format)


@dataclass(frozen=True)
class ReplicatedLayoutInfo(LayoutInfo):
    """A LayoutInfo for an item that is the same on every rank: one file for the whole job, no `{rank}`.

    A path without `{rank}` on several ranks is written once, by the lowest rank, and read by all; for a plain
    LayoutInfo the manager warns about it (once), since the other ranks' values are not saved. This subclass is
    how an item says that is intended, so nothing is said. It needs no new ItemSpec field (the design document
    fixes ItemSpec at four), is recorded like a LayoutInfo, and the engine does not compare the ranks' values.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if RANK_PLACEHOLDER in self.file_path:
            raise ConfigError(
                f"ReplicatedLayoutInfo({self.file_path!r}): a replicated item has one file for every rank, so its "
                f"path cannot hold '{RANK_PLACEHOLDER}'; use LayoutInfo for per-rank files."
            )


def default_layout_info(key: str, rank: int) -> LayoutInfo:
    """`<key>_<rank>.pt`, the rank an integer scalar's plain int: `True` named "k_True.pt" and `1.0` "k_1.0.pt",
    files no rank writes."""
    if type(rank) is not int:
        rank = integer_as_int(rank)
        if type(rank) is not int:
            raise ConfigTypeError(f"default_layout_info: rank must be an int, got {type(rank).__name__} {rank!r:.80}")
    return LayoutInfo(f"{key}_{rank}.pt", TorchSerialization())
