"""Object storage (S3, GCS, any fsspec filesystem): checkpoints on stores that cannot rename a directory.

An object store has no directories and no rename: a "directory" is a key prefix, and a rename is a copy of
every byte. So this backend sets `atomic_rename = False` and the commit writes each file under the final
prefix with the manifest written last, after every rank's files; a prefix without a manifest is an
incomplete checkpoint (see docs/storage.md).

Throughput is the other concern. A large file is uploaded as concurrent multipart parts while it is still
being encoded, holding at most `max_concurrency + 1` parts in memory (never the whole file), and read back
with concurrent ranged GETs; `read_range` issues ranged GETs only, so a resharding load fetches the byte ranges
it needs, never whole files (a verified one widens each range to the checksummed blocks it touches).
Both writers checksum what they upload (size, CRC32, block CRC32s for the manifest): the multipart writer on
its upload threads, one part each, when parts are whole blocks.

fsspec (and s3fs / gcsfs for the protocol) are optional: `pip install torch-checkpointing[s3]`. They are
imported when a storage is created, never when this module is imported, so the base install stays lean.
The config is a plain dataclass that pickles: the async writer process rebuilds the storage from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import email.utils
import errno
import functools
import hashlib
import inspect
import io
import json
import logging
import os
import posixpath
import re
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

try:  # POSIX: what makes a marker's compare-and-delete one step on file:// (`_marker_lock`)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from torch_checkpointing.checksum import FileChecksum, RunningChecksum, block_crc32s
from torch_checkpointing.config import CarriesNotes, check_number, notes_held, notes_of, recheck
from torch_checkpointing.errors import (
    CheckpointError,
    ConfigError,
    ConfigTypeError,
    ObjectStoreError,
    add_note,
    exception_chain,
    is_shortage,
    shortage_within,
)
from torch_checkpointing.futures import WorkerPool
from torch_checkpointing.manifest import (
    GC_TOKEN_PREFIX,
    INCOMPLETE_MARKER,
    MANIFEST_FILE_NAME,
    MAX_MARKER_BYTES,
    UNNAMED_SAVE,
    Manifest,
    our_marker,
    stray_claim,
)
from torch_checkpointing.names import (
    CREATING_RE,
    creating_name,
    held_here,
    holding,
    made_here,
    pid_alive,
    same_host,
    this_host,
)
from torch_checkpointing.storage.base_storage import (
    ReadArgs,
    Storage,
    StorageConfig,
    clock_probe_name,
    local_store_now,
    probing,
    store_now,
)

__all__ = ["FsspecStorage", "FsspecStorageConfig", "ObjectStoreError", "store_environment", "url_scheme"]

logger = logging.getLogger("torch_checkpointing")

MiB = 1 << 20
GiB = 1 << 30
# S3 takes multipart parts of 5 MiB (all but the last) to 5 GiB, and one PUT of up to 5 GiB; GCS and the others
# take parts outside that range too.
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * GiB
_READ_ATTEMPTS = 3  # a small object read whole: tries when it changes between its HEADs
_DELETE_BATCH = 1000  # S3's limit of keys per DeleteObjects request
# The store stamps an upload's start to the second: a create retried within `took_s` may read up to this earlier.
_CLOCK_SLACK_S = 1.0
MAX_PARTS = 10_000  # S3's limit per multipart upload: the largest file is part_size * MAX_PARTS (156 GiB at 16 MiB)
# What to do when the store refuses a request, by its S3 error code: appended to the ObjectStoreError.
_CREDENTIALS = "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or storage_options 'key' / 'secret')"
_FIXES = {
    "NoSuchBucket": "the bucket does not exist: create it, or fix the bucket name in the checkpoint id or url",
    "AccessDenied": (
        "these credentials may not do this here: grant them s3:GetObject, s3:PutObject, s3:DeleteObject and "
        "s3:ListBucket on the bucket (its policy or the role's), or use credentials that have them"
    ),
    "AllAccessDisabled": "all access to this bucket is disabled: use another bucket",
    "InvalidAccessKeyId": f"the store does not know this access key: check {_CREDENTIALS} and AWS_ENDPOINT_URL",
    "SignatureDoesNotMatch": f"the secret does not match the access key: check {_CREDENTIALS}",
    "ExpiredToken": "the session token has expired: refresh the credentials (AWS_SESSION_TOKEN, the role)",
    "InvalidToken": "the session token is malformed: check AWS_SESSION_TOKEN (or storage_options 'token')",
}
# The store's own failure, through every retry the client made: nothing of the caller's to fix.
_STORE_FAILING = (
    "the store failed the request through every retry: try again later (more retries: storage_options "
    "config_kwargs {'retries': {'max_attempts': N}})"
)
_FIXES.update(dict.fromkeys(("InternalError", "ServiceUnavailable", "SlowDown", "500", "502", "503"), _STORE_FAILING))
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/+")
_S3_PROTOCOLS = frozenset({"s3", "s3a"})
_VERSION_ID = "?versionId="  # s3fs's version marker in a path
# Stores where a "directory" is only a key prefix: mkdir is a no-op there.
_OBJECT_STORE_PROTOCOLS = _S3_PROTOCOLS | {"gs", "gcs", "az", "abfs", "abfss", "oss", "r2"}
# The user-metadata key (x-amz-meta-...) that names the save which uploaded an object: its claim token.
SAVE_TAG = "torch-checkpointing-save"


def url_scheme(checkpoint_id: str | os.PathLike[str]) -> str | None:
    """The URL scheme of an id (`s3://b/run/step_1` -> `s3`), or None for a local path.

    `pathlib.Path` folds `s3://b/k` into `s3:/b/k`; both spellings are recognised, so ids that went through
    `Path` inside the engine still name their store.
    """
    match = _SCHEME.match(os.fspath(checkpoint_id))
    return match.group(1).lower() if match else None


@dataclass
class FsspecStorageConfig(StorageConfig, CarriesNotes):
    """Where and how to reach an fsspec filesystem; every field pickles (the writer process rebuilds from it).

    * `url`: an optional root (`s3://bucket/runs/exp1`). Relative checkpoint ids are placed under it; full URL
      ids (`s3://bucket/run/step_100`) are used as they are.
    * `protocol`: the fsspec protocol; taken from `url` when empty. With neither, the store is selected by each
      id's scheme (`s3://...` -> S3, `gs://...` -> GCS), and ids must be full URLs.
    * `storage_options`: passed to `fsspec.filesystem` (credentials, `endpoint_url`, `client_kwargs`, ...).
      Leave credentials out to use the store's own chain (environment, instance role, config files).
    * `part_size`: bytes per multipart part and per ranged GET. `max_concurrency`: parts in flight per file.
    * `request_timeout_s`: the longest one request to the store may take (one part, one ranged GET, one HEAD
      or listing, s3fs's own retries included) before it fails with an `ObjectStoreError`; None: no bound.
      The HTTP client's own timeouts (`storage_options={"config_kwargs": {"read_timeout": ...}}`) cover
      connecting and waiting for an answer, but not sending a body to a server that stopped reading it. Not
      bounded by it: a file streamed to a store other than S3 (GCS, Azure: the backend's own file object
      uploads its parts), where the backend's own timeout options are the bound.
    * `filesystem`: an fsspec filesystem instance to use for its protocols instead of building one from
      `storage_options` (a subclass that adds tracing, throttling or fault injection). It must pickle, as
      fsspec filesystems do through their constructor arguments, to reach the async writer process.
    """

    may_be_process_local: ClassVar[bool] = True  # memory://

    url: str = ""
    protocol: str = ""
    storage_options: dict[str, Any] = field(default_factory=dict)
    part_size: int = 16 * MiB
    max_concurrency: int = 8
    filesystem: Any = None
    request_timeout_s: float | None = 300.0

    def __post_init__(self) -> None:
        self._check_types()
        if self.url and url_scheme(self.url) is None:
            raise ConfigError(f"FsspecStorageConfig.url must be a URL such as 's3://bucket/prefix' (got {self.url!r}).")
        with notes_held():  # two threads checking it at once (two managers built from it): one note lost
            given = self._take_protocol()
        if given is not None and self.protocol not in given:
            raise ConfigError(
                f"FsspecStorageConfig.filesystem speaks {sorted(given)}, not the configured {self.protocol}://; "
                f"pass a filesystem of that protocol or leave url/protocol to match it."
            )
        self._check_s3_part_size()
        if self.part_size < 1 or self.max_concurrency < 1:
            raise ConfigError(
                f"part_size and max_concurrency must be positive (FsspecStorageConfig.part_size={self.part_size}, "
                f"max_concurrency={self.max_concurrency})"
            )
        self._check_endpoint()
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ConfigError(f"request_timeout_s must be positive or None (got {self.request_timeout_s})")

    def _take_protocol(self) -> frozenset[str] | None:
        """Fill the protocol in from the url (or the filesystem) where the user gave none, noting that it was
        filled in; the protocols the filesystem given speaks (None: none given)."""
        if self.protocol and self.protocol == notes_of(self).get("protocol taken"):
            # this check filled it in when the config was built; the url (or filesystem) may have been edited since
            # (`config.recheck`): taken again from them, or an edited url was refused as naming another protocol
            self.protocol = ""
        taken = not self.protocol
        self.protocol = (self.protocol or url_scheme(self.url) or "").lower()
        self._check_url_protocol()
        given = _protocols_of(self.filesystem) if self.filesystem is not None else None
        if given is not None:
            self.protocol = self.protocol or sorted(given)[0]
        notes_of(self)["protocol taken"] = self.protocol if taken else None
        return given

    def _check_s3_part_size(self) -> None:
        """S3's part sizes (`MIN_PART_SIZE`..`MAX_PART_SIZE`), for S3 and for ids that may name it (no protocol).
        A part_size past 5 GiB was taken before: every file larger than 5 GiB then failed at its upload (S3's
        EntityTooLarge), after the save had staged and encoded it."""
        if self.protocol not in ("", *_S3_PROTOCOLS) or MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            return
        raise ConfigError(
            f"FsspecStorageConfig.part_size must be at least {MIN_PART_SIZE} and at most {MAX_PART_SIZE} bytes on "
            f"S3 (5 MiB to 5 GiB, the sizes S3 takes for a multipart part; got {self.part_size}): pass a part_size "
            f"in that range."
        )

    def _check_url_protocol(self) -> None:
        """A `url` of another store than `protocol` (`s3://...` with `gs`) was refused only by `create_storage()`,
        in the writer process for an async save. Aliases of one filesystem (`s3`/`s3a`, `gs`/`gcs`,
        `file`/`local`) agree; a protocol fsspec does not know yet is left to `create_storage()`. The fix names
        `dataclasses.replace`: its copy is built from the old fields, so a protocol filled in from the first url
        reads as the user's, and "leave protocol empty" was what that user had done."""
        scheme = url_scheme(self.url) if self.url else None
        if scheme is None or scheme == self.protocol:
            return
        if _same_filesystem(scheme, self.protocol) is not False:
            return
        raise ConfigError(
            f"FsspecStorageConfig.url {self.url!r} is a {scheme}:// path, but this storage talks to "
            f"{self.protocol}:// (FsspecStorageConfig.protocol). Fix: leave protocol empty (it is taken from url; "
            f"a copy made by dataclasses.replace(config, url=...) carries the protocol its first url filled in, as "
            f"if set: pass protocol='' with the new url), or give a url of {self.protocol}://."
        )

    def _check_endpoint(self) -> None:
        """An `endpoint_url` without a scheme (`minio:9000`) failed only at the first request, as a client error."""
        client_kwargs = self.storage_options.get("client_kwargs")
        for where, options in (("", self.storage_options), ("['client_kwargs']", client_kwargs)):
            endpoint = options.get("endpoint_url") if isinstance(options, dict) else None
            if endpoint is not None and not (isinstance(endpoint, str) and _SCHEME.match(endpoint)):
                raise ConfigError(
                    f"FsspecStorageConfig.storage_options{where}['endpoint_url'] must be a URL with its scheme, such "
                    f"as 'http://127.0.0.1:9000' or 'https://minio.internal:9000' (got {endpoint!r})."
                )

    def _check_types(self) -> None:
        """Wrong types fail here, naming the field, not as a comparison error or inside the writer process."""
        owner = "FsspecStorageConfig"
        for name in ("url", "protocol"):
            if not isinstance(getattr(self, name), str):
                raise ConfigTypeError(f"{owner}.{name} must be a str ('' when unset), got {getattr(self, name)!r}.")
        if not isinstance(self.storage_options, dict):
            raise ConfigTypeError(
                f"{owner}.storage_options must be a dict of fsspec options ({{}} when none), got "
                f"{self.storage_options!r}."
            )
        self.part_size = check_number(owner, "part_size", self.part_size, integer=True)
        self.max_concurrency = check_number(owner, "max_concurrency", self.max_concurrency, integer=True)
        if self.request_timeout_s is not None:
            self.request_timeout_s = check_number(owner, "request_timeout_s", self.request_timeout_s)
        if self.filesystem is not None:
            _check_filesystem(self.filesystem)

    @classmethod
    def from_url(cls, url: str, **storage_options: Any) -> FsspecStorageConfig:
        """A config for the store named by `url`'s scheme, e.g. `from_url("s3://bucket/run/step_100")`."""
        if not isinstance(url, str):  # was os.fspath's bare TypeError
            raise ConfigTypeError(
                f"FsspecStorageConfig.from_url takes a URL str such as 's3://bucket/run', got {url!r:.80}"
            )
        scheme = url_scheme(url)
        if scheme is None:  # was a config of no protocol, refused only by the first save of a local id
            raise ConfigError(
                f"FsspecStorageConfig.from_url({url!r:.80}) names no store: pass a URL with its scheme, such as "
                f"'s3://bucket/run' or 'file:///abs/run'; for a local directory, LocalFileSystemStorageConfig "
                f"(or no storage config) is the storage."
            )
        return cls(protocol=scheme, storage_options=dict(storage_options))

    def handles(self, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether an id belongs to this store: a URL of its protocol (any, if none is set), or relative to `url`."""
        scheme = url_scheme(checkpoint_id)
        if scheme is None:
            return bool(self.url)
        return not self.protocol or scheme == self.protocol

    def create_storage(self) -> FsspecStorage:
        recheck(self)  # a field set since construction
        return FsspecStorage(self)


def _check_same_bucket(scheme: str, rest: str, name: str) -> None:
    """Refuse an object-store URL whose `..` climbs out of the bucket it names (`s3://a/../b/k` is `b/k`): the save
    wrote into another bucket, where retention and gc of the named one never look."""
    bucket = rest.strip("/").split("/", 1)[0]
    if name.split("/", 1)[0] != bucket or name in ("", "."):
        raise ConfigError(
            f"Checkpoint id {scheme}://{rest.lstrip('/')} leaves its bucket {bucket!r} through '..' (it names "
            f"{scheme}://{name}). Give {scheme}://{name} as the id if that is meant; otherwise drop the '..'."
        )


def _check_filesystem(fs: object) -> None:
    """Refuse a `filesystem=` that is no fsspec filesystem instance (a protocol name, a dict of options, the
    class itself): the first failed with an AttributeError about `protocol`, the class was used as an instance."""
    base = _import_fsspec().AbstractFileSystem
    if isinstance(fs, base):
        return
    if isinstance(fs, type):
        got, fix = f"the class {fs.__name__}", f"pass an instance: {fs.__name__}(...)"
    else:
        got = f"{type(fs).__name__} ({fs!r:.80})"
        fix = "e.g. fsspec.filesystem('s3', ...) or s3fs.S3FileSystem(...); or None, to build one from storage_options"
    raise ConfigTypeError(
        f"FsspecStorageConfig.filesystem must be an fsspec filesystem instance or None, got {got}; {fix}."
    )


def _same_filesystem(a: str, b: str) -> bool | None:
    """Whether fsspec's protocols `a` and `b` name one filesystem class (`s3` and `s3a` do); None where that
    cannot be told (a protocol fsspec does not know, its package not installed, or fsspec itself not).

    While neither class is imported, told by fsspec's table of the classes' dotted names, importing nothing. Once
    one is (fsspec registers a class when it is first used), by the classes themselves: the table names a class
    by its package (`s3fs.S3FileSystem`), the registry by its module (`s3fs.core.S3FileSystem`), and comparing the
    two spellings refused `s3a://` with `s3` in a process that had built an S3 filesystem before, not in another.
    """
    try:
        from fsspec.registry import get_filesystem_class, known_implementations, registry
    except ImportError:  # pragma: no cover - exercised only without the extra
        return None
    if a in registry or b in registry:
        try:  # the one not registered yet is imported here; its package is most often the other's
            return get_filesystem_class(a) is get_filesystem_class(b)
        except ValueError:  # a protocol fsspec does not know
            return None
        except ImportError:  # the other's package is not installed: not the class registered, which was imported
            return False
    known_a, known_b = known_implementations.get(a), known_implementations.get(b)
    if known_a is None or known_b is None:
        return None
    return bool(known_a["class"] == known_b["class"])


def _protocols_of(fs: Any) -> frozenset[str]:
    """The schemes an fsspec filesystem answers to (`fs.protocol` is a name or a tuple of names)."""
    return frozenset({fs.protocol} if isinstance(fs.protocol, str) else fs.protocol)


def _import_fsspec() -> Any:
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "FsspecStorageConfig needs fsspec and the filesystem for its protocol: "
            "pip install 'torch-checkpointing[s3]' (S3) or add gcsfs/adlfs for GCS/Azure."
        ) from exc
    return fsspec


# The blocking calls the storage makes; fsspec's sync wrapper of an async filesystem takes `timeout=` for them.
_BOUNDED_CALLS = frozenset(
    {"call_s3", "cat_file", "cp_file", "exists", "find", "info", "isdir", "ls", "pipe_file", "rm", "rm_file", "size"}
)


class _FsWrapper:
    """A filesystem whose attributes are the wrapped one's (`_fs`), forwarded by `__getattr__`.

    A copy (pickle, `copy.deepcopy`) is made without its state and then asked for `__setstate__`: that lookup
    reached `self._fs`, itself looked up through `__getattr__`, and the copy died of a RecursionError."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    def __getattr__(self, name: str) -> Any:
        if name == "_fs":  # only a copy whose state is not set yet gets here
            raise AttributeError(name)
        return getattr(self._fs, name)


class _BoundedFs(_FsWrapper):
    """A filesystem whose blocking calls give up after `timeout_s` (fsspec cancels the request and raises
    `FSTimeoutError`). The HTTP client's read timeout does not cover a body sent to a server that stopped
    reading it: without this, an upload to a hung server waits forever.

    Only fsspec's own sync wrappers of async methods take `timeout=`; a method a subclass overrides (a test
    filesystem that traces GETs) is called as it is.
    """

    def __init__(self, fs: Any, timeout_s: float) -> None:
        super().__init__(fs)
        self._timeout_s = timeout_s

    def __getattr__(self, name: str) -> Any:
        attr = super().__getattr__(name)
        if name in _BOUNDED_CALLS and inspect.iscoroutinefunction(getattr(attr, "__wrapped__", None)):
            return functools.partial(attr, timeout=self._timeout_s)
        return attr


class _BucketGone(ObjectStoreError):
    """A request's "not found" that the store said of the bucket (NoSuchBucket), not of a key.

    s3fs raises both as FileNotFoundError, which every "if it is still there" caller suppresses: a bucket deleted
    after the storage's first look (a lifecycle rule, an operator) read as an empty run, a delete in it as done.
    Not a FileNotFoundError, it passes every such `except`; an `_ErrorScope` names its object in it.
    """

    def __init__(self, bucket: str, request: str) -> None:
        self.reason = f"the bucket {bucket!r} does not exist (NoSuchBucket: {_FIXES['NoSuchBucket']})"
        super().__init__(f"{request} failed: {self.reason}")


class _NamesMissingBucket(_FsWrapper):
    """An S3 filesystem whose calls raise `_BucketGone` where the store said NoSuchBucket (see there).

    Each method's wrapper is made once and kept (`_calls`): it was made anew at every lookup, so at every request.
    The kept wrappers are no state of a copy (they close over this instance's filesystem)."""

    def __init__(self, fs: Any) -> None:
        super().__init__(fs)
        self._calls: dict[str, Callable[..., Any]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"_fs": self._fs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._fs = state["_fs"]
        self._calls = {}

    def __getattr__(self, name: str) -> Any:
        if name == "_calls":  # only a copy whose state is not set yet gets here
            raise AttributeError(name)
        call = self._calls.get(name)
        if call is not None:
            return call
        attr = super().__getattr__(name)
        if not callable(attr):
            return attr
        call = self._calls[name] = self._wrapped(name, attr)
        return call

    def _wrapped(self, name: str, attr: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except FileNotFoundError as exc:
                if _error_code(exc) != "NoSuchBucket":
                    raise
                raise _BucketGone(_bucket_of(self._fs, args, kwargs), f"{name} of {_target(args, kwargs)}") from exc

        return call


def _bucket_of(fs: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The bucket a call named: its `Bucket=` (boto's calls), else its first path's."""
    if "Bucket" in kwargs:
        return str(kwargs["Bucket"])
    return str(fs.split_path(args[0])[0]) if args and isinstance(args[0], str) else "?"


def _target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    if "Bucket" in kwargs:
        return f"s3://{kwargs['Bucket']}/{kwargs.get('Key') or kwargs.get('Prefix') or ''}"
    return f"s3://{args[0]}" if args and isinstance(args[0], str) else "the bucket"


@dataclass
class _Backend:
    """One fsspec filesystem and what the names on it look like; `io` is the filesystem for requests."""

    fs: Any
    scheme: str
    protocols: frozenset[str]
    io: Any = None

    def __post_init__(self) -> None:
        if self.io is None:
            self.io = self.fs

    @property
    def is_s3(self) -> bool:
        return bool(self.protocols & _S3_PROTOCOLS)

    @property
    def object_store(self) -> bool:
        return bool(self.protocols & _OBJECT_STORE_PROTOCOLS)

    def name(self, rest: str) -> str:
        """`bucket/key` on object stores; an absolute path elsewhere (file://, memory://)."""
        name = posixpath.normpath(rest if self.object_store else "/" + rest)
        # One leading slash on a directory store: `normpath` keeps a leading `//`, so a relative id joined to the
        # root (itself named here) read `//root/id`, another name for the same file.
        return name.strip("/") if self.object_store else "/" + name.lstrip("/")

    def url(self, key: str) -> str:
        """The URL a user passes for `key` (to `load`, the CLI, fsspec): `s3://bucket/key`, `file:///abs/path`,
        `memory://root/id` (a directory store's key is absolute, but only a local path keeps its slash in a URL).
        The one place a name of this store is turned back into a URL: every message names it so."""
        local = bool(self.protocols & {"file", "local"})
        return f"{self.scheme}://{key if self.object_store or local else key.lstrip('/')}"


def _own_copy(options: Any) -> Any:
    """The caller's fsspec options with every dict and list copied: botocore fills in a `retries` dict given in
    `config_kwargs` (adding `total_max_attempts`), which changed the caller's config under them."""
    if isinstance(options, dict):
        return {key: _own_copy(value) for key, value in options.items()}
    if isinstance(options, list):
        return [_own_copy(value) for value in options]
    return options


def _own_filesystem_options(options: dict[str, Any], scheme: str) -> dict[str, Any]:
    """`_own_copy` of the caller's options; for S3 with the endpoint the environment names pinned at build, as the
    options' own is (`_pin_endpoint`)."""
    own = _own_copy(options)
    return _pin_endpoint(own) if scheme in _S3_PROTOCOLS else own


# Environment variables that choose a store or its credentials (AWS_ENDPOINT_URL, AWS_PROFILE, ...).
_STORE_ENVIRONMENT = ("AWS_", "BOTO_", "GOOGLE_", "GCE_", "GCSFS_", "AZURE_", "FSSPEC_")
_filesystems: dict[str, Any] = {}
_filesystems_lock = threading.Lock()  # over the two dicts only: never held while a client is made
# key -> the lock of the one thread making that store's filesystem and client (`_connected`): a client's making may
# wait on a credential_process, an STS AssumeRole or the instance metadata service. Made under `_filesystems_lock`,
# it held up every other thread's storage of any store for as long.
_filesystems_building: dict[str, threading.Lock] = {}


def store_environment() -> dict[str, str]:
    """The environment variables of this process that choose a store or its credentials (`_STORE_ENVIRONMENT`)."""
    return {k: v for k, v in os.environ.items() if k.upper().startswith(_STORE_ENVIRONMENT)}


def _filesystem(scheme: str, options: dict[str, Any]) -> Any:
    """The fsspec filesystem for `scheme` with the caller's `options`, shared by the storages of this process that
    name the same store. fsspec's own instance cache keys a filesystem on its options alone, but the environment
    (AWS_ENDPOINT_URL, the credentials, a profile) defines the store as much: a storage built after they changed
    got the client of the store they named before, and read and wrote there, silently. A filesystem of its own
    per storage cost 170-200 ms of client set-up at each `latest_checkpoint`, `storage_for` or manager on S3.
    So the key here is the options and that environment, in this process; options that are no JSON (a session
    object) get a filesystem of their own, and the caller's own `skip_instance_cache` is fsspec's to obey."""
    fsspec = _import_fsspec()  # first: a filesystem shared from before must not hide a missing package
    own = _own_filesystem_options(options, scheme)
    if "skip_instance_cache" in own:
        return _connected(fsspec.filesystem(scheme, **own))
    environment = sorted(store_environment().items())
    try:
        key = json.dumps([scheme, own, environment, os.getpid()], sort_keys=True)
    except (TypeError, ValueError):  # an option that is no JSON: no telling two stores apart by it
        return _connected(fsspec.filesystem(scheme, skip_instance_cache=True, **own))
    with _filesystems_lock:
        fs = _filesystems.get(key)
        if fs is not None:
            return fs
        building = _filesystems_building.setdefault(key, threading.Lock())
    with building:  # a storage of the same store waits for this one's client; any other store's does not
        with _filesystems_lock:
            fs = _filesystems.get(key)
        if fs is None:
            fs = _connected(fsspec.filesystem(scheme, skip_instance_cache=True, **own))
            with _filesystems_lock:
                _filesystems[key] = fs
                _filesystems_building.pop(key, None)
    return fs


def _connected(fs: Any) -> Any:
    """`fs` with its S3 client made now. botocore reads the credentials, region and profile from the environment
    when the client is made, and s3fs makes it at the first request: a storage built for one set of credentials
    and first used after AWS_ACCESS_KEY_ID changed signed with the new ones, and every storage sharing its
    filesystem (built for the old ones) with it. A client that cannot be made now (a profile that is not there)
    is made, and fails naming the URL, at the first request, as before."""
    connect = getattr(fs, "connect", None) if _protocols_of(fs) & _S3_PROTOCOLS else None
    if connect is not None:
        try:
            connect()
        except Exception as exc:  # the first request raises it again, naming the URL
            logger.debug("S3 client not made when the storage was built (%s); the first request makes it", exc)
    return fs


def _pin_endpoint(options: dict[str, Any]) -> dict[str, Any]:
    """The S3 endpoint the environment names now, put into `options` where they name none: botocore reads
    AWS_ENDPOINT_URL only when the client is made, at the first request, so a storage built for one store and
    first used after the variable changed reached the other store."""
    client_kwargs = options.get("client_kwargs")
    if options.get("endpoint_url") or (isinstance(client_kwargs, dict) and client_kwargs.get("endpoint_url")):
        return options
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return options
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {**options, "endpoint_url": endpoint} if endpoint else options


class FsspecStorage(Storage):
    """The Storage interface over fsspec filesystems, with the object-store commit (no directory rename)."""

    atomic_rename = False

    def __init__(self, config: FsspecStorageConfig) -> None:
        if not isinstance(config, FsspecStorageConfig):
            raise ConfigTypeError(
                f"FsspecStorage needs an FsspecStorageConfig, got {config!r}; e.g. FsspecStorageConfig(url='s3://b/run')."
            )
        self.config = config
        self._backends: dict[str, _Backend] = {}
        self._buckets_seen: set[str] = set()  # buckets known to exist: a miss in them is only a miss
        self._buckets_answered: set[str] = set()  # buckets a request answered in: `exists` names their loss
        self._owners: dict[str, str] = {}  # prefix -> the claim token its uploads carry (`own_writes`)
        self._root: tuple[_Backend, str] | None = self._resolve_url(config.url) if config.url else None
        if config.protocol:
            self._backend(config.protocol)  # fail at construction on an unknown protocol or a missing package

    @property
    def fs(self) -> Any:
        """The filesystem of the configured protocol (a config without one has a filesystem per scheme)."""
        if not self.config.protocol:
            raise ValueError("this FsspecStorage selects its filesystem by each id's scheme; it has no single `fs`")
        return self._backend(self.config.protocol).fs

    # ------------------------------------------------------------------ names

    def _backend(self, scheme: str, url: str = "") -> _Backend:
        """The filesystem of `scheme`, made at its first use. Making it imports the client and may start its
        event loop, before any call's `_ErrorScope`: a shortage there was a bare OSError naming a file of fsspec's
        or botocore's, with no word of the store; now it carries the note naming `url` (the id that needed it) or
        the config's url. With neither (a storage of a protocol alone), the caller that knows the id names it."""
        backend = self._backends.get(scheme)
        if backend is None:
            where = url or self.config.url
            with shortage_named(f"set-up of the {scheme}:// client for {where}") if where else contextlib.nullcontext():
                backend = self._new_backend(scheme)
        return backend

    def _new_backend(self, scheme: str) -> _Backend:
        given = self.config.filesystem
        if given is not None and scheme in _protocols_of(given):
            fs = given
        else:
            fs = _filesystem(scheme, self.config.storage_options)
        timeout = self.config.request_timeout_s
        bounded = _BoundedFs(fs, timeout) if timeout is not None and getattr(fs, "async_impl", False) else fs
        backend = _Backend(fs, scheme, _protocols_of(fs) | {scheme}, bounded)
        if backend.is_s3:
            backend.io = _NamesMissingBucket(bounded)
        for name in backend.protocols:
            self._backends.setdefault(name, backend)
        self._backends[scheme] = backend
        return backend

    def _resolve_url(self, text: str) -> tuple[_Backend, str]:
        match = _SCHEME.match(text)
        assert match is not None
        scheme = match.group(1).lower()
        if self.config.protocol and scheme not in self._backend(self.config.protocol, text).protocols:
            raise ConfigError(  # the caller's id or config: a ValueError too
                f"{text!r} is a {scheme}:// path, but this storage talks to {self.config.protocol}://; "
                f"configure a storage for that scheme."
            )
        backend = self._backend(scheme, text)
        rest = text[match.end() :]  # every slash after the scheme: `Path` may fold them
        name = backend.name(rest)
        if backend.object_store and ".." in rest.split("/"):
            _check_same_bucket(match.group(1), rest, name)
        return backend, name

    def _resolve(self, path: Path | str) -> tuple[_Backend, str]:
        """The filesystem and its name for a path: `bucket/key` for `s3://bucket/key` (or `s3:/bucket/key`)."""
        backend, key = self._resolve_name(path)
        if backend.object_store:
            _refuse_non_utf8_key(backend, key)
        return backend, key

    def _resolve_name(self, path: Path | str) -> tuple[_Backend, str]:
        text = os.fspath(path)
        if _SCHEME.match(text):
            return self._resolve_url(text)
        if self._root is None:
            raise ConfigError(
                f"{text!r} has no URL scheme and FsspecStorageConfig has no url root to place it under; "
                f"use a full id such as 's3://bucket/run/step_100'."
            )
        backend, root = self._root
        if text in ("", "."):
            return backend, root
        if text.startswith("/"):
            # placed under the root it named another path than the one given, silently (`/abs/c3` -> root/abs/c3)
            raise ConfigError(
                f"Checkpoint id {text!r} is an absolute path, but FsspecStorageConfig.url "
                f"({backend.url(root)}) is a root for relative ids only. Give {text.lstrip('/')!r} to use "
                f"{backend.url(backend.name(posixpath.join(root, text.lstrip('/'))))}, or the full URL as the id."
            )
        key = backend.name(posixpath.join(root, text))
        inside, under = key.lstrip("/"), root.strip("/")
        if under and inside != under and not inside.startswith(under + "/"):
            # `..` steps out: on an object store up to another bucket, where retention and gc of this root never look
            raise ConfigError(
                f"Checkpoint id {text!r} leaves this storage's url root {backend.url(root)} (it names "
                f"{backend.url(key)}); name ids inside the root, or give the full URL as the id"
            )
        return backend, key

    def _key(self, path: Path | str) -> str:
        return self._resolve(path)[1]

    def _resolve_for_write(self, path: Path | str) -> tuple[_Backend, str]:
        """`_resolve` for a write. s3fs reads `?versionId=` in a name as a version and drops it with all that
        follows: every file of `run/step?versionId=1/` was written to the one object `run/step`, another name's.
        (Reads and listings take such a name as it comes: a user's object so named must not break a listing.)"""
        backend, key = self._resolve(path)
        if backend.is_s3 and _VERSION_ID in key:
            raise ConfigError(
                f"{backend.url(key)} cannot be stored on S3 through s3fs: it reads {_VERSION_ID!r} in a name "
                f"as an object version. Choose an id without it."
            )
        return backend, key

    def remap_path(self, path: Path) -> str:
        backend, key = self._resolve(path)
        return backend.url(key)

    def handles_url(self, checkpoint_id: str) -> bool:
        """URL ids of this store's scheme (any fsspec scheme, without a configured protocol) are its own names."""
        scheme = url_scheme(checkpoint_id)
        return scheme is not None and self.config.handles(checkpoint_id)

    def _errors(self, what: str, path: Path | str) -> _ErrorScope:
        return _ErrorScope(f"{what} {self.remap_path(Path(os.fspath(path)))}", wrap_missing=what.startswith("upload"))

    # ------------------------------------------------------------------ reads

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        args = read_args or ReadArgs()
        if args.pre_read_full_file:
            return io.BytesIO(self.read(path))  # type: ignore[return-value]
        backend, key = self._resolve(path)
        if backend.protocols & {"file", "local"}:
            with self._errors("download of", path):
                return backend.fs.open(key, "rb", block_size=self.config.part_size)  # type: ignore[no-any-return]
        with self._missing_bucket_named(backend, key, "download of", path), self._errors("download of", path):
            return _RangedStream(self, path, _version(backend, key))

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        """The object as it is now: its size from a fresh HEAD (never fsspec's listing cache, which another
        process's write makes stale), and every byte from that one version of it.

        Manifests are not read through here: every reader of one sizes it first and refuses one larger than any
        manifest unread (`manifest.read_stored_bounded`, for every store without local paths).
        """
        backend, key = self._resolve(path)
        with self._missing_bucket_named(backend, key, "download of", path), self._errors("download of", path):
            if not backend.is_s3:
                version = _version(backend, key)
                return self._read_span(backend, key, 0, version[0], version)
            # One part: one GET held to the HEAD's ETag (a plain GET of the HEAD's size read a larger replacement's
            # first bytes as the whole object). Larger: concurrent GETs, the version checked after them.
            version, data = _get_sized(backend, key, self.config.part_size, self.config.request_timeout_s)
            return data if data is not None else self._read_span(backend, key, 0, version[0], version)

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        """Ranged GETs only (concurrent ones for a long range): the rest of the object is never fetched.

        Exactly `length` bytes or an `ObjectStoreError`: a range past the object's end means the object is not
        the one the caller sized (truncated or replaced), and a short answer would be taken for data.
        """
        if length <= 0:
            return b""
        backend, key = self._resolve(path)
        with self._missing_bucket_named(backend, key, "ranged read of", path), self._errors("ranged read of", path):
            return self._read_span(backend, key, offset, length)

    def read_sized(self, path: Path, limit: int) -> tuple[int, bytes | None]:
        """On S3 a HEAD, then a GET held to its ETag (`If-Match`, `_get_sized`): a HEAD then a plain GET met two
        versions when the object was replaced between them (the id saved again, a move putting a copy back), and
        the new one's first bytes were read as the whole old manifest: a healthy checkpoint refused as damaged,
        or as a failed read. A larger object than `limit` is never fetched. Elsewhere, and in a subclass that
        overrides `getsize` or `read_range` (to count, route or decrypt reads), the base's: those two, in turn."""
        backend, key = self._resolve(path)
        if not backend.is_s3 or not self._sizes_and_ranges_own():
            return super().read_sized(path, limit)
        with self._missing_bucket_named(backend, key, "download of", path), self._errors("download of", path):
            try:
                version, data = _get_sized(backend, key, limit, self.config.request_timeout_s)
                return version[0], data
            except FileNotFoundError as exc:  # s3fs's says "The specified key does not exist.", naming nothing
                raise FileNotFoundError(errno.ENOENT, "no such object", backend.url(key)) from exc

    def _sizes_and_ranges_own(self) -> bool:
        """Whether `getsize` and `read_range` are this class's, which `read_sized`'s one GET stands for."""
        kind = type(self)
        return kind.getsize is FsspecStorage.getsize and kind.read_range is FsspecStorage.read_range

    def _get(self, backend: _Backend, key: str, start: int, end: int) -> bytes:
        data = bytes(backend.io.cat_file(key, start=start, end=end))
        if len(data) != end - start:
            raise EOFError(
                f"asked for bytes [{start}, {end}), got {len(data)}: the object is shorter than that (it was "
                f"truncated or replaced meanwhile)"
            )
        return data

    def _read_span(
        self, backend: _Backend, key: str, offset: int, length: int, version: tuple[int, str] | None = None
    ) -> bytes:
        """Bytes [offset, offset+length): one GET, or concurrent part-sized GETs of one version of the object.

        Several GETs may each meet a different object if it is replaced meanwhile, and their parts would join
        into bytes that no version holds; so the object's size and ETag are taken before and after them and
        must agree (one GET answers from one version by itself).
        """
        part = self.config.part_size
        if length <= part:
            return self._get(backend, key, offset, offset + length) if length else b""
        before = version or _version(backend, key)
        out, view = new_bytes(length)

        def fetch(start: int) -> None:
            size = min(part, length - start)
            view[start : start + size] = self._get(backend, key, offset + start, offset + start + size)

        _run_all(fetch, list(range(0, length, part)), self.config.max_concurrency)
        after = _version(backend, key)
        if after != before:
            raise _ChangedWhileRead(
                f"the object changed while it was read (size {before[0]}, ETag {before[1] or '?'} before; "
                f"size {after[0]}, ETag {after[1] or '?'} after); its parts may come from different versions"
            )
        return out if isinstance(out, bytes) else bytes(out)

    def local_path(self, path: Path) -> str | None:
        return None  # nothing the OS can mmap: the engine reads through read()/read_range()

    # ------------------------------------------------------------------ writes

    def stream_write(self, path: Path) -> io.RawIOBase:
        """A stream that uploads parts as they fill; close() completes the upload (the object becomes durable).

        Leaving its `with` block on an exception aborts the upload, so no partial object ever appears.
        """
        backend, key = self._resolve_for_write(path)
        url = backend.url(key)
        if backend.is_s3:
            return _S3MultipartWriter(
                backend.io,
                key,
                url,
                self.config.part_size,
                self.config.max_concurrency,
                _is_commit_file(key),
                self._tag(key),
            )
        return _FsspecFileWriter(backend.io, key, self.config.part_size, url)

    def write(self, path: Path, data: Any) -> None:
        """One PUT (a multipart upload when larger than a part). On S3 a manifest is created, never replaced. On
        `file://`, which writes in place, through `stream_write`: a write that fails leaves no partial file.

        The manifest's appearance is the commit on a store without rename. Two saves of one id that both pass
        the commit's "no manifest yet" check would otherwise both succeed, the later manifest silently
        replacing the earlier one (whose save was told it committed); a conditional create
        (`If-None-Match: *`) lets only the first land, and the second fails with an `ObjectStoreError`.
        """
        view = memoryview(data).cast("B")
        backend, key = self._resolve_for_write(path)
        if len(view) > self.config.part_size or backend.protocols & {"file", "local"}:
            # `file://` writes in place: the stream drops what a failed write left (`_FsspecFileWriter._discard`),
            # where `pipe_file` left a truncated file (a save's manifest, refusing the id to every later save)
            self._check_parts(path, len(view))
            with self.stream_write(path) as stream:
                stream.write(view)
            return
        url = backend.url(key)
        tag = self._tag(key) if backend.is_s3 else {}
        if backend.is_s3 and _is_commit_file(key):
            _create(backend.io, key, bytes(view), url, tag)
            return
        with self._errors("upload of", path):
            backend.io.pipe_file(key, bytes(view), **tag)

    def _check_parts(self, path: Path, size: int) -> None:
        """An `ObjectStoreError` naming `path` when its `size` bytes need more than S3's `MAX_PARTS` parts of
        `part_size`: refused before any request. Its upload began before, and failed after 10,000 parts had been
        sent (50 GiB at 5 MiB), saying nothing of the part size it needed."""
        backend, key = self._resolve_for_write(path)
        part_size = self.config.part_size
        if not backend.is_s3 or size <= part_size * MAX_PARTS:
            return
        needed = -(-size // MAX_PARTS)
        fix = (
            f"raise FsspecStorageConfig.part_size to at least {needed}"
            if needed <= MAX_PART_SIZE
            else f"no part size up to S3's {MAX_PART_SIZE} bytes fits it: save it in smaller pieces"
        )
        raise ObjectStoreError(  # raised only: the caller hears of it, before any request
            f"upload of {backend.url(key)}: {size} bytes need more than {MAX_PARTS} parts of {part_size} bytes "
            f"(S3's limit per object): {fix}."
        )

    def delete(self, path: Path) -> None:
        backend, key = self._resolve(path)
        with self._errors("delete of", path):
            backend.io.rm_file(key)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        """A no-op on object stores (a prefix exists once an object is under it); elsewhere `path`, and with
        `recursive` its missing parents. Without it, a missing parent is a FileNotFoundError: a rank must not
        re-create the directories its save's rank 0 made and removed (`Commit._mkdir_one`), and fsspec's
        makedirs, used whatever `recursive` said, did."""
        backend, key = self._resolve(path)
        if backend.object_store:
            return
        with self._errors("mkdir of", path):
            if recursive:
                backend.fs.makedirs(key, exist_ok=True)
            elif not backend.io.isdir(key):
                _mkdir_one_level(backend, key)

    def rmdir(self, path: Path) -> None:
        """Delete every object under the prefix `path/` (and an object named exactly `path`), in bulk.

        A committed checkpoint is first claimed (`.incomplete`), then its files go in bulk, its manifest after them
        (first where the claim does not own it: `_delete_marked`), the marker last: a delete that fails or is
        killed midway leaves a prefix that readers refuse and gc collects, never a committed checkpoint missing
        files. A checkpoint saved at `path` after the listing is left whole (`_manifest_listed`).
        """
        backend, key = self._resolve(path)
        with self._errors("delete of", path):
            if not backend.object_store:  # a real directory tree (file://, memory://)
                if backend.io.exists(key):
                    _remove_tree(backend, key)
                return
            read = _manifest_now(backend, key)
            keys = _objects_under(backend, key, include_self=True)
            _refuse_a_live_save(backend, key, keys)
            _delete_prefix(backend, key, keys, copied=_manifest_listed(backend, key, keys, read))

    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        is_cross_link: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        """A server-side copy then delete: NOT atomic on an object store (which is why atomic_rename is False).

        For a directory, `dst` first gets an `.incomplete` marker and the manifest is copied last, so `dst` never
        looks committed before all its files are and a copy killed midway leaves a prefix gc recognises as ours
        (before: files nothing claimed, kept for good; on `file://`, a trash folder gc kept as "not ours"). The
        source then goes as `rmdir` deletes it (`_delete_objects`): claimed, its files, its manifest, the marker
        last. On `file://` the source's manifest went first, unclaimed: a delete killed among its files left them
        at the id with no manifest and no marker, which gc never named and every later save of the id refused.
        """
        (backend, src), (other, dst) = self._resolve(src_path), self._resolve_for_write(dst_path)
        if other is not backend:
            raise ValueError(f"cannot rename across stores: {self.remap_path(src_path)} -> {self.remap_path(dst_path)}")
        fs = backend.io
        with self._errors(f"rename (copy, then delete) of {self.remap_path(src_path)} to", dst_path):
            if not is_directory:
                _copy_into_place(backend, src, dst)
                fs.rm_file(src)
                return
            keys = sorted(_objects_under(backend, src), key=lambda k: posixpath.basename(k) == MANIFEST_FILE_NAME)
            if keys:
                copied = _manifest_of(backend, src, keys)
                _copy_prefix(backend, src, dst, keys)
                _delete_prefix(backend, src, keys, restore=True, copied=copied)
            if not backend.object_store:
                _remove_empty_dirs(backend, src)
        fs.invalidate_cache()

    def replace_directory(self, src: Path, dst: Path) -> None:
        """Refuses to replace a committed checkpoint: on an object store there is no moment at which the old
        one could be swapped out without a window where a reader sees a mix of both."""
        if self.exists(dst / MANIFEST_FILE_NAME):
            raise CheckpointError(
                f"Refusing to overwrite the committed checkpoint {self.remap_path(dst)}: an object store cannot "
                f"replace it atomically. Save under a new id, or delete the old one first."
            )
        self.rename(src, dst, is_directory=True)

    # ------------------------------------------------------------------ conditional writes (a save's claim)
    # What `commit.ConditionalStorage` asks for: the object-store commit claims an id by creating its marker
    # only if absent, and takes a dead save's claim over only if it is still the version that was judged.

    def create_object(self, path: Path, data: bytes) -> bool:
        """Create `path` only if no object is there (S3's `If-None-Match: *`); False when one is.

        On `file://` and `memory://` in one step too (`_create_here`). fsspec's own create there checks
        existence, then opens the file for writing: two creators of one claim (two ranks of a save, a save and
        gc) were both told they created it, and the second's open truncated the first's bytes, so a reader saw
        an empty marker (no claim: taken over) or one claim's tail after the other's (no claim at all). Other
        stores get fsspec's create (GCS and Azure: see docs/storage.md).
        """
        backend, key = self._resolve_for_write(path)
        if backend.protocols & {"memory"}:
            with _MEMORY_MARKER_LOCK:
                return self._create_here(backend, key, path, data)
        return self._create_here(backend, key, path, data)

    def _create_here(self, backend: _Backend, key: str, path: Path, data: bytes) -> bool:
        """`create_object`, its caller holding the process's lock on `memory://`."""
        with self._errors("upload of", path):
            try:
                if backend.protocols & {"file", "local"}:
                    created = _create_claim_here(key, bytes(data))
                    backend.fs.invalidate_cache(key)
                    return created
                if backend.protocols & {"memory"} and backend.io.exists(key):
                    return False
                backend.io.pipe_file(key, bytes(data), mode="create")
            except Exception as exc:
                if _precondition_failed(exc):
                    return False
                raise
            if backend.is_s3:
                _check_conditions_honoured(backend, key, bytes(data))
        backend.fs.invalidate_cache(key)
        return True

    def read_object(self, path: Path) -> tuple[bytes, str] | None:
        """A small object's bytes and the ETag of that very version; None when there is none. Of an object larger
        than any claim (`MAX_MARKER_BYTES`) only its first bytes are read: enough to tell it is none.

        One GET between two HEADs that agree: the bytes belong to the ETag a conditional replace then names.
        A store without ETags (file://, memory://) gets a version from the bytes (`_content_version`).
        """
        backend, key = self._resolve(path)
        with self._errors("download of", path):
            for _ in range(_READ_ATTEMPTS):
                try:
                    before = _version(backend, key)
                    # A claim is small: of a larger object (another program's) its first bytes tell that.
                    data = self._get(backend, key, 0, min(before[0], MAX_MARKER_BYTES + 1)) if before[0] else b""
                    after = _version(backend, key)
                except FileNotFoundError as exc:
                    self._check_bucket(backend, key, "download of", path, exc)
                    return None
                if after == before:
                    return data, before[1] or _content_version(data)
            raise _ChangedWhileRead(f"the object kept changing while it was read ({_READ_ATTEMPTS} attempts)")

    def replace_object(self, path: Path, data: bytes, etag: str) -> bool:
        """Replace `path` only if it is still the version `etag` (S3's `If-Match`); False when it changed or went.

        On a store without ETags: the bytes compared with that version, a delete, then `create_object` (two
        replacers racing: one creates); on `file://` and `memory://` the compare and the delete are one step
        among processes (`_marker_lock`), elsewhere two. On `file://` the delete and the create are one rename
        (`_replace_local`): a process killed between the two left no marker, and beside a dead save's manifest
        that made the save gc was collecting a committed checkpoint.
        """
        backend, key = self._resolve(path)
        if not backend.is_s3:
            with self._marker_lock(backend, key, path):
                if not self._still(path, etag):
                    return False
                if backend.protocols & {"file", "local"}:  # one step, also against a kill: see `_replace_local`
                    with self._errors("upload of", path):
                        _replace_local(key, bytes(data))
                    backend.fs.invalidate_cache(key)
                    return True
                with self._errors("delete of", path), contextlib.suppress(FileNotFoundError):
                    backend.io.rm_file(key)
                return self._create_here(backend, key, path, data)  # the lock is held here already
        with self._errors("upload of", path):
            try:
                backend.io.pipe_file(key, bytes(data), IfMatch=etag)
            except Exception as exc:
                if _precondition_failed(exc) or _missing(exc):
                    return False
                raise
        backend.fs.invalidate_cache(key)
        return True

    def delete_object(self, path: Path, etag: str) -> bool:
        """Delete `path` only if it is still the version `etag` (S3's conditional delete); False otherwise.

        On a store without ETags the bytes are compared with that version first, then deleted (one step among
        processes on `file://` and `memory://`: `_marker_lock`). There a claim's folder goes with it when nothing
        else is in it (`_remove_emptied_folder`)."""
        backend, key = self._resolve(path)
        if backend.is_s3:
            return self._delete_if_match(backend, key, path, etag)
        with self._marker_lock(backend, key, path):
            deleted = self._still(path, etag) and self._delete_if_match(backend, key, path, etag)
            if deleted and posixpath.basename(key) == INCOMPLETE_MARKER:
                _remove_emptied_folder(backend, posixpath.dirname(key))
            return deleted

    def compares_atomically(self, path: Path) -> bool:
        """Whether a marker's compare and its replace or delete (`replace_object`, `delete_object`) are one step
        against every other writer: S3's conditional requests, the marker's lock on `file://` and `memory://`.
        Elsewhere (GCS, Azure and other fsspec stores, as reached here) they are two requests, and the claim of
        another save must not be taken over or deleted by them (`commit.compares_atomically`)."""
        backend, _ = self._resolve(path)
        return backend.is_s3 or bool(backend.protocols & {"memory", "file", "local"})

    def _delete_if_match(self, backend: _Backend, key: str, path: Path, etag: str) -> bool:
        """The delete itself: on S3 conditional on `etag`; elsewhere (compared already, under the marker's lock)
        plain."""
        with self._errors("delete of", path):
            try:
                if backend.is_s3:
                    bucket, name, _ = backend.fs.split_path(key)
                    backend.io.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=etag)
                else:
                    backend.io.rm_file(key)
            except Exception as exc:
                if _precondition_failed(exc) or _missing(exc):
                    return False
                raise
            finally:
                backend.fs.invalidate_cache(key)
        return True

    @contextlib.contextmanager
    def _marker_lock(self, backend: _Backend, key: str, path: Path) -> Iterator[None]:
        """Make a marker's compare and its delete (or replace) one step among the processes of this machine: an
        exclusive `flock` on the marker's directory (`file://`), a lock of this process (`memory://`, which lives
        in one). Other stores keep the two steps (see docs/storage.md).

        Before, gc and a save that both judged one claim dead compared it, then both deleted and created: gc's
        delete removed the save's new claim, both held the id, and gc deleted the save's files while it wrote.
        A process stopped (SIGSTOP) inside this step holds the lock: the others give up after
        `_MARKER_LOCK_WAIT_S` with an `ObjectStoreError` naming the marker, rather than wait for ever."""
        with _locked_marker(backend, key, lambda: self.remap_path(path)):
            yield

    def _still(self, path: Path, etag: str) -> bool:
        """Whether `path` is still the version `etag` that `read_object` returned (a store without ETags: its
        bytes). Before, such a store's conditional replace and delete ignored the version: gc's delete of a claim
        it had judged dead removed the claim a new save had put there since."""
        found = self.read_object(path)
        return found is not None and found[1] == etag

    # ------------------------------------------------------------------ which save wrote an object
    # A failed save removes only what a save of ours wrote (`commit.TaggedStorage`): a user's object PUT under
    # its prefix while it ran, or over one of its keys, stays.

    def own_writes(self, root: Path, token: str) -> bool:
        """From now on, every object this storage uploads under `root/` names the save `token` in its metadata;
        whether it does. Only on S3, whose HEAD returns it; elsewhere nothing is recorded."""
        backend, key = self._resolve(root)
        if backend.is_s3:
            self._owners[key] = token
        return backend.is_s3

    def _tag(self, key: str) -> dict[str, Any]:
        """The metadata of an upload to `key`: its save's token when `key` is under a prefix a save owns."""
        owners = [prefix for prefix in self._owners if key.startswith(prefix + "/")]
        if not owners:
            return {}
        return {"Metadata": {SAVE_TAG: save_tag(self._owners[max(owners, key=len)])}}

    def objects_by_save(self, root: Path) -> tuple[dict[str, tuple[str, str]], list[str]] | None:
        """The objects under `root/`, relative: {name: (token, ETag)} of those a save of ours uploaded, and the
        names of the others (a user's, another program's, or one PUT over a save's key). None off S3, whose
        objects carry no such record. One HEAD per object (`max_concurrency` at once: a checkpoint of many ranks
        holds thousands): the ETag is the version the caller may delete."""
        backend, key = self._resolve(root)
        if not backend.is_s3:
            return None
        with self._errors("listing of", root):
            names = _objects_under(backend, key)
            heads = _GET_POOL.map_bounded(lambda name: _head(backend, name), names, self.config.max_concurrency)
        ours: dict[str, tuple[str, str]] = {}
        others: list[str] = []
        for name, head in zip(names, heads, strict=True):
            if head is None:
                continue  # deleted meanwhile
            rel = name[len(key) + 1 :]
            # A name no save writes (`a//b`, `a/../b`, `a/`) is never joined back into a path to delete: `Path`
            # folds it into another object's name.
            tag = (head.get("Metadata") or {}).get(SAVE_TAG)
            if tag and posixpath.normpath(rel) == rel and not rel.startswith("/"):
                ours[rel] = (urllib.parse.unquote(tag), str(head.get("ETag") or ""))
            else:
                others.append(rel)
        return ours, sorted(others)

    def delete_unchanged(self, root: Path, etags: dict[str, str]) -> list[str]:
        """Delete each object under `root` (relative name: ETag) only if it is still that version, `max_concurrency`
        at once; the names that changed or went meanwhile (left as they are)."""
        kept = _GET_POOL.map_bounded(
            lambda rel: not self.delete_object(root / rel, etags[rel]), list(etags), self.config.max_concurrency
        )
        return [rel for rel, k in zip(etags, kept, strict=True) if k]

    # ------------------------------------------------------------------ unfinished multipart uploads
    # An upload never completed nor aborted (its writer killed, or a CreateMultipartUpload whose answer was lost
    # and retried) holds its parts invisibly, billed until aborted. Whoever removes a save's prefix while holding
    # its claim aborts them: listed before the claim goes, so none of a save that claims the id after is listed.

    def unfinished_uploads(self, root: Path) -> list[tuple[str, str]]:
        """The multipart uploads under `root/` never completed nor aborted: (key, upload id). [] off S3."""
        backend, key = self._resolve(root)
        if not backend.is_s3:
            return []
        with self._errors("listing of the unfinished uploads of", root):
            return [(u["Key"], u["UploadId"]) for u in _uploads_under(backend.io, key + "/")]

    def abort_uploads(self, root: Path, uploads: list[tuple[str, str]]) -> list[str]:
        """Abort `uploads` (from `unfinished_uploads(root)`); the URLs of those the store would not abort."""
        backend, _ = self._resolve(root)
        return [backend.url(k) for k, upload_id in uploads if not _abort_upload(backend.io, k, upload_id)]

    # ------------------------------------------------------------------ listings (never from a stale cache)
    # A store that cannot answer is an ObjectStoreError naming the URL, never a raw client error, and never
    # "nothing there": a listing that failed must not read as an empty run or a missing manifest.

    def _fresh(self, path: Path) -> tuple[_Backend, str]:
        """The filesystem and name for `path`, with fsspec's listing cache dropped: another process (the writer,
        another rank) may have written since."""
        backend, key = self._resolve(path)
        backend.fs.invalidate_cache(key)
        return backend, key

    def ls(self, path: Path) -> list[str]:
        backend, key = self._fresh(path)
        with self._missing_bucket_named(backend, key, "listing of", path), self._errors("listing of", path):
            names = {n.rstrip("/") for n in backend.io.ls(key, detail=False)} - {key}
            return sorted(posixpath.basename(n) for n in names)  # in the scope: a shortage here names the prefix

    def tree_bytes(self, path: Path) -> int:
        """The bytes of the objects under the prefix `path/` (on S3: one listing, 1000 keys a page)."""
        backend, key = self._fresh(path)
        with self._errors("listing of", path):
            try:
                found = backend.io.find(key, detail=True)
            except FileNotFoundError:
                return 0
            inside = [info for name, info in found.items() if name.startswith(key + "/")]
            return sum(int(info.get("size") or 0) for info in inside if info.get("type") != "directory")

    def process_local(self, path: Path) -> bool:
        backend, _ = self._resolve(path)
        return "memory" in backend.protocols

    def changed_at(self, path: Path) -> float | None:
        """On an object store, the newest LastModified of the object `path` and those under the prefix `path/` (a
        move copies every object, so that is when a trash or aside copy got its name); before, none: gc counted another
        host's trash as 0 s old for ever and never collected it. On a directory store, the later of its mtime
        and ctime (as a local path's). None where the store says neither, or where any object's time cannot be
        read: that one may be the newest."""
        backend, key = self._fresh(path)
        with self._errors("listing of", path):
            if not backend.object_store:
                info = backend.io.info(key)
                times = [_modified(info), _seconds(info.get("created"))]
            else:
                found = backend.io.find(key, detail=True)
                # An object at `path` itself is its own time (a probe's a killed process left: `CLOCK_PROBE_RE`).
                times = [_modified(info) for name, info in found.items() if name == key or name.startswith(key + "/")]
                if not found:
                    raise FileNotFoundError(errno.ENOENT, "nothing under this prefix", backend.url(key))
                if None in times:  # that object may be the newest: left out, a young copy read as old
                    return None
        known = [t for t in times if t is not None]
        return max(known) if known else None

    def store_now(self, folder: Path) -> float:
        """Now by the clock that stamps `changed_at`'s times under `folder`: on an object store the LastModified
        of a probe object put under `folder/` and deleted (a PUT, a HEAD and a DELETE, at most once per
        `STORE_CLOCK_REREAD_S`; a store that stamps whole seconds reads up to a second early, which only makes
        ages younger); on `file://` a local probe; elsewhere (`memory://`, stamped by this process) this host's.
        A pass that writes nothing (`base_storage.writing_nothing`: a dry run) reads S3's clock from the `Date` of
        a listing's answer instead (whole seconds, cut: early by up to one, which only makes ages younger)."""
        backend, key = self._resolve(folder)
        if backend.protocols & {"file", "local"}:
            return local_store_now(key)
        if not backend.object_store:
            return time.time()
        look = (lambda: _answer_date(backend, key)) if backend.is_s3 else None
        return store_now(_clock_place(backend, key), lambda: _probe_object(backend, key), look)

    def exists(self, path: Path) -> bool:
        """Whether an object or prefix is there. On S3, in a bucket this storage has seen exist and the store now
        says does not, an `ObjectStoreError` naming the bucket: s3fs's `exists` answered False, so a bucket
        deleted between a listing and this lookup made `latest_checkpoint` skip every checkpoint (a resume from
        scratch). A bucket never seen stays False: a save's first check calls this, and the save then fails
        on its upload (an async save in its Future); every listing raises it first."""
        backend, key = self._fresh(path)
        with self._errors("lookup of", path):
            return self._s3_exists(backend, key) if backend.is_s3 else bool(backend.io.exists(key))

    def _s3_exists(self, backend: _Backend, key: str) -> bool:
        """s3fs's own lookup (a HEAD, then a listing of `key/` on a miss), whose NoSuchBucket it answered False."""
        bucket, rest, _ = backend.fs.split_path(key)
        try:
            if rest:
                backend.io.info(key)
            elif not _has_objects_under(backend, key):  # a bucket's root: there when the bucket is
                return False
        except FileNotFoundError:  # `_NamesMissingBucket` raised a NoSuchBucket as `_BucketGone`, none of these
            return False
        except _BucketGone:
            if bucket in self._buckets_seen or bucket in self._buckets_answered:
                raise
            return False
        self._buckets_answered.add(bucket)
        return True

    def getsize(self, path: Path) -> int:
        backend, key = self._fresh(path)
        with self._missing_bucket_named(backend, key, "lookup of", path), self._errors("lookup of", path):
            return int(backend.io.size(key))

    def is_link(self, path: Path) -> bool:
        """On a directory store (`file://`) what the OS says: fsspec's listing and `isdir` follow a link, and
        without this a walk under a checkpoint went through a user's `eval -> /data/eval` (`commit._walk`)."""
        backend, key = self._fresh(path)
        if backend.object_store:
            return False
        try:
            info = backend.io.info(key)
        except FileNotFoundError:  # nothing there, or a link to nothing: no directory to walk into either way
            return False
        return info.get("islink") is True

    def is_irregular(self, path: Path) -> bool:
        """On a directory store (`file://`) what the OS says: fsspec sizes a FIFO 0 bytes and reads through a
        link, so an `.incomplete` FIFO beside a committed manifest read as an empty marker (a delete under way)
        and gc tried to collect the checkpoint. Objects in an object store are all plain bytes."""
        backend, key = self._fresh(path)
        if backend.object_store:
            return False
        try:
            with self._errors("lookup of", path):
                info = backend.io.info(key)
        except FileNotFoundError:  # nothing there (or a link to nothing): nothing to read either way
            return False
        return info.get("islink") is True or info.get("type") != "file"

    def isdir(self, path: Path) -> bool:
        """Whether `path` is a prefix with objects under it; an `ObjectStoreError` in a bucket that does not exist
        (discovery asks this first: a missing run must not list as an empty one). On S3 its own listing, whose
        NoSuchBucket s3fs's `isdir` swallowed: a bucket deleted after the first check read as an empty run."""
        backend, key = self._fresh(path)
        with self._errors("lookup of", path):
            if backend.is_s3:
                found = _has_objects_under(backend, key)  # the listing says NoSuchBucket: no bucket check
                self._buckets_answered.add(backend.fs.split_path(key)[0])
                return found
            found = bool(backend.io.isdir(key))
        if not found:
            self._check_bucket(backend, key, "lookup of", path)
        return found

    @contextlib.contextmanager
    def _missing_bucket_named(self, backend: _Backend, key: str, what: str, path: Path | str) -> Iterator[None]:
        """A "not found" inside is re-raised as it is, unless the bucket itself is missing (then that error)."""
        try:
            yield
        except FileNotFoundError as exc:
            self._check_bucket(backend, key, what, path, exc)
            raise

    def _check_bucket(
        self, backend: _Backend, key: str, what: str, path: Path | str, told: BaseException | None = None
    ) -> None:
        """After a lookup found nothing: on S3, an `ObjectStoreError` if the bucket itself does not exist.

        s3fs answers a key in a missing bucket as a missing key (`exists` False, an empty run), so a typo in the
        bucket read as "no checkpoint yet" and a resume started from scratch. One HEAD of the bucket per storage,
        on its first miss; an answer other than "no such bucket" (a store that denies ListBucket, or is failing)
        leaves the lookup's own answer standing. `told`: the lookup's own "not found"; where the store said
        NoSuchBucket in it, that is the answer, even for a bucket checked before (deleted since: a listing then
        read as an empty run).
        """
        bucket = backend.fs.split_path(key)[0] if backend.is_s3 else ""
        if bucket and told is not None and _error_code(told) == "NoSuchBucket":
            raise self._no_bucket(bucket, what, path) from told
        if not bucket or bucket in self._buckets_seen:
            return
        with _caller_handling():  # the lookup's "not found" (a NoSuchKey) is no answer of this HEAD
            self._ask_bucket(backend, bucket, what, path)
        self._buckets_seen.add(bucket)

    def _ask_bucket(self, backend: _Backend, bucket: str, what: str, path: Path | str) -> None:
        """HEAD the bucket: an `ObjectStoreError` if the store says it does not exist; any other failure passes."""
        try:
            backend.io.call_s3("head_bucket", Bucket=bucket)
        except Exception as exc:
            if not (_missing(exc) or _error_code(exc) == "NoSuchBucket"):
                self._buckets_seen.add(bucket)  # asked once: a role without ListBucket must not pay this per miss
                return
            raise self._no_bucket(bucket, what, path) from exc

    def _no_bucket(self, bucket: str, what: str, path: Path | str) -> ObjectStoreError:
        """The error of a lookup of `path` in `bucket`, which does not exist."""
        return ObjectStoreError(
            f"{what} {self.remap_path(Path(os.fspath(path)))} failed: the bucket {bucket!r} does not exist "
            f"(NoSuchBucket: {_FIXES['NoSuchBucket']})"
        )


def _has_objects_under(backend: _Backend, key: str) -> bool:
    """Whether the prefix `key/` holds an object; a bucket's root is a directory when the bucket exists, empty or
    not (an empty bucket's root, a run not yet saved to, was told "a file, not a directory"). One listing of one
    key, as s3fs's `isdir`, which answers False for a bucket that does not exist: its NoSuchBucket is raised here."""
    bucket, rest, _ = backend.fs.split_path(key)
    prefix = rest.rstrip("/") + "/" if rest else ""
    extra = getattr(backend.fs, "req_kw", None) or {}
    page = backend.io.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", MaxKeys=1, **extra)
    return not rest or bool(page.get("Contents") or page.get("CommonPrefixes"))


def _remove_emptied_folder(backend: _Backend, key: str) -> None:
    """The directory `key` of a directory store (`file://`, `memory://`), if it is empty: on an object store a
    prefix is gone with its last object. Before, the id's folder stayed once a save's or a delete's claim went
    (a failed save let go, gc collected a killed save or delete): an empty `step_1/` that `ls` showed and
    `inspect` called "not a checkpoint". One that holds anything (a user's file, a manifest) stays as it is."""
    with contextlib.suppress(OSError):  # not empty, or removed meanwhile
        backend.io.rmdir(key)
    backend.fs.invalidate_cache(key)


def _mkdir_one_level(backend: _Backend, key: str) -> None:
    """Make the directory `key` whose parent must be there (memory:// makes one whatever its parent: asked)."""
    parent = posixpath.dirname(key)
    if parent not in ("", "/", key) and not backend.io.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, "its parent directory is not there", backend.url(parent))
    try:
        backend.fs.mkdir(key, create_parents=False)
    except FileExistsError:
        if not backend.io.isdir(key):
            raise


# The S3 endpoints (endpoint URL, bucket) seen to refuse conditional requests they must refuse, in this process.
_CONDITIONS_HONOURED: set[tuple[str, str]] = set()
_NO_SUCH_ETAG = '"00000000000000000000000000000000"'  # an If-Match no version of any object matches


def _check_conditions_honoured(backend: _Backend, key: str, data: bytes) -> None:
    """After the first claim this process creates in a bucket: the same bytes PUT again under `If-None-Match: *`
    and under an `If-Match` no version matches must both be refused. An endpoint that ignores those headers
    (some S3-compatible stores and gateways) rewrites the claim with the same bytes instead: the claim is then
    deleted and the save refused, naming the endpoint. Before, every conditional request succeeded there: two
    saves of one id both held it, a manifest replaced another, and nothing said so."""
    bucket = backend.fs.split_path(key)[0]
    seen = (_endpoint_of(backend.fs), bucket)
    if seen in _CONDITIONS_HONOURED:
        return
    ignored = []
    for header, condition in (("If-None-Match: *", {"mode": "create"}), ("If-Match", {"IfMatch": _NO_SUCH_ETAG})):
        try:
            backend.io.pipe_file(key, data, **condition)
        except Exception as exc:
            if not _precondition_failed(exc):
                raise
        else:
            ignored.append(header)
    if not ignored:
        _CONDITIONS_HONOURED.add(seen)
        return
    with contextlib.suppress(FileNotFoundError):
        backend.io.rm_file(key)
    raise ObjectStoreError(
        f"the S3 endpoint {seen[0]} ignores conditional requests ({' and '.join(ignored)} on {backend.url(key)} "
        f"were not refused): a save's claim on its id, its conditional manifest and its conditional deletes would "
        f"not hold, and two saves of one id would overwrite each other unnoticed. Nothing was saved. Use a store "
        f"that honours If-None-Match and If-Match on PutObject and DeleteObject (AWS S3, a current MinIO), or "
        f"upgrade this one."
    )


def _clock_place(backend: _Backend, key: str) -> str:
    """The place whose clock `store_now` keeps for `key`: its URL, and the server that answers for it (an S3
    endpoint, an Azure account), which the URL does not name. Kept by URL alone, a read of `s3://b/run` on one
    endpoint stood for `s3://b/run` on another (a job copying between two stores, a test's server restarted on
    another port) for `STORE_CLOCK_REREAD_S`: with that clock ahead, gc aged a trash made a moment ago as old
    and removed it."""
    if backend.is_s3:
        return f"s3://{key} at {_endpoint_of(backend.fs)}"  # `s3a://` is the same store
    server = getattr(backend.fs, "account_name", None) or getattr(backend.fs, "endpoint_url", None)
    return backend.url(key) if server is None else f"{backend.url(key)} at {server}"


def _endpoint_of(fs: Any) -> str:
    """The endpoint an s3fs filesystem talks to, as its client was configured (AWS's own when none is)."""
    options = getattr(fs, "client_kwargs", None) or {}
    return str(
        getattr(fs, "endpoint_url", None)
        or options.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or "AWS S3"
    )


# Where each fsspec store puts an object's last modification in its info dicts: s3fs `LastModified` (a
# datetime), adlfs `last_modified` (a datetime), gcsfs `updated` (an RFC 3339 string; newer releases add `mtime`,
# a datetime), local and memory-like stores `mtime` (seconds). Reading only the first two spellings left another
# host's trash on GCS and Azure aged 0 for ever, never collected.
_MODIFIED_KEYS = ("LastModified", "last_modified", "updated", "mtime")


def _probe_object(backend: _Backend, prefix: str) -> float | None:
    """`_probe_modified` of a probe object of this process under `prefix/`, marked as being written meanwhile (a
    gc in another thread must not take it for a killed process's: `clock_probe_running`)."""
    name = clock_probe_name()
    with probing(name):
        return _probe_modified(backend, f"{prefix}/{name}")


def _probe_modified(backend: _Backend, probe: str) -> float | None:
    """The LastModified the store gives the empty object `probe` it is sent, which is then deleted; None where
    it cannot be written or read (no write access)."""
    try:
        backend.io.pipe_file(probe, b"")
    except Exception as exc:  # whatever the store's client raises: the caller falls back to this host's clock
        logger.debug("No clock probe could be written at %s: %s", backend.url(probe), exc)
        return None
    try:
        return _modified(backend.io.info(probe))
    except Exception as exc:
        logger.debug("The clock probe %s could not be read: %s", backend.url(probe), exc)
        return None
    finally:
        try:
            backend.io.rm_file(probe)
        except FileNotFoundError:  # deleted already, by another host's gc that took it for a killed prober's
            logger.debug("The clock probe %s was deleted by another process before this one deleted it", probe)
        except Exception as exc:
            logger.warning(
                "Could not delete the clock probe %s (%s): an empty object; `torch-checkpointing gc` removes it once "
                "this process is gone, or delete it by hand",
                backend.url(probe),
                exc,
            )


def _answer_date(backend: _Backend, prefix: str) -> float | None:
    """The store's clock as the `Date` of its answer to a listing of one key under `prefix/` (nothing written);
    None where it cannot be listed or gives no date."""
    bucket, _, under = prefix.partition("/")
    try:
        answer = backend.io.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{under}/" if under else "", MaxKeys=1)
        return _seconds(answer["ResponseMetadata"]["HTTPHeaders"]["date"])
    except Exception as exc:  # whatever the client raises, or an answer without the header: this host's clock
        logger.debug("The store's clock could not be read from a listing of %s: %s", backend.url(prefix), exc)
        return None


def _modified(info: dict[str, Any]) -> float | None:
    """An object's last modification as `time.time()` reads, whichever spelling and type its store gives."""
    known = [t for t in (_seconds(info.get(k)) for k in _MODIFIED_KEYS) if t is not None]
    return max(known) if known else None


# An RFC 3339 / ISO 8601 time as stores write it: extended (`2024-01-02T03:04:05`) or basic (`20240102T030405`)
# form, `T`, `t` or a space between date and time, a fraction of any length, `Z`/`z` or an offset with or
# without its colon or minutes; or a span (a date alone, an hour, a minute). Read by hand: `datetime.fromisoformat`
# takes a different grammar on each Python version (3.10: no `z`, no basic form, fractions of 3 or 6 digits only;
# 3.11+: no `t`/`z`).
_ISO_STAMP_RE = re.compile(
    r"(?P<year>[0-9]{4})(?P<dash>-?)(?P<month>[0-9]{2})(?P=dash)(?P<day>[0-9]{2})"
    r"(?:[Tt ](?P<hour>[0-9]{2})(?:(?P<colon>:?)(?P<minute>[0-9]{2})"
    r"(?:(?P=colon)(?P<second>[0-9]{2})(?:[.,](?P<frac>[0-9]+))?)?)?"
    r"(?P<zone>[Zz]|(?P<sign>[+-])(?P<zone_h>[0-9]{2})(?::?(?P<zone_m>[0-9]{2}))?)?)?"
)
# An HTTP date's time of day with its seconds; one without them names a whole minute.
_HTTP_SECONDS_RE = re.compile(r"[0-9]:[0-9]{2}:[0-9]{2}")


def _seconds(stamp: Any) -> float | None:
    """A time as seconds since the epoch: a datetime (naive ones are UTC, as the stores mean them), a number, an
    RFC 3339 / ISO 8601 string or an HTTP (RFC 1123) date; None for anything else (its age is then unknown,
    never 0). A stamp that names a span (a date alone, a minute) is its span's last instant: read as its first,
    a copy made late on the day it names read as up to a day old, and gc removed it as such."""
    if isinstance(stamp, str):
        stamp = _parsed_stamp(stamp.strip())
    if isinstance(stamp, datetime.datetime):
        aware = stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=datetime.timezone.utc)
        return aware.timestamp()
    if isinstance(stamp, int | float) and not isinstance(stamp, bool):
        return float(stamp)
    return None


def _parsed_stamp(text: str) -> datetime.datetime | None:
    """`text` as an ISO 8601 time (RFC 3339's included) or an RFC 1123 date (`Mon, 01 Jan 2024 00:00:00 GMT`),
    at the last instant of the span it names; None if it is none of them, or no such date (a 30 February)."""
    match = _ISO_STAMP_RE.fullmatch(text)
    try:
        if match is not None:
            return _iso_stamp(match)
        read = email.utils.parsedate_to_datetime(text)
    except (ValueError, TypeError, IndexError, OverflowError):
        return None
    return read if _HTTP_SECONDS_RE.search(text) else read + datetime.timedelta(minutes=1)


def _iso_stamp(match: re.Match[str]) -> datetime.datetime:
    """A match of `_ISO_STAMP_RE` as a datetime (UTC where it names no zone), at the last instant of its span:
    the end of the day, hour or minute where it stops there. ValueError for a date or time that does not exist."""
    zone = datetime.timezone.utc
    if match["sign"] is not None:
        offset = datetime.timedelta(hours=int(match["zone_h"]), minutes=int(match["zone_m"] or 0))
        zone = datetime.timezone(offset if match["sign"] == "+" else -offset)
    year, month, day, hour, minute, second = (
        int(match[name] or 0) for name in ("year", "month", "day", "hour", "minute", "second")
    )
    micro = int((match["frac"] or "").ljust(6, "0")[:6])
    start = datetime.datetime(year, month, day, hour, minute, second, micro, tzinfo=zone)
    if match["hour"] is None:
        return start + datetime.timedelta(days=1)
    if match["minute"] is None:
        return start + datetime.timedelta(hours=1)
    return start if match["second"] is not None else start + datetime.timedelta(minutes=1)


def _version(backend: _Backend, key: str) -> tuple[int, str]:
    """An object's size and ETag from a fresh HEAD (the ETag is empty on filesystems that have none).

    A prefix is refused: read as an object it would be zero bytes of data that nobody wrote.
    """
    backend.fs.invalidate_cache(key)
    info = backend.io.info(key)
    if info.get("type") == "directory":
        raise IsADirectoryError(errno.EISDIR, "a prefix (a 'directory'), not an object", key)
    return int(info["size"]), str(info.get("ETag") or "")


# How long a marker's compare-and-delete waits for another process's (`FsspecStorage._marker_lock`): that step is
# a read and a delete, milliseconds; a process holding it longer is stopped.
_MARKER_LOCK_WAIT_S = 30.0
_MEMORY_MARKER_LOCK = threading.Lock()
# Whether a file made with O_TMPFILE can be given a name (`_create_local`): Linux, with /proc mounted.
_HAS_TMPFILE_LINKS = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")
# How old the hidden file of a marker's create (no O_TMPFILE) must be to be a dead creator's, whoever made it: a
# live one writes a few hundred bytes into it and links it at once.
_CREATING_STALE_S = 60.0


def _get_sized(
    backend: _Backend, key: str, limit: int, timeout_s: float | None
) -> tuple[tuple[int, str], bytes | None]:
    """((size, ETag), bytes) of one version of the S3 object `key`: its version from a HEAD, then (at most `limit`
    bytes: else bytes None and no GET) one GET of that many bytes `If-Match` that ETag. A version replaced in
    between fails the GET's condition and is read again, from its HEAD; so does one served by a store that ignores
    the condition, told by the ETag its answer names (`_served_another`)."""
    import fsspec.asyn

    bucket, name, _ = backend.fs.split_path(key)
    for _ in range(_READ_ATTEMPTS):
        version = size, etag = _version(backend, key)
        if size > limit or size == 0:
            return version, None if size else b""
        if not etag:  # a store that names no version: nothing to hold the GET to
            return version, bytes(backend.io.cat_file(key, start=0, end=size))
        try:
            answer = backend.io.call_s3(
                "get_object", Bucket=bucket, Key=name, Range=f"bytes=0-{size - 1}", IfMatch=etag
            )
        except Exception as exc:
            if _precondition_failed(exc):
                continue
            raise
        body = answer["Body"]
        try:
            if _served_another(answer, etag):
                continue
            data = bytes(fsspec.asyn.sync(backend.fs.loop, body.read, timeout=timeout_s))
        finally:
            body.close()
        if len(data) != size:
            raise EOFError(f"the object is {size} bytes (ETag {etag}), but its GET gave {len(data)}")
        return version, data
    raise _ChangedWhileRead(f"the object kept changing while it was read ({_READ_ATTEMPTS} attempts)")


def _served_another(answer: dict[str, Any], etag: str) -> bool:
    """Whether a GET held to `etag` (`If-Match`) was answered with another version, as a store that ignores the
    condition does: before, the first bytes of a larger replacement came back as the whole object, silently. An
    answer naming no ETag cannot tell, and is taken as the version asked for."""
    served = answer.get("ETag")
    return bool(served) and str(served) != etag


def _create_claim_here(name: str, data: bytes) -> bool:
    """`_create_local` of a save's claim. Its folder, gone since the save made it (emptied, it went with a dead
    save's claim that gc collected: `_remove_emptied_folder`), is made again, one level as that mkdir did (a
    missing parent still raises). Before, the save failed on a bare FileNotFoundError."""
    try:
        return _create_local(name, data)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            os.mkdir(os.path.dirname(name) or ".")
        return _create_local(name, data)


def _create_local(name: str, data: bytes) -> bool:
    """Create the file `name` holding `data` only if nothing is there, in one step: the bytes are written into a
    file no reader can see (unnamed where the filesystem has O_TMPFILE, else a hidden name beside it), which is
    then linked under `name`; a link never replaces what is there. False when something is."""
    if not _HAS_TMPFILE_LINKS:
        return _create_local_named(name, data)
    folder = os.open(os.path.dirname(name) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        created = _create_unnamed(folder, os.path.basename(name), data)
    finally:
        os.close(folder)
    return _create_local_named(name, data) if created is None else created


def _create_unnamed(folder: int, base: str, data: bytes) -> bool | None:
    """`_create_local` through an O_TMPFILE file in `folder`, linked through /proc/self/fd. None where that cannot
    be done here (no O_TMPFILE on this filesystem; or a link through /proc refused: /proc gone since the import,
    or mounted without the link, or an LSM's EPERM), and nothing was made: the caller takes the hidden-name way.
    Before, a refused link raised out of the create, though the way every other filesystem takes was open."""
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666, dir_fd=folder)
    except OSError:  # a filesystem without O_TMPFILE (NFS, some FUSE ones)
        return None
    try:
        _write_all(fd, data)
        # dir_fd makes this a linkat(), which follows the /proc link to the open file (a link() does not)
        os.link(f"/proc/self/fd/{fd}", base, src_dir_fd=folder, dst_dir_fd=folder)
    except FileExistsError:
        return False
    except OSError as exc:  # a failure of the bytes themselves (a full disk) fails the hidden-name way too
        logger.debug("A marker's O_TMPFILE create of %s failed (%s); creating it through a hidden name", base, exc)
        return None
    finally:
        os.close(fd)
    return True


def _replace_local(name: str, data: bytes) -> None:
    """Put `data` at `name` in place of what is there, in one step: written under a hidden name of this process
    beside it (`_written_beside`), then renamed over it. Killed at any point, `name` holds the old bytes or the
    new, never nothing."""
    with _written_beside(name, data) as hidden:
        os.replace(hidden, name)


def _create_local_named(name: str, data: bytes) -> bool:
    """`_create_local` through a hidden file of this process beside `name` (`_written_beside`), linked to it."""
    try:
        with _written_beside(name, data) as hidden:
            os.link(hidden, name)
    except FileExistsError:
        return False
    return True


@contextlib.contextmanager
def _written_beside(name: str, data: bytes) -> Iterator[str]:
    """`data` in a hidden file of this process beside `name`, for the block to link or rename into place; removed
    after it, whatever it did.

    A creator killed between that file's create and its unlink left it there for good: in the id's folder with
    no marker (killed before the link), it made every later save of the id refuse it as "a directory that is not
    a checkpoint"; beside the marker (killed after), it stayed in the checkpoint committed there. So the dead
    creators' files go first, and a save takes a folder holding only those as its own (`commit`)."""
    folder = os.path.dirname(name) or "."
    hidden = os.path.join(folder, creating_name(os.path.basename(name)))
    with holding(hidden):  # told from one a killed process of this pid left (`_creation_dead`)
        fd = os.open(hidden, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o666)
        try:
            try:
                # Its ctime is now by the file server's clock, which stamped the others' (no probe of our own:
                # one killed here would be a stray file in the id's folder, as these were).
                _remove_dead_creations(folder, os.path.basename(name), os.fstat(fd).st_ctime)
                _write_all(fd, data)
            finally:
                os.close(fd)
            yield hidden
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(hidden)


def _remove_dead_creations(folder: str, base: str, now: float) -> None:
    """Remove the hidden files of `base`'s creators that are dead (`_creation_dead`; `now` by the clock that
    stamped them), named at WARNING."""
    with contextlib.suppress(FileNotFoundError), os.scandir(folder) as entries:
        for entry in entries:
            match = CREATING_RE.match(entry.name)
            if match is None or match["name"] != base or not _creation_dead(match, entry.path, now):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                logger.warning(
                    "Removed %s, the bytes of a create of %s that never finished: its process (pid %s) was killed "
                    "before it linked or removed them (it is gone, or the file is over %gs old).",
                    entry.path,
                    os.path.join(folder, base),
                    match["pid"],
                    _CREATING_STALE_S,
                )


def _creation_dead(match: re.Match[str], path: str, now: float) -> bool:
    """Whether the creator that made the hidden file `path` is gone: a process of this host that no longer runs
    (this pid: one that is not creating it now, a killed job's restarted in a container with its pid), or any
    creator once the file is older than a create takes (another host's pid is nothing here), by the clock that
    stamped it (`now`, the file server's; by this host's, one ahead of its server removed another host's live
    create). Removing a live creator's file makes its link fail (an error it raises), never a marker
    of the wrong bytes."""
    pid = int(match["pid"])
    if made_here(match) and (not held_here(path) if pid == os.getpid() else not pid_alive(pid)):
        return True
    try:
        return now - os.lstat(path).st_mtime > _CREATING_STALE_S
    except FileNotFoundError:
        return False


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# Errors of a filesystem that takes no flock on a directory (an NFS mount without lock support, some FUSE ones).
_NO_FLOCK = frozenset({errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS})
_told_no_flock: list[str] = []  # the first directory said so: once per process (every commit deletes a marker)


@contextlib.contextmanager
def _locked_marker(backend: _Backend, key: str, shown: Callable[[], str]) -> Iterator[None]:
    """`FsspecStorage._marker_lock` itself, for the module's own compare-and-replace of a marker (`_replace_judged`):
    one lock per marker directory among the processes of this machine, whoever takes it. `shown`: the marker's
    name in an error."""
    if backend.protocols & {"memory"}:
        with _MEMORY_MARKER_LOCK:
            yield
        return
    if not backend.protocols & {"file", "local"} or fcntl is None:
        yield
        return
    try:
        fd = os.open(posixpath.dirname(key) or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:  # its directory went, the marker with it: the compare finds no such version
        yield
        return
    try:
        _flock_within(fd, _MARKER_LOCK_WAIT_S, shown)
        yield
    finally:
        os.close(fd)  # releases the lock


def _flock_within(fd: int, wait_s: float, shown: Callable[[], str]) -> None:
    """An exclusive flock on `fd`, or an `ObjectStoreError` after `wait_s` seconds of another holding it. Where
    the filesystem takes none, the step goes on unlocked (two steps, as on other stores), said once at WARNING."""
    assert fcntl is not None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise ObjectStoreError(
                    f"the marker {shown()} stayed locked for {wait_s:.0f}s by another process comparing and "
                    f"replacing it (a save or gc of this id, stopped or hung in that step); nothing was changed. "
                    f"Find that process (lsof on the checkpoint's directory) and let it go on or end it, then retry."
                ) from None
            time.sleep(0.02)
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise ObjectStoreError(f"locking the directory of the marker {shown()} failed: {exc}") from exc
            _tell_no_flock(shown(), exc)
            return


def _tell_no_flock(marker: str, exc: OSError) -> None:
    where = posixpath.dirname(marker)
    if _told_no_flock:
        return
    _told_no_flock.append(where)
    logger.warning(
        "The filesystem under %s takes no lock on a directory (%s): a marker's compare and its delete or replace "
        "there are two steps, and a save and gc of one dead id at the same moment can both take it. Give "
        "concurrent jobs distinct ids, and run gc while no save of the ids it collects starts.",
        where,
        exc,
    )


def _content_version(data: bytes) -> str:
    """A version of a small object on a store without ETags: a hash of its bytes. A claim holds its save's unique
    token and time, so two claims never share one; it is not an ETag a store's request could name."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def save_tag(token: str) -> str:
    """A claim token as S3 metadata takes it: ASCII only (the token holds the checkpoint's name, `stüp€1`)."""
    return urllib.parse.quote(token, safe="")


def _head(backend: _Backend, name: str) -> dict[str, Any] | None:
    """One object's HEAD (its metadata and ETag); None when it is gone."""
    bucket, obj, _ = backend.fs.split_path(name)
    try:
        return dict(backend.io.call_s3("head_object", Bucket=bucket, Key=obj))
    except FileNotFoundError:
        return None


def _is_commit_file(key: str) -> bool:
    return posixpath.basename(key) == MANIFEST_FILE_NAME


def _create(fs: Any, key: str, data: bytes, url: str, tag: dict[str, Any]) -> None:
    """Upload an object that must not exist yet (S3's conditional create, `If-None-Match: *`)."""
    with _ErrorScope(f"upload of {url}", wrap_missing=True), _refused_if_present(url):
        fs.pipe_file(key, data, mode="create", **tag)


@contextlib.contextmanager
def _refused_if_present(url: str) -> Iterator[None]:
    """Turns the store's "it already exists" answer to a conditional create into an error that says so. Not
    logged here: a create whose answer was lost meets its own manifest on the client's retry, and the commit,
    which tells the two apart (`Commit._write_manifest`), reports a real refusal as the save's failure."""
    try:
        yield
    except Exception as exc:
        if not _precondition_failed(exc):
            raise
        raise ObjectStoreError(
            f"upload of {url} refused: it already exists, so another save committed this checkpoint while this "
            f"one ran. This save was not committed; save under a new id."
        ) from exc


def _precondition_failed(exc: BaseException) -> bool:
    """Whether the store refused a conditional request: the object exists (If-None-Match), is being created,
    or is no longer the version named (If-Match)."""
    if isinstance(exc, FileExistsError):  # s3fs's translation of a failed If-None-Match
        return True
    return _error_code(exc) in ("PreconditionFailed", "ConditionalRequestConflict")


def _missing(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or _error_code(exc) in ("NoSuchKey", "404")


# Failures of the client itself, before any answer of the store (no S3 error code): by the class name of the
# exception or of one of its causes (botocore's and aiohttp's; neither is imported here), or by its message.
_ENDPOINT_FIX = (
    "the store cannot be reached at its endpoint: check AWS_ENDPOINT_URL or storage_options['endpoint_url'] "
    "(scheme, host and port, e.g. 'http://minio.internal:9000'), and that the store is up and reachable from this host"
)
_CLIENT_FIXES = {
    "NoCredentialsError": f"no credentials were found: set {_CREDENTIALS}, a profile (AWS_PROFILE), or an "
    "instance role",
    "PartialCredentialsError": f"the credentials are incomplete: set both {_CREDENTIALS}",
    "EndpointConnectionError": _ENDPOINT_FIX,
    "ConnectTimeoutError": _ENDPOINT_FIX,
    "ClientConnectorError": _ENDPOINT_FIX,
    "InvalidEndpointError": _ENDPOINT_FIX,
}


def _client_fix(exc: BaseException) -> str | None:
    """What to do about a failure of the client's configuration or connection (see `_CLIENT_FIXES`)."""
    for seen in _chain(exc):
        name, text = type(seen).__name__, str(seen)
        if name in _CLIENT_FIXES:
            return _CLIENT_FIXES[name]
        if isinstance(seen, ValueError) and text.startswith("Invalid endpoint"):
            return _ENDPOINT_FIX
        if isinstance(seen, TypeError) and "unexpected keyword argument" in text:
            return (
                "FsspecStorageConfig.storage_options holds an option the filesystem does not take: fix or remove "
                "it (S3: key, secret, token, endpoint_url, client_kwargs, config_kwargs, ... of s3fs.S3FileSystem)"
            )
    return None


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code of a botocore error, found through s3fs's translation of it (its cause)."""
    for seen in _chain(exc):
        code = (getattr(seen, "response", None) or {}).get("Error", {}).get("Code")
        if code:
            return str(code)
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and its links (`errors.exception_chain`), up to (not into) what a caller was handling as an open
    error scope of this thread began (`_ErrorScope`, `_caller_handling`). Python chains an error raised in an
    `except` block to the one handled there: the caller's S3 code was taken for the call's, and a conditional
    replace or delete on a store that could not be reached, made in a handler of a NoSuchKey, answered "it
    changed or went"."""
    return exception_chain(exc, getattr(_SCOPES, "outside", ()))


def _refuse_non_utf8_key(backend: _Backend, key: str) -> None:
    """An object store's keys are UTF-8: a surrogate (even one `os.fsdecode` made of a byte of a file name that is
    no UTF-8) has no form there. Its request failed as an `ObjectStoreError` ("... UnicodeEncodeError ..."), a
    store failure that a caller retries or falls back from, for a name no retry can store."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"{backend.url(key)!r} holds {key[exc.start]!r}, which an object store's key (UTF-8) cannot hold: a lone "
            f"surrogate, such as the one that stands for a byte of a local file name that is no UTF-8. Name the "
            f"checkpoint or root in text that UTF-8 encodes."
        ) from None


class _ChangedWhileRead(OSError):
    """Raised inside an error scope: the object was replaced between the GETs of one read."""


def _objects_under(backend: _Backend, key: str, include_self: bool = False) -> list[str]:
    backend.fs.invalidate_cache()
    try:
        found = backend.io.find(key)
    except FileNotFoundError:
        return []
    return [k for k in found if k.startswith(key + "/") or (include_self and k == key)]


def _copy_into_place(backend: _Backend, src: str, dst: str) -> None:
    """One file copied to `dst`, its directory made first on a directory store (`file://`), whose copy does not
    make it: a directory rename there (retention's move to a trash name) failed on the first file with ENOENT,
    so retention under a `file://` root deleted nothing. Never `copy`: it expands `*`, `?` and `[` as a glob."""
    if not backend.object_store:
        backend.io.makedirs(posixpath.dirname(dst), exist_ok=True)
    backend.io.cp_file(src, dst)


def _copy_prefix(backend: _Backend, src: str, dst: str, keys: list[str]) -> None:
    """Copy `keys` (under `src`, its manifest last) to `dst`, marked `.incomplete` until every one is there.

    The marker is a live claim while the copy runs (`_live_claim`): `dst` may be an id (a checkpoint moved back
    under it). It was empty, a dead save's claim to every judge: a save of the id took it over, wrote its files
    over the copied ones and committed, and the copy's manifest then replaced the save's (neither loaded)."""
    marker = f"{dst}/{INCOMPLETE_MARKER}"
    if not backend.object_store:  # a directory store: the claim needs its folder (`_copy_into_place` makes the rest)
        backend.io.makedirs(dst, exist_ok=True)
    if f"{src}/{INCOMPLETE_MARKER}" in keys:  # an unfinished save's: its copy stays unfinished, under its claim
        _put_up_claim(backend, marker, backend.io.cat_file(f"{src}/{INCOMPLETE_MARKER}"))
        _refuse_a_committed(backend, src, dst)
        _copy_keys(backend, src, dst, [k for k in keys if k != f"{src}/{INCOMPLETE_MARKER}"])
        return
    with _live_claim() as claim:
        _put_up_claim(backend, marker, claim)
        _refuse_a_committed(backend, src, dst)
        _copy_keys(backend, src, dst, keys)
        backend.io.rm_file(marker)


def _refuse_a_committed(backend: _Backend, src: str, dst: str) -> None:
    """Once the move's claim is up at `dst` (no save commits there after it): refuse a `dst` that holds another
    committed checkpoint than `src`'s, taking the claim down, as a local rename onto a non-empty directory fails.
    Before, the copy went over it: gc putting a copy aside back while a new save of the id committed replaced
    the new save's manifest and files with the old ones, and the id loaded the older state. The same
    checkpoint (a delete putting back the copy of what it failed to delete) is made whole again, as before."""
    manifest = f"{dst}/{MANIFEST_FILE_NAME}"
    if manifest not in _objects_under(backend, dst):  # one listing, never a cached answer
        return
    try:
        same = backend.io.cat_file(manifest) == backend.io.cat_file(f"{src}/{MANIFEST_FILE_NAME}")
    except FileNotFoundError:
        same = False
    if same:
        return
    backend.io.rm_file(f"{dst}/{INCOMPLETE_MARKER}")  # ours: a committed checkpoint has none, or a stray one
    raise FileExistsError(errno.ENOTEMPTY, "another committed checkpoint is there; nothing was moved", backend.url(dst))


def _copy_keys(backend: _Backend, src: str, dst: str, keys: list[str]) -> None:
    for k in sorted(keys, key=_copy_order):  # an unfinished save's own marker first, the manifest last
        _copy_into_place(backend, k, dst + k[len(src) :])


def _copy_order(key: str) -> int:
    name = posixpath.basename(key)
    return 0 if name == INCOMPLETE_MARKER else 2 if name == MANIFEST_FILE_NAME else 1


def _manifest_of(backend: _Backend, key: str, keys: list[str]) -> bytes | None:
    """The manifest among `keys` (the objects under `key`), read before a rename copies them; None when none is."""
    manifest = f"{key}/{MANIFEST_FILE_NAME}"
    return bytes(backend.io.cat_file(manifest)) if manifest in keys else None


def _delete_prefix(
    backend: _Backend, key: str, keys: list[str], *, restore: bool = False, copied: bytes | None = None
) -> None:
    """`_delete_objects`, then the unfinished uploads of a dead or failed save under `key/` (listed before
    anything went: see `_abandoned_uploads`). A move's source goes this way too: its uploads cannot follow it."""
    uploads = _abandoned_uploads(backend, key, keys)
    _delete_objects(backend, key, keys, restore=restore, copied=copied)
    for upload_key, upload_id in uploads:
        _abort_upload(backend.io, upload_key, upload_id)


def _delete_objects(
    backend: _Backend, key: str, keys: list[str], *, restore: bool = False, copied: bytes | None = None
) -> None:
    """Delete `keys` (the objects under `key`): a committed checkpoint is first claimed (`.incomplete`), then its
    files go in bulk, its manifest after them, the marker last (see `FsspecStorage.rmdir`, `_delete_marked`).
    With `restore` (the source of a rename, which must stay whole if it cannot go), a delete the store refuses
    before any file went (a policy denying s3:DeleteObject) puts the manifest back and the marker away; one that
    deleted some files, or any refused `rmdir`, leaves an incomplete prefix that readers refuse and gc collects.

    `copied`: the manifest a rename read before it copied `key`, or a delete before it listed `key`
    (`_manifest_listed`). Its delete goes only while `key` holds that checkpoint (`_same_as_copied`)."""
    manifest, marker = f"{key}/{MANIFEST_FILE_NAME}", f"{key}/{INCOMPLETE_MARKER}"
    committed, marked = manifest in keys, marker in keys
    if not committed:
        _delete_marked(backend, key, keys, restore=restore)
        return
    collects = _save_of(backend, manifest, copied)
    with _live_claim(collects) as claim:
        if marked and not _dead_claim_of_ours(backend, marker, claim):  # a live save's: not ours to replace
            owned = _owned_by_marker(backend, marker, manifest, copied)
            _delete_marked(backend, key, keys, restore=restore, copied=copied, owns=owned)
            return
        _delete_marked(backend, key, keys, restore=restore, claim=claim, copied=copied, owns=bool(collects))


def _manifest_now(backend: _Backend, key: str) -> bytes | None:
    """The manifest at `key`, read before a delete lists `key` (`_manifest_listed`); None where there is none.
    Never from a cached listing (s3fs sizes a file from it first): one taken before a save committed there said
    "no manifest", and the delete refused the checkpoint it was asked to delete as saved meanwhile."""
    backend.fs.invalidate_cache()
    try:
        return bytes(backend.io.cat_file(f"{key}/{MANIFEST_FILE_NAME}"))
    except FileNotFoundError:
        return None


def _manifest_listed(backend: _Backend, key: str, keys: list[str], read: bytes | None) -> bytes | None:
    """The manifest among `keys` (the objects listed under `key`) as `_manifest_now` read it before that listing,
    for the delete to hold the id to once its claim is up (`_same_as_copied`, as a rename's copy is); None where
    none is listed. A manifest listed but not there before is a save committed meanwhile: `_SavedAgainMeanwhile`,
    nothing deleted.

    The names were listed before the claim went up. Before, a delete by the id (`rmdir`, no rename first) whose
    checkpoint other processes deleted and saved again in between removed the listed names the two saves share,
    and the new manifest: the new save's other files were left at the id with neither manifest nor marker."""
    if f"{key}/{MANIFEST_FILE_NAME}" not in keys:
        return None
    if read is None:
        raise _SavedAgainMeanwhile(backend.url(key))
    return read


def _save_of(backend: _Backend, manifest: str, copied: bytes | None) -> str:
    """The save whose manifest `manifest` (or `copied`, the one a rename read) is, as the claim of its delete names
    it (`Claim.collects`): its claim token, `UNNAMED_SAVE` for a manifest naming none; '' where it is no manifest
    of ours (then its delete's claim owns nothing, and the manifest goes first, as before)."""
    try:
        data = copied if copied is not None else bytes(backend.io.cat_file(manifest))
        return Manifest.from_json(data).claim or UNNAMED_SAVE
    except FileNotFoundError:
        return UNNAMED_SAVE  # gone meanwhile: `_same_as_copied` finds it so, and takes the claim down
    except (CheckpointError, ValueError, KeyError, UnicodeDecodeError):
        return ""


def _owned_by_marker(backend: _Backend, marker: str, manifest: str, copied: bytes | None) -> bool:
    """Whether the live claim at `marker` owns the manifest beside it (no stray claim: `stray_claim`), as gc's
    own does while it moves a dead save it holds aside: that manifest then goes after the files it lists. False
    where either is gone or not ours (the manifest then goes first, as beside a stray claim).

    A store's error reading either (403, a 503 after the client's retries, EMFILE) is raised, before anything is
    deleted: it was taken for "not ours", and the delete went on in that order under a claim it never read."""
    try:
        data = copied if copied is not None else bytes(backend.io.cat_file(manifest))
        return not stray_claim(_marker_bytes(backend, marker), Manifest.from_json(data))
    except (FileNotFoundError, CheckpointError, ValueError, KeyError, UnicodeDecodeError):
        return False


def _same_as_copied(backend: _Backend, key: str, copied: bytes | None, claim: bytes) -> bytes:
    """The manifest at `key`, read with this delete's `claim` up; a `_SavedAgainMeanwhile` when it is not
    `copied` (the one a rename read before its copy), a FileNotFoundError when it is gone (the claim taken down
    for both).

    The keys a rename deletes were listed before its copy. Before, a save that re-used the id after another
    process deleted the checkpoint, committed between the copy and the delete, lost its manifest and its files
    (of the same names) to the delete: a trainer told its save committed found nothing at the id."""
    error: OSError
    try:
        manifest = backend.io.cat_file(f"{key}/{MANIFEST_FILE_NAME}")
        if copied is None or manifest == copied:
            return bytes(manifest)
        error = _SavedAgainMeanwhile(backend.url(key))
    except FileNotFoundError as exc:  # deleted by another process meanwhile: nothing of it is ours to delete
        error = exc
    marker = f"{key}/{INCOMPLETE_MARKER}"
    if claim and _is_up(backend, marker, claim):
        backend.io.rm_file(marker)
    raise error


class _SavedAgainMeanwhile(OSError):
    """Raised inside an error scope: the source of a rename (or a delete) holds another checkpoint than the one it
    copied (or listed)."""

    def __init__(self, src: str) -> None:
        super().__init__(f"{src} was saved again while it was moved or deleted: the new checkpoint was left as it is")


def _dead_claim_of_ours(backend: _Backend, marker: str, mine: bytes, unread: str = "") -> bool:
    """Whether the marker beside a committed manifest is ours and dead (empty, or a claim no process holds: a
    delete or a move killed, or whose marker's own delete failed). A delete replaces it with its own live claim:
    kept as it was, it let a save of the id take it over while the files went, and lose them to the delete.
    `unread`: what a marker there but unreadable leaves undone, said at WARNING (gone meanwhile is no failure)."""
    try:
        data = _marker_bytes(backend, marker)
    except Exception as exc:  # gone meanwhile, or unreadable: nothing proves it dead
        if unread and not _missing(exc):
            logger.warning("Could not read the claim %s (%s): %s", backend.url(marker), exc, unread)
        return False
    return _held_by(data, mine) is None


def _marker_bytes(backend: _Backend, marker: str) -> bytes:
    """The first `MAX_MARKER_BYTES + 1` bytes of the object `marker`: all of any claim, and enough to tell a larger
    object is none. An empty one (an earlier version's claim, a delete's, one made by hand) is b"": S3 refuses a
    ranged GET of an empty object (416 InvalidRange), and before, removing or claiming a prefix that held one
    failed on it ("The requested range is not satisfiable": a trash gc could never remove, uploads said not
    aborted). FileNotFoundError when there is none."""
    try:
        return bytes(backend.io.cat_file(marker, start=0, end=MAX_MARKER_BYTES + 1))
    except OSError as exc:
        if _error_code(exc) != "InvalidRange" and exc.errno != errno.EINVAL:
            raise
        if int(backend.io.info(marker).get("size") or 0) != 0:  # a range past a larger object's end: never ours
            raise
        return b""


def _refuse_a_live_save(backend: _Backend, key: str, keys: list[str]) -> None:
    """Refuse to remove a prefix under the live claim of a save running in another process: its files and its
    claim went, and the save, knowing nothing of it, went on. Held before its manifest, it committed a manifest
    whose files were gone; held before its claim's removal, it was told "committed" over an id that held
    nothing. Claims of this process (its own save's cleanup, gc's own claim) and dead ones are no bar, and nor
    is a claim made on another host: nothing here can tell whether it lives, and removing the prefix is the way
    the save's refusal gives an operator to clear one that does not (`CommitError` "another save is writing it")."""
    from torch_checkpointing.commit import Claim, stale_reason  # imported here: commit imports this package

    marker = f"{key}/{INCOMPLETE_MARKER}"
    if marker not in keys:
        return
    try:
        held = Claim.parse(_marker_bytes(backend, marker))
    except FileNotFoundError:  # gone meanwhile: the save committed or was discarded
        return
    here = held is not None and same_host(held.host, this_host())
    if held is None or not here or held.pid == os.getpid():
        return
    with _live_claim() as mine:
        mine_claim = Claim.parse(mine)
        if mine_claim is None or stale_reason(held, mine_claim) is not None:
            return
    raise _ClaimedMeanwhile(backend.url(marker), held.describe())


def _held_by(data: bytes, mine: bytes) -> str | None:
    """Who holds an id whose marker holds `data`, judged by the process about to put its claim `mine` up: None
    when nobody does (an empty marker, or a claim of ours no process holds), else what holds it."""
    from torch_checkpointing.commit import Claim, stale_reason  # imported here: commit imports this package

    mine_claim = Claim.parse(mine)
    if mine_claim is None or len(data) > MAX_MARKER_BYTES or not our_marker(data):
        return "a file that is no claim of ours (another program's)"
    held = Claim.parse(data)
    if stale_reason(held, mine_claim) is not None:
        return None
    return held.describe() if held is not None else "a claim that cannot be read"


def _put_up_claim(backend: _Backend, marker: str, claim: bytes) -> None:
    """Put `claim` up as the `.incomplete` marker at `marker` only where no save holds the id: created only if
    absent, or in place of a dead claim of ours only while it is still the version judged (S3's `If-None-Match`
    and `If-Match`; stores without a conditional replace do it in two steps, as `compares_atomically` says).

    Before, a plain PUT: the caller checked that no save held the id, but a save that claimed it after that check
    lost its claim to the PUT, and the move's copy then wrote its files among the save's."""
    backend.fs.invalidate_cache(marker)
    try:
        etag: str | None = str(backend.io.info(marker).get("ETag") or "")
        data = _marker_bytes(backend, marker)
    except FileNotFoundError:
        etag, data = None, b""
    if etag is not None and (held := _held_by(data, claim)) is not None:
        raise _ClaimedMeanwhile(backend.url(marker), held)
    try:
        if etag is None and backend.protocols & {"file", "local"}:
            _create_claim_local(marker, claim)
        elif etag is None:
            backend.io.pipe_file(marker, claim, mode="create")
        elif backend.is_s3 and etag:
            backend.io.pipe_file(marker, claim, IfMatch=etag)
        else:
            _replace_judged(backend, marker, claim, data)
    except Exception as exc:
        if not (_precondition_failed(exc) or _missing(exc)):
            raise
        if not _is_up(backend, marker, claim):
            raise _ClaimedMeanwhile(
                backend.url(marker), "a claim put up after this one's check (another save)"
            ) from exc
    finally:
        backend.fs.invalidate_cache(marker)


def _create_claim_local(marker: str, claim: bytes) -> None:
    """`_put_up_claim`'s create on `file://`, in one step as a save's claim is (`_create_local`): a plain write let
    a save find the marker there and empty (a dead claim to every judge) before its bytes were. A marker made
    since the check is `FileExistsError`, for the caller to judge."""
    if not _create_local(marker, claim):
        raise FileExistsError(errno.EEXIST, "a claim was made since the check", marker)


def _replace_judged(backend: _Backend, marker: str, claim: bytes, judged: bytes) -> None:
    """`_put_up_claim`'s replace off S3: `claim` in place of the dead claim `judged`, only while the marker still
    holds it, compared under the lock a save's take-over of it holds (`_locked_marker`, as `replace_object`; one
    step on `file://` and `memory://`, two elsewhere). On `file://` in one rename (`_replace_local`).

    Before, the write went unlocked and uncompared: a save that took the same dead claim over after this check
    lost its claim to it, and the delete then removed the id under the save, which held it too."""
    with _locked_marker(backend, marker, lambda: backend.url(marker)):
        if _marker_bytes(backend, marker) != judged:
            raise _ClaimedMeanwhile(backend.url(marker), "a claim put up after this one's check (another save)")
        if backend.protocols & {"file", "local"}:
            _replace_local(marker, claim)
        else:
            backend.io.pipe_file(marker, claim)


def _is_up(backend: _Backend, marker: str, claim: bytes) -> bool:
    """Whether the marker holds `claim` after its conditional PUT was refused: a PUT the server did, its answer
    lost, is retried by the client and refused by the marker it put up itself. Before, the move (or delete) then
    failed, saying another save held the id, and a move left its own claim at the destination. A store's error
    reading it (403, a 503 after retries) is raised: it was told as another save's claim."""
    backend.fs.invalidate_cache(marker)
    try:
        return bool(_marker_bytes(backend, marker) == claim)
    except FileNotFoundError:  # gone again: the claim is not up
        return False


class _ClaimedMeanwhile(OSError):
    """Raised inside an error scope: a marker this process meant to put up is another save's (or changed)."""

    def __init__(self, marker: str, held: str) -> None:
        super().__init__(
            f"{marker} is held by another save ({held}): nothing was moved or deleted under it; retry once that "
            f"save is done with the id"
        )


@contextlib.contextmanager
def _live_claim(collects: str = "") -> Iterator[bytes]:
    """The `.incomplete` marker a delete of a committed checkpoint (or a copy of one to another prefix) puts up
    while its files go (or come): a claim naming an owner lock this process holds for as long as the delete (or
    copy) runs, so that it reads as live until it is over, however it ends (`commit.stale_reason`), and as dead
    after (gc collects what a failed delete or copy left).

    Before, the marker was empty, which every judge takes for a dead save's claim: a save of the id took it over
    while the files went and committed, and the delete's bulk delete, listed before, removed the files it had
    just written (a committed manifest whose files were missing).

    `collects`: the save whose manifest the delete removes (`_save_of`). The claim then owns that manifest, as
    gc's own claim does (`Claim.for_gc`): readers take the id as incomplete from the moment the claim is up, and
    the manifest is the record of what the delete removes (`records`), gone only after the files it lists."""
    # Imported here: both import this module's package.
    from torch_checkpointing.commit import Claim
    from torch_checkpointing.discovery import OwnerLock

    lock = OwnerLock(f"gc{uuid.uuid4().hex}")
    try:
        token = f"{GC_TOKEN_PREFIX}{uuid.uuid4().hex}"
        uid = lock.uid if lock.held else ""
        claim = Claim(token, uid, this_host(), os.getpid(), time.time(), records=bool(collects), collects=collects)
        yield claim.to_bytes()
    finally:
        lock.release()


def _delete_marked(
    backend: _Backend,
    key: str,
    keys: list[str],
    *,
    restore: bool,
    claim: bytes = b"",
    copied: bytes | None = None,
    owns: bool = False,
) -> None:
    """`_delete_prefix` itself; `claim`: the marker a committed checkpoint gets first (in place of a dead one).

    Under that claim (it names the manifest's save: `_live_claim`) the manifest goes after the files it lists:
    killed among them, the delete leaves them listed beside a claim gc collects by that list (`remove_recorded`),
    a user's file put there since left in place and named. Deleted first, the files were named by nothing: on an
    untagged store gc kept them whole for a person, on `file://` nothing named them at all. Beside another
    save's live claim that strays beside it, or where the manifest is none of ours (`owns` False: the claim up,
    this delete's or the live one found, does not own it), the manifest still goes first. Another save's manifest
    than the one this delete's claim names is never deleted: it is not `copied` (`_same_as_copied`)."""
    manifest, marker = f"{key}/{MANIFEST_FILE_NAME}", f"{key}/{INCOMPLETE_MARKER}"
    rest = [k for k in keys if k not in (manifest, marker)]
    committed, marked = manifest in keys, marker in keys
    if committed and claim:  # over a dead marker of ours too (`_dead_claim_of_ours`)
        _put_up_claim(backend, marker, claim)
    saved = _same_as_copied(backend, key, copied, claim) if committed else b""
    owned = committed and owns
    try:
        if committed and not owned:
            backend.io.rm_file(manifest)
        if rest:
            _delete_all(backend, rest)  # the marker stays if any is kept: gc collects the prefix later
        if owned:
            backend.io.rm_file(manifest)
    except BaseException:
        if committed and restore:
            _restore_if_whole(backend, key, rest, saved, remove_marker=not marked or bool(claim))
        raise
    if committed or marked:
        backend.io.rm_file(marker)
    backend.fs.invalidate_cache()


def _remove_tree(backend: _Backend, key: str) -> None:
    """Remove a directory tree (or one file) by its own name: fsspec's `rm(recursive=True)` expands `*`, `?` and
    `[` in it as a glob, and removing `run/step*1` removed `run/stepX1` and `run/step11` with it. Its files go as
    an object store's do (`_delete_objects`): a committed checkpoint claimed first, its manifest after the files
    it lists, the marker last. In listing order the marker went first, and a removal killed among the files left
    a manifest without its marker (a committed checkpoint); manifest first, it left in gc's trash files beside
    neither, which no later gc recognised.

    A tree under a live save's claim is refused (`_refuse_a_live_save`), as on an object store. Before, on
    `file://` the save's claim and files went, and the save failed on a bare FileNotFoundError over an id that
    held nothing."""
    if not backend.io.isdir(key):
        backend.io.rm_file(key)
        return
    read = _manifest_now(backend, key)
    found = backend.io.find(key, withdirs=True, detail=True)
    files = [name for name, info in found.items() if info.get("type") != "directory"]
    _refuse_a_live_save(backend, key, files)
    if files:
        _delete_objects(backend, key, files, copied=_manifest_listed(backend, key, files, read))
    dirs = [name for name, info in found.items() if info.get("type") == "directory" and name != key]
    for name in [*sorted(dirs, key=len, reverse=True), key]:  # the deepest first
        with contextlib.suppress(FileNotFoundError):
            backend.io.rmdir(name)
    backend.fs.invalidate_cache()


def _remove_empty_dirs(backend: _Backend, key: str) -> None:
    """The directories of `key`'s tree (and `key`) that a directory rename emptied, deepest first: on `file://`
    the source's directories stayed, so a checkpoint retention moved to the trash left an empty directory at
    its id. One that is not empty (a file written there since the rename listed it) stays, with that file."""
    if not backend.io.isdir(key):
        return
    found = backend.io.find(key, withdirs=True, detail=True)
    dirs = [name for name, info in found.items() if info.get("type") == "directory" and name != key]
    for name in [*sorted(dirs, key=len, reverse=True), key]:
        with contextlib.suppress(OSError):  # not empty, or gone already
            backend.io.rmdir(name)
    backend.fs.invalidate_cache()


def _restore_if_whole(backend: _Backend, key: str, files: list[str], manifest: bytes, remove_marker: bool) -> None:
    """After a refused delete: a checkpoint none of whose files went is committed again, as it was."""
    try:
        backend.fs.invalidate_cache()
        if not set(files) <= set(_objects_under(backend, key)):
            return  # some files are gone: it stays marked incomplete, and gc collects it
        backend.io.pipe_file(f"{key}/{MANIFEST_FILE_NAME}", manifest)
        if remove_marker:
            backend.io.rm_file(f"{key}/{INCOMPLETE_MARKER}")
        backend.fs.invalidate_cache()
    except Exception as exc:  # the delete's own error is the one raised; this says what is left
        logger.warning(
            "A refused delete of %s://%s could not put its manifest back (%s): it is left marked incomplete; its "
            "files are all there. Delete the prefix, or restore manifest.json from a copy and remove %s",
            backend.scheme,
            key,
            exc,
            INCOMPLETE_MARKER,
        )


def _delete_all(backend: _Backend, keys: list[str]) -> None:
    """Delete `keys` in bulk (1000 a request on S3); raise naming every object the store kept.

    s3fs's bulk delete drops the per-key errors S3 answers with status 200 (a bucket policy or role that
    denies s3:DeleteObject): the objects stayed while the caller went on as if they were gone, and removed
    the `.incomplete` marker that let gc find them.
    """
    if not backend.is_s3:
        for key in keys:  # one by one: `rm(keys)` expands `*`, `?` and `[` in a name as a glob
            backend.io.rm_file(key)
        backend.fs.invalidate_cache()
        return
    kept: list[str] = []
    try:
        for start in range(0, len(keys), _DELETE_BATCH):
            kept += _delete_batch(backend, keys[start : start + _DELETE_BATCH])
    finally:
        backend.fs.invalidate_cache()
    if kept:
        more = " ..." if len(kept) > 5 else ""
        raise _KeptObjects(
            f"the store kept {len(kept)} of {len(keys)} objects ({', '.join(kept[:5])}{more})"
            f": let these credentials delete objects in the bucket (s3:DeleteObject in its policy or the role's), "
            f"then delete the prefix again (FsspecStorage.rmdir, or `aws s3 rm --recursive`)"
        )


def _delete_batch(backend: _Backend, keys: list[str]) -> list[str]:
    """One DeleteObjects request (keys of one bucket); the objects it did not delete, with the store's reason."""
    bucket = backend.fs.split_path(keys[0])[0]
    objects = [{"Key": backend.fs.split_path(k)[1]} for k in keys]
    out = backend.io.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
    return [f"{bucket}/{e.get('Key')} ({e.get('Code')}: {e.get('Message')})" for e in out.get("Errors", [])]


class _KeptObjects(OSError):
    """Raised inside an error scope: a bulk delete answered, but left some objects in place."""


# ---------------------------------------------------------------------- helpers


def _uploads_under(fs: Any, prefix: str) -> list[dict[str, Any]]:
    """Every unfinished multipart upload whose key starts with `prefix` (`bucket/key...`), all pages."""
    bucket, key, _ = fs.split_path(prefix)
    found: list[dict[str, Any]] = []
    markers: dict[str, str] = {}
    while True:
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key, **markers)
        found += [{**u, "Key": f"{bucket}/{u['Key']}"} for u in page.get("Uploads", [])]
        if not page.get("IsTruncated"):
            return found
        markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}


def _abandoned_uploads(backend: _Backend, key: str, keys: list[str]) -> list[tuple[str, str]]:
    """The unfinished multipart uploads under a prefix `rmdir` removes, listed before anything goes (so none of
    a save that claims the id after is listed), and only where no live save holds it: no marker, or a claim no
    process holds (a dead save's prefix that gc collects whole, a trash, a failed save's). [] off S3; a listing
    that fails is said at WARNING, never the removal's failure (a lifecycle rule aborts what is left)."""
    marker = f"{key}/{INCOMPLETE_MARKER}"
    if not backend.is_s3:
        return []
    unread = (
        f"the unfinished multipart uploads under {backend.url(key)}/ are not aborted, and stay billed until a "
        f"lifecycle rule for incomplete uploads (or `aws s3api abort-multipart-upload`) removes them"
    )
    if marker in keys:
        with _live_claim() as mine:
            if not _dead_claim_of_ours(backend, marker, mine, unread):
                return []
    try:
        return [(u["Key"], u["UploadId"]) for u in _uploads_under(backend.io, key + "/")]
    except Exception as exc:
        logger.warning("Could not list the unfinished multipart uploads under %s: %s", backend.url(key), exc)
        return []


def _abort_upload(fs: Any, key: str, upload_id: str) -> bool:
    """Abort one upload of `key` (`bucket/key`); whether it is gone (an upload already gone is). Logged if not."""
    bucket, name, _ = fs.split_path(key)
    try:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=name, UploadId=upload_id)
    except Exception as exc:
        if _error_code(exc) == "NoSuchUpload" or isinstance(exc, FileNotFoundError):
            return True
        logger.warning(
            "Could not abort the unfinished multipart upload %s of s3://%s (%s): its parts stay billed until it "
            "is aborted (`aws s3api abort-multipart-upload`) or a lifecycle rule for incomplete uploads removes it",
            upload_id,
            key,
            exc,
        )
        return False
    return True


# Per thread, what the caller was handling as each open `_ErrorScope` began: where `_chain` stops.
_SCOPES = threading.local()


def _push_outside() -> BaseException | None:
    """What this thread is handling now, if anything, made a stop of `_chain` until `_pop_outside`."""
    outside = sys.exc_info()[1]
    if outside is not None:
        _SCOPES.__dict__.setdefault("outside", []).append(outside)
    return outside


def _pop_outside(outside: BaseException | None) -> None:
    if outside is not None:  # by identity: the last of this exception's entries is its latest push
        stack = _SCOPES.outside
        del stack[max(i for i, e in enumerate(stack) if e is outside)]


@contextlib.contextmanager
def _caller_handling() -> Iterator[None]:
    """Within: an error of a call made here is told by its own chain only, not by what the caller is handling
    (see `_chain`), for code that asks the store in an `except` block and reads the code of what it met."""
    outside = _push_outside()
    try:
        yield
    finally:
        _pop_outside(outside)


class _ErrorScope:
    """Turns a store's error (botocore's, aiohttp's, OSError) into an ObjectStoreError naming the object.

    FileNotFoundError passes through unchanged: callers ask "is it there?" with it. So does this process short of
    memory or file descriptors (`errors.is_shortage`): the step that met it names it (a load's "Out of memory
    reading ...", a save's `errors.save_shortage`). Before, a download short of memory was an ObjectStoreError
    ("download of ... failed: MemoryError: "), a `CheckpointError` that a caller falling back to an earlier
    checkpoint, or deleting a damaged one, acts on, for an intact checkpoint.
    """

    def __init__(self, what: str, wrap_missing: bool = False) -> None:
        self.what = what
        self.wrap_missing = wrap_missing  # uploads: a missing bucket is a failed upload, not "not found"
        self.outside: BaseException | None = None

    def __enter__(self) -> None:
        # What the caller is handling (its `except` block): the call's errors are chained to it, and it is none
        # of theirs. A store refusing a connection inside a caller's `except MemoryError:` was told as a shortage.
        self.outside = _push_outside()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._translate(exc)
        finally:
            _pop_outside(self.outside)

    def _translate(self, exc: BaseException | None) -> None:
        """`exc`, met in the scope, raised as what it is for the caller (see the class); None: it passes as it is."""
        if isinstance(exc, _BucketGone):
            raise ObjectStoreError(f"{self.what} failed: {exc.reason}") from exc
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, CheckpointError):
            return
        if isinstance(exc, FileNotFoundError) and not self.wrap_missing:
            return
        named = _shortage_as_named(exc, self.what, self.outside)
        if named is exc:
            return  # raised as it is, with its note
        if named is not None:
            raise named from exc
        reason = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, TimeoutError):  # fsspec's FSTimeoutError says nothing by itself
            reason += (
                " (no answer within FsspecStorageConfig.request_timeout_s, or the client's own timeouts: check that "
                "the endpoint is up and reachable from here, or raise the timeout for a store this slow)"
            )
        code = _error_code(exc)
        if code == "403":  # a HEAD's refusal: no body, so no S3 code but its status
            reason += f" (AccessDenied: {_FIXES['AccessDenied']})"
        elif code in _FIXES:
            reason += f" ({code}: {_FIXES[code]})"
        elif (fix := _client_fix(exc)) is not None:
            reason += f" ({fix})"
        raise ObjectStoreError(f"{self.what} failed: {reason}") from exc


def _shortage_as_named(exc: BaseException, what: str, outside: BaseException | None) -> BaseException | None:
    """`exc` with the note naming `what` when it is a shortage, the shortage it wraps as itself (`_as_shortage`),
    or None when it is none. `outside`: what the caller was handling (see `errors.shortage_within`)."""
    if is_shortage(exc):
        _name_shortage(exc, what)
        return exc
    short = shortage_within(exc, outside)
    return None if short is None else _as_shortage(what, exc, short)


@contextlib.contextmanager
def shortage_named(what: str) -> Iterator[None]:
    """A shortage met inside, named with `what`; every other error passes as it is (an unknown protocol, a missing
    package: the caller's to fix, no store failure)."""
    outside = sys.exc_info()[1]
    try:
        yield
    except Exception as exc:
        named = _shortage_as_named(exc, what, outside)
        if named is not None and named is not exc:
            raise named from exc
        raise


def _as_shortage(what: str, exc: BaseException, short: MemoryError | OSError) -> MemoryError | OSError:
    """The shortage `short` that the client's error `exc` wraps, as what it is (a `MemoryError`, or an `OSError`
    of its errno), in the client's words and with the note naming `what`: the step that meets it names the
    checkpoint and the fix, as for one raised bare."""
    told = f"{type(exc).__name__}: {exc}"
    same = MemoryError(told) if isinstance(short, MemoryError) else OSError(short.errno, told)
    _name_shortage(same, f"{what} (told by the client as {type(exc).__name__})")
    return same


def _name_shortage(exc: BaseException, what: str) -> None:
    """A note on `exc`, a shortage passing through a storage call, naming that call and its object: a listing short
    of memory (gc's, `latest_checkpoint`'s) was a bare `MemoryError`, with no word of the bucket or prefix."""
    lacking = "file descriptors" if isinstance(exc, OSError) and exc.errno != errno.ENOMEM else "memory"
    if any(note.startswith("Out of ") for note in getattr(exc, "__notes__", ())):
        return  # the scope of a call inside this one named it already
    add_note(
        exc,
        f"Out of {lacking} during the {what}: this process's shortage, not the store's. Free {lacking} (or raise "
        f"the process's limit) and try again.",
    )


def _run_all(fn: Callable[[int], None], args: list[int], concurrency: int) -> None:
    """fn over args on up to `concurrency` threads; the first error is raised once all have stopped. The threads
    are a process-wide WorkerPool's: a Ctrl-C on the caller's thread cannot wedge one (see `futures`)."""
    _GET_POOL.map_bounded(fn, args, concurrency)


_GET_POOL = WorkerPool(1, "ckpt-get")


@functools.cache
def _bytes_api() -> tuple[Any, Any] | None:
    """CPython's PyBytes_FromStringAndSize / PyBytes_AsString, with private signatures (not ctypes.pythonapi's)."""
    try:
        api = ctypes.PyDLL(None)
        make, as_string = api.PyBytes_FromStringAndSize, api.PyBytes_AsString
    except (AttributeError, OSError):  # pragma: no cover - not CPython
        return None
    make.restype, make.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
    as_string.restype, as_string.argtypes = ctypes.c_void_p, [ctypes.py_object]
    return make, as_string


def new_bytes(size: int) -> tuple[bytes | bytearray, memoryview]:
    """A `bytes` of `size` and a writable view of its buffer, so parts land in the result without a second copy.

    Readers want `bytes` (io.BytesIO shares a bytes buffer but copies a bytearray; RawSerialization returns
    it to the user), and filling a bytearray then converting it would hold the file twice. The new bytes
    object is seen by nobody until it is filled, so writing into it is safe. Without CPython's C API this
    falls back to a bytearray (the caller converts it).
    """
    api = _bytes_api()
    if api is None:  # pragma: no cover - not CPython
        buf = bytearray(size)
        return buf, memoryview(buf)
    make, as_string = api
    out = make(None, size)
    return out, memoryview((ctypes.c_char * size).from_address(as_string(out))).cast("B")


class _RangedStream(io.RawIOBase):
    """An object read as a stream by the storage's own ranged reads (`FsspecStorage.read_range`): each bounded
    by `request_timeout_s`, its errors named. fsspec's file made its own unbounded requests (a server that
    accepted and never answered held `verify` for minutes), raised the client's bare errors, and on memory://
    was the one stored file itself, whose position every reader of the object moved.

    Sized at its open (`version`); at the end the object must still be that version, or the bytes read may
    come from two (an `ObjectStoreError`, as for a ranged read)."""

    def __init__(self, storage: FsspecStorage, path: Path, version: tuple[int, str]) -> None:
        super().__init__()
        self._storage = storage
        self._path = path
        self._version = version
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        size = min(len(view), self._version[0] - self._pos)
        if size <= 0:
            return 0
        view[:size] = self._storage.read_range(self._path, self._pos, size)
        self._pos += size
        if self._pos == self._version[0]:
            self._check_unchanged()
        return size

    def readall(self) -> bytes:
        """The rest in one ranged read, not in `DEFAULT_BUFFER_SIZE` requests."""
        rest = self._storage.read_range(self._path, self._pos, self._version[0] - self._pos)
        self._pos = self._version[0]
        self._check_unchanged()
        return rest

    def _check_unchanged(self) -> None:
        storage, path = self._storage, self._path
        backend, key = storage._resolve(path)
        with storage._missing_bucket_named(backend, key, "download of", path), storage._errors("download of", path):
            now = _version(backend, key)
            if now != self._version:
                raise _ChangedWhileRead(
                    f"the object changed while it was read (size {self._version[0]}, ETag {self._version[1] or '?'} "
                    f"at its open; size {now[0]}, ETag {now[1] or '?'} at its end)"
                )


class _ChecksummedUpload(io.RawIOBase):
    """A write-only stream that checksums what it uploads (`_running`), for the manifest's record.

    The first error of a `write` is kept, raised again by every later one, and raised in place of the error the
    `with` block is left with: an encoder that turns a failed write into its own error (torch's "unexpected pos
    704 vs 598") hid it before, a part's thread the OS refused (a `MemoryError` naming the limit) or a refused
    upload among them. The local filesystem's stream does the same (`DurableFileWriter`).
    """

    _running: RunningChecksum
    _first_error: Exception | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self._first_error is not None:
            raise self._first_error
        try:
            return self._write_data(data)
        except Exception as exc:  # MemoryError among them
            self._first_error = exc
            raise

    def _write_data(self, data: Any) -> int:
        raise NotImplementedError

    def checksum(self) -> FileChecksum:
        """Size, CRC32 and block CRC32s of every byte written; complete once the stream is closed."""
        return self._running.result()

    def _discard(self) -> None:
        """Drop a failed upload: nothing may appear under its name."""
        raise NotImplementedError

    def __del__(self) -> None:
        """`io.IOBase`'s finalizer would close() and so finish a half-written file (a stream its caller dropped
        unclosed, outside any `with`): it is discarded instead."""
        if self.closed:
            return
        try:
            self._discard()
        except Exception as exc:  # a finalizer cannot raise: the caller is gone
            logger.warning("Could not drop the unfinished upload %s: %s", getattr(self, "_url", "?"), exc)
        finally:
            io.RawIOBase.close(self)

    def _refuse_if_failed(self) -> None:
        """At close(): after a failed write (an encoder that caught its error and closed the stream), the upload
        is discarded and that error raised again. Before, close() committed what there was: a file truncated at
        the failed part, or, where the failing write had aborted the upload, its empty buffer as the object."""
        first = self._first_error
        if first is None:
            return
        try:
            self._discard()
        finally:
            io.RawIOBase.close(self)
        raise first

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        self._discard()
        super().close()
        first = self._first_error
        if first is not None and exc is not first:
            raise first  # its context: what the encoder made of it


class _FsspecFileWriter(_ChecksummedUpload):
    """An fsspec file opened for writing; leaving its `with` block on an error discards what was written.

    Its writes and close are the backend file's own part uploads, which `request_timeout_s` does not bound (the
    file makes its requests itself): on GCS or Azure the backend's own timeout options do. No such store runs
    beside the tests to show a stalled upload; `docs/storage.md` says so."""

    def __init__(self, fs: Any, key: str, block_size: int, url: str) -> None:
        super().__init__()
        self._fs = fs
        self._key = key
        self._url = url
        self._running = RunningChecksum()
        with _ErrorScope(f"upload of {url}", wrap_missing=True):
            self._inner = fs.open(key, "wb", block_size=block_size)

    def _write_data(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._running.update(view)
        with _ErrorScope(f"upload of {self._url}", wrap_missing=True):
            return int(self._inner.write(view))

    def close(self) -> None:
        """Finish the file. Where it is written in place (file://) a close that fails (its flush of the buffered
        tail met a full disk) removes the partial file: a write the OS took only in part raised nothing, so the
        failure first showed here, and the truncated file stayed under its name. A stream whose open failed has
        nothing to close: its finalizer's close logged a second failure, an AttributeError."""
        if not self.closed and not hasattr(self, "_inner"):  # its open failed (raised): the finalizer's close
            io.RawIOBase.close(self)
        if not self.closed:
            self._refuse_if_failed()
            try:
                with _ErrorScope(f"upload of {self._url}", wrap_missing=True):
                    self._inner.close()
            except BaseException:
                if _writes_in_place(self._inner):
                    self._remove_partial()
                raise
            finally:
                super().close()

    def _discard(self) -> None:
        """Drop what was written. In place (file://, memory://) the partial file is removed even where closing it
        fails: the close flushes the buffered tail of the very write that failed and fails again, and that bare
        OSError replaced the upload's error, the partial file left. memory://'s `discard()` is a no-op on a file
        committed at its open: taken for a dropped upload, the bytes written so far stayed, a partial object.

        Elsewhere the store's upload is discarded and the file marked closed: left open, its finalizer's close
        flushed the dropped buffer (an upload of the partial bytes; on s3fs an "Exception ignored" traceback)."""
        if not hasattr(self, "_inner"):  # its open failed: nothing was written
            return
        if _writes_in_place(self._inner):
            self._remove_partial()
            return
        try:
            self._inner.discard()
        except Exception:  # a store that cannot discard: what it holds under the name goes
            self._remove_partial()
        else:
            _mark_closed(self._inner)

    def _remove_partial(self) -> None:
        try:
            self._inner.close()  # a no-op where it is closed already
        except Exception as exc:  # the failure the caller is told of, met again: not raised twice
            logger.debug("Closing the dropped upload of %s failed too: %s", self._url, exc)
        if self._fs.exists(self._key):
            self._fs.rm_file(self._key)


def _writes_in_place(inner: Any) -> bool:
    """Whether the fsspec file `inner` puts its bytes under their name as they come (a local file; a memory file,
    there from its open), so that a failed write or close leaves a partial file; an object store's upload leaves
    nothing."""
    from fsspec.implementations.local import LocalFileSystem  # fsspec is imported at its first use
    from fsspec.implementations.memory import MemoryFileSystem

    return isinstance(getattr(inner, "fs", None), (LocalFileSystem, MemoryFileSystem))


def _mark_closed(inner: Any) -> None:
    """A discarded buffered fsspec file (`AbstractBufferedFile`) marked closed, so that neither a later close nor
    its finalizer flushes what it held; other files are left as they are."""
    from fsspec.spec import AbstractBufferedFile

    if isinstance(inner, AbstractBufferedFile):
        inner.closed = True


class _S3MultipartWriter(_ChecksummedUpload):
    """Uploads a file as S3 multipart parts while it is written; memory is bounded by in-flight parts.

    Bytes collect in one part-sized buffer; a full buffer is handed to a pool that uploads up to
    `max_concurrency` parts at once (write() waits when that many are in flight). close() uploads the tail
    and completes the upload: only then does the object exist. A file smaller than one part is one PUT.
    Any failure, or leaving the `with` block on an exception, aborts the upload: no object, no stray parts.
    """

    def __init__(
        self,
        fs: Any,
        key: str,
        url: str,
        part_size: int,
        concurrency: int,
        exclusive: bool = False,
        tag: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._fs = fs
        self._url = url
        self._tag = tag or {}  # the save's metadata (`FsspecStorage.own_writes`), on whichever request creates it
        self._exclusive = exclusive  # created only if absent (a manifest): see FsspecStorage.write
        self._bucket, self._object, _ = fs.split_path(key)
        self._part_size = part_size
        self._concurrency = concurrency
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[tuple[dict[str, Any], list[int]]]] = []
        self._lost_creates: Future[None] | None = None  # `_abort_lost_creates`, run beside the first parts
        self._part_sizes: list[int] = []
        self._uploaded = 0  # bytes handed to parts: `sum(_part_sizes)`, kept so a write need not add them up
        self._pool: WorkerPool | None = None  # waited for on the caller's thread (a sync save): see `futures`
        self._running = RunningChecksum()
        # Parts made of whole blocks are checksummed on their upload threads; otherwise here, in order.
        self._sum_parts = part_size % self._running.block_size == 0

    def _write_data(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._uploaded + len(self._buffer) + len(view)
        if written > self._part_size * MAX_PARTS:
            self._refuse_past_limit(written)  # before any byte of `view` is sent
        if not self._sum_parts:
            self._running.update(view)
        pos = 0
        while pos < len(view):
            take = min(self._part_size - len(self._buffer), len(view) - pos)
            self._buffer += view[pos : pos + take]
            pos += take
            if len(self._buffer) >= self._part_size:
                self._send_part()
        return len(view)

    def _call(self, method: str, **kwargs: Any) -> Any:
        with _ErrorScope(f"upload of {self._url} ({method})", wrap_missing=True), _refused_if_present(self._url):
            return self._fs.call_s3(method, Bucket=self._bucket, Key=self._object, **kwargs)

    def _send_part(self) -> None:
        if self._upload_id is None:
            asked = time.monotonic()
            self._upload_id = self._call("create_multipart_upload", **self._tag)["UploadId"]
            self._pool = WorkerPool(self._concurrency, "ckpt-part")
            # Beside the parts, never before them: every multipart file waited one more round trip for it.
            self._lost_creates = self._pool.submit(self._abort_lost_creates, time.monotonic() - asked)
        pending = [f for f in self._parts if not f.done()]
        if len(pending) >= self._concurrency:
            pending[0].result()  # bounds memory: at most `max_concurrency` parts in flight
        for fut in self._parts:
            if fut.done() and fut.exception() is not None:
                fut.result()  # fail fast: no point encoding the rest of the file
        number = len(self._parts) + 1
        data, self._buffer = bytes(self._buffer), bytearray()
        assert self._pool is not None
        self._parts.append(self._pool.submit(self._checksum_and_upload, number, data))
        self._part_sizes.append(len(data))
        self._uploaded += len(data)

    def _refuse_past_limit(self, written: int) -> None:
        """The stream's `written` bytes need more than S3's `MAX_PARTS` parts: the upload is aborted here and the
        error says how much had been sent and that nothing is stored. A write that alone passes the limit (a
        tensor, a bytes or safetensors item, each one write) is refused before any of its bytes is sent.
        Before, the limit was met only at the 10,001st part, after 10,000 parts of a file known too large at
        its first write had been uploaded, and the error said neither how much was sent nor whether the
        upload was aborted."""
        sent = self._uploaded
        aborted = self._abort()
        fate = "the upload was aborted (nothing is stored)" if aborted else "the upload could not be aborted (logged)"
        raise ObjectStoreError(
            f"upload of {self._url}: {written} bytes written need more than {MAX_PARTS} parts of "
            f"{self._part_size} bytes (S3's limit per object); {sent} bytes had been sent, and {fate}: raise "
            f"FsspecStorageConfig.part_size to at least {-(-written // MAX_PARTS)} (more if the file is larger "
            f"still), or save it in smaller pieces."
        )

    def _abort_lost_creates(self, took_s: float) -> None:
        """Abort the uploads of this key that a create whose answer was lost left: the client retried it and
        the store made one upload per try, but only the last one's id came back. Never completed nor aborted,
        those were billed for ever. They are the other uploads of this exact key initiated while the create
        ran (the store's own clock, against ours' time), so another writer's upload begun earlier than that is
        never touched. The store's clock cannot tell a lost try from another writer of this very key begun
        within the window (`took_s` + `_CLOCK_SLACK_S`; only a writer still running under a claim judged dead):
        that upload is aborted too, and its writer's next request fails (raised, never a silent loss).
        One listing per multipart file, beside the first parts; a failure is logged, never the save's."""
        key = f"{self._bucket}/{self._object}"
        try:
            uploads = [u for u in _uploads_under(self._fs, key) if u["Key"] == key]
        except Exception as exc:
            logger.warning("Could not list the multipart uploads of %s: %s", self._url, exc)
            return
        ours = next((u for u in uploads if u["UploadId"] == self._upload_id), None)
        if ours is None:
            return
        since = ours["Initiated"] - datetime.timedelta(seconds=took_s + _CLOCK_SLACK_S)
        for upload in uploads:
            if upload is not ours and since <= upload["Initiated"] <= ours["Initiated"]:
                _abort_upload(self._fs, key, upload["UploadId"])

    def _checksum_and_upload(self, number: int, data: bytes) -> tuple[dict[str, Any], list[int]]:
        crcs = block_crc32s(memoryview(data), self._running.block_size) if self._sum_parts else []
        return self._upload_part(number, data), crcs

    def _upload_part(self, number: int, data: bytes) -> dict[str, Any]:
        out = self._call("upload_part", PartNumber=number, UploadId=self._upload_id, Body=data)
        return {"PartNumber": number, "ETag": out["ETag"]}

    def close(self) -> None:
        if self.closed:
            return
        self._refuse_if_failed()
        try:
            self._commit()
        except BaseException:
            self._abort()
            raise
        finally:
            self._shutdown()
            super().close()

    def _commit(self) -> None:
        if self._upload_id is None:
            if self._sum_parts:
                self._running.update(self._buffer)
            if self._exclusive:
                _create(self._fs, f"{self._bucket}/{self._object}", bytes(self._buffer), self._url, self._tag)
                return
            with _ErrorScope(f"upload of {self._url}", wrap_missing=True):
                self._fs.pipe_file(f"{self._bucket}/{self._object}", bytes(self._buffer), **self._tag)
            return
        if self._buffer:
            self._send_part()
        parts = []
        for future, size in zip(self._parts, self._part_sizes, strict=True):
            part, crcs = future.result()
            parts.append(part)
            if self._sum_parts:
                self._running.add_blocks(crcs, size)
        if self._lost_creates is not None:
            self._lost_creates.result()
        condition = {"IfNoneMatch": "*"} if self._exclusive else {}
        self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": parts}, **condition)
        self._fs.invalidate_cache(f"{self._bucket}/{self._object}")

    def _abort(self) -> bool:
        """Drop the upload and its parts; False when the store would not abort it (logged)."""
        self._buffer = bytearray()
        if self._pool is not None:
            for fut in self._parts:
                fut.cancel()
        if self._upload_id is None:
            return True
        self._shutdown()
        try:
            self._fs.call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._object, UploadId=self._upload_id)
        except Exception as exc:  # the store's lifecycle rule for incomplete uploads cleans up after us
            logger.warning("Could not abort the multipart upload of %s: %s", self._url, exc)
            return False
        finally:
            self._upload_id = None
        return True

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _discard(self) -> None:
        self._abort()
