"""A save-time warning for values that the default (safe) load of the same checkpoint will refuse.

Torch files are read with torch's safe unpickler (`CheckpointLoaderConfig.weights_only=True`), which refuses
classes it does not know: an `argparse.Namespace` of hyper-parameters, a dataclass, an Enum. The save pickles
them without complaint, so the refusal surfaced only at resume time, on a checkpoint that may be the only one
left. Each such type is tried once per manager against torch's own safe loader (no list of ours to drift from
torch's), and a warning names the item, the path and the fix when the checkpoint is written, not when it is read.
"""

from __future__ import annotations

import enum
import io
import logging
import pickle
import sys
import warnings
from types import FrameType
from typing import Any

import torch

from torch_checkpointing.checkpoint_layout import TorchSerialization
from torch_checkpointing.schema import ResolvedItem
from torch_checkpointing.traversal import NestingError, find_path, is_container, nodes

__all__ = ["SafeLoadCheck"]

logger = logging.getLogger(__name__)

# Containers the walk descends into that pickle by opcodes of their own: never a global to refuse.
_PLAIN_CONTAINERS = (dict, list, tuple)
# Modules whose containers' own `__reduce__` names their class, as the default protocol does (defaultdict,
# OrderedDict, Counter, a torch `return_types` value): their class's verdict is the container's.
_REDUCE_BY_CLASS = ("builtins", "collections", "torch.return_types")

# Leaf types the safe unpickler always accepts: checked without a trial (the common, tensor-only state).
_ALWAYS_LOADED = (
    *(torch.Tensor, int, float, bool, str, bytes, complex, type(None)),
    *(torch.dtype, torch.device, torch.Size),
)


class SafeLoadCheck:
    """Checks each item on the first save that holds it, and tries each leaf and container type once per manager.

    Once per item, not on every save: the walk over a state's leaves cost 0.3 ms of every save()'s blocked
    time (192 leaves), against a 1 ms budget for saves that copy nothing; an item's leaf types rarely change
    between saves of one job.
    """

    def __init__(self) -> None:
        self._verdicts: dict[type, str | None] = {}  # type -> torch's reason to refuse it, None if it loads
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
            kind = type(node)
            if kind in _PLAIN_CONTAINERS or isinstance(node, _ALWAYS_LOADED) or kind in self._verdicts:
                continue
            reason = self._verdicts[kind] = _container_refusal(kind) if is_container(node) else _refusal(node)
            if reason is not None:
                _warn(item.key, find_path(item.value, node), kind, reason)


def _container_refusal(kind: type) -> str | None:
    """None if torch's safe loader accepts a container of class `kind` back, else its reason: the class is
    tried, never the caller's container (whose pickle would run its `__reduce__` and pickle everything in it).
    A class whose own `__reduce__` may pickle it as another type is not judged (no warning), as for leaves."""
    return _trial(kind) if _pickles_by_class(kind) else None


def _pickles_by_class(kind: type) -> bool:
    """Whether a `kind` instance's pickle names `kind`: its nearest `__reduce__`/`__reduce_ex__` is object's or
    one of the standard containers' (which reduce to `type(self)`), not the caller's own."""
    for k in kind.__mro__:
        if k is object:
            return True
        if "__reduce__" in vars(k) or "__reduce_ex__" in vars(k):
            return k.__module__ in _REDUCE_BY_CLASS
    return True


def _refusal(leaf: Any) -> str | None:
    """None if torch's safe loader accepts `leaf` back, else its reason.

    The caller's own objects are judged by their class, never pickled: pickling one inside save() would run its
    `__reduce__` (side effects, cost, and a read of a requires_copy=False value before save() returns that the
    engine itself makes later). A class that pickles by the default protocol, or an Enum, names itself in the
    pickle, so torch's verdict on the class is its verdict on the value; a class with its own `__reduce__` may
    pickle as anything, so it is not judged (no warning). A builtin value (a set, a slice) has no such code and
    pickles by opcodes of its own, so it is tried as it is.
    """
    kind = type(leaf)
    if kind.__module__ == "builtins":
        return _trial(leaf)
    if issubclass(kind, enum.Enum) or _default_reduce(kind):
        return _trial(kind)
    return None


def _default_reduce(kind: type) -> bool:
    """Whether `kind` pickles by object's own protocol (its class named in the pickle, then its state)."""
    own = (vars(k) for k in kind.__mro__ if k is not object)
    return not any("__reduce__" in d or "__reduce_ex__" in d for d in own)


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


def _warn(key: str, path: str, kind: type, reason: str) -> None:
    name = f"{kind.__module__}.{kind.__qualname__}"
    where = f"'{key}::{path}'" if path else f"'{key}'"
    warnings.warn(
        f"Item {where} holds a {name}, which the default load of this checkpoint will refuse (torch's safe "
        f"unpickler, CheckpointLoaderConfig.weights_only=True; it says: {reason}). Before loading, allow it with "
        f"torch.serialization.add_safe_globals([{kind.__qualname__}]); or save it as plain data (a dict, or "
        f"JsonSerialization); or load with CheckpointLoaderConfig(weights_only=False) if you trust the files. "
        f"(Checked on the first save of each item; said once per type per manager.)",
        stacklevel=_user_stacklevel(),
    )
