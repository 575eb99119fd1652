"""`ItemSpec` and the overlay of specs onto a payload (save) or an `into=` mapping (load).

Resolution happens before anything is staged or written, so every schema error leaves the disk untouched.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch_checkpointing.checkpoint_layout import SUPPORTED_FORMATS, LayoutInfo, default_layout_info
from torch_checkpointing.commit import RESERVED_FILE_NAMES  # defined once, beside the commit that writes them
from torch_checkpointing.config import check_bool
from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.names import NAME_MAX
from torch_checkpointing.schema_constants import KEY_PATTERN, RANK_PLACEHOLDER

if TYPE_CHECKING:
    from torch_checkpointing.resharding import Resharder

__all__ = ["RANK_PLACEHOLDER", "RESERVED_FILE_NAMES", "ItemSpec", "ResolvedItem", "resolve", "validate_keys"]

_KEY_RE = re.compile(KEY_PATTERN)


@dataclass(frozen=True)
class ItemSpec:
    """Per-item behaviour, bound once to a key in `CheckpointManager.Config.items`."""

    requires_copy: bool = True
    layout: LayoutInfo | None = None
    resharder: Resharder | None = None
    required: bool = True

    def __post_init__(self) -> None:
        check_bool("ItemSpec", "requires_copy", self.requires_copy)
        check_bool("ItemSpec", "required", self.required)
        if self.layout is not None and not isinstance(self.layout, LayoutInfo):
            raise ConfigTypeError(
                f"ItemSpec.layout must be a LayoutInfo or None, got {type(self.layout).__name__} "
                f"({self.layout!r}); e.g. LayoutInfo('model_{{rank}}.pt', TorchSerialization())."
            )
        _check_resharder(self.resharder)


def _check_resharder(resharder: object) -> None:
    """Refused here, not on the first save, where a non-resharder failed with an AttributeError."""
    if resharder is None:
        return
    if isinstance(resharder, type):
        raise ConfigTypeError(
            f"ItemSpec.resharder must be a resharder instance, got the class {resharder.__name__}; "
            f"pass {resharder.__name__}()."
        )
    missing = [
        m for m in ("extract_sharding_metadata", "should_reshard", "load") if not callable(getattr(resharder, m, None))
    ]
    if missing:
        raise ConfigTypeError(
            f"ItemSpec.resharder must be a Resharder (e.g. DTensorResharder()), got {type(resharder).__name__}, "
            f"which has no {', '.join(missing)}."
        )


@dataclass(frozen=True)
class ResolvedItem:
    """One payload entry with its spec overlaid and its layout materialised for this rank."""

    key: str
    value: Any
    spec: ItemSpec
    layout: LayoutInfo
    is_default_layout: bool


def validate_keys(keys: list[Any]) -> None:
    _check_key_types(keys)
    _check_key_rule(keys)


def _check_key_types(keys: list[Any]) -> None:
    non_str = [k for k in keys if not isinstance(k, str)]
    if non_str:
        raise ConfigTypeError(f"Checkpoint keys must be str; got {non_str!r}. Use string keys such as 'model'.")


def _check_key_rule(keys: list[str]) -> None:
    bad = [k for k in keys if not _KEY_RE.fullmatch(k)]
    if bad:
        raise ConfigError(
            f"Invalid checkpoint keys {bad!r}: keys must contain only alphanumeric characters, hyphens, and "
            f"underscores (^[a-zA-Z0-9_-]+$), because they become part of file names. Rename them, e.g. "
            f"'model.weights' -> 'model_weights'."
        )


def check_layout(key: str, layout: LayoutInfo) -> None:
    """Refuse a layout no save can write (what the format and the path must be), naming `key`."""
    if not isinstance(layout, LayoutInfo):
        raise ConfigTypeError(
            f"ItemSpec.layout for key '{key}' must be a LayoutInfo or None, got {type(layout).__name__}"
        )
    fmt = layout.serialization_format
    if type(fmt) not in SUPPORTED_FORMATS:
        raise ConfigError(
            f"Unsupported serialization format for key '{key}': {type(fmt).__name__}. Custom SerializationFormat "
            f"subclasses are not supported by the writer; use one of "
            f"{', '.join(f.__name__ for f in SUPPORTED_FORMATS)}."
        )
    path = layout.file_path
    if not isinstance(path, str) or not path or path.endswith("/"):
        raise ConfigError(f"Layout file_path for key '{key}' must name a file relative to the checkpoint, got {path!r}")
    if "\x00" in path:  # the OS refuses it when the file is opened: mid-save, as a bare ValueError naming nothing
        raise ConfigError(f"Layout file_path {path!r} for key '{key}' holds a NUL character; remove it.")
    _refuse_unnameable(key, path)
    if posixpath.isabs(path) or path.startswith("\\"):
        raise ConfigError(
            f"Layout file_path {path!r} for key '{key}' is absolute; it must be relative to the checkpoint "
            f"directory (e.g. 'model_{{rank}}.pt')."
        )
    normal = posixpath.normpath(path)
    if normal == ".." or normal.startswith("../"):
        raise ConfigError(
            f"Layout file_path {path!r} for key '{key}' leaves the checkpoint directory; keep it inside, "
            f"e.g. 'sub/model_{{rank}}.pt'."
        )
    if normal == "." or ".." in path.split("/") or path.split("/")[-1] == ".":
        # the writer opens the path as given: 'a/../x.bin' failed mid-save ("Parent directory does not exist"),
        # '.', 'a/..' and 'x.pt/.' (the folder x.pt: normpath drops the '/.') with IsADirectoryError, naming no item
        raise ConfigError(
            f"Layout file_path {path!r} for key '{key}' must name a file by a plain relative path, without '..' "
            f"or a trailing '/.' (e.g. {normal if normal != '.' else 'model_{rank}.pt'!r})."
        )
    if normal.split("/")[0] in RESERVED_FILE_NAMES:
        # also as a directory: 'manifest.json/x.bin' failed at the commit, leaving a directory nothing removes
        raise ConfigError(
            f"Layout file_path {path!r} for key '{key}' uses {normal.split('/')[0]!r}, a name reserved by the "
            f"engine at the top of a checkpoint; choose another name."
        )


def resolve(
    payload: Mapping[str, Any],
    items: Mapping[str, ItemSpec],
    default: ItemSpec | None,
    rank: int,
) -> list[ResolvedItem]:
    """Overlay specs onto `payload`: required/strict checks, key rules, `{rank}`, layout sanity."""
    if not isinstance(payload, Mapping):
        raise ConfigTypeError(
            f"A checkpoint payload must be a Mapping of item key -> value, got {type(payload).__name__}"
        )
    keys = list(payload.keys())
    _check_key_types(keys)  # the checks below sort and compare keys; the key rule comes after them (§3 order)
    for key, spec in items.items():
        if not isinstance(spec, ItemSpec):
            raise ConfigTypeError(f"Config.items['{key}'] must be an ItemSpec, got {type(spec).__name__}")
    missing = sorted(k for k, spec in items.items() if spec.required and k not in payload)
    if missing:
        raise KeyError(
            f"Missing required checkpoint item(s): {missing}. Pass them, or declare them with ItemSpec(required=False)."
        )
    if default is None:
        unknown = sorted(k for k in keys if k not in items)
        if unknown:
            raise KeyError(
                f"No ItemSpec for checkpoint key(s) {unknown} and the schema is strict (default=None). "
                f"Declare them in Config.items or set a Config.default."
            )
    _check_key_rule(keys)
    resolved: list[ResolvedItem] = []
    owners: dict[str, str] = {}
    for key in keys:
        chosen = _spec_for(key, items, default)
        if chosen.layout is None:
            layout, is_default = default_layout_info(key, rank), True
        else:
            check_layout(key, chosen.layout)
            layout, is_default = chosen.layout.for_rank(rank), False
        normal = posixpath.normpath(layout.file_path)
        _check_name_lengths(key, normal)
        if normal in owners:
            raise ConfigError(
                f"Items '{owners[normal]}' and '{key}' both resolve to the file {normal!r} on rank {rank}; "
                f"each key needs its own file. Give one of them a different LayoutInfo.file_path."
            )
        owners[normal] = key
        resolved.append(ResolvedItem(key, payload[key], chosen, layout, is_default))
    _refuse_file_under_file(owners, rank)
    return resolved


def _refuse_unnameable(key: str, path: str) -> None:
    """A path the OS cannot be given: a surrogate outside U+DC80..U+DCFF (the bytes of a non-UTF-8 name, which
    `os.fsencode` gives back) has no bytes. It was a bare UnicodeEncodeError, at the save or the manager's build."""
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"Layout file_path {path!r} for key '{key}' holds {path[exc.start]!r}, a lone surrogate that no file name "
            f"can hold; remove it (only U+DC80..U+DCFF, the bytes of a name that is no UTF-8, have a form on disk)."
        ) from None


def check_names_fit(key: str, layout: LayoutInfo, world_size: int = 1) -> None:
    """Refuse a layout whose names some rank of a `world_size` job cannot write: with the longest rank
    (`world_size - 1`) in place of `{rank}`, one name of its path is over NAME_MAX bytes (what `resolve` refuses
    at every save of that job, said when a manager is built). Rank 0 alone missed a name that fits up to rank 9
    and not at rank 10."""
    _check_name_lengths(key, posixpath.normpath(layout.for_rank(max(world_size, 1) - 1).file_path))


def _check_name_lengths(key: str, path: str) -> None:
    """A file name over NAME_MAX is refused when the save is planned, naming the item (an ENAMETOOLONG from the
    writer before), whether it comes from a long key in the default layout or from a LayoutInfo."""
    for part in path.split("/"):
        size = len(part.encode("utf-8", "surrogateescape"))
        if size > NAME_MAX:
            raise ConfigError(
                f"Item '{key[:64]}{'...' if len(key) > 64 else ''}' would be written to a file name of {size} "
                f"bytes ({part[:40]}...), over the {NAME_MAX}-byte limit of a file name: use a shorter key or "
                f"LayoutInfo.file_path."
            )


def _refuse_file_under_file(owners: Mapping[str, str], rank: int) -> None:
    """A file path that is another item's folder ('d' and 'd/x.pt') can never both be written: refused here,
    naming both items, instead of an IsADirectoryError from the writer."""
    for path, key in owners.items():
        parent = posixpath.dirname(path)
        while parent:
            if parent in owners:
                raise ConfigError(
                    f"Item '{key}' is written to {path!r}, inside {parent!r}, the file of item '{owners[parent]}' "
                    f"on rank {rank}: a path cannot be a file and a folder at once. Give one of them a "
                    f"different LayoutInfo.file_path."
                )
            parent = posixpath.dirname(parent)


def _spec_for(key: str, items: Mapping[str, ItemSpec], default: ItemSpec | None) -> ItemSpec:
    spec = items.get(key)
    if spec is not None:
        return spec
    assert default is not None  # strict schemas (default=None) refused unknown keys before this
    return default
