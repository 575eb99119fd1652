"""A save-time warning for values that the default (safe) load of the same checkpoint will refuse.

Torch files are read with torch's safe unpickler (`CheckpointLoaderConfig.weights_only=True`), which refuses
classes it does not know: an `argparse.Namespace` of hyper-parameters, a dataclass, an Enum. The save pickles
them without complaint, so the refusal surfaced only at resume time, on a checkpoint that may be the only one
left. Each such type is tried once per manager against torch's own safe loader (no list of ours to drift from
torch's), and a warning names the item, the path and the fix when the checkpoint is written, not when it is read.
"""

from __future__ import annotations

import copyreg
import dataclasses
import enum
import io
import logging
import pickle
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from torch_checkpointing.checkpoint_layout import TorchSerialization
from torch_checkpointing.schema import ResolvedItem
from torch_checkpointing.traversal import NestingError, find_path, is_container, local_tensor, nodes
from torch_checkpointing.types import conversion_hint

__all__ = ["SafeLoadCheck"]

logger = logging.getLogger(__name__)

# Containers the walk descends into that pickle by opcodes of their own: never a global to refuse.
_PLAIN_CONTAINERS = (dict, list, tuple)
# Modules whose containers' own `__reduce__` names their class, as the default protocol does (defaultdict,
# OrderedDict, Counter, a torch `return_types` value): their class's verdict is the container's.
_REDUCE_BY_CLASS = ("builtins", "collections", "torch.return_types")

# The pickle protocol torch.save writes (torch.serialization.DEFAULT_PROTOCOL): reductions are asked for it.
TORCH_PICKLE_PROTOCOL = 2

# Leaf types the safe unpickler always accepts: checked without a trial (the common, tensor-only state). Exact
# types, never `isinstance`: a subclass (numpy's float64 is a float, an IntEnum an int, a tensor subclass a
# Tensor) pickles under its own class's name, and the safe unpickler refuses that name.
_ALWAYS_LOADED = frozenset(
    {
        *(torch.Tensor, torch.nn.Parameter, int, float, bool, str, bytes, complex, type(None)),
        *(torch.dtype, torch.device, torch.Size),
    }
)


@dataclass(frozen=True)
class _Refusal:
    """torch's reason to refuse a value, and the global a caller would allow for it (its class, or what the
    class's own `__reduce__` pickles it as)."""

    reason: str
    allow: str
    via_reduce: bool = False


class SafeLoadCheck:
    """Checks each item on the first save that holds it, and tries each leaf and container type once per manager.

    Once per item, not on every save: the walk over a state's leaves cost 0.3 ms of every save()'s blocked
    time (192 leaves), against a 1 ms budget for saves that copy nothing; an item's leaf types rarely change
    between saves of one job.
    """

    def __init__(self) -> None:
        self._verdicts: dict[type, _Refusal | None] = {}  # type -> why torch refuses it, None if it loads
        self._checked: set[str] = set()  # item keys

    def warn_refused(self, items: list[ResolvedItem]) -> None:
        """Warn (once per type) for each leaf or container of a torch-format item that the default load would
        refuse."""
        for item in items:
            if item.key in self._checked or not isinstance(item.layout.serialization_format, TorchSerialization):
                continue
            try:
                self._check_item(item)
            except NestingError as exc:  # a value that contains itself: refused here, before anything is written
                raise exc.for_item(item.key) from None
            self._checked.add(item.key)

    def _check_item(self, item: ResolvedItem) -> None:
        """Judge each leaf, and each container of another type than dict/list/tuple (a named tuple, a
        defaultdict, a dict subclass): the safe unpickler refuses a container's class as it does a leaf's."""
        for node in nodes(item.value):  # no paths built: this runs inside save()'s blocked time
            written = _as_written(node)
            if isinstance(written, Mapping) and not _ALWAYS_LOADED.issuperset(map(type, written)):
                self._check_keys(item, written)
            refusal = self._judged(written)
            if refusal is not None:
                _warn(item.key, find_path(item.value, node), type(written), refusal)

    def _check_keys(self, item: ResolvedItem, mapping: Mapping[Any, Any]) -> None:
        """Judge a dict's keys (a tuple key's parts too), which the file pickles as it does the values: a numpy
        integer or the caller's own object as a key was saved without a word, and every default load refused it."""
        for key in mapping:
            for part in nodes(key) if type(key) is tuple else (key,):
                refusal = self._judged(part)
                if refusal is not None:
                    _warn(item.key, find_path(item.value, mapping), type(part), refusal, (key,))

    def _judged(self, node: Any) -> _Refusal | None:
        """Why the safe loader refuses `node`, where its type is judged here for the first time; else None."""
        kind = type(node)
        if kind in _PLAIN_CONTAINERS or kind in _ALWAYS_LOADED or kind in self._verdicts:
            return None
        refusal = self._verdicts[kind] = _verdict(node, _MAX_REDUCE_DEPTH)
        return refusal


def _as_written(node: Any) -> Any:
    """What the file holds for `node`: a DTensor's local shard (its layout goes to metadata.json), not the
    DTensor, which the safe loader would refuse but no file of ours holds."""
    return local_tensor(node) if isinstance(node, torch.Tensor) else node


# copyreg's stand-ins for "call the class's __new__" (pickle's NEWOBJ opcodes): the class is the global named.
_NEWOBJ = (getattr(copyreg, "__newobj__", None), getattr(copyreg, "__newobj_ex__", None))

_MAX_REDUCE_DEPTH = 4
"""How many `__reduce__` results deep the check follows a value whose reduction holds more such values."""


def _verdict(node: Any, depth: int) -> _Refusal | None:
    """None if torch's safe loader accepts `node` back, else why not.

    A class that pickles by the default protocol (or a standard container's, or an Enum) names itself in the
    pickle, so torch's verdict on the class is its verdict on the value; the caller's own objects are then
    judged by their class, never pickled (pickling one inside save() would pickle everything it holds). A
    builtin value (a set, a slice) has no such code and pickles by opcodes of its own, so it is tried as it is.
    A class with its own `__reduce__` pickles as whatever that returns, so the reduction is what is judged:
    asked for once per type per manager, its callable (or, for `copyreg.__newobj__`, the class it names) is
    tried, and the values in its arguments and state are judged in turn.
    """
    kind = type(node)
    if is_container(node):
        return _class_verdict(kind) if _pickles_by_class(kind) else _reduced_verdict(node, depth)
    if kind.__module__ == "builtins":
        return _as_refusal(_trial(node), f"{kind.__module__}.{kind.__qualname__}")
    if issubclass(kind, enum.Enum) or _default_reduce(kind):
        return _class_verdict(kind)
    return _reduced_verdict(node, depth)


def _class_verdict(kind: type) -> _Refusal | None:
    return _as_refusal(_trial(kind), kind.__qualname__)


def _as_refusal(reason: str | None, allow: str, via_reduce: bool = False) -> _Refusal | None:
    return None if reason is None else _Refusal(reason, allow, via_reduce)


def _pickles_by_class(kind: type) -> bool:
    """Whether a `kind` instance's pickle names `kind`: its nearest `__reduce__`/`__reduce_ex__` is object's or
    one of the standard containers' (which reduce to `type(self)`), not the caller's own."""
    for k in kind.__mro__:
        if k is object:
            return True
        if "__reduce__" in vars(k) or "__reduce_ex__" in vars(k):
            return k.__module__ in _REDUCE_BY_CLASS
    return True


def _default_reduce(kind: type) -> bool:
    """Whether `kind` pickles by object's own protocol (its class named in the pickle, then its state)."""
    own = (vars(k) for k in kind.__mro__ if k is not object)
    return not any("__reduce__" in d or "__reduce_ex__" in d for d in own)


def _reduced_verdict(node: Any, depth: int) -> _Refusal | None:
    """The verdict on what `node`'s own `__reduce_ex__` returns: the global it names, then its arguments."""
    try:
        reduced = node.__reduce_ex__(TORCH_PICKLE_PROTOCOL)
    except Exception as exc:  # not picklable: the save itself names it
        logger.debug("safe-load check: %s does not reduce (%s); the save reports it", type(node), exc)
        return None
    if isinstance(reduced, str):  # pickled as the module-level global of that name
        return _as_refusal(_trial(node), f"{type(node).__module__}.{reduced}", via_reduce=True)
    if not isinstance(reduced, tuple) or len(reduced) < 2:
        return None  # pickle refuses it at the save, naming it
    func, args, *rest = reduced
    named = args[0] if func in _NEWOBJ and args else func
    refusal = _as_refusal(_trial(named), _global_name(named), via_reduce=True)
    if refusal is not None or depth <= 1:
        return refusal
    return _first_refused((args, *rest[:3]), depth - 1)


def _first_refused(parts: tuple[Any, ...], depth: int) -> _Refusal | None:
    """The first refusal among the values a reduction passes (arguments, state, items), judged as leaves are."""
    try:
        for node in nodes(parts):
            if type(node) in _PLAIN_CONTAINERS or type(node) in _ALWAYS_LOADED:
                continue
            refusal = _verdict(node, depth)
            if refusal is not None:
                return dataclasses.replace(refusal, via_reduce=True)
    except (NestingError, TypeError) as exc:  # an iterator of items, a reduction that holds itself
        logger.debug("safe-load check: a reduction's arguments are not walked (%s)", exc)
    return None


def _global_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _trial(obj: Any) -> str | None:
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
    except Exception as exc:  # not picklable (or not importable by name): the save itself names it
        logger.debug("safe-load check: %r does not pickle (%s); the save reports it", obj, exc)
        return None
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as exc:
        return _reason(str(exc))
    except Exception as exc:  # any other failure is not the safe loader's refusal
        logger.debug("safe-load check: %r could not be tried (%s)", obj, exc)
        return None
    return None


def _reason(message: str) -> str:
    """torch's one line that names the refused global, without its advice (ours follows) or terminal colours."""
    for line in message.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip().split(". ")[0].rstrip(".")[:300]
    return "refused"


def _user_stacklevel() -> int:
    """The stack level of the first frame outside this package: the caller's save()."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch_checkpointing"):
        frame, level = frame.f_back, level + 1
    return level


def _warn(key: str, path: str, kind: type, refusal: _Refusal, dict_key: tuple[Any, ...] = ()) -> None:
    """`dict_key`: (the dict key,) where that key is (or holds) the refused value, not a value under `path`."""
    name = f"{kind.__module__}.{kind.__qualname__}"
    where = f"'{key}::{path}'" if path else f"'{key}'"
    held = f"has the dict key {dict_key[0]!r:.60}, a" if dict_key else "holds a"
    pickled = f" (pickled by its own __reduce__ as {refusal.allow})" if refusal.via_reduce else ""
    warnings.warn(
        f"Item {where} {held} {name}{pickled}, which the default load of this checkpoint will refuse (torch's "
        f"safe unpickler, CheckpointLoaderConfig.weights_only=True; it says: {refusal.reason}). Before loading, "
        f"allow it with torch.serialization.add_safe_globals([{refusal.allow}]); or save it as plain data (a "
        f"dict, or JsonSerialization); or load with CheckpointLoaderConfig(weights_only=False) if you trust the "
        f"files.{conversion_hint(dict_key[0]) if dict_key else ''} (Checked on the first save of each item; said "
        f"once per type per manager.)",
        stacklevel=_user_stacklevel(),
    )
