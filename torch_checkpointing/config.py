"""Every configuration dataclass of the savers and the loader, in one module.

One module so that building a configuration (in a launcher, a config system, a test) imports neither torch
nor the writer-process stack. `CheckpointStagerConfig`, `CheckpointWriterConfig` and `CheckpointProcessConfig`
are also importable from `staging`, `checkpoint_writer` and `checkpoint_process`, where they used to live.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import numbers
import operator
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from torch_checkpointing.errors import ConfigError, ConfigTypeError

if TYPE_CHECKING:  # barriers imports torch.distributed; the type is needed for annotations only
    from torch_checkpointing.barriers import BarrierConfig

__all__ = [
    "DEFAULT_WAIT_TIMEOUT_SECS",
    "AsyncCheckpointSaverConfig",
    "CheckpointLoaderConfig",
    "CheckpointProcessConfig",
    "CheckpointSaverConfig",
    "CheckpointStagerConfig",
    "CheckpointWriterConfig",
    "SyncCheckpointSaverConfig",
]

DEFAULT_WAIT_TIMEOUT_SECS = 600
_DEFAULT_METRIC_PREFIX = "train.checkpoint_write"
_DEFAULT_BARRIER_TIMEOUT_SECS = 600


# What the engine noted about a configuration object (the fields it warned about, a value it filled in), by the
# object's id, dropped with the object. Kept in the object's own `__dict__`, the notes broke rebuilding a config
# from its fields, `type(c)(**vars(c))` ("unexpected keyword argument '_protocol_taken'").
_NOTES: dict[int, dict[str, Any]] = {}
_WARNED = "warned"  # the note of the fields a config was warned about
# Held while a note is made and while `warn_once` reads, warns and notes: two threads building managers from one
# config both read "not said" and warned twice, and two first notes of one object each made a dict, one lost.
# Reentrant: a `showwarning` hook may itself build a config.
_NOTES_LOCK = threading.RLock()


def _new_notes_lock() -> None:
    """(In a child just forked.) A fresh lock: one held by another thread of the parent at the fork (warning, in a
    `showwarning` hook) stayed held in the child for good, where no thread is left to release it."""
    global _NOTES_LOCK
    _NOTES_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):  # POSIX: nothing forks elsewhere
    os.register_at_fork(after_in_child=_new_notes_lock)


@contextlib.contextmanager
def notes_held() -> Iterator[None]:
    """Hold the notes' lock (the one `warn_once` holds) while a check reads a note, decides on it, and writes it:
    two threads checking one config at once otherwise each read the other's half-done work, and one's note was
    lost (`FsspecStorageConfig`'s "protocol taken"). Reentrant; the lock a fork leaves to the child is a new one."""
    with _NOTES_LOCK:
        yield


def notes_of(config: object) -> dict[str, Any]:
    """The engine's notes about `config` (a dataclass instance: any object that takes a weak reference)."""
    key = id(config)
    with _NOTES_LOCK:
        notes = _NOTES.get(key)
        if notes is None:
            # first: an object without weak references raises here, before a note kept by an id that another
            # object takes once this one is gone
            weakref.finalize(config, _NOTES.pop, key, None)
            notes = _NOTES[key] = {}
        return notes


class CarriesNotes:
    """A config whose copies (`copy.copy`, `copy.deepcopy`, a pickle: what the async writer process receives)
    carry the engine's notes about it, outside its `__dict__` still. A note that decides a check run again (the
    protocol `FsspecStorageConfig` filled in from its url) was lost on a copy: the copy's edited url was refused
    as naming another protocol than the one its first url filled in."""

    def __getstate__(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Fields and notes as one: a check rewrites both under the notes' lock (`notes_held`), and a copy taken
        meanwhile without it caught the check half-way (an `FsspecStorageConfig` whose protocol it had cleared)."""
        with _NOTES_LOCK:
            return dict(vars(self)), dict(_NOTES.get(id(self), {}))

    def __setstate__(self, state: tuple[dict[str, Any], dict[str, Any]] | dict[str, Any]) -> None:
        fields, notes = state if isinstance(state, tuple) else (state, {})  # a pickle from before: fields alone
        vars(self).update(fields)
        if notes:
            notes_of(self).update(notes)


def warn_ignored(config: object, field_name: str, why: str) -> None:
    """A field kept for configs written against the published release, which the engine does not read: warned
    about once per config object. `recheck` runs the checks again at every manager build, and a script building
    one manager per evaluation from one config was told once per manager (under `-W always`; under the default
    filters once more, at a line inside the engine)."""
    warn_once(config, field_name, f"{field_name} is ignored and will be removed: {why}", FutureWarning)


def warn_once(config: object, key: str, message: str, category: type[Warning]) -> None:
    """Warn about `config` once per object for `key`, naming the user's line (`_callers_level`). A copy made
    after the warning (a manager's `snapshot`) keeps the note as it was, so a check run again on it stays quiet;
    what is warned on one of them after the copy is noted on that one only (a shared set took a field warned on
    the copy as said on the original). Noted only where no filter ignored it (`_ignored_at`)."""
    with _NOTES_LOCK:  # read, warn and note as one: a second thread read "not said" meanwhile, and warned too
        said: frozenset[str] = notes_of(config).get(_WARNED, frozenset())
        if key in said:
            return
        level = _callers_level()
        ignored = _ignored_at(message, category, level)
        warnings.warn(message, category, stacklevel=level)
        if not ignored:  # after: under `-W error` the warning is raised, and each build from the config raises it
            notes_of(config)[_WARNED] = said | {key}  # a new set: a snapshot keeps what was said before it only


def _ignored_at(message: str, category: type[Warning], level: int) -> bool:
    """Whether the filters in force ignore `message` warned at `stacklevel=level` of `warn_once`'s caller (the
    first filter matching it decides, as in `warnings`). A config built inside `catch_warnings()` with "ignore"
    was noted as told, and no later check outside it said anything: Python itself forgets what a filter ignored
    once the filters change."""
    try:  # level 1 is `warn_once`, as this function is called from there
        frame = sys._getframe(level)
        module, lineno = frame.f_globals.get("__name__", "<string>"), frame.f_lineno
    except ValueError:  # no frame outside the engine: `warnings` names "sys", line 1
        module, lineno = "sys", 1
    for action, text, cls, mod, line in warnings.filters:
        if (
            (text is None or text.match(message))
            and issubclass(category, cls)
            and (mod is None or mod.match(module))
            and line in (0, lineno)
        ):
            return action == "ignore"
    return bool(getattr(warnings, "defaultaction", "default") == "ignore")  # not in the stubs


def _callers_level() -> int:
    """The `stacklevel` naming the first frame outside the engine (the user's line that built or edited the
    config, or built the manager): a fixed level named a line of `recheck` when the check ran from there."""
    frame: FrameType | None = sys._getframe(2)  # level 1 is `warn_ignored`, the caller of `warnings.warn`
    level = 2
    while frame is not None and _in_the_engine(frame):
        level, frame = level + 1, frame.f_back
    return level


def _in_the_engine(frame: FrameType) -> bool:
    """A frame of the engine's code, or a dataclass's generated `__init__` (compiled from a string)."""
    if frame.f_globals.get("__name__", "").split(".")[0] == __name__.split(".")[0]:
        return True
    code = frame.f_code
    return (
        code.co_name == "__init__"
        and code.co_filename.startswith("<")
        and dataclasses.is_dataclass(frame.f_locals.get("self"))
    )


def check_bool(owner: str, name: str, value: object, *, allow_none: bool = False) -> None:
    """A flag must be a real bool: `"no"` is truthy, so a string or a number would silently mean True."""
    if isinstance(value, bool) or (allow_none and value is None):
        return
    also = " or None" if allow_none else ""
    raise ConfigTypeError(f"{owner}.{name} must be True or False{also}, got {value!r}.")


def integer_as_int(value: Any) -> Any:
    """`value` as the int it stands for when it is one integer (numpy's integers, an IntEnum's member, a 0-d
    integer tensor, anything with `__index__`) but no bool; anything else as it is, for the field's check to
    refuse. The one rule for every integer of the public API, records and call arguments alike: a training
    loop's step or count is often a numpy value or a 0-d tensor. A sharding or plan computed with numpy
    (`np.cumsum` of the shard sizes) was refused at save and at load ("must hold ints only, got int64"), though
    torch slices with any such integer."""
    if type(value) is int or not hasattr(type(value), "__index__") or not _integer_scalar(value):
        return value
    try:
        return operator.index(value)
    except MemoryError:
        raise
    except Exception:  # an `__index__` that refuses, or has no value to give: no integer here
        # TypeError for a tensor of more than one element; a fake or traced tensor (torch.compile's) holds no value
        # and raised torch's bare DataDependentOutputException (a RuntimeError), naming neither argument nor fix.
        return value


def _integer_scalar(value: Any) -> bool:
    """Whether `value`, which has `__index__`, is one integer and no bool. torch's `Tensor.__index__` also gives an
    int for a 0-d bool tensor (a comparison's result) and for a one-element tensor of any shape: a rank of
    `torch.tensor(True)` read shard 1, where `True` and numpy's bool are refused, and a `torch.tensor([2])` of sizes
    was refused as "got int 2". numpy refuses its one-element arrays itself. A meta tensor holds no value to
    read: its `__index__` raised torch's bare RuntimeError, naming neither the argument nor the fix."""
    if type(value).__name__ in ("bool", "bool_") or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return False
    if getattr(value, "is_meta", False) is True:
        return False
    return getattr(value, "ndim", 0) == 0


def real_as_number(what: str, value: Any) -> Any:
    """`value` as the int or float a number of seconds is kept as: an integer scalar as its int (`integer_as_int`),
    any other real number but a bool (numpy's float32, a `Fraction`: `numbers.Real`) as its float; anything else
    as it is, for the caller's check to refuse. np.float64 (a float subclass) was taken and np.float32 refused,
    though every wait uses a number of seconds only as a float. A `Decimal` is no `numbers.Real` (it does not
    mix with floats) and stays refused, as the stdlib's waits refuse it."""
    value = integer_as_int(value)
    if isinstance(value, (bool, int)):
        return value
    if not isinstance(value, numbers.Real):
        value = _float_scalar(value)
        if not isinstance(value, float):
            return value
    try:
        result = float(value)
    except OverflowError:  # a Fraction (or another Real) past what a float holds
        result = math.inf
    if math.isinf(result) and value != result:  # numpy's longdouble gave inf in silence: no limit at all
        raise ConfigError(
            f"{what} is {value!r:.80}, past what a float holds (about 1.8e308); pass a number of seconds that fits "
            f"a float (math.inf where the argument takes it for 'never')."
        )
    return result


def _float_scalar(value: Any) -> Any:
    """A 0-d floating tensor or numpy array as its float, as `integer_as_int` takes a 0-d integer one (a
    timeout computed with torch: `torch.tensor(2)` was taken, `torch.tensor(2.0)` refused); anything else as it
    is. One that holds no value (a fake tensor) stays as it is, for the caller to refuse."""
    dtype = getattr(value, "dtype", None)
    floating = getattr(dtype, "is_floating_point", False) is True or getattr(dtype, "kind", None) == "f"
    if not floating or getattr(value, "ndim", None) != 0 or not hasattr(value, "item"):
        return value
    try:
        return float(value.item())  # item(): float() of a tensor that requires grad warns
    except MemoryError:
        raise
    except Exception:
        return value


def literal_tilde(path: str) -> str:
    """A normalised local `path` with the `./` that `normpath` and `Path` drop put back before a leading `~`.

    `./~/run` is a folder named `~`; normalised to `~/run` it names the home directory wherever it is used again
    (a listing's path loaded back, retention's root): retention of saves under `./~/run` pruned the home
    directory's `run/`."""
    return f"./{path}" if path.startswith("~") else path


def home_expanded(path: str | os.PathLike[str]) -> str:
    """`path` as text, a leading `~` of a `str` the home directory (as a shell reads it); a `Path`'s `~` is a
    folder of that name, as pathlib and `open()` read it (`.expanduser()` is how a Path names the home directory).

    `Path("./~/run")` is `~/run` to pathlib (the `./` dropped), and expanded, `delete_checkpoint(Path("./~/run/
    step_3"))` deleted the home directory's `run/step_3`, a checkpoint the caller never named."""
    if isinstance(path, str):
        return os.path.expanduser(path)
    return literal_tilde(os.fspath(path))


def refuse_unencodable(what: str, path: str | os.PathLike[str]) -> None:
    """Refuse a path holding a lone surrogate (one outside U+DC80..U+DCFF, the bytes of a name that is no UTF-8),
    which no file name can hold: it failed at its first use, as a bare UnicodeEncodeError naming nothing."""
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        text = os.fspath(path)
        raise ConfigError(
            f"{what} {text!r} holds {text[exc.start]!r}, a lone surrogate that no path can hold; remove it."
        ) from None


# The longest wait a pipe's poll() or a lock's acquire() takes (2**31 ms is about 24.8 days): a timeout past it
# failed inside close() or the writer's start with a bare OverflowError, after the config had been accepted.
MAX_OS_WAIT_S = 2_000_000


def check_number(
    owner: str,
    name: str,
    value: object,
    *,
    positive: bool = False,
    integer: bool = False,
    at_most: float | None = None,
) -> Any:
    """A count or a timeout: a real, finite number, non-negative (or `positive`), not over `at_most`; bools and
    strings are refused. Returns it as the caller keeps it: an integer scalar (numpy's, a 0-d tensor) as its
    int, which a config pickled to the writer process or dumped as JSON must hold."""
    kinds = (int,) if integer else (int, float)
    what = "an int" if integer else "a number of seconds"
    value = integer_as_int(value) if integer else real_as_number(f"{owner}.{name}", value)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ConfigTypeError(f"{owner}.{name} must be {what}, got {value!r} ({type(value).__name__}).")
    if not integer:
        refuse_past_a_float(f"{owner}.{name}", value)
    elif isinstance(value, int) and value > sys.maxsize:  # counts go to reads and thread pools: a C ssize_t
        raise ConfigError(
            f"{owner}.{name} must be at most sys.maxsize ({sys.maxsize}), got an int of {value.bit_length()} bits."
        )
    if (isinstance(value, float) and not math.isfinite(value)) or value < 0 or (positive and value == 0):
        bound = "positive" if positive else "non-negative"
        raise ConfigError(f"{owner}.{name} must be a finite, {bound} number, got {value!r}.")
    if at_most is not None and value > at_most:
        raise ConfigError(
            f"{owner}.{name} must be at most {at_most:g} seconds (about {at_most / 86400:.0f} days: the longest wait "
            f"the operating system's pipe and lock waits take), got {value!r}."
        )
    return value


def refuse_past_a_float(what: str, value: object) -> None:
    """Refuse an int of seconds past what a float holds: every wait takes its seconds as a float, and such an int
    raised a bare OverflowError ("int too large to convert to float") naming no argument, at the check or later
    where the wait began (a manager's build)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return
    try:
        float(value)
    except OverflowError:
        raise ConfigError(
            f"{what} is an int of {abs(value).bit_length()} bits, past what a float holds (about 1.8e308); pass a "
            f"number of seconds that fits a float (math.inf where the argument takes it for 'never')."
        ) from None


def wait_seconds(what: str, value: object) -> float | None:
    """A wait's timeout as a float (None: no limit). Waits compute a deadline from it: NaN compared false with
    every deadline and waited forever, an int past what a float holds raised a bare OverflowError, and a str a
    bare TypeError, none naming the argument. A negative one times out at once, as the stdlib's waits do."""
    if value is None:
        return None
    value = real_as_number(what, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{what} must be a number of seconds or None (no limit), got {value!r}.")
    refuse_past_a_float(what, value)
    if math.isnan(value):
        raise ConfigError(f"{what} is NaN, which no wait ever reaches; pass a number of seconds, or None for no limit.")
    return float(value)


_N = TypeVar("_N", int, float)


def read_number(text: str, kind: Callable[[str], _N]) -> _N:
    """`kind(text)` (int or float) of a number as typed: ASCII digits, no `_`, no padding. Python's own reading
    takes any Unicode decimal digit (a full-width 5) and `1_0` as 10: a number nobody wrote, used silently."""
    if not text.isascii() or "_" in text or text != text.strip():
        raise ValueError(f"{text!r} is not a number written in the digits 0-9")
    return kind(text)


def check_text(owner: str, name: str, value: object) -> None:
    """A non-empty str (a thread name, a prefix)."""
    if not isinstance(value, str) or not value:
        raise ConfigTypeError(f"{owner}.{name} must be a non-empty str, got {value!r}.")


def check_instance(owner: str, name: str, value: object, cls: type, fix: str) -> None:
    """A nested configuration object: None here would fail much later, inside the saver or the writer process."""
    if not isinstance(value, cls):
        raise ConfigTypeError(f"{owner}.{name} must be a {cls.__name__}, got {value!r}. {fix}")


def recheck(config: object) -> None:
    """Run the checks of a configuration dataclass and of every one it holds again, as at construction.

    Users edit a config after building it (`config.save.process_config.x = ...`), which `__post_init__` never
    sees: `subprocess_shutdown_timeout_secs = math.inf` set so was taken by the manager, and its close() raised a
    bare OverflowError from the lock's wait. Whoever builds from a config calls this first, so an edited field is
    refused with the same error, naming it, as at construction. Only the engine's own checks run again (the
    nearest `__post_init__` of ours in the class's MRO): a user's subclass's may not be safe to run twice."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return
    for f in dataclasses.fields(config):
        recheck(getattr(config, f.name, None))
    for cls in type(config).__mro__:
        if "__post_init__" in vars(cls) and cls.__module__.split(".")[0] == "torch_checkpointing":
            vars(cls)["__post_init__"](config)
            return


_D = TypeVar("_D")


def snapshot(config: _D) -> _D:
    """A copy of a configuration dataclass and of every one it holds, and of the dicts and lists in them; any
    other value (a callback, a client) is shared. What a manager builds its saver, writer process, loader and
    storage from, so that an edit of the caller's config never reaches a running manager half-way (its close()
    read a timeout set since, and raised; a writer restarted after a crash took `storage_options` edited since,
    while the trainer kept the first)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return config
    made = copy.copy(config)
    noted = _NOTES.get(id(config))
    if noted:  # only where there are any: a user's dataclass in a config's dict may take no weak reference (slots)
        notes_of(made).update(noted)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        if isinstance(value, (dict, list)) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
            object.__setattr__(made, f.name, _copied(value))  # frozen ones too
    return made


def _copied(value: Any) -> Any:
    """`value` with its dicts, lists and configuration dataclasses copied, all the way down (`snapshot`)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()} if type(value) is dict else copy.copy(value)
    if isinstance(value, list):
        return [_copied(v) for v in value] if type(value) is list else copy.copy(value)
    return snapshot(value)


def _cuda_available() -> bool:
    """Imports torch only when a default is actually computed (constructing the config), not on import."""
    import torch

    return torch.cuda.is_available()


@dataclass
class CheckpointStagerConfig:
    """How `requires_copy=True` values are copied before an async write: memory kind and scheduling."""

    use_pinned_memory: bool = field(default_factory=_cuda_available)
    use_shared_memory: bool = True
    # False: save() returns once the copy is done, so the loop may mutate right away (the design document's
    # promise for requires_copy=True). True: the copy overlaps the caller's next work, and in-place updates
    # must then go inside CheckpointManager.lock(), which waits for the copy.
    use_async_staging: bool = False
    use_non_blocking_copy: bool = field(default_factory=_cuda_available)
    thread_name: str = "ckpt-staging"
    metric_prefix: str = _DEFAULT_METRIC_PREFIX  # ignored (the engine reports no metrics); warns when set
    # Where the shared staging slab lives (with use_shared_memory). None: anonymous shared memory (memfd),
    # which a small /dev/shm (64 MiB in containers) does not limit. A directory: an unlinked file there,
    # mapped shared; it must have room for the whole staged state (about the size of the payload's tensors).
    # A leading `~` of a str is the home directory, as in every other path the engine takes (a Path's is literal).
    staging_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        owner = "CheckpointStagerConfig"
        for flag in ("use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy"):
            check_bool(owner, flag, getattr(self, flag))
        check_text(owner, "thread_name", self.thread_name)
        if not isinstance(self.metric_prefix, str):
            raise ConfigTypeError(f"{owner}.metric_prefix must be a str, got {self.metric_prefix!r}; leave it unset.")
        if self.staging_dir is not None:
            self._check_staging_dir(owner)
        if self.metric_prefix != _DEFAULT_METRIC_PREFIX:
            warn_ignored(self, "CheckpointStagerConfig.metric_prefix", "the engine reports no metrics; leave it unset.")
        self.warn_without_cuda()

    def warn_without_cuda(self) -> None:
        """Pinned memory or non-blocking copies asked for where CUDA is not available: said once per config,
        when it is built (or the first manager built from it after an edit), not at every manager's stager."""
        if (self.use_pinned_memory or self.use_non_blocking_copy) and not _cuda_available():
            warn_once(
                self,
                "no CUDA",
                "CheckpointStagerConfig asks for pinned memory / non-blocking copies but CUDA is not available; "
                "staging uses plain host memory.",
                UserWarning,
            )

    def _check_staging_dir(self, owner: str) -> None:
        """A path, and only where it is used: with use_shared_memory=False it was silently ignored."""
        if not isinstance(self.staging_dir, (str, os.PathLike)):
            raise ConfigTypeError(
                f"{owner}.staging_dir must be a directory path (str) or None, got {self.staging_dir!r}; None "
                f"stages in anonymous shared memory."
            )
        if not os.fspath(self.staging_dir):
            raise ConfigError(f"{owner}.staging_dir is empty; name a directory, or leave it None (anonymous memory).")
        refuse_unencodable(f"{owner}.staging_dir", self.staging_dir)
        if not self.use_shared_memory:
            raise ConfigError(
                f"{owner}.staging_dir={self.staging_dir!r} is used only with use_shared_memory=True (it holds the "
                f"shared staging slab); with use_shared_memory=False nothing is staged there. Drop one of the two."
            )


@dataclass
class CheckpointWriterConfig:
    """How many threads write a rank's item files at once (`file_write_max_threads`; 1: one after another).

    `barrier_config` and `checkpoint_write_barrier_timeout_sec`, the published release's barrier between ranks,
    are accepted for old code and ignored, with a FutureWarning when set: the ranks of a save always commit
    together, bounded by `CheckpointSaverConfig.wait_timeout_secs`.
    """

    # Both ignored, and warn when set: the ranks of a save always commit together through the agreement
    # over rank 0's TCPStore, bounded by CheckpointSaverConfig.wait_timeout_secs.
    checkpoint_write_barrier_timeout_sec: int = _DEFAULT_BARRIER_TIMEOUT_SECS
    barrier_config: BarrierConfig | None = None
    file_write_max_threads: int = 1

    def __post_init__(self) -> None:
        self.file_write_max_threads = integer_as_int(self.file_write_max_threads)
        if isinstance(self.file_write_max_threads, bool) or not isinstance(self.file_write_max_threads, int):
            raise ConfigTypeError(
                f"CheckpointWriterConfig.file_write_max_threads must be an int, got {self.file_write_max_threads!r}."
            )
        if self.file_write_max_threads < 1:
            raise ConfigError(
                f"file_write_max_threads must be positive (CheckpointWriterConfig.file_write_max_threads="
                f"{self.file_write_max_threads}); 1 writes the files one after another."
            )
        how = "multi-rank saves always commit together, bounded by CheckpointSaverConfig.wait_timeout_secs."
        # Ignored, but kept as the plain number every timeout of the configs is (a tensor rode to each writer)
        self.checkpoint_write_barrier_timeout_sec = real_as_number(
            "CheckpointWriterConfig.checkpoint_write_barrier_timeout_sec", self.checkpoint_write_barrier_timeout_sec
        )
        if self.barrier_config is not None:
            warn_ignored(self, "CheckpointWriterConfig.barrier_config", how)
        if self.checkpoint_write_barrier_timeout_sec != _DEFAULT_BARRIER_TIMEOUT_SECS:
            warn_ignored(
                self, "CheckpointWriterConfig.checkpoint_write_barrier_timeout_sec", f"{how} Set that instead."
            )


@dataclass
class CheckpointProcessConfig:
    """The background writer process of async saves: start and shutdown timeouts, thread names."""

    # Spawning imports torch in a fresh interpreter: seconds, more on a loaded 2-core machine with many ranks.
    subprocess_init_timeout_secs: int = 300
    subprocess_shutdown_timeout_secs: int = 60
    thread_name_prefix: str = "ckpt"

    def __post_init__(self) -> None:
        owner = "CheckpointProcessConfig"
        # Zero would time out before the writer could answer: the first save would fail, not this line.
        init, shutdown = self.subprocess_init_timeout_secs, self.subprocess_shutdown_timeout_secs
        init = check_number(owner, "subprocess_init_timeout_secs", init, positive=True, at_most=MAX_OS_WAIT_S)
        shutdown = check_number(owner, "subprocess_shutdown_timeout_secs", shutdown, at_most=MAX_OS_WAIT_S)
        self.subprocess_init_timeout_secs, self.subprocess_shutdown_timeout_secs = init, shutdown
        check_text(owner, "thread_name_prefix", self.thread_name_prefix)


@dataclass(kw_only=True)
class CheckpointSaverConfig:
    """Settings shared by both savers; pick `SyncCheckpointSaverConfig` or `AsyncCheckpointSaverConfig`."""

    writer_config: CheckpointWriterConfig = field(default_factory=CheckpointWriterConfig)
    # How long save()/close() wait on a previous write, and multi-rank commits wait on other ranks.
    wait_timeout_secs: int | None = DEFAULT_WAIT_TIMEOUT_SECS
    # Whether a save may replace an existing checkpoint of ours at its id (atomically; the old one stays intact
    # until the new one is durable). A path that is not a checkpoint of ours is never replaced, whatever this says.
    overwrite: bool = True

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_instance(
            owner, "writer_config", self.writer_config, CheckpointWriterConfig, "Leave it unset for the default."
        )
        if self.wait_timeout_secs is not None:
            self.wait_timeout_secs = real_as_number(f"{owner}.wait_timeout_secs", self.wait_timeout_secs)
            if isinstance(self.wait_timeout_secs, bool) or not isinstance(self.wait_timeout_secs, (int, float)):
                raise ConfigTypeError(
                    f"{owner}.wait_timeout_secs must be a number of seconds or None, got {self.wait_timeout_secs!r}."
                )
            refuse_past_a_float(f"{owner}.wait_timeout_secs", self.wait_timeout_secs)
            if not self.wait_timeout_secs >= 0:  # also refuses NaN, which no wait could ever reach
                raise ConfigError(
                    f"wait_timeout_secs must be non-negative or None ({owner}.wait_timeout_secs="
                    f"{self.wait_timeout_secs!r}); None waits {DEFAULT_WAIT_TIMEOUT_SECS} s."
                )
        check_bool(owner, "overwrite", self.overwrite)


@dataclass(kw_only=True)
class SyncCheckpointSaverConfig(CheckpointSaverConfig):
    """Write inline: `save()` returns once the checkpoint is committed and durable."""


@dataclass
class AsyncCheckpointSaverConfig(CheckpointSaverConfig):
    """Stage off the training thread, write from a background process; `save()` returns a Future."""

    staging_config: CheckpointStagerConfig = field(default_factory=CheckpointStagerConfig)
    process_config: CheckpointProcessConfig = field(default_factory=CheckpointProcessConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        fix = "Leave it unset for the default."
        check_instance(type(self).__name__, "staging_config", self.staging_config, CheckpointStagerConfig, fix)
        check_instance(type(self).__name__, "process_config", self.process_config, CheckpointProcessConfig, fix)


@dataclass(kw_only=True)
class CheckpointLoaderConfig:
    """How `CheckpointManager.load` reads files: mmap, torch's safe unpickler, checksum verification."""

    use_mmap: bool = True
    # torch's safe unpickler for TorchSerialization files; set False only for checkpoints you trust.
    weights_only: bool = True
    # CRC32 of every file a load reads, against the manifest. None (default): verify whatever the manifest
    # records; True: the same, and refuse a directory without a manifest; False: sizes only (know why).
    verify_checksums: bool | None = None
    # Directories without a manifest (the published release wrote none) load unverified with a logged warning;
    # False refuses them.
    allow_legacy_checkpoints: bool = True
    # On several ranks a load is collective: the ranks agree after checking, so it goes on on every rank or on
    # none, and a load on some ranks only waits for the others (until save.wait_timeout_secs). False: each rank
    # loads on its own (a rank-0-only read, an evaluation process), and one rank's failure is its own.
    collective: bool = True

    def __post_init__(self) -> None:
        owner = "CheckpointLoaderConfig"
        for flag in ("use_mmap", "weights_only", "allow_legacy_checkpoints", "collective"):
            check_bool(owner, flag, getattr(self, flag))
        check_bool(owner, "verify_checksums", self.verify_checksums, allow_none=True)
