"""Every error the engine raises on purpose.

Bad arguments stay `ValueError`/`TypeError` (the caller passed something wrong). Everything that concerns a
checkpoint itself, or the save/load machinery, is a `CheckpointError`, so one `except CheckpointError`
catches "this checkpoint cannot be used" without swallowing programming errors. Each subclass names one
kind of failure a caller may want to handle differently. `TemplateMismatchError` is both: the checkpoint and
the caller's `into=` template disagree.

`log_safely` is how the engine reports a failure (or a commit) where a log handler that raises must not
change the outcome: it is not exported (the package's top level exports only the errors).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import re
import struct
import sys
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError

if TYPE_CHECKING:
    from torch_checkpointing.types import NestedPath

# The package's top level exports every name listed here (its lazy table reads this list).
__all__ = [
    "CheckpointError",
    "CheckpointReplacedError",
    "CommitError",
    "CommitOutcomeUnknownError",
    "ConfigError",
    "ConfigTypeError",
    "CorruptCheckpointError",
    "ForeignManifestError",
    "IncompleteCheckpointError",
    "MissingItemError",
    "NestingError",
    "NewerCheckpointError",
    "ObjectStoreError",
    "RefusedPickleError",
    "TemplateMismatchError",
    "UndecodableFileError",
    "UnsafeCheckpointError",
    "WriterProcessDied",
]


class ConfigError(ValueError):
    """A configuration field or an argument holds a value the engine cannot use.

    Raised where the value is given (a config dataclass's construction, the call that takes the argument),
    never later inside the stager or the background writer. The message names the field and says what to pass.
    A `ValueError`, not a `CheckpointError`: the caller passed something wrong, no checkpoint is involved.
    """


class ConfigTypeError(ConfigError, TypeError):
    """A configuration field or an argument has the wrong type; also a `TypeError`, for callers that catch one."""


class NestingError(ValueError):
    """A value the tree walk cannot finish: it contains itself (`cycle`, `path` is the container met again),
    or nests deeper than a recursive walk can descend. `for_item` names the item, for callers that know it.

    A `ValueError`, not a `ConfigError`: most often the caller's save payload or load template, but a crafted
    checkpoint file can decode to such a value too.
    """

    def __init__(self, path: NestedPath, cycle: bool, key: str = "") -> None:
        self.path, self.cycle, self.key = path, cycle, key
        super().__init__(self._describe())

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by its fields, not its message: a refusal found in the async writer process reached the
        # trainer as a RuntimeError (the default pickling called __init__ with the message alone and failed).
        return (type(self), (self.path, self.cycle, self.key), self.__dict__)

    def for_item(self, key: str) -> NestingError:
        """The same refusal, naming item `key` (raise it `from None`: it says everything)."""
        return NestingError(self.path, self.cycle, key)

    def _describe(self) -> str:
        from torch_checkpointing.traversal import dotted_key  # the walks' module, which raises this

        dotted = dotted_key(self.path)
        where = f"{self.key}::{dotted}" if self.key and dotted else self.key or dotted
        if self.cycle:
            return (
                f"The value at '{where}' contains itself (a container that is its own ancestor), so no save can "
                f"walk it to the end. Break the cycle (store what it refers to once, e.g. by key) before saving."
            )
        item = f"Item '{self.key}'" if self.key else "The value"
        return (
            f"{item} is nested deeper than Python's recursion limit ({sys.getrecursionlimit()}) lets the "
            f"checkpoint walk descend. Flatten it, e.g. into a list of its rows."
        )


class CheckpointError(RuntimeError):
    """Base of every checkpoint failure the engine raises on purpose (a `RuntimeError`, for old callers)."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is not a committed checkpoint: its save never finished, or it has no manifest."""


class ForeignManifestError(IncompleteCheckpointError):
    """The directory's `manifest.json` is none this engine writes (another tool's: a JSON value that is no manifest
    of ours, or bytes that name none of its fields), so the directory is not a checkpoint of ours, damaged or not.
    Never a `CorruptCheckpointError`: before, `ls --json` listed such a folder under "damaged" and `verify` said
    FAILED (exit 1), and a script that deletes damaged checkpoints deleted another tool's folder."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint no longer matches its manifest, or a file of it cannot be parsed.

    The message names the file (and the field, for malformed metadata). Load an earlier checkpoint.
    """


class CheckpointReplacedError(CorruptCheckpointError):
    """The checkpoint was replaced by a new save of its id, or deleted, while it was read: no damage (the files
    it listed went with the copy the save or the deletion removed). Read it again. A `CorruptCheckpointError` for
    callers that caught that before; a tool that acts on damage (an operator's `verify || rm`) must tell the two
    apart, and the command line reads such a checkpoint again rather than report it."""


class NewerCheckpointError(CorruptCheckpointError):
    """The checkpoint records what this engine does not know: a manifest or sharding metadata version above the
    ones it reads, or a serialization format, dtype or placement type it has no name for (`unknown_to_this_engine`).
    A newer engine (or another tool) wrote it. Not damage: load it with that engine (do not delete it). A
    `CorruptCheckpointError` for callers that catch one (it cannot be loaded here); a tool that acts on damage
    must tell the two apart, as the listings and `verify` do (`ls` lists it as unreadable, `verify` exits 2,
    never FAILED).

    `record` is what it records, without the verdict (the field and the name), for a reader that finds the
    claim implausible (`manifest.parse_manifest`: a manifest no newer engine wrote) and calls it damage."""

    def __init__(self, message: str, record: str | None = None) -> None:
        super().__init__(message)
        self.record = message if record is None else record


def unknown_to_this_engine(where: str, what: str, name: object) -> CorruptCheckpointError:
    """The refusal of a record naming `what` (a serialization format, a dtype, ...) as `name`, which this engine
    does not know. A well-formed name (an identifier, as every engine writes them) is a newer engine's or another
    tool's: a `NewerCheckpointError`, which `verify` and the listings never call damage, so a healthy checkpoint
    is not deleted over an engine too old to read it. Anything else (not a string, `os.system`, empty) no engine
    writes: damage or crafted."""
    if isinstance(name, str) and name.isidentifier():
        return NewerCheckpointError(
            f"{where} records {what} {name!r}, which this engine does not know: a newer engine (or another tool) "
            f"wrote this checkpoint. It is not damaged as far as this engine can tell (do not delete it): read it "
            f"with the engine that wrote it, or upgrade this one.",
            record=f"{where} records {what} {name!r}",
        )
    return CorruptCheckpointError(
        f"{where} records {what} {name!r}, which no engine writes; the checkpoint is damaged or crafted. Load an "
        f"earlier checkpoint."
    )


class UndecodableFileError(CorruptCheckpointError, ValueError, TypeError):
    """A checkpoint file whose bytes do not decode as its format says (crafted, or damaged where no checksum
    covers it). Also a `ValueError` and a `TypeError`: the parsers raised those for it before, and callers
    (and API_SURFACE, for a JSON item missing a dataclass field) catch them."""


def undecodable(path: object, what: str, exc: BaseException, operation: str = "load") -> UndecodableFileError:
    """The error for `exc`, met decoding file `path` for `what` by `operation` (which its fix names); raise it
    `from exc`. A process short of memory or file descriptors is raised as that instead
    (`raise_if_short_of_resources`): never worded as the file's damage, at whichever decoder met it."""
    raise_if_short_of_resources(exc, path, what)
    return UndecodableFileError(
        f"File {path} for {what} cannot be decoded ({type(exc).__name__}: {exc}); the file is damaged or crafted. "
        f"{on_another(operation)}"
    )


_ON_ANOTHER = {"load": "Load", "export": "Export from", "read": "Read from"}


def on_another(operation: str, checkpoint: str = "an earlier checkpoint") -> str:
    """The fix a refusal of a damaged checkpoint offers `operation` (a read context's: "load", "export", "read"
    of `iter_item_tensors`; a CLI command or a listing's check uses one): the same on another checkpoint. Every
    such refusal said "Load an earlier checkpoint", also to an export, a diff and a verify."""
    return f"{_ON_ANOTHER.get(operation, 'Use')} {checkpoint}."


# How an allocation the system refused reads in what torch (its CPU allocator, an mmap of a file) and the OS raise:
# a plain RuntimeError or an ENOMEM OSError, which the decoders' handlers would otherwise take for the file's damage.
# The words must END the message, with their errno, as torch's do ("... Error code 12 (Cannot allocate memory)",
# "unable to mmap ...: Cannot allocate memory (12)"): anywhere in it, a crafted file's record name ("failed
# locating file data/Cannot allocate memory (12): file not found") passed a damaged file off as a shortage.
# pybind11's words (torch's bindings) are the whole message: "Could not allocate bytes object!" was a load from an
# object store under RLIMIT_AS, its record's bytes refused, called "not a readable Torch file".
_ALLOCATION_REFUSED_RE = re.compile(
    r"(cannot allocate memory \((os error )?12\)|error code 12 \(cannot allocate memory\)"
    r"|not enough memory: you tried to allocate [0-9]+ bytes\.?|^could not allocate [a-z]+ object!)$",
    re.IGNORECASE,
)


# What torch appends to the message of its errors where TORCH_SHOW_CPP_STACKTRACES=1 (the only value torch takes
# for on): its C++ backtrace, under one of these headers or both, in this order.
_RAISED_FROM_RE = re.compile(r"\nException raised from [^\n]*\(most recent call first\):")
_CAPTURED_TRACEBACK = "\nC++ CapturedTraceback:"


def _torch_message(exc: BaseException) -> str:
    """What `exc` says, without the C++ backtrace torch appends to its errors where TORCH_SHOW_CPP_STACKTRACES=1:
    after it, the words that end torch's message (`_ALLOCATION_REFUSED_RE`) no longer ended it, and a load short
    of memory, with that variable set to debug a job, called an intact file "not a readable Torch file". Cut at
    the last header, only with the variable set: the text of a crafted record name before it is read whole."""
    text = str(exc).strip()
    if os.environ.get("TORCH_SHOW_CPP_STACKTRACES") != "1":
        return text
    cut = text.rfind(_CAPTURED_TRACEBACK)
    raised = list(_RAISED_FROM_RE.finditer(text if cut < 0 else text[:cut]))
    if raised and (cut < 0 or raised[-1].end() == cut):  # "Exception raised from ..." heads the backtrace
        cut = raised[-1].start()
    return text if cut < 0 else text[:cut].rstrip()


def raise_if_out_of_memory(exc: BaseException, path: object, what: str) -> None:
    """Raise a `MemoryError` (from `exc`) when `exc`, met reading file `path` for `what`, is the machine out of
    memory, else return. Before, torch's "DefaultCPUAllocator: can't allocate memory" or "unable to mmap ...:
    Cannot allocate memory (12)" was an `UndecodableFileError` ("the file is damaged or crafted"), and a caller
    that deletes damaged checkpoints, or falls back to an earlier one, acted on an intact checkpoint. A
    `MemoryError` is what Python says for it, and what a caller that retries with less catches."""
    if isinstance(exc, MemoryError) and _NOT_DAMAGED in str(exc):
        raise exc  # named already, by the step nearest the shortage
    enomem = isinstance(exc, OSError) and exc.errno == errno.ENOMEM
    refused = isinstance(exc, RuntimeError) and _ALLOCATION_REFUSED_RE.search(_torch_message(exc)) is not None
    if enomem or refused or isinstance(exc, MemoryError):
        said = f" ({type(exc).__name__}: {_torch_message(exc)})" if str(exc) else ""
        raise MemoryError(
            f"Out of memory reading {path} for {what}{said}; {_NOT_DAMAGED} (do not delete it). Free memory, or "
            f"run it on a machine with more, and try again."
        ) from exc


# What every shortage this module names says; one without it is named where it is met. A MemoryError Python
# raised itself (the bytes of a raw item, the text of a JSON item) or a decoder raised in its own words
# (safetensors' "Cannot allocate memory (os error 12)") left `load()` as `MemoryError()`, naming nothing.
_NOT_DAMAGED = "the checkpoint was not found damaged"


# How a process out of file descriptors reads: EMFILE (its own limit, `ulimit -n`), ENFILE (the system's), or
# torch's RuntimeError for a refused open of the file it maps ("unable to open file <...>: Too many open files (24)"),
# its words and errno ending the message (`_ALLOCATION_REFUSED_RE`).
_NO_DESCRIPTOR_ERRNOS = (errno.EMFILE, errno.ENFILE)
_NO_DESCRIPTOR_RE = re.compile(r"too many open files( in system)? \((os error )?(24|23)\)$", re.IGNORECASE)


def raise_if_short_of_resources(exc: BaseException, path: object, what: str) -> None:
    """Raise, from `exc`, what the process being short of a resource reading file `path` for `what` is, else
    return: out of memory (`raise_if_out_of_memory`), or out of file descriptors, an `OSError` with its errno
    that names the file and says the checkpoint was not found damaged. Before, a refused open was
    `CorruptCheckpointError` ("Cannot open ...: [Errno 24]") and torch's refused map `UndecodableFileError` ("the
    file is damaged or crafted"): a caller that deletes damaged checkpoints, or falls back to an earlier one,
    acted on an intact checkpoint because its own process held too many files."""
    raise_if_out_of_memory(exc, path, what)
    code = exc.errno if isinstance(exc, OSError) else None
    if code in _NO_DESCRIPTOR_ERRNOS and _NOT_DAMAGED in str(exc):
        raise exc  # named already, by the step nearest the shortage (its errno says so, not its words alone)
    _raise_if_no_thread(exc, path, what)
    worded = isinstance(exc, RuntimeError) and _NO_DESCRIPTOR_RE.search(_torch_message(exc)) is not None
    if code in _NO_DESCRIPTOR_ERRNOS or worded:
        raise OSError(
            code or errno.EMFILE,
            f"Out of file descriptors reading {path} for {what} ({type(exc).__name__}: {_torch_message(exc)}); "
            f"{_NOT_DAMAGED} (do not delete it). Close files this process holds, or raise its limit (`ulimit -n`, "
            f"RLIMIT_NOFILE), and try again.",
        ) from exc


# What CPython says where the OS refuses a thread (pthread_create: no room for its stack under RLIMIT_AS, no thread
# left under RLIMIT_NPROC or a container's pids limit): a bare RuntimeError, with no errno and no word of why.
_NO_THREAD = "can't start new thread"


def raise_if_thread_not_started(exc: BaseException, name: str) -> None:
    """Raise a `MemoryError` (from `exc`) when `exc`, met starting thread `name`, is the OS refusing a thread, else
    return. Before, a load or save under a low RLIMIT_AS failed with `RuntimeError("can't start new thread")`,
    named neither as a shortage (a caller that retries with less catches `MemoryError`) nor with its fix."""
    if isinstance(exc, RuntimeError) and str(exc).startswith(_NO_THREAD):
        raise MemoryError(
            f"Out of memory starting thread {name} ({type(exc).__name__}: {exc}): the OS refused it a stack (the "
            f"address-space limit, RLIMIT_AS, `ulimit -v`) or a thread (RLIMIT_NPROC, `ulimit -u`, a container's "
            f"pids limit). Free memory, or raise the limit, and try again."
        ) from exc


def _raise_if_no_thread(exc: BaseException, path: object, what: str) -> None:
    """Python's "can't start new thread" met reading `path` (a decoder's own thread), named as the shortage it is,
    a `MemoryError` as `raise_if_thread_not_started` names one of ours: a decoder's handler called the intact file
    "not a readable Torch file" before."""
    if isinstance(exc, RuntimeError) and str(exc).strip().startswith(_NO_THREAD):
        raise MemoryError(
            f"Out of memory starting a thread reading {path} for {what} ({type(exc).__name__}: {exc}); "
            f"{_NOT_DAMAGED} (do not delete it). The OS refused a thread's stack (RLIMIT_AS, `ulimit -v`) or a "
            f"thread (RLIMIT_NPROC, `ulimit -u`, a container's pids limit): free memory or raise the limit, and try "
            f"again."
        ) from exc


def is_shortage(exc: BaseException) -> bool:
    """Whether `exc` is the process short of memory, a thread or file descriptors, in any of the words the OS,
    Python or torch say it: a caller that would blame the value or the file for it must not."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOMEM, *_NO_DESCRIPTOR_ERRNOS)
    if isinstance(exc, RuntimeError):
        text = _torch_message(exc)
        refused = _ALLOCATION_REFUSED_RE.search(text) or _NO_DESCRIPTOR_RE.search(text)
        return refused is not None or text.startswith(_NO_THREAD)
    return False


def shortage_within(exc: BaseException, outside: BaseException | None = None) -> MemoryError | OSError | None:
    """The shortage (`is_shortage`, as a `MemoryError` or an errno) that `exc`, a library's own error, wraps:
    raised from it or while handling it, or held as botocore's `error=` argument; nearest first, None where there
    is none. A client says the process's own shortage in its words: botocore's `EndpointConnectionError` around
    aiohttp's refused socket (errno 24), its `HTTPClientError` around the `OSError` or around a `MemoryError` met
    in aiohttp's socket read, and each was taken for the store's failure. `outside`: what the caller was handling
    when the call began (`sys.exception()` then), and every exception the call raised is chained to: its
    shortage is the caller's, not this call's, and is not looked into."""
    for inner in exception_chain(exc, () if outside is None else (outside,)):
        # `exc` itself is the caller's to ask `is_shortage` of; it is no link when it is `outside` (re-raised)
        if inner is not exc and isinstance(inner, (MemoryError, OSError)) and is_shortage(inner):
            return inner
    return None


# The most links `exception_chain` walks: a real chain is a few; a cycle or a crafted one is cut here.
CHAIN_LIMIT = 16


def exception_chain(exc: BaseException, stop: Iterable[BaseException] = ()) -> Iterator[BaseException]:
    """`exc`, then what each link was raised from, or (where not suppressed) while handling, and botocore's
    `kwargs['error']`: nearest first, each once (a cycle ends), at most `CHAIN_LIMIT` links, and never into an
    exception of `stop` (by identity) nor past it. `stop`: what the caller was handling when the call that raised
    `exc` began: Python chains an error raised in an `except` block to the one handled there, and that one's
    S3 code or shortage is the caller's, not the call's. The one walker of the package: two walked chains their
    own ways before, one of them endlessly round a cycle of causes and into what a caller was handling."""
    stops = {id(e) for e in stop}
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < CHAIN_LIMIT:
        link = todo.pop(0)
        if id(link) in seen or id(link) in stops:
            continue
        seen.add(id(link))
        yield link
        todo += _wrapped(link)


def _wrapped(exc: BaseException) -> list[BaseException]:
    """What `exc` was raised from or (where not suppressed) while handling, and botocore's `kwargs['error']`."""
    kwargs = getattr(exc, "kwargs", None)
    held = kwargs.get("error") if isinstance(kwargs, dict) else None
    chained = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return [e for e in (chained, held) if isinstance(e, BaseException)]


# How a shortage named for a save (here, or the writer process's start) begins: one that does is not named again.
_SAVE_FIXES_SAID = re.compile(r"^(Out of (memory|file descriptors) saving|Checkpoint writer process failed to start)")


def save_shortage(exc: BaseException, checkpoint_dir: str) -> MemoryError | OSError | None:
    """What a save of `checkpoint_dir` that failed with `exc` says when `exc` is the process short of memory (a
    `MemoryError`) or of file descriptors (an `OSError` with its errno), naming the checkpoint, what became of it
    and the fix; None for any other failure. Before, a save whose aligned write buffer the OS refused failed with a
    bare `OSError: [Errno 12] Cannot allocate memory` naming a file of the hidden temporary directory, and one
    whose pickle found no room with a bare `MemoryError()`."""
    if not is_shortage(exc) or _SAVE_FIXES_SAID.match(str(exc)):
        return None  # not a shortage, or named already (by the writer process, or starting it)
    outcome = f"checkpoint {checkpoint_dir} was not committed; an earlier checkpoint under that id, if any, is intact"
    said = f"{type(exc).__name__}: {_torch_message(exc)}" if str(exc) else type(exc).__name__
    code = exc.errno if isinstance(exc, OSError) else None
    if code in _NO_DESCRIPTOR_ERRNOS or (isinstance(exc, RuntimeError) and _NO_DESCRIPTOR_RE.search(str(exc))):
        return OSError(
            code or errno.EMFILE,
            f"Out of file descriptors saving ({said}): {outcome}. Close files this process holds, or raise its "
            f"limit (`ulimit -n`, RLIMIT_NOFILE), and save again.",
        )
    return MemoryError(
        f"Out of memory saving ({said}): {outcome}. The OS refused memory (the address-space limit, RLIMIT_AS, "
        f"`ulimit -v`; a thread: RLIMIT_NPROC, `ulimit -u`; or the machine's memory): free memory, or raise the "
        f"limit, and save again."
    )


def shortage_told_by_peers(reasons: list[str], message: str) -> MemoryError | OSError | None:
    """The error a rank raises, saying `message`, for the failures `reasons` (each "TypeName: message", in rank
    order) when every one is a shortage this module named (`raise_if_short_of_resources`): the first one's
    type, a `MemoryError` for memory, an `OSError` with its errno for file descriptors. None otherwise. Every
    rank of a collective step then raises the type a caller's handler for that shortage catches; where ranks were
    short of different resources, the lowest failed rank's decides, on every rank, the short ones included (each
    rank deciding by its own had the others raise a plain `CheckpointError`, and the short ones two types)."""
    codes = [_shortage_errno(why) for why in reasons]
    if not codes or None in codes:
        return None
    first = codes[0]
    return MemoryError(message) if first == errno.ENOMEM else OSError(first, message)


def _shortage_errno(reason: str) -> int | None:
    """ENOMEM for a peer's named `MemoryError`, EMFILE or ENFILE for its named descriptor shortage, else None."""
    if _NOT_DAMAGED not in reason:
        return None
    if reason.startswith("MemoryError: "):
        return errno.ENOMEM
    code = _DESCRIPTOR_REASON_RE.match(reason)
    return int(code[1]) if code is not None and int(code[1]) in _NO_DESCRIPTOR_ERRNOS else None


# How `agreement.describe` words an OSError that has an errno: "OSError: [Errno 24] ...".
_DESCRIPTOR_REASON_RE = re.compile(r"OSError: \[Errno ([0-9]+)\] ")


@contextlib.contextmanager
def resource_shortage_named(path: object, what: str) -> Iterator[None]:
    """`raise_if_short_of_resources` around a whole step: a shortage met anywhere in it (a map of a file to verify,
    an allocation for a template, a descriptor for the checkpoint's directory) is a `MemoryError` or an `OSError`
    naming `path`, never a bare `OSError` [Errno 12] or [Errno 24] out of `load()`, nor any other error a caller
    takes for damage."""
    try:
        yield
    except CheckpointError:
        raise  # already said what it is (another rank's shortage in a collective step among them)
    except (OSError, RuntimeError, MemoryError) as exc:
        raise_if_short_of_resources(exc, path, what)
        raise


# What every refusal of a file this user may not read says (listings tell it from damage by its type, PermissionError).
UNREADABLE_BY_THIS_USER = "this user may not read it"


def unreadable_file(path: object, what: str, exc: OSError) -> PermissionError:
    """The refusal of a checkpoint file that the OS will not let this user open (EACCES, EPERM); raise it
    `from exc`. A `PermissionError`, never a `CorruptCheckpointError`: its bytes were never seen, so the
    checkpoint may well be whole, and an operator told "corrupt" deletes it. The message names the file and
    the fix."""
    return PermissionError(
        exc.errno,
        f"Cannot read {path} ({what}): {exc.strerror}; {UNREADABLE_BY_THIS_USER}, which says nothing about its "
        f"bytes (the checkpoint may well be intact: do not delete it). Give this user read permission on it "
        f"(chmod u+r or a group that has it, and search permission on its directories), or run as its owner",
    )


# What parsing untrusted bytes raises when they are not what they claim: torch's loader (RuntimeError), pickle,
# zipfile, struct, json, safetensors (its SafetensorError is no ValueError: a resharding load of a safetensors
# source with bytes past its last tensor raised it bare), and the engine's own walkers (NestingError is a
# ValueError). Never MemoryError: a real shortage is not a property of the file.
DECODE_ERRORS: tuple[type[BaseException], ...] = (
    RuntimeError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    OverflowError,
    EOFError,
    RecursionError,
    AssertionError,  # torch's unpickler asserts on some crafted records (a persistent id that is not a tuple)
    struct.error,
    pickle.UnpicklingError,
    zipfile.BadZipFile,
    SafetensorError,
)


class UnsafeCheckpointError(CorruptCheckpointError):
    """Checkpoint content that would escape the directory, name code to import, or is not a regular file.

    A subclass of `CorruptCheckpointError`: crafted content is refused the same way damaged content is.
    """


class RefusedPickleError(UnsafeCheckpointError, pickle.UnpicklingError):
    """torch's safe loader (weights_only=True) refused an object in a file; still a `pickle.UnpicklingError`."""


class TemplateMismatchError(CheckpointError, ValueError):
    """What the checkpoint holds does not fit the `into=` template (shape, dtype, structure, missing keys).

    Also a `ValueError`: the template is the caller's argument, and a resharding load refused a model whose
    shapes changed with a bare ValueError before, which callers may still catch.
    """


class MissingItemError(TemplateMismatchError, KeyError):
    """A load asked for an item the checkpoint does not hold (the message lists those it does hold).

    Also a `KeyError`, as the docs promise and as a missing key of a mapping is: `except KeyError` catches it.
    """

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0]) if self.args else ""


class CommitError(CheckpointError):
    """A collective save step failed on at least one rank; raised identically on every rank.

    `failures` maps each failed rank to its reason. Nothing was committed (but see `CommitOutcomeUnknownError`).
    """

    outcome_unknown = False  # see `committed_state`

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})

    def __reduce__(self) -> tuple[type[CommitError], tuple[str, dict[int, str]]]:
        # Crosses the writer-process pipe intact (the default would drop `failures`).
        return (type(self), (str(self), self.failures))


class CommitOutcomeUnknownError(CommitError):
    """Rank 0 did not answer the commit step, which it may have completed: the id holds its previous checkpoint
    or this save's, either of them whole. Save again to be sure of the state."""

    outcome_unknown = True


class WriterProcessDied(CheckpointError):
    """The background writer process exited before answering.

    `outcome_unknown`: it died during a write, which it may have committed right before it died (the id then
    holds this save, whole); otherwise the save was not committed. For such a death the trainer keeps what it
    needs to settle the outcome itself (`checkpoint_writer.finish_for_a_dead_writer`): `manifest_digest`, the
    digest of the manifest the writer said it was about to write (None: it died before it began to publish), and
    `if_not_committed`, this death told as the trainer tells it once it found the checkpoint not in place, and
    `pid`, the dead writer's (whose hidden names, such as the aside of a replace without an atomic exchange, the
    trainer finishes or puts back).
    """

    def __init__(
        self,
        message: str,
        outcome_unknown: bool = False,
        *,
        manifest_digest: str | None = None,
        if_not_committed: str = "",
        pid: int | None = None,
    ) -> None:
        super().__init__(message)
        self.outcome_unknown = outcome_unknown
        self.manifest_digest = manifest_digest
        self.if_not_committed = if_not_committed
        self.pid = pid

    def __reduce__(self) -> tuple[type[WriterProcessDied], tuple[str, bool], dict[str, str | int | None]]:
        state = {"manifest_digest": self.manifest_digest, "if_not_committed": self.if_not_committed, "pid": self.pid}
        return (type(self), (str(self), self.outcome_unknown), state)


def add_note(exc: BaseException, note: str) -> None:
    """`exc.add_note(note)` where Python has notes (3.11+); on 3.10 the note is dropped (callers that must be heard
    also log it)."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)


def committed_state(exc: BaseException) -> str:
    """What a failed save's error means for its id, as its log line and its Future's message say it: "nothing
    was committed" was said too of a save whose writer died right after committing it."""
    if getattr(exc, "outcome_unknown", False) is True:
        return "it may have been committed right before it failed (the id holds its previous checkpoint or this one)"
    return "nothing was committed there"


class ObjectStoreError(CheckpointError):
    """A request to the object store failed (upload, download, copy). Nothing was committed by it.

    The message names the object's URL and the store's own error; the storage stays usable, so the next save
    can simply be retried.
    """


def log_safely(log: logging.Logger, level: int, msg: str, *args: object, exc_info: bool = False) -> None:
    """`log.log(...)` that never raises: a `logging.Handler` whose `emit` raises (one that does not catch its own
    I/O error) propagates out of the logging call, and on a save's completion path that made a committed save
    raise, or left its Future unresolved forever. What the handler could not take goes to stderr instead, with
    the handler's error, so that it is not lost either."""
    try:
        log.log(level, msg, *args, exc_info=exc_info)
    except Exception as exc:
        try:
            text = msg % args if args else msg
        except Exception:  # the record's own arguments do not format: keep the template
            text = msg
        with contextlib.suppress(Exception):  # stderr itself is gone: no channel is left to report on
            sys.stderr.write(
                f"{log.name}: a logging handler raised {type(exc).__name__}: {exc}; the record it dropped: "
                f"{logging.getLevelName(level)} {text}\n"
            )
