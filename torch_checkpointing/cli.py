"""`torch-checkpointing` / `python -m torch_checkpointing`: look at, check, compare, clean up and export checkpoints.

Exit codes: 0 success; 1 the answer is "no" (verify found damage or a path that is no committed checkpoint, diff
found differences, gc failed to remove something); 2 the command could not run (not a checkpoint, bad arguments,
missing path); 130 interrupted (SIGINT (Ctrl-C)). Every command takes `--json` for scripts (one JSON document on
stdout). Tables and progress bars use `rich` when it is installed (the `[cli]` extra) and the stream is a terminal;
otherwise the output is plain text, so pipes and logs work.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import errno
import json
import logging
import math
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar, cast

import torch

from torch_checkpointing.asides import replace_under_way
from torch_checkpointing.checksum import RunningChecksum, combine_blocks
from torch_checkpointing.cli_stops import STOPS, json_requested
from torch_checkpointing.codecs import dtype_from_name
from torch_checkpointing.config import read_number
from torch_checkpointing.discovery import (
    CheckpointInfo,
    PassedOver,
    checkpoint_info,
    committed_manifest,
    current_resume_point,
    default_storage,
    require_directory,
    require_path,
    storage_for,
)
from torch_checkpointing.distributed_metadata import (
    DistributedMetadata,
    read_distributed_metadata,
    sharding_type,
    unknown_types_as_stored,
)
from torch_checkpointing.dtensor_metadata import DTensorShardingMetadata
from torch_checkpointing.errors import (
    CheckpointError,
    CheckpointReplacedError,
    ConfigError,
    ForeignManifestError,
    IncompleteCheckpointError,
    NewerCheckpointError,
    ObjectStoreError,
    raise_if_short_of_resources,
    resource_shortage_named,
)
from torch_checkpointing.manifest import MANIFEST_FILE_NAME, FileRecord, Manifest
from torch_checkpointing.read_context import CheckedFile, CheckpointReadContext, ReadPolicy, checked_relative_path
from torch_checkpointing.retention import (
    DEFAULT_UNOWNED_AGE_S,
    RetentionPolicy,
    check_age,
    collect_garbage,
    leftovers_report,
    prune,
)
from torch_checkpointing.storage.base_storage import ReadArgs, Storage
from torch_checkpointing.storage.fsspec_storage import url_scheme
from torch_checkpointing.value_diff import compare, named_leaves

__all__ = ["main"]

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_NO, EXIT_ERROR = 0, 1, 2
_ROOT = "the directory that holds the checkpoints (a run's root)"
_CHUNK = 8 << 20


# ------------------------------------------------------------------------------------------------ output


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _metrics(m: Mapping[str, float] | None) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(m.items())) if m else "-"


def shown(text: str) -> str:
    """`text` with every non-printable character escaped (`\\n`, `\\x1b`; a byte of a name that is not
    UTF-8 as `\\xff`) and every backslash doubled: names and messages come from whoever can write into a root,
    and a newline would forge a table row, an escape sequence drive the terminal. A backslash is doubled
    always, as `ls -b` and Python's repr do, so that each escape reads one way: before, the byte 0xff and a
    name holding the four characters `\\xff` were shown alike."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else _escaped(c) for c in text)


def _escaped(c: str) -> str:
    if "\udc80" <= c <= "\udcff":  # os.fsdecode's stand-in for an undecodable byte
        return f"\\x{ord(c) - 0xDC00:02x}"
    return repr(c)[1:-1]


def _encodable(text: str, encoding: str) -> str:
    """`text` with each character `encoding` cannot hold written as `\\u00e9`: under `PYTHONIOENCODING=ascii` a
    name like `ckpt-é` raised UnicodeEncodeError mid-table. (`\\x..` stays an undecodable byte's, `shown`.)"""
    try:
        text.encode(encoding)
        return text
    except UnicodeEncodeError:
        return "".join(
            c if _holds(encoding, c) else f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}" for c in text
        )


def _holds(encoding: str, c: str) -> bool:
    try:
        c.encode(encoding)
    except UnicodeEncodeError:
        return False
    return True


def _json_safe(doc: Any) -> Any:
    """`doc` with every string valid Unicode, so that strict JSON parsers read it and what json.loads gives back
    can be encoded: a name that is not UTF-8 (os.fsdecode's lone surrogates) has each undecodable byte written
    as `\\xff`, as the text output shows it, and, as a dict value, its exact bytes beside it in hex under the key
    plus `_hex` (`bytes.fromhex(entry["path_hex"])` opens it). Before, such a name was written as a `"\\udcff"`
    escape, which parsers refuse or replace, and Python's json.loads returned a str that `.encode()` refused.
    A NaN or infinite float (a diverged loss among the metrics) is written as the manifest records it, the string
    "NaN", "Infinity" or "-Infinity": json.dump wrote the bare tokens, which are not JSON."""
    if isinstance(doc, float) and not math.isfinite(doc):
        return "NaN" if math.isnan(doc) else ("Infinity" if doc > 0 else "-Infinity")
    if isinstance(doc, os.PathLike):
        doc = os.fspath(doc)
    if isinstance(doc, str):
        return _unicode(doc)
    if isinstance(doc, Mapping):
        out: dict[Any, Any] = {}
        for key, value in doc.items():
            safe_key = _unicode(key) if isinstance(key, str) else key
            text = os.fspath(value) if isinstance(value, os.PathLike) else value
            out[safe_key] = _json_safe(text)
            if isinstance(text, str) and out[safe_key] != text and (exact := _fs_bytes(text)) is not None:
                out[f"{safe_key}_hex"] = exact.hex()
        return out
    if isinstance(doc, (list, tuple)):
        return [_json_safe(v) for v in doc]
    return doc


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:  # lone surrogates: \udcff from os.fsdecode, or any from a crafted JSON file
        return "".join(_escaped(c) if "\ud800" <= c <= "\udfff" else c for c in text)


def _fs_bytes(value: str) -> bytes | None:
    """The bytes a name os.fsdecode'd came from; None for a string no file name gives (other lone surrogates)."""
    try:
        return os.fsencode(value)
    except UnicodeEncodeError:
        return None


_T = TypeVar("_T")


class OutputFailed(Exception):
    """Writing the command's report to standard output failed: a full disk under `> report.txt`, stdout closed
    (`>&-`). Not the command's own failure: what it did (a prune's deletions) stands, so it is said as such rather
    than as a bare `[Errno 28] No space left on device` that reads as the checkpoints' disk being full."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Output:
    """Standard output (or a caller's stream) whose write and flush errors are `OutputFailed`. A closed stdout
    (`sys.stdout` is None) fails its first write with EBADF, as a write to a closed descriptor does. A reader
    gone from a pipe (`| head -1`) stays a BrokenPipeError: `main` ends that quietly."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream
        self.encoding: str = getattr(stream, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def write(self, text: str) -> int:
        return self._through(lambda stream: stream.write(text))

    def flush(self) -> None:
        if self._stream is not None:
            self._through(lambda stream: stream.flush())

    def _through(self, call: Callable[[TextIO], _T]) -> _T:
        if self._stream is None:
            raise OutputFailed(OSError(errno.EBADF, "standard output is closed"))
        try:
            return call(self._stream)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(exc) from exc


class Ui:
    """Tables, lines and progress: `rich` on a terminal when installed, plain text otherwise.

    Every cell and line is shown as data (`shown`), and `rich` is given it as plain text, never as markup: a
    checkpoint named `[bold]x` is shown as that name."""

    def __init__(self, json_mode: bool, plain: bool, out: TextIO | None = None) -> None:
        self.json_mode = json_mode
        self.out = _Output(out or sys.stdout)
        self._rich: Any = None
        if not json_mode and not plain and self.out.isatty():
            try:
                import rich.console

                self._rich = rich.console.Console(file=cast(TextIO, self.out))
            except ImportError:
                self._rich = None

    def line(self, text: str = "") -> None:
        if self.json_mode:
            return
        print(self._fit(shown(text)), file=self.out)

    def _fit(self, text: str) -> str:
        return _encodable(text, self.out.encoding)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        if self.json_mode:
            return
        cells = [[self._fit(shown(str(c))) for c in row] for row in rows]
        title = self._fit(shown(title))
        if self._rich is not None:
            from rich.table import Table
            from rich.text import Text

            table = Table(title=Text(title), title_justify="left")
            for c in columns:
                table.add_column(c)
            for row in cells:
                table.add_row(*(Text(c) for c in row))
            self._rich.print(table)
            return
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
        print(f"{title}:", file=self.out)
        print("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip(), file=self.out)
        for row in cells:
            print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=self.out)

    def emit_json(self, doc: Any) -> None:
        if self.json_mode:
            json.dump(
                _json_safe(doc),
                self.out,
                indent=2,
                sort_keys=True,
                allow_nan=False,
                default=lambda o: _json_safe(str(o)),
            )
            self.out.write("\n")

    @contextmanager
    def progress(self, total: int, description: str) -> Iterator[Any]:
        """A bytes progress bar on stderr when it is a terminal (and rich is there); a no-op advance otherwise.

        `description` names a checkpoint: shown as data, as every line is, and never as rich markup (a checkpoint
        named `[bold red]x` was drawn as a red `x`, and an escape sequence in a name reached the terminal)."""
        if self.json_mode or not sys.stderr.isatty():
            yield lambda n: None
            return
        description = _encodable(shown(description), sys.stderr.encoding or "utf-8")
        try:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
        except ImportError:
            yield _PlainProgress(total, description)
            return
        columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn())
        with Progress(*columns, transient=True, console=_stderr_console()) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)


def _stderr_console() -> Any:
    import rich.console

    return rich.console.Console(stderr=True)


@dataclass
class _PlainProgress:
    """Percent steps on stderr (a terminal without rich)."""

    total: int
    description: str
    done: int = 0
    shown: int = -1

    def __call__(self, n: int) -> None:
        self.done += n
        pct = 100 if self.total == 0 else int(100 * self.done / self.total)
        if pct // 10 != self.shown // 10:
            self.shown = pct
            print(f"\r{self.description}: {pct:3d}%", end="\n" if pct >= 100 else "", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ helpers


def _open(storage: Storage, path: str | Path, *, verify: bool) -> CheckpointReadContext:
    """The read context every command reads a checkpoint's files through, as a load does: the directory
    pinned, paths contained, regular files only (no symlink out, no FIFO to hang on), only listed files read.
    Checksums are checked as files are read when `verify` (diff); verify and inspect check or show them."""
    return CheckpointReadContext(
        storage, str(path), ReadPolicy(verify_checksums=verify, allow_legacy_checkpoints=False), operation="command"
    )


def _info(storage: Storage, path: str) -> CheckpointInfo:
    info = checkpoint_info(path, storage)
    if info is None:
        committed_manifest(storage, Path(path), operation="command")  # raises the precise reason
        raise IncompleteCheckpointError(f"{path}: not a committed checkpoint")
    return info


# ------------------------------------------------------------------------------------------------ ls


def cmd_ls(args: argparse.Namespace, ui: Ui, storage: Storage) -> int:
    root = args.root
    require_directory(storage, Path(root), _ROOT)
    listed, latest, passed_over = current_resume_point(root, storage)
    found = listed.checkpoints
    # A checkpoint this user may not read is no damage: a script deleting "damaged" ones must never get it.
    unusable = passed_over + listed.unlisted
    gc = leftovers_report(root, storage, dry_run=True, unowned_after_s=args.older_than)  # the listing warned
    verdicts = [(lo, "removable by gc") for lo in gc.removed] + [(lo, f"kept: {why}") for lo, why in gc.kept]
    verdicts.sort(key=lambda t: t[0].path)
    ui.emit_json(
        {
            "root": str(root),
            "checkpoints": [c.to_dict() for c in found],
            "latest": None if latest is None else latest.path,
            "damaged": [p.to_dict() for p in unusable if not p.unreadable],
            "unreadable": [p.to_dict() for p in unusable if p.unreadable],
            "leftovers": [{**lo.to_dict(), "gc": v} for lo, v in verdicts],
        }
    )
    rows = [
        [c.name, _s(c.step), _when(c.commit_time), c.world_size, _human(c.total_bytes), _metrics(c.metrics)]
        for c in found
    ]
    ui.table(
        f"{len(found)} committed checkpoint(s) under {root}",
        ["NAME", "STEP", "COMMITTED", "RANKS", "SIZE", "METRICS"],
        rows,
    )
    _show_resume_point(ui, latest, passed_over)
    for p in listed.unlisted:
        ui.line(f"{'UNREADABLE' if p.unreadable else 'DAMAGED'} {p.name}: not listed: {p.problem}")
    if verdicts:
        owner = {True: "alive", False: "dead", None: "unknown"}
        rows = [[Path(lo.path).name, lo.kind, owner[lo.owner_alive], _human(lo.total_bytes), v] for lo, v in verdicts]
        ui.table("Leftovers", ["DIRECTORY", "KIND", "OWNER", "SIZE", "GC"], rows)
    return EXIT_OK


def _show_resume_point(ui: Ui, latest: CheckpointInfo | None, passed_over: list[PassedOver]) -> None:
    """When the newest rows are damaged or unreadable: why, and which row a resume loads. The last row of the
    table is what an operator reads as "latest", and a load refuses a checkpoint whose recorded files are gone or
    resized. (An intact root prints nothing more: its last row is the resume point.)"""
    if not passed_over:
        return
    for p in passed_over:  # a file this user may not read is no damage: the operator must not delete it
        ui.line(f"{'UNREADABLE' if p.unreadable else 'DAMAGED'} {p.name}: not a resume point: {p.problem}")
    if latest is not None:
        ui.line(f"resume point (what latest_checkpoint returns): {latest.name}")
    elif all(p.unreadable for p in passed_over):
        ui.line("no resume point this user can read: every committed one is UNREADABLE (see above: permissions)")
    else:
        ui.line("no intact checkpoint: every committed one is damaged (torch-checkpointing verify names the files)")


def _s(v: Any) -> str:
    return "-" if v is None else str(v)


# ------------------------------------------------------------------------------------------------ inspect


def _sharding(storage: Storage, path: str) -> dict[str, list[dict[str, Any]]]:
    with _open(storage, path, verify=False) as ctx, unknown_types_as_stored():
        metadata = read_distributed_metadata(ctx)
    return _sharding_rows(metadata)


def _sharding_rows(metadata: DistributedMetadata | None) -> dict[str, list[dict[str, Any]]]:
    if metadata is None:
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for key, item in sorted(metadata.metadata.items()):
        rows = []
        for nested, groups in sorted(item.nested_path_to_metadata.items(), key=lambda kv: [str(c) for c in kv[0]]):
            for g in groups:
                d = g.sharding_metadata.to_dict()
                mesh = d.get("mesh_spec", {})
                rows.append(
                    {
                        "tensor": ".".join(str(c) for c in nested),
                        "type": sharding_type(g.sharding_metadata),
                        "global_shape": d.get("global_shape"),
                        "dtype": d.get("dtype"),
                        "mesh_shape": mesh.get("mesh_shape"),
                        "placements": [_placement(p) for p in d.get("placements", [])],
                        "ranks": list(g.ranks),
                    }
                )
        out[key] = rows
    return out


def _placement(p: Mapping[str, Any]) -> str:
    if p.get("type") == "Shard":
        return f"Shard({p['dim']})"
    if p.get("type") == "StridedShard":
        return f"_StridedShard({p['dim']}, sf={p['split_factor']})"
    return str(p.get("type"))


def cmd_inspect(args: argparse.Namespace, ui: Ui, storage: Storage) -> int:
    manifest = committed_manifest(storage, Path(args.checkpoint), operation="command")
    info = _info(storage, args.checkpoint)
    sharding = _sharding(storage, args.checkpoint)
    _still_committed(storage, Path(args.checkpoint), manifest)  # the three reads above describe one commit
    items: dict[str, list[FileRecord]] = {}
    for rec in sorted(manifest.files, key=lambda r: (r.key, r.rank)):
        items.setdefault(rec.key, []).append(rec)
    doc = {
        **info.to_dict(),
        "metadata_file": manifest.metadata_file,
        "items": {
            key: {
                "format": recs[0].format.get("type"),
                "files": [r.to_dict() for r in recs],
                "bytes": sum(r.size for r in recs),
                "layout": _layout_kind(recs, manifest.world_size, key in sharding),
                "sharding": sharding.get(key, []),
            }
            for key, recs in items.items()
        },
    }
    ui.emit_json(doc)
    ui.line(f"Checkpoint {info.path}")
    ui.line(
        f"  step {_s(info.step)}, committed {_when(info.commit_time)}, world size {info.world_size}, "
        f"{_human(info.total_bytes)}, library {info.library_version}"
    )
    ui.line(f"  metrics: {_metrics(info.metrics)}")
    rows = [[k, v["format"], len(v["files"]), _human(v["bytes"]), v["layout"]] for k, v in doc["items"].items()]
    ui.table("Items", ["ITEM", "FORMAT", "FILES", "SIZE", "LAYOUT"], rows)
    files = [
        [r.key, r.rank, r.path, r.format.get("type"), _human(r.size), f"{r.crc32:08x}"]
        for recs in items.values()
        for r in recs
    ]
    ui.table("Files", ["ITEM", "RANK", "PATH", "FORMAT", "SIZE", "CRC32"], files)
    shard_rows = [
        [
            key,
            r["tensor"] or "<item>",
            r["global_shape"],
            r["dtype"],
            r["mesh_shape"],
            ", ".join(r["placements"]),
            r["ranks"],
        ]
        for key, rows in sharding.items()
        for r in rows
    ]
    if shard_rows:
        ui.table("Sharding", ["ITEM", "TENSOR", "GLOBAL SHAPE", "DTYPE", "MESH", "PLACEMENTS", "RANKS"], shard_rows)
    return EXIT_OK


def _layout_kind(recs: list[FileRecord], world_size: int, resharded: bool) -> str:
    if resharded:
        return f"sharded over {world_size} rank(s) (resharder metadata)"
    if len(recs) == 1 and world_size > 1:
        return "one file for every rank"
    return "per-rank files" if world_size > 1 else "single file"


# ------------------------------------------------------------------------------------------------ verify


# What `verify` meets that says nothing about the checkpoint's bytes, so never its FAILED (exit 1, which
# `verify || rm` reads as damage) but the command's error (exit 2), as `ls`, `inspect` and `diff` say it: a save
# that replaced it meanwhile (read again, `_run`), a newer engine's manifest, a store that failed to answer (it
# said FAILED of a store it could not reach at all), and a file this user may not read.
_NOT_DAMAGE = (CheckpointReplacedError, NewerCheckpointError, ObjectStoreError, PermissionError, ForeignManifestError)


@dataclass
class _Check:
    path: str
    ok: bool
    problem: str = ""


def _verify_record(ctx: CheckpointReadContext, rec: FileRecord, advance: Any) -> _Check:
    """Size and CRC32 (and each block's) of one recorded file, opened through the read context (contained,
    regular, listed); a file that cannot be opened so is a failed check naming why, never followed."""
    try:
        checked = ctx.check(rec.path, f"item '{rec.key}' of rank {rec.rank}")
    except _NOT_DAMAGE:
        raise
    except CheckpointError as exc:
        advance(rec.size)
        return _Check(rec.path, False, str(exc))
    running = RunningChecksum(rec.blocks.block_size) if rec.blocks is not None else RunningChecksum()
    for chunk in _chunks(ctx, checked):
        running.update(chunk)
        advance(len(chunk))
    summed = running.result()
    if rec.blocks is not None and combine_blocks(rec.blocks.crc32s, rec.size, rec.blocks.block_size) != rec.crc32:
        return _Check(rec.path, False, "manifest record is inconsistent: its block CRC32s do not combine to its CRC32")
    if rec.blocks is not None:  # every block, so a damaged one is named
        for i, (want, got) in enumerate(zip(rec.blocks.crc32s, summed.blocks.crc32s, strict=True)):
            if want != got:
                start, end = rec.blocks.span(i, rec.size)
                problem = f"crc32 {got:08x} in block {i} (bytes [{start}, {end})), manifest records {want:08x}"
                return _Check(rec.path, False, problem)
    if summed.crc32 != rec.crc32:
        return _Check(rec.path, False, f"crc32 {summed.crc32:08x}, manifest records {rec.crc32:08x}")
    return _Check(rec.path, True)


def _chunks(ctx: CheckpointReadContext, checked: CheckedFile) -> Iterator[bytes]:
    """The bytes of a checked file: from its held descriptor (what was checked is what is read), else the store."""
    if checked.fd is None:
        with ctx.storage.stream_read(ctx.root / checked.rel, ReadArgs(pre_read_full_file=False)) as stream:
            while chunk := stream.read(_CHUNK):
                yield chunk
        return
    offset = 0
    while chunk := os.pread(checked.fd, min(_CHUNK, checked.size - offset), offset):
        offset += len(chunk)
        yield chunk


def cmd_verify(args: argparse.Namespace, ui: Ui, storage: Storage) -> int:
    root = Path(args.checkpoint)
    try:
        committed_manifest(storage, root, operation="command")  # the precise reason a directory is not a checkpoint
        ctx = _open(storage, root, verify=False)
        manifest = ctx.__enter__().manifest
    except _NOT_DAMAGE:
        raise  # it could not check (exit 2): no FAILED, which means damaged
    except (CheckpointError, RuntimeError, FileNotFoundError, NotADirectoryError) as exc:
        raise_if_short_of_resources(exc, root, "the check of its manifest")  # the command's error, no FAILED
        if isinstance(exc, FileNotFoundError):
            _refuse_if_aside(storage, root, exc)
        ui.emit_json(
            {"checkpoint": args.checkpoint, "ok": False, "error": str(exc), "kind": type(exc).__name__, "files": []}
        )
        ui.line(f"FAILED: {exc}")
        return EXIT_NO
    with closing(ctx):  # opened above, once: a second opening pins what a re-save put there since
        assert manifest is not None  # allow_legacy_checkpoints=False: a directory without one raised
        checks, newer = _verify_all(ctx, manifest, ui)
    if newer is not None and all(c.ok for c in checks):
        raise newer  # whole as recorded, in what this engine cannot read: the command's error (exit 2), no FAILED
    total = sum(r.size for r in manifest.files)
    ok = all(c.ok for c in checks)
    ui.emit_json({"checkpoint": args.checkpoint, "ok": ok, "files": [c.__dict__ for c in checks]})
    for c in checks:
        if not c.ok:
            ui.line(f"FAILED {c.path}: {c.problem}")
    ui.line(
        f"{'OK' if ok else 'FAILED'}: {sum(c.ok for c in checks)}/{len(checks)} file(s) match the manifest "
        f"({_human(total)} checked)"
    )
    return EXIT_OK if ok else EXIT_NO


def _refuse_if_aside(storage: Storage, root: Path, missing: FileNotFoundError) -> None:
    """Raise `CheckpointReplacedError` when nothing is at `root` but a copy of it is aside: a replace without an
    atomic exchange is between its two renames (the new copy moves in next), or was killed there (gc moves the
    copy back). Before, `verify` said FAILED (exit 1) of that moment, and `verify || rm -rf` removed the save
    that landed right after."""
    copy = replace_under_way(storage, root)  # loads' and listings' rule: a copy aside long since is a killed replace's
    if copy is not None:
        raise CheckpointReplacedError(
            f"Checkpoint {root} is not at its path, but a copy of it is aside ({copy.name}): a save is "
            f"replacing it (the new copy moves in next), or one was killed between its two renames "
            f"(`torch-checkpointing gc {root.parent}` moves the copy back). Verify it again."
        ) from missing


def _verify_all(
    ctx: CheckpointReadContext, manifest: Manifest, ui: Ui
) -> tuple[list[_Check], NewerCheckpointError | None]:
    """Every file's check, and the first record in a format this engine does not know (a newer engine's): its
    bytes are still checked, so a damaged file is FAILED whatever its format."""
    checks: list[_Check] = []
    newer: list[NewerCheckpointError] = []
    with ui.progress(sum(r.size for r in manifest.files), f"verify {ctx.root.name}") as advance:
        for rec in sorted(manifest.files, key=lambda r: (r.key, r.rank)):
            checks.append(_known_format(ctx, rec, newer) or _verify_record(ctx, rec, advance))
    if manifest.metadata_file:
        checks.append(_verify_metadata(ctx, manifest.metadata_file))
    return checks, (newer[0] if newer else None)


def _known_format(ctx: CheckpointReadContext, rec: FileRecord, newer: list[NewerCheckpointError]) -> _Check | None:
    """A failed check for a file recorded in a format no engine writes (a damaged or crafted record): its bytes
    may match, but the checkpoint does not load, and `verify` said OK. A format a newer engine wrote goes to
    `newer` instead: no damage, and `verify` said FAILED (exit 1) of a healthy checkpoint, which `verify || rm`
    deletes."""
    try:
        rec.serialization_format(ctx.root / MANIFEST_FILE_NAME)
    except NewerCheckpointError as exc:
        newer.append(exc)
    except CheckpointError as exc:
        return _Check(rec.path, False, str(exc))
    return None


def _verify_metadata(ctx: CheckpointReadContext, name: str) -> _Check:
    """Its bytes against the manifest's size and CRC32 (manifests that record them), then that it parses."""
    record = ctx.record(name)
    if record is not None:
        check = _verify_record(ctx, dataclasses.replace(record, path=name), lambda n: None)
        if not check.ok:
            return check
    try:
        with unknown_types_as_stored():  # a user's resharder's class, which this process never imports
            read_distributed_metadata(ctx)
    except _NOT_DAMAGE:
        raise
    except (CheckpointError, ValueError, OSError) as exc:
        raise_if_short_of_resources(exc, ctx.root / name, "the sharding metadata")  # no FAILED: not its bytes
        return _Check(name, False, str(exc))
    return _Check(name, True)


# ------------------------------------------------------------------------------------------------ diff


def _item_leaves(storage: Storage, root: Path, manifest: Manifest, key: str, resharded: bool) -> dict[str, Any]:
    """Every leaf of an item: for a resharded one its consolidated full tensors plus the non-tensor state its
    lowest rank saved (an optimizer's param_groups, which a resharding load restores from there), else each
    rank's file; every file read through a verifying read context (a damaged or crafted file is an error,
    not a difference)."""
    from torch_checkpointing.hf import iter_item_tensors

    recs = sorted((r for r in manifest.files if r.key == key), key=lambda r: r.rank)
    out: dict[str, Any] = {}
    with _open(storage, root, verify=True) as ctx:
        _require_commit(ctx.manifest, manifest, root)
        if resharded:
            state = named_leaves(_decode_checked(ctx, recs[0], key)) if recs else {}
            out.update((name, leaf) for name, leaf in state.items() if not isinstance(leaf, torch.Tensor))
        else:
            for rec in recs:
                out.update(named_leaves(_decode_checked(ctx, rec, key), f"rank{rec.rank}" if len(recs) > 1 else ""))
    if resharded:
        out.update(iter_item_tensors(root, key, storage=storage))
    return out


def _require_commit(now: Manifest | None, read: Manifest, root: Path) -> None:
    """Raise `CheckpointReplacedError` unless `now` (the manifest at `root` now) is the commit `read` was read
    from: a command that reads a checkpoint in several passes (diff: one per item) must not mix two commits of an
    id a running job saves again (it compared one item of the old commit with the others of the new one)."""
    if now is None or now.commit_time != read.commit_time or now.files != read.files:
        raise CheckpointReplacedError(
            f"Checkpoint {root} was replaced by a new save of its id, or deleted, while it was read; read it again."
        )


def _still_committed(storage: Storage, root: Path, read: Manifest) -> None:
    """`_require_commit` for the manifest at `root` now (none when it was deleted meanwhile)."""
    try:
        now = committed_manifest(storage, root, operation="command")
    except (FileNotFoundError, IncompleteCheckpointError):
        now = None
    _require_commit(now, read, root)


def _consolidated(sharding: dict[str, list[dict[str, Any]]], key: str) -> bool:
    """Whether an item's tensors are compared whole across ranks: DTensors are; an item of a user's own resharder
    (its metadata says nothing of tensors) is compared file by file, as one saved without a resharder."""
    return any(row["type"] == DTensorShardingMetadata._type_name for row in sharding.get(key, []))


def _decode_checked(ctx: CheckpointReadContext, rec: FileRecord, key: str) -> Any:
    from torch_checkpointing.encoding import decode

    fmt = rec.serialization_format(ctx.root / MANIFEST_FILE_NAME)
    path = ctx.root / checked_relative_path(rec.path, str(ctx.root))
    value = decode(fmt, ctx.storage_view(f"item '{key}'"), path, key, operation=ctx.operation)
    ctx.wait_verified()
    return value


def _compare(args: argparse.Namespace, key: str, leaf: str, a: Any, b: Any) -> str | None:
    """`compare`, its working memory refused naming the leaf and saying it is no damage (torch's bare
    "DefaultCPUAllocator: can't allocate memory" before)."""
    with resource_shortage_named(f"{args.a} and {args.b}", f"the comparison of item '{key}', leaf '{leaf}'"):
        return compare(a, b)


def cmd_diff(args: argparse.Namespace, ui: Ui, storage: Storage) -> int:
    # B's store is what B names (A's is `storage`): with A's, a `file://` B was read as the local `file:/...`
    # and "no such directory", and a local B beside an `s3://` A was looked up in the bucket.
    other = storage_for(args.b)
    ma = committed_manifest(storage, Path(args.a), operation="command")
    mb = committed_manifest(other, Path(args.b), operation="command")
    sa, sb = _sharding(storage, args.a), _sharding(other, args.b)
    ka, kb = ma.keys(), mb.keys()
    rows: list[dict[str, Any]] = [{"item": k, "leaf": "", "status": "only in A", "detail": ""} for k in sorted(ka - kb)]
    rows += [{"item": k, "leaf": "", "status": "only in B", "detail": ""} for k in sorted(kb - ka)]
    for key in sorted(ka & kb):
        # each side as it was saved: a resharded item compares with one saved whole (one rank, no resharder)
        la = _item_leaves(storage, Path(args.a), ma, key, _consolidated(sa, key))
        lb = _item_leaves(other, Path(args.b), mb, key, _consolidated(sb, key))
        for leaf in sorted(set(la) | set(lb)):
            if leaf not in lb:
                rows.append({"item": key, "leaf": leaf, "status": "only in A", "detail": ""})
            elif leaf not in la:
                rows.append({"item": key, "leaf": leaf, "status": "only in B", "detail": ""})
            elif (detail := _compare(args, key, leaf, la[leaf], lb[leaf])) is not None:
                rows.append({"item": key, "leaf": leaf, "status": "differs", "detail": detail})
    _still_committed(storage, Path(args.a), ma)  # every item of each side from the one commit
    _still_committed(other, Path(args.b), mb)
    same = not rows
    ui.emit_json({"a": args.a, "b": args.b, "identical": same, "differences": rows})
    if same:
        ui.line(f"identical: {args.a} and {args.b} hold the same items and values")
    else:
        ui.table(
            f"{len(rows)} difference(s)",
            ["ITEM", "LEAF", "STATUS", "DETAIL"],
            [[r["item"], r["leaf"] or "-", r["status"], r["detail"]] for r in rows],
        )
    return EXIT_OK if same else EXIT_NO


# ------------------------------------------------------------------------------------------------ gc / prune


def cmd_gc(args: argparse.Namespace, ui: Ui, storage: Storage) -> int:
    require_directory(storage, Path(args.root), _ROOT)
    report = collect_garbage(args.root, storage, dry_run=args.dry_run, unowned_after_s=args.older_than)
    ui.emit_json(
        {
            "root": args.root,
            "dry_run": args.dry_run,
            "removed": [lo.to_dict() for lo in report.removed],
            "kept": [{**lo.to_dict(), "reason": why} for lo, why in report.kept],
            "failed": [{**lo.to_dict(), "reason": why} for lo, why in report.failed],
        }
    )
    verb = "would remove" if args.dry_run else "removed"
    rows = [[Path(lo.path).name, lo.kind, _human(lo.total_bytes), verb] for lo in report.removed]
    rows += [[Path(lo.path).name, lo.kind, _human(lo.total_bytes), f"kept: {why}"] for lo, why in report.kept]
    rows += [[Path(lo.path).name, lo.kind, _human(lo.total_bytes), f"FAILED: {why}"] for lo, why in report.failed]
    if rows:
        ui.table(f"Leftovers under {args.root}", ["DIRECTORY", "KIND", "SIZE", "ACTION"], rows)
    freed = sum(lo.total_bytes for lo in report.removed)
    ui.line(f"{verb} {len(report.removed)} leftover(s), {_human(freed)}")
    return EXIT_NO if report.failed else EXIT_OK


def cmd_prune(args: argparse.Namespace, ui: Ui, storage: Storage) -> int:
    _check_prune_flags(args)
    policy = RetentionPolicy(
        keep_last=args.keep_last,
        keep_every_n_steps=args.keep_every_n_steps,
        keep_best=args.keep_best,
        metric=args.metric,
        mode=args.mode,
    )
    if not policy.active:
        raise ValueError("prune needs at least one of --keep-last, --keep-every-n-steps, --keep-best")
    require_directory(storage, Path(args.root), _ROOT)
    # The text output shows the note itself (below); --json has it in the document, and on stderr as logged.
    report = prune(args.root, policy, storage, dry_run=args.dry_run, log_note=ui.json_mode)
    failed = [{**c.to_dict(), "reason": why} for c, why in report.failed]
    ui.emit_json(
        {
            "root": args.root,
            "dry_run": args.dry_run,
            "deleted": [c.to_dict() for c in report.deleted],
            "failed": failed,
            "metric_not_recorded": report.metric_not_recorded,
            "damaged": [p.to_dict() for p in report.not_listed if not p.unreadable],
            "unreadable": [p.to_dict() for p in report.not_listed if p.unreadable],
            "trash_left": [{"path": path, "reason": why} for path, why in report.trash_left],
        }
    )
    if report.metric_not_recorded is not None:  # on stdout beside the deletions it explains, at either level, once
        ui.line(f"warning: {report.metric_not_recorded}")
    verb = "would delete" if args.dry_run else "deleted"
    ui.line(f"{verb} {len(report.deleted)} checkpoint(s): {', '.join(c.name for c in report.deleted) or '-'}")
    for c, why in report.failed:
        ui.line(f"NOT DELETED {c.name}: {why}")
    for p in report.not_listed:  # as `ls` names them: an unreadable one is no damage
        ui.line(f"{'UNREADABLE' if p.unreadable else 'DAMAGED'} {p.name}: not weighed, left as it is: {p.problem}")
    for path, why in report.trash_left:
        ui.line(f"TRASH LEFT {path}: {why}")
    return EXIT_NO if report.failed or report.trash_left else EXIT_OK


def _check_prune_flags(args: argparse.Namespace) -> None:
    """The policy's own checks, in the flags' words: an operator at a shell has flags, not fields."""
    for flag in ("keep_last", "keep_every_n_steps", "keep_best"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            name = "--" + flag.replace("_", "-")
            raise ConfigError(f"prune {name} must be a whole number >= 1, got {value} (leave it out for no such rule)")
    if args.keep_best is not None and not args.metric:
        raise ConfigError("prune --keep-best needs --metric NAME (a name passed in save(..., metrics={...}))")


# ------------------------------------------------------------------------------------------------ export


def cmd_export(args: argparse.Namespace, ui: Ui, storage: Storage) -> int:
    from torch_checkpointing.hf import export_hf

    dtype = None
    if args.dtype:
        dtype = dtype_from_name(args.dtype)
        if dtype is None:
            raise ValueError(f"--dtype {args.dtype!r} is not a torch dtype (e.g. bfloat16, float16, float32)")
    report = export_hf(
        args.checkpoint,
        args.item,
        args.out,
        max_shard_size=args.max_shard_size,
        dtype=dtype,
        rank=args.rank,
        storage=storage,
        overwrite=args.overwrite,
    )
    ui.emit_json({"checkpoint": args.checkpoint, "item": args.item, "out": args.out, **report.to_dict()})
    ui.line(
        f"exported {report.tensors} tensor(s), {_human(report.total_bytes)}, of {args.checkpoint}::{args.item} "
        f"to {args.out} ({len(report.files) - 1} shard(s) + index)"
    )
    return EXIT_OK


# ------------------------------------------------------------------------------------------------ parser


class UsageError(Exception):
    """Bad arguments, raised instead of argparse's print-and-exit so that `--json` gets its error document."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="torch-checkpointing", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")
    parser.add_argument("--plain", action="store_true", help="plain text even on a terminal")
    # The same flags after the command; SUPPRESS keeps a flag given before the command from being reset.
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document")
    common.add_argument("--plain", action="store_true", default=argparse.SUPPRESS, help="plain text even on a terminal")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ls", parents=[common], help="committed checkpoints and leftovers under ROOT")
    p.add_argument("root", type=_path("root"))
    _older_than(p)
    p.set_defaults(run=cmd_ls)
    p = sub.add_parser("inspect", parents=[common], help="items, files, formats, sizes, sharding, metrics")
    p.add_argument("checkpoint", type=_path("checkpoint path"))
    p.set_defaults(run=cmd_inspect)
    p = sub.add_parser("verify", parents=[common], help="check every file against the manifest (size + crc32)")
    p.add_argument("checkpoint", type=_path("checkpoint path"))
    p.set_defaults(run=cmd_verify)
    p = sub.add_parser("diff", parents=[common], help="which items/tensors differ between two checkpoints")
    p.add_argument("a", type=_path("checkpoint path"))
    p.add_argument("b", type=_path("checkpoint path"))
    p.set_defaults(run=cmd_diff)
    p = sub.add_parser("gc", parents=[common], help="remove what killed saves and deletions left behind")
    p.add_argument("root", type=_path("root"))
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    _older_than(p)
    p.set_defaults(run=cmd_gc)
    p = sub.add_parser("prune", parents=[common], help="apply a retention policy to the checkpoints under ROOT")
    p.add_argument("root", type=_path("root"))
    p.add_argument("--keep-last", type=_count, metavar="N", help="keep the N newest")
    p.add_argument("--keep-every-n-steps", type=_count, metavar="N", help="keep every step that is a multiple of N")
    p.add_argument("--keep-best", type=_count, metavar="N", help="keep the N best by --metric")
    p.add_argument("--metric", help="the metric --keep-best ranks by (a name passed in save(..., metrics={...}))")
    p.add_argument("--mode", choices=["min", "max"], default="min")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(run=cmd_prune)
    p = sub.add_parser("export", parents=[common], help="export an item, e.g. to Hugging Face safetensors")
    p.add_argument("checkpoint", type=_path("checkpoint path"))
    p.add_argument("--item", required=True, help="the item key to export (e.g. model)")
    p.add_argument("--to", choices=["hf"], required=True, help="target layout")
    p.add_argument("out", type=_path("output directory"), help="output directory")
    p.add_argument("--max-shard-size", default="5GB", help="per output file, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--dtype", help="cast floating-point tensors, e.g. bfloat16")
    p.add_argument("--rank", type=_count, help="export one rank's copy of an item saved per rank without a resharder")
    p.add_argument("--overwrite", action="store_true", help="replace the files of an earlier export in OUT")
    p.set_defaults(run=cmd_export)
    return parser


def _path(what: str) -> Callable[[str], str]:
    """An argparse type refusing an empty path (`prune "$ROOT"` with ROOT unset pruned the current directory),
    and expanding a local path's leading `~` as save() does: a shell leaves it alone when quoted or after `=`,
    and `ls '~/run'` said "no such directory" of the root the job saves under. A URL is taken as it is."""

    def check(text: str) -> str:
        try:
            require_path(text, what)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text if url_scheme(text) is not None else os.path.expanduser(text)

    return check


def _count(text: str) -> int:
    """An argparse type for a count or a rank: `int`, but only as typed in ASCII digits (`read_number`)."""
    try:
        return read_number(text, int)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (write it in the digits 0-9)") from None


def _seconds(text: str) -> float:
    """An argparse type for `--older-than`: seconds as a number. `1.5h` or `3d` got Python's bare "could not
    convert string to float", which named neither the unit wanted nor how to write that age."""
    try:
        value = read_number(text, float)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--older-than takes a number of seconds written in the digits 0-9, got {text!r}: e.g. 86400 for a "
            f"day, 5400 for an hour and a half, inf for never"
        ) from None
    try:
        return check_age(value, "--older-than")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _older_than(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--older-than",
        type=_seconds,
        default=DEFAULT_UNOWNED_AGE_S,
        metavar="SECONDS",
        help="temporaries whose owner cannot be checked on this host count as dead once this old (default 1 day)",
    )


def _storage_of(args: argparse.Namespace) -> Storage:
    """The store the command's path names (`s3://bucket/run`: that object store, from the environment)."""
    where = next((getattr(args, name) for name in ("root", "checkpoint", "a") if getattr(args, name, None)), None)
    return storage_for(where) if where is not None else default_storage()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:  # SystemExit(2), as argparse's own error() exits
        raise SystemExit(_usage_error(exc, json_requested(argv))) from None
    ui = Ui(args.json, args.plain)
    try:
        with _stops_raise() as stopping, _warnings_shown():
            code = _run(args, ui, _storage_of(args))
            ui.out.flush()  # a full disk under `> report.txt` fails here, not unseen at the interpreter's exit
            stopping.decided = True
        return code
    except OutputFailed as exc:
        return _report_lost_output(args.command, exc)
    except BrokenPipeError as exc:
        if not _stdout_closed():  # a connection of the store's, not our reader: a failure like any other
            return _report_error(args.command, ui, exc)
        _silence_stdout()  # `| head -1`: the reader has what it wanted
        return EXIT_OK
    except (CheckpointError, RuntimeError, OSError, KeyError, ValueError, ImportError, MemoryError) as exc:
        return _report_error(args.command, ui, exc)  # a MemoryError too: uncaught, it exited 1, which means damaged
    except KeyboardInterrupt:  # Ctrl-C: what was under way has cleaned up on the way out (an export's staging)
        return _report_stop(args.command, ui, signal.SIGINT)
    except Terminated:  # SIGTERM (`timeout`, a scheduler, `kill`): the same clean-up as on Ctrl-C
        return _report_stop(args.command, ui, signal.SIGTERM)


# How many times a command that only reads a checkpoint runs again when a save replaced it meanwhile: a job
# re-saving its `latest` id races a long verify now and then, not five times in a row.
_READ_AGAIN = 5
_READ_AGAIN_PAUSE_S = 0.05
"""Times the try, the pause before each read again: a replace without an atomic exchange leaves its id empty
between two renames, and a read again at once can land in the same gap (0.7 s in all over the 5 tries)."""
_READERS = frozenset({"verify", "inspect", "diff", "export"})


def _run(args: argparse.Namespace, ui: Ui, storage: Storage) -> int:
    """The command; one that reads a checkpoint that a new save of its id replaced (or a deletion removed) while
    it read is run again on what the path holds now. Before, `verify` said FAILED (exit 1, which a script reads
    as damage) of a healthy checkpoint a running job had saved again, and `diff` mixed the two commits. Nothing
    is written before a reader's end, so a run stopped this way has said nothing (an export removes its staging).
    """
    for attempt in range(2, _READ_AGAIN + 1):
        try:
            return int(args.run(args, ui, storage))
        except CheckpointReplacedError as exc:
            if args.command not in _READERS:
                raise
            logger.info("torch-checkpointing %s: %s (reading it again, try %d)", args.command, exc, attempt)
            time.sleep(_READ_AGAIN_PAUSE_S * attempt)  # a replace between its two renames: not at once
    return int(args.run(args, ui, storage))  # the last try: a replace now is the command's error (exit 2)


class Terminated(BaseException):
    """SIGTERM, raised as Ctrl-C's KeyboardInterrupt is (not an Exception: no `except Exception` swallows it)."""


@dataclass
class _Stopping:
    """Whether a Ctrl-C or SIGTERM still stops the command: not once its result is decided and its report out."""

    decided: bool = False


@contextmanager
def _stops_raise() -> Iterator[_Stopping]:
    """SIGTERM raises `Terminated` (Ctrl-C `KeyboardInterrupt`) while a command runs, so that what it was doing
    cleans up on the way out, and neither once the command has decided its result and written its report.

    Before, SIGTERM killed the process outright: an export's staging folder, with the shards written so far, was
    left beside its output. And a stop landing after the report was out turned a finished command into 143 or
    130, with `--json` a second document after the whole first one. Only where the signal has its default action
    (not when a caller handles or ignores it) and on the main thread, which alone may set a handler.
    """
    stopping = _Stopping()
    if threading.current_thread() is not threading.main_thread():
        yield stopping
        return

    def stop(signum: int, _frame: object) -> None:
        if stopping.decided:
            return  # the command is done; the caller's exit code stands (`__main__` ends the process with it)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated

    previous = {
        signum: signal.signal(signum, stop)
        for signum in STOPS
        if signal.getsignal(signum) in (signal.default_int_handler, signal.SIG_DFL)
    }
    try:
        yield stopping
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _ShownHandler(logging.Handler):
    """The engine's WARNINGs on stderr as Python's last-resort handler wrote them (the message alone), with
    names shown as data (`shown`): they name checkpoints and files, which whoever can write into a root names,
    and a name's escape sequence reached the terminal where every line the CLI prints escapes it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            lines = [shown(record.getMessage())]
            if record.exc_info:  # a traceback keeps its lines, each shown as data
                lines += map(shown, logging.Formatter().formatException(record.exc_info).splitlines())
            print(_encodable("\n".join(lines), sys.stderr.encoding or "utf-8"), file=sys.stderr, flush=True)
        except Exception:  # logging's own rule: a failing handler reports, never raises
            self.handleError(record)


@contextmanager
def _warnings_shown() -> Iterator[None]:
    """While a command runs, its WARNINGs go through `_ShownHandler`, where nothing else would print them (no
    handler configured: Python's last resort would). A program that configured logging keeps its own."""
    package = logging.getLogger("torch_checkpointing")
    if package.hasHandlers():
        yield
        return
    handler = _ShownHandler(logging.WARNING)
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)


def _usage_error(exc: UsageError, json_mode: bool) -> int:
    """What argparse prints for bad arguments (usage and the message, on stderr, exit 2), and with --json also
    the error document on stdout that scripts parse: before, they got an empty stdout."""
    if json_mode:
        _emit_error_document(Ui(json_mode=True, plain=True), {"error": str(exc), "kind": "UsageError"})
    exc.parser.print_usage(sys.stderr)
    print(f"{exc.parser.prog}: error: {shown(str(exc))}", file=sys.stderr)
    return EXIT_ERROR


def _report_error(command: str, ui: Ui, exc: Exception) -> int:
    """One line on stderr (and the JSON error document in --json mode); EXIT_ERROR even when stdout is closed."""
    exc = _shortage_named(command, exc)
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    _emit_error_document(ui, {"error": str(message), "kind": type(exc).__name__})
    print(f"torch-checkpointing {command}: error: {shown(str(message))}", file=sys.stderr)
    return EXIT_ERROR


def _shortage_named(command: str, exc: Exception) -> Exception:
    """`exc`, or where it is this process out of descriptors or memory that no step named (listing ROOT with no
    descriptor left was a bare "[Errno 24] Too many open files: 'ROOT'"), the error naming the path and the fix
    and saying that nothing was found damaged (`errors.raise_if_short_of_resources`). A `MemoryError` named by a
    step that could not say whether the checkpoint is damaged (a refused thread: "Out of memory starting thread
    ...") gets that said too: exit 2 means "could not check", and its message now says so."""
    if not isinstance(exc, (OSError, RuntimeError, MemoryError)):
        return exc
    where = exc.filename if isinstance(exc, OSError) and exc.filename else "the checkpoint's files"
    try:
        raise_if_short_of_resources(exc, where, f"`torch-checkpointing {command}`")
    except (MemoryError, OSError) as named:
        return named
    return exc


def _emit_error_document(ui: Ui, doc: dict[str, str]) -> None:
    """The --json error document, where stdout can take it. Where it cannot (a reader gone, a full disk, stdout
    closed) the stderr line says the error alone: before, a closed pipe lost that line too."""
    try:
        ui.emit_json(doc)
        ui.out.flush()
    except (BrokenPipeError, OutputFailed):
        _silence_stdout()


def _report_lost_output(command: str, exc: OutputFailed) -> int:
    """One line on stderr (no JSON document: it would go where the report could not), exit 2. Stdout is then
    pointed at /dev/null, so what is still buffered for it does not fail again at the interpreter's exit."""
    _silence_stdout()
    print(
        f"torch-checkpointing {command}: error: could not write the report to standard output: {shown(str(exc))}. "
        "What the command did is not undone (a prune's or gc's deletions stand; `torch-checkpointing ls ROOT` shows "
        "what is there now): send stdout where it can be written (a file on a disk with space, a pipe, /dev/null)",
        file=sys.stderr,
    )
    return EXIT_ERROR


def _report_stop(command: str, ui: Ui, signum: signal.Signals) -> int:
    """A command stopped by a signal: one line on stderr, and with --json the error document on stdout (before,
    stdout was left empty and a script's json.load of it failed instead of reading why)."""
    stop = STOPS[signum]
    _emit_error_document(ui, {"error": f"torch-checkpointing {command}: {stop.said}", "kind": stop.kind})
    print(f"torch-checkpointing {command}: {stop.said}", file=sys.stderr)
    return stop.code


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _silence_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for the closed pipe would otherwise fail again when
    the interpreter flushes it at exit ("Exception ignored ... BrokenPipeError")."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a capture: nothing of ours flushes it at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
