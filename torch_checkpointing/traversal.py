"""Walking nested state: which values are containers, how a position is named, and what a DTensor holds here.

Every module that visits a state tree goes through this one, so that the save side, the load side, the
resharders and the exporters agree on three rules:

* containers are any `Mapping` (children in `items()` order) and `list`/`tuple` (children by index, named
  tuples and `torch.Size` included); everything else is a leaf, tensors and DTensors too, and so are other
  sequences and sets (a `UserList`, a `deque`, a `range`, a `set`, a `str`): the save stores such a value whole,
  and the load's merge into a template (`walk_utils`) replaces it whole; a walk that copies the tree copies such
  a value with what it shares with the tree (`map_leaves` with `WholeValues`);
* a position's dotted key joins its path components with `.`, with no leading dot while the key so far is
  empty. This is an on-disk contract: safetensors files are keyed by it, so it must never change;
* a DTensor's data on this rank is its local shard (`local_tensor`), read through DTensor's public API;
* a value no walk can finish is refused with `NestingError` (a ValueError naming the path): a container that
  contains itself (a cycle: the walk would never end, with memory growing), or nesting deeper than Python's
  recursion limit lets a recursive walk descend. A container reached twice by different paths (a shared
  subtree) is not a cycle and is walked twice.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeGuard

import torch

from torch_checkpointing.errors import NestingError
from torch_checkpointing.types import NestedPath, holds_nan

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "NestingError",
    "TreeMemo",
    "WholeValues",
    "any_leaf",
    "children",
    "distinct_leaves",
    "dotted_key",
    "find_path",
    "flatten",
    "get_path",
    "is_container",
    "is_dtensor",
    "is_sequence",
    "iter_leaves",
    "join_key",
    "local_tensor",
    "map_leaves",
    "nan_key_path",
    "nodes",
    "rebuild",
    "tree_sizes",
    "walk_sizes",
]

logger = logging.getLogger(__name__)

_SEQUENCES = (list, tuple)
"""The sequences the walk descends into; any other Sequence is a leaf (see the module docstring)."""
_CONTAINERS = (Mapping, *_SEQUENCES)


class _Cycle(Exception):
    """Raised inside the recursive walks that build no paths; the caller finds the path (`_raise_cycle`)."""


def _enter(node: Any, on_path: set[int]) -> None:
    """Mark container `node` as being walked, refusing one already on the current path (a cycle)."""
    if id(node) in on_path:
        raise _Cycle
    on_path.add(id(node))


def is_container(value: Any) -> bool:
    """Whether the walk descends into `value` (a Mapping, list or tuple)."""
    return isinstance(value, _CONTAINERS)


def is_sequence(value: Any) -> bool:
    """Whether `value` is a container whose children are indexed (a list or tuple, named tuples included)."""
    return isinstance(value, _SEQUENCES)


def children(value: Any) -> Iterable[tuple[Any, Any]]:
    """`(key or index, child)` pairs of a container, in order; nothing for a leaf."""
    if isinstance(value, Mapping):
        return value.items()
    if isinstance(value, _SEQUENCES):
        return enumerate(value)
    return ()


def iter_leaves(value: Any, path: NestedPath = ()) -> Iterator[tuple[NestedPath, Any]]:
    """`(path, leaf)` for every leaf under `value`, depth first in container order. Empty containers yield
    nothing; a bare leaf yields itself at `path`. `NestingError` for a cycle or too deep a nesting."""
    try:
        yield from _iter_leaves(value, path, set())
    except RecursionError:
        raise NestingError(path, cycle=False) from None


def _iter_leaves(value: Any, path: NestedPath, on_path: set[int]) -> Iterator[tuple[NestedPath, Any]]:
    if not is_container(value):
        yield path, value
        return
    if id(value) in on_path:
        raise NestingError(path, cycle=True)
    on_path.add(id(value))
    for k, v in children(value):
        yield from _iter_leaves(v, (*path, k), on_path)
    on_path.discard(id(value))


class _Exit:
    """Pushed under a container's children in `leaves`: popping it means the walk has left that container.
    It holds the container: one a Mapping made at the access stays alive (its id its own) while on the path."""

    __slots__ = ("node", "node_id")

    def __init__(self, node: Any) -> None:
        self.node, self.node_id = node, id(node)


def leaves(value: Any) -> Iterator[Any]:
    """Every leaf under `value`, in `iter_leaves` order, without building paths (the staging copy's hot path).

    Iterative, so any depth is walked; a cycle is a `NestingError` naming the container met again (its path
    is found only then, by `iter_leaves`)."""
    return _walk(value, with_containers=False)


def distinct_leaves(value: Any) -> Iterator[Any]:
    """The leaves `map_leaves` applies its function to, in its order: a container met again (shared under two
    paths) is not walked again, as `map_leaves` gives back the one it rebuilt the first time."""
    return _walk(value, with_containers=False, once=True)


def nodes(value: Any) -> Iterator[Any]:
    """Every container (before its children) and every leaf under `value`, `value` itself first, in
    `iter_leaves` order and without building paths: a check that judges container types too (the safe-load
    check). `NestingError` for a cycle, as `leaves`."""
    return _walk(value, with_containers=True)


def _walk(value: Any, with_containers: bool, once: bool = False) -> Iterator[Any]:
    stack = [value]
    on_path: set[int] = set()
    # With `once`: every container entered, by id, each kept alive until the walk ends. A Mapping may make its
    # values at each access: one dropped once walked would give its id to the next made, skipped as met before.
    walked: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if type(node) is _Exit:
            on_path.discard(node.node_id)
            continue
        if isinstance(node, Mapping | list | tuple):
            if id(node) in on_path:
                _raise_cycle(value)
            if once and id(node) in walked:
                continue
            if once:
                walked[id(node)] = node
            on_path.add(id(node))
            if with_containers:
                yield node
            stack.append(_Exit(node))
            stack.extend(reversed(list(node.values())) if isinstance(node, Mapping) else reversed(node))
        else:
            yield node


# The key types searched by no NaN test: the keys of almost every dict (a set difference of them is one C step).
_NO_NAN_KEYS = frozenset({str, int, bool, type(None)})


def nan_key_path(value: Any) -> NestedPath | None:
    """The path to the first dict whose keys hold a NaN (the key itself last), else None. NaN is unequal to itself:
    such a key is found again by no lookup, so a load into a template holding it restored the entry "partially"
    (missing and extra at once). Each distinct container once, its leaves judged by type in C (a list of millions
    of ints takes no Python step per entry); only a dict with a key of another type than str, int, bool or None is
    searched (numpy's NaN, a float64 or a float32 key, was saved). A cycle is left to the walks that refuse it."""
    stack: list[tuple[Any, NestedPath]] = [(value, ())]
    seen: dict[int, Any] = {}  # kept alive: a Mapping may make its values at each access
    while stack:
        node, path = stack.pop()
        if id(node) in seen or not _descends(node):
            continue
        seen[id(node)] = node
        if isinstance(node, Mapping):
            if _has_nan_key(node):
                return (*path, next(k for k in node if holds_nan(k)))
            kids: Iterable[tuple[Any, Any]] = node.items()
        else:
            kids = enumerate(node)
        if _inner_containers(node.values() if isinstance(node, Mapping) else node):
            stack.extend((v, (*path, k)) for k, v in kids if _descends(v))
    return None


_COUNT_CAP = 1 << 62


def walk_sizes(value: Any) -> tuple[int, int]:
    """(positions a tree walk of `value` visits, positions it would visit were no container reached twice):
    containers and leaves, a shared subtree counted once per path to it in the first, once in the second.

    Counted over distinct containers (iteratively, in time linear in them), never by walking: a pickle's memo
    lets 60 lists hold 2**60 paths. The first count stops growing at 2**62 (no walk gets that far). A container
    met again on its own path (a cycle) counts as a leaf here; the walks refuse it (`NestingError`)."""
    walked, distinct, _ = tree_sizes(value, nan_keys=False)
    return walked, distinct


def tree_sizes(value: Any, *, nan_keys: bool) -> tuple[int, int, bool]:
    """`walk_sizes`, and with `nan_keys` whether some dict's key is or holds NaN, in the same pass: a save's
    encode needs both, and two passes over each distinct container cost it twice. Where one is found,
    `nan_key_path` finds its path (a second pass only for the save it refuses)."""
    walked: dict[int, int] = {}
    nan_found = False
    # Every container entered, held until the count ends: a Mapping may make its values at each access, and one
    # dropped once counted would give its id to the next one made, taken for it (met again: not counted).
    entered: list[Any] = []
    distinct = 0
    stack: list[tuple[Any, list[Any] | None]] = [(value, None)] if _descends(value) else []
    while stack:
        node, inner = stack.pop()
        if inner is not None:  # done: every container in it is counted
            leaves = len(node) - len(inner)
            walked[id(node)] = min(_COUNT_CAP, 1 + leaves + sum([walked[id(c)] for c in inner]))
            distinct += 1 + leaves
        elif id(node) not in walked:
            walked[id(node)] = 1  # entered: counted as a leaf until done (a cycle back to it stays one)
            entered.append(node)
            mapping = isinstance(node, Mapping)
            if nan_keys and mapping and not nan_found:
                nan_found = _has_nan_key(node)
            inner = _inner_containers(node.values() if mapping else node)
            stack.append((node, inner))
            stack.extend((c, None) for c in inner if id(c) not in walked)
    return walked.get(id(value), 1), max(distinct, 1), nan_found


def _has_nan_key(node: Mapping[Any, Any]) -> bool:
    """Whether a key of `node` is or holds NaN; only a dict with a key of another type than str, int, bool or None
    is searched (a float, a tuple, numpy's float32 or float64; the key types judged in C, no Python step per str
    key)."""
    return bool(set(map(type, node)) - _NO_NAN_KEYS) and any(map(holds_nan, node))


def _inner_containers(kids: Iterable[Any]) -> list[Any]:
    """The children of a container the walk descends into, in order. Judged by type, once per distinct type:
    a list of millions of ints takes no Python step per entry."""
    kinds = {kind for kind in set(map(type, kids)) if kind not in _LEAF_TYPES and issubclass(kind, _CONTAINERS)}
    return [c for c in kids if type(c) in kinds] if kinds else []


_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})
_LEAF_TYPES = _SCALARS | {torch.Tensor, torch.nn.Parameter}


def _descends(value: Any) -> bool:
    """`is_container`, without an ABC check for the common leaf types (a large state has millions)."""
    kind = type(value)
    return kind is dict or kind is list or (kind not in _LEAF_TYPES and is_container(value))


def _raise_cycle(value: Any) -> NoReturn:
    """Raise the cycle's `NestingError` with its path, found by the walk that builds paths."""
    for _ in iter_leaves(value):
        pass
    raise NestingError((), cycle=True)  # the value changed between the two walks


def join_key(prefix: str, part: object) -> str:
    """One step of the dotted-key rule: `prefix.part`, or `part` alone while `prefix` is empty."""
    return f"{prefix}.{part}" if prefix else str(part)


def dotted_key(path: NestedPath) -> str:
    """The dotted key of a nested path (`("a", 0, "b")` -> `"a.0.b"`, `()` -> `""`): the name safetensors
    files store the leaf under."""
    return functools.reduce(join_key, path, "")


def flatten(value: Any, keep: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """Every leaf (or every leaf `keep` accepts) under its dotted key, DTensors as their local shards.

    Dotted keys of distinct paths can be equal (a dict key holding a dot): the later leaf wins here; the
    safetensors encoder refuses such a tree instead.
    """
    return {dotted_key(path): local_tensor(leaf) for path, leaf in iter_leaves(value) if keep is None or keep(leaf)}


def get_path(value: Any, path: NestedPath, default: Any = None) -> Any:
    """The value at `path`, or `default` where a component is absent (a missing key, an index out of range, a
    non-int index into a list, a path running through a leaf)."""
    node = value
    for comp in path:
        if isinstance(node, Mapping):
            if comp not in node:
                return default
            node = node[comp]
        elif isinstance(node, _SEQUENCES) and isinstance(comp, int) and -len(node) <= comp < len(node):
            node = node[comp]
        else:
            return default
    return node


def any_leaf(value: Any, pred: Callable[[Any], bool]) -> bool:
    """Whether `pred` holds for some leaf (stops at the first)."""
    return any(pred(leaf) for leaf in leaves(value))


@dataclass(frozen=True)
class WholeValues:
    """How `map_leaves` treats the leaves `fn` does not map (a set, a deque, an object of the caller's: values a
    walk takes whole): each is `copy(leaf, memo)`-ed, with one deepcopy memo for the walk that knows the tree.

    `mapped`: the leaf types `fn` maps (plain scalars go to `fn` as well, and are never copied). A `copy` may
    have the memo keep some of what the value holds as it is (`TreeMemo.keep`)."""

    copy: Callable[[Any, TreeMemo], Any] = copy.deepcopy
    mapped: tuple[type, ...] = (torch.Tensor,)


def map_leaves(value: Any, fn: Callable[[Any], Any], whole: WholeValues | None = None) -> Any:
    """`value` with containers rebuilt and `fn` applied to every leaf.

    Plain dicts, lists and tuples come back as such; any other container keeps its type and attributes where
    `rebuild` can make one (a defaultdict, an OrderedDict, a named tuple, a dict or list subclass), else
    becomes a dict or list, logged with its path. `NestingError` for a cycle or too deep a nesting; no paths
    are built unless one is refused or logged.

    A container reachable under several paths is rebuilt once and that one copy is put at each (`fn` is applied
    to its leaves once, in `distinct_leaves` order): what torch.save's pickle keeps shared stays shared. Before,
    each path got a copy of its own, and a save through here (an async save's staging, a sync save's written
    form) loaded back two lists where the trainer's state, and a plain torch.save of it, had one.

    With `whole`, each leaf that is neither of a `whole.mapped` type nor a plain scalar is copied
    (`WholeValues`), with one deepcopy memo for the walk that knows the tree: a container of the tree met
    inside such a value is the one rebuilt here, a mapped leaf of the tree is `fn`'s result for it (`fn` runs
    once per such object), as one pickle of the whole tree keeps them. Before, a list or tensor both in the
    tree and inside a set or an object loaded back as two.
    """
    fell_back: list[Any] = []
    walk = _Rebuilt(set(), fell_back, {})
    if whole is not None:
        memo = TreeMemo(value, whole.mapped, lambda node: _made_for(node, fn, walk))
        walk.whole = _Whole(whole, memo)
    try:
        out = _map_leaves(value, fn, walk)
    except RecursionError:
        raise NestingError((), cycle=False) from None
    except _Cycle:
        _raise_cycle(value)
    finally:
        # The memo holds what the walk made (staged tensors over a slab): let it go with the walk, now, not at
        # the next garbage collection (it and the walk refer to each other).
        walk.whole = None
    for original in fell_back:
        _log_fallback(original, find_path(value, original))
    return out


@dataclass
class _Rebuilt:
    """What one `map_leaves` walk keeps: the containers on the current path (a cycle), those that fell back to
    a plain dict or list (logged after), and each container rebuilt so far by its id, with the original it was
    rebuilt from: held until the walk ends, so that no id is reused. A Mapping may make its values at each
    access; one dropped once rebuilt gave its id to the next one made, which got the first one's copy."""

    on_path: set[int]
    fell_back: list[Any]
    done: dict[int, tuple[Any, Any]]
    whole: _Whole | None = None


@dataclass
class _Whole:
    """How a `map_leaves` walk copies the values it takes whole, and the memo those copies share."""

    how: WholeValues
    memo: TreeMemo


_NOT_MADE = object()


class TreeMemo(dict[int, Any]):
    """A deepcopy memo that knows a tree: asked for a container or tensor of the tree that the walk has not made
    yet, it has the walk make it first (`make`), so a copy of a whole value holds what the tree holds.

    The tree's nodes are found on the first question about an id not in the memo (a walk of the tree, run only
    for a state holding a value taken whole). A container the walk is inside of (a cycle through a value taken
    whole) is not made: deepcopy copies it, as it would without the tree."""

    def __init__(self, root: Any, mapped: tuple[type, ...], make: Callable[[Any], Any]) -> None:
        super().__init__()
        self._root, self._mapped, self._make = root, mapped, make
        self._nodes: dict[int, Any] | None = None
        self._container_ids: set[int] | None = None
        self.kept: list[Any] = []  # every original whose id is a key here, alive while the walk runs

    def remember(self, original: Any, made: Any) -> None:
        dict.__setitem__(self, id(original), made)
        self.kept.append(original)

    def keep(self, objects: Iterable[Any]) -> None:
        """Have a copy through this memo share each of `objects` the tree does not hold with the value copied:
        one of the tree is still what the walk made for it."""
        nodes = self._tree_nodes()
        for obj in objects:
            if id(obj) not in nodes and not dict.__contains__(self, id(obj)):
                self.remember(obj, obj)

    def holds_a_container_of_the_tree(self, ids: set[int]) -> bool:
        """Whether one of the objects whose ids are `ids` (all alive) is a container of the tree. Set against
        set, which costs the smaller of the two: matched against the tree's node dict, it walked every node once
        per value taken whole, and an item holding a small object per layer cost layers x nodes to hand over."""
        if not ids:
            return False
        if self._container_ids is None:
            self._container_ids = {i for i, node in self._tree_nodes().items() if is_container(node)}
        return not ids.isdisjoint(self._container_ids)

    def in_tree(self, obj: Any) -> bool:
        """Whether `obj` is a node of the tree (a container of it, or a leaf of a mapped type)."""
        return id(obj) in self._tree_nodes()

    def forget_since(self, size: int) -> None:
        """Drop the copies added since the memo held `size` entries: a copy that failed partway left objects it
        had made but not filled, which a later copy through the memo would take for finished ones. What the walk
        made for the tree's nodes meanwhile stays: each is whole."""
        nodes = self._tree_nodes()
        for key in list(self)[size:]:
            if key not in nodes:
                dict.__delitem__(self, key)

    def _tree_nodes(self) -> dict[int, Any]:
        if self._nodes is None:
            nodes = _walk(self._root, True, once=True)
            self._nodes = {id(n): n for n in nodes if isinstance(n, (*_CONTAINERS, *self._mapped))}
        return self._nodes

    def _fill(self, key: object) -> None:
        if not isinstance(key, int) or dict.__contains__(self, key):
            return
        node = self._tree_nodes().get(key)
        if node is not None:
            self._make(node)  # remembers what it made here, unless it made nothing

    def get(self, key: int, default: Any = None) -> Any:
        self._fill(key)
        return dict.get(self, key, default)

    def __getitem__(self, key: int) -> Any:
        self._fill(key)
        return dict.__getitem__(self, key)

    def __contains__(self, key: object) -> bool:
        self._fill(key)
        return dict.__contains__(self, key)


def _made_for(node: Any, fn: Callable[[Any], Any], walk: _Rebuilt) -> Any:
    """What the walk gives for a node of the tree, made now if not yet: `_NOT_MADE` for a container that holds
    one the walk is inside of (a cycle through the value taken whole, which deepcopy then copies itself)."""
    if not is_container(node):
        return _map_leaf(node, fn, walk)
    if id(node) in walk.on_path:
        return _NOT_MADE
    inside = set(walk.on_path)
    try:
        return _map_leaves(node, fn, walk)
    except _Cycle:
        walk.on_path.intersection_update(inside)  # what it had entered (the containers it made are whole)
        return _NOT_MADE


def _map_leaf(value: Any, fn: Callable[[Any], Any], walk: _Rebuilt) -> Any:
    whole = walk.whole
    if whole is None or type(value) in _SCALARS:
        return fn(value)
    if not isinstance(value, whole.how.mapped):
        return whole.how.copy(value, whole.memo)
    made = dict.get(whole.memo, id(value), _NOT_MADE)
    if made is _NOT_MADE:
        made = fn(value)
        whole.memo.remember(value, made)
    return made


def _map_leaves(value: Any, fn: Callable[[Any], Any], walk: _Rebuilt) -> Any:
    if not isinstance(value, _CONTAINERS):
        return _map_leaf(value, fn, walk)
    if id(value) in walk.done:
        return walk.done[id(value)][1]
    _enter(value, walk.on_path)
    out: Any
    if isinstance(value, Mapping):
        items = {k: _map_leaves(v, fn, walk) for k, v in value.items()}
        out = items if type(value) is dict else _rebuilt_or_plain(value, items, walk.fell_back)
    else:
        items_list = [_map_leaves(v, fn, walk) for v in value]
        plain = type(value) in _SEQUENCES
        out = type(value)(items_list) if plain else _rebuilt_or_plain(value, items_list, walk.fell_back)
    walk.on_path.discard(id(value))
    walk.done[id(value)] = (value, out)
    if walk.whole is not None:
        walk.whole.memo.remember(value, out)
    return out


def _rebuilt_or_plain(original: Any, items: dict[Any, Any] | list[Any], fell_back: list[Any]) -> Any:
    try:
        return _rebuilt(original, items)
    except Exception:  # a type none of the ways builds: the caller logs it with its path
        fell_back.append(original)
        return _plain(items)


def rebuild(original: Any, items: dict[Any, Any] | list[Any], where: str = "") -> Any:
    """A container of `original`'s type and attributes holding `items` (a dict for a Mapping, a list for a
    sequence), so that every walk of a tree gives back what a pickle of the tree itself would.

    * a dict or list subclass (defaultdict, OrderedDict, Counter, one of the caller's): a shallow copy of
      `original` (its `default_factory`, its instance attributes), emptied and refilled with `items`;
    * a named tuple through `_make`; another tuple subclass (torch.Size, a torch `return_types` value) from
      its items, with the instance attributes it has that its constructor did not set;
    * any other Mapping or sequence from its items, as one argument.

    A type none of these builds comes back as a dict or list, and a warning on the `torch_checkpointing` logger
    names `where` (the dotted path, when the caller knows it) and the type: never silently.
    """
    try:
        return _rebuilt(original, items)
    except Exception:  # a type none of the ways builds: the plain equivalent serves, and that is said
        _log_fallback(original, where)
        return _plain(items)


def _rebuilt(original: Any, items: dict[Any, Any] | list[Any]) -> Any:
    kind = type(original)
    if isinstance(original, dict | list):
        try:
            return _refilled_copy(original, items)
        except Exception:  # its copy fails (its own __reduce_ex__ refuses): its constructor may still build it
            pass
    if isinstance(original, tuple) and hasattr(kind, "_make"):
        return kind._make(items)
    built = kind(items)
    if type(built) is not kind:
        raise TypeError(f"{kind.__name__}(items) gave {type(built).__name__}")
    if isinstance(original, tuple) and getattr(original, "__dict__", None):
        # A tuple holds its items itself, so its attributes are its own; a Mapping built from its items may
        # keep them in an attribute, which the constructor just set.
        for name, attribute in vars(original).items():
            vars(built).setdefault(name, attribute)
    return built


def _refilled_copy(original: dict[Any, Any] | list[Any], items: dict[Any, Any] | list[Any]) -> Any:
    """A shallow copy of a dict or list subclass (its `default_factory`, its attributes), refilled with `items`."""
    out = copy.copy(original)  # a new object (a dict or list subclass copies its items, never aliases them)
    if type(out) is not type(original) or out is original:
        raise TypeError(f"copy.copy gave {type(out).__name__}")
    # The base class's own methods: an override (say one mirroring into an attribute the copy shares with
    # `original`) must not run on the caller's state.
    if isinstance(out, dict):
        dict.clear(out)
        dict.update(out, items)
    else:
        list.clear(out)
        list.extend(out, items)
    return out


def _plain(items: dict[Any, Any] | list[Any]) -> dict[Any, Any] | list[Any]:
    return dict(items) if isinstance(items, dict) else list(items)


def _log_fallback(original: Any, where: str) -> None:
    kind = type(original)
    logger.warning(
        "The %s at '%s' cannot be rebuilt as its own type (neither a copy refilled with its items, nor its "
        "constructor given them): it is saved, or returned by a load, as a plain %s. Use a dict or list, or give "
        "%s a constructor taking its items.",
        f"{kind.__module__}.{kind.__qualname__}",
        where or "<unnamed path>",
        "dict" if isinstance(original, Mapping) else "list",
        kind.__qualname__,
    )


def find_path(root: Any, node: Any) -> str:
    """The dotted path of `node` (found by identity: a container, or a leaf object) under `root`, "" where it is
    `root` or is not found: to name a value in a warning or a log line, never on a hot path."""
    stack: list[tuple[NestedPath, Any]] = [((), root)]
    while stack:
        path, here = stack.pop()
        if here is node:
            return dotted_key(path)
        if is_container(here):
            stack.extend(reversed([((*path, k), v) for k, v in children(here)]))  # the first in walk order wins
    return ""


def _dtensor_type() -> type | None:
    """DTensor's class once its module is loaded; until then no DTensor can exist, so none is looked for.

    Importing `torch.distributed.tensor` costs about a second (it pulls in sympy): a load, a staging copy or
    the writer process that holds no DTensor must not pay it.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """Whether `value` is a DTensor (False where this torch build has no distributed support)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(value, dtensor)


def local_tensor(value: Any) -> Any:
    """A DTensor's local shard (the tensor sharing its memory, not a copy); any other value unchanged.

    `to_local()` under no_grad is the DTensor's own local tensor: no autograd view is built, so what the
    caller copies into or out of is the shard itself.
    """
    if not is_dtensor(value):
        return value
    with torch.no_grad():
        return value.to_local()


def is_dense_data(t: torch.Tensor) -> bool:
    """Whether a tensor is dense (strided), not quantized or nested, with data: its values are its memory."""
    return t.layout == torch.strided and not t.is_quantized and not t.is_nested and t.device.type != "meta"


def freed_storage_said(t: torch.Tensor) -> str:
    """What is wrong with a tensor `storage_freed` finds, for the messages that refuse it."""
    return (
        f"a tensor of shape {tuple(t.shape)} whose storage holds {t.untyped_storage().nbytes()} bytes, fewer than "
        f"its elements need (freed with untyped_storage().resize_(0), as FSDP does with unsharded parameters)"
    )


def storage_freed(t: torch.Tensor) -> bool:
    """Whether a dense tensor's storage is too small for its elements (freed with `untyped_storage().resize_(0)`,
    as FSDP frees unsharded parameters): copying or pickling it crashed the process or sent garbage."""
    if t.layout != torch.strided or t.is_nested or t.is_meta:  # checked on every save: the cheap tests first
        return False
    count = t.numel()
    if count == 0:
        return False
    have, offset, size = t.untyped_storage().nbytes(), t.storage_offset(), t.element_size()
    if t.is_contiguous():
        return have < (offset + count) * size
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return have < (offset + extent) * size
