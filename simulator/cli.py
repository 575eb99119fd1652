"""Command line: parse `--world 4→8` style arguments into a :class:`Plan` and run it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from math import prod
from pathlib import Path
from types import ModuleType

from simulator.held_signals import exit_on_a_late_stop, signals_held
from simulator.plan import DEFAULT_SCENARIOS, SCENARIOS, Plan

_ARROWS = re.compile(r"\s*(?:→|->|:)\s*")
# Every rank is a trainer process plus its checkpoint writer, each importing torch, on this one machine.
MAX_RANKS = 64


def _positive(text: str, what: str, full: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{what} {full!r}: {text!r} is not a positive whole number")
    return int(text)


def _launchable(ranks: int, what: str, full: str) -> int:
    if ranks > MAX_RANKS:
        raise argparse.ArgumentTypeError(
            f"{what} {full!r}: {ranks} ranks is more than this one-machine simulator launches (at most "
            f"{MAX_RANKS}: each rank is a process with its own writer); for planning at thousands of ranks, "
            "run the benchmarks' scale section (python -m benchmarks --sections scale), which launches nothing"
        )
    return ranks


def _redirect_hint(save: str, flag: str = "--world", cwd: Path | None = None) -> str:
    """Why `--world 8->3` arrived as `8-`: unquoted, bash read `>3` as "write stdout to a file named 3".

    Bash creates that file before the command starts, so a fresh all-digit file in the working directory tells
    us the load size the user meant; otherwise we show a placeholder.
    """
    here = cwd or Path.cwd()
    now = time.time()
    fresh = (
        sorted(
            (p for p in here.iterdir() if p.name.isdigit() and p.is_file() and now - p.stat().st_mtime < 60),
            key=lambda p: p.stat().st_mtime,
        )
        if here.is_dir()
        else []
    )
    load = fresh[-1].name if fresh else "LOAD"
    created = f" (bash also created a file named {load!r} here: remove it)" if fresh else ""
    return (
        f"{flag} {save}-: an unquoted '->' is a shell redirect{created}; "
        f"quote the argument: '{save}->{load}' (or write {save}:{load})"
    )


def parse_world(text: str) -> tuple[int, int]:
    """`4→8`, `4->8`, `4:8` → (4, 8); a single `N` → (N, N)."""
    stripped = text.strip()
    if stripped.endswith("-") and stripped[:-1].strip().isdigit():
        raise argparse.ArgumentTypeError(_redirect_hint(stripped[:-1].strip()))
    parts = _ARROWS.split(text.strip())
    if len(parts) == 1:
        n = _launchable(_positive(parts[0], "--world", text), "--world", text)
        return n, n
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(
            f"--world {text!r}: expected SAVE→LOAD (also SAVE->LOAD or SAVE:LOAD) or a single N, e.g. 4→8"
        )
    save, load = (_launchable(_positive(p, "--world", text), "--world", text) for p in parts)
    return save, load


def _parse_mesh_shape(text: str, full: str) -> tuple[int, ...]:
    dims = text.lower().split("x")
    return tuple(_positive(d, "--mesh", full) for d in dims)


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`2x2→2x4` → ((2, 2), (2, 4)); a single shape is used on both sides."""
    if text.strip().endswith("-"):
        raise argparse.ArgumentTypeError(_redirect_hint(text.strip()[:-1].strip(), "--mesh"))
    parts = _ARROWS.split(text.strip())
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected SHAPE→SHAPE such as 2x2→2x4")
    meshes = [_parse_mesh_shape(p, text) for p in parts]
    if len(meshes) == 1:
        meshes.append(meshes[0])
    if len(meshes[0]) != len(meshes[1]) or len(meshes[0]) > 2:
        raise argparse.ArgumentTypeError(
            f"--mesh {text!r}: both sides need the same number of dimensions (1 or 2), e.g. 2x2→2x4"
        )
    for mesh in meshes:
        _launchable(prod(mesh), "--mesh", text)
    return meshes[0], meshes[1]


def parse_scenarios(values: Sequence[str] | None) -> tuple[str, ...]:
    if not values:
        return DEFAULT_SCENARIOS
    chosen: list[str] = []
    for value in values:
        for name in filter(None, (v.strip() for v in value.split(","))):
            if name == "all":
                return tuple(SCENARIOS)
            if name not in SCENARIOS:
                raise argparse.ArgumentTypeError(f"--scenario {name!r}: unknown; choose from {', '.join(SCENARIOS)}")
            if name not in chosen:
                chosen.append(name)
    return tuple(chosen)


def build_parser() -> argparse.ArgumentParser:
    scenario_help = "\n".join(f"  {name}: {text}" for name, text in SCENARIOS.items())
    parser = argparse.ArgumentParser(
        prog="python -m simulator",
        description=(
            "Launch real multi-rank jobs on this machine (gloo over 127.0.0.1, CPU DTensors) and check that "
            "a checkpointing backend keeps the design document's promises about {rank} layouts, async "
            "races and resharding across world sizes."
        ),
        epilog=f"scenarios:\n{scenario_help}\n\nexit code 0 only if every scenario passed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--world",
        default=None,
        help="SAVE→LOAD world sizes: 4→8, '4->8' (quoted: > is a shell redirect), 4:8, or N (default 4→8)",
    )
    parser.add_argument("--mesh", default=None, help="2-D device meshes SAVE→LOAD, e.g. 2x2→2x4 (implies --world)")
    parser.add_argument(
        "--scenario",
        action="append",
        metavar="NAME",
        help=f"run only these ({', '.join(SCENARIOS)}; repeat or comma-separate)",
    )
    parser.add_argument(
        "--backend", default="torch_checkpointing", help="module implementing the API (default torch_checkpointing)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for every generated tensor (default 0)")
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        metavar="DIR",
        help=(
            "write checkpoints under DIR and leave them there (with --storage-url: DIR gets the results and the "
            "checkpoints stay in the store)"
        ),
    )
    parser.add_argument(
        "--storage-url",
        default=None,
        metavar="URL",
        help=(
            "write checkpoints to this fsspec URL through the backend's FsspecStorageConfig, e.g. "
            "s3://bucket/prefix or file:///abs/dir; each run uses a fresh sub-prefix, deleted afterwards unless "
            "--keep. S3 endpoint and credentials come from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY), which every rank inherits"
        ),
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="also write a machine-readable report to PATH"
    )
    parser.add_argument(
        "--timeout", type=float, default=150.0, help="seconds each multi-rank launch may take (default 150)"
    )
    parser.add_argument(
        "--write-delay", type=float, default=0.25, help="seconds the slowed storage sleeps per write in async-race"
    )
    return parser


def plan_from_args(args: argparse.Namespace, root: str) -> Plan:
    """Turn parsed arguments into a validated plan; raises ArgumentTypeError with the flag named."""
    if args.mesh:
        save_mesh, load_mesh = parse_mesh(args.mesh)
        worlds = prod(save_mesh), prod(load_mesh)
        if args.world and parse_world(args.world) != worlds:
            raise argparse.ArgumentTypeError(
                f"--world {args.world} disagrees with --mesh {args.mesh} ({worlds[0]}→{worlds[1]} ranks); drop one"
            )
    else:
        worlds = parse_world(args.world or "4→8")
        save_mesh, load_mesh = (worlds[0],), (worlds[1],)
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise argparse.ArgumentTypeError(f"--timeout {args.timeout}: must be a positive, finite number of seconds")
    if not math.isfinite(args.write_delay) or args.write_delay < 0:
        raise argparse.ArgumentTypeError(
            f"--write-delay {args.write_delay}: must be zero or a positive, finite number of seconds"
        )
    storage_url = parse_storage_url(getattr(args, "storage_url", None))
    return Plan(
        backend=args.backend,
        seed=args.seed,
        root=root,
        save_world=worlds[0],
        load_world=worlds[1],
        save_mesh=save_mesh,
        load_mesh=load_mesh,
        scenarios=parse_scenarios(args.scenario),
        write_delay_s=args.write_delay,
        storage_url=run_prefix(storage_url) if storage_url else "",
    )


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


def parse_storage_url(text: str | None) -> str:
    """`s3://bucket/prefix` or `file:///abs/dir` as given (no trailing slash); "" when not given."""
    if text is None:
        return ""
    match = _URL.match(text.strip())
    if match is None or not match.group(2).strip("/"):
        raise argparse.ArgumentTypeError(
            f"--storage-url {text!r}: expected an fsspec URL with a location, e.g. s3://bucket/prefix or "
            "file:///abs/dir (without --storage-url checkpoints go to a local temporary directory)"
        )
    if match.group(1).lower() == "file" and not match.group(2).startswith("/"):
        raise argparse.ArgumentTypeError(
            f"--storage-url {text!r}: a file:// URL needs an absolute path: file:///abs/dir"
        )
    if match.group(1).lower() == "memory":
        raise argparse.ArgumentTypeError(
            f"--storage-url {text!r}: memory:// lives in one process, but every rank is its own process; "
            "use s3://... (or file:///abs/dir)"
        )
    return text.strip().rstrip("/")


def run_prefix(url: str) -> str:
    """A fresh prefix under `url` for one run: checkpoint ids cannot be overwritten on an object store."""
    import uuid

    return f"{url}/simulator-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before anything is launched, a run whose results could not be written at the end."""
    keep: Path | None = args.keep
    if keep is not None and keep.exists() and not keep.is_dir():
        raise argparse.ArgumentTypeError(f"--keep {str(keep)!r}: exists and is not a directory; name a directory")
    if keep is not None:
        _check_creatable(keep)
    report: Path | None = args.json
    if report is not None:
        parent = report.parent if str(report.parent) else Path(".")
        if report.is_dir():
            raise argparse.ArgumentTypeError(f"--json {str(report)!r}: is a directory; name a file to write")
        if not parent.is_dir() or not _can_create_in(parent):
            raise argparse.ArgumentTypeError(
                f"--json {str(report)!r}: {str(parent)!r} is not a writable directory; create it or name another path"
            )
        why = _unwritable_file(report)
        if why is not None:
            raise argparse.ArgumentTypeError(f"--json {str(report)!r}: exists and cannot be written ({why})")


def _unwritable_file(path: Path) -> str | None:
    """Why an existing `path` cannot be opened for writing (None if it can, or is not there): found by opening
    it, without truncating it or waiting on a FIFO. Its folder's probe passed a file set immutable or read-only,
    and the report's write failed after the whole run."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    return None


def _check_creatable(keep: Path) -> None:
    """--keep DIR (or the nearest folder above it that exists) must be writable: otherwise every rank fails."""
    existing = keep.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not _can_create_in(existing):
        raise argparse.ArgumentTypeError(
            f"--keep {str(keep)!r}: {str(existing)!r} is not a writable directory (read-only or no permission); "
            "name a directory you can write to, or leave --keep out for a temporary one"
        )


def _can_create_in(folder: Path) -> bool:
    """Whether this process can create an entry in `folder`, found by creating (and removing) one.

    `os.access` answers yes to root for any folder, also where nothing can be created (/proc, a read-only
    mount): such a --keep failed with a traceback, such a --json after every scenario had run.
    """
    try:
        probe = tempfile.mkdtemp(prefix=".simulator-probe-", dir=folder)
    except OSError:
        return False
    os.rmdir(probe)
    return True


def check_backend(name: str) -> None:
    """A backend that is not importable fails here, not as every scenario failing on every rank."""
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        found = None
        reason = f" ({type(exc).__name__}: {exc})"
    else:
        reason = ""
    if found is None:
        raise argparse.ArgumentTypeError(
            f"--backend {name!r}: no importable module of that name{reason}; install the package that "
            "implements the API, or leave --backend out for torch_checkpointing"
        )


# Signals that end a run as SIGTERM does (the terminal closed, Ctrl-\\), where their handler is the default one:
# left to it, the simulator died at once and its ranks ran on. One the shell ignores (`nohup`) stays ignored.
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the simulator; Ctrl-C (or SIGTERM, SIGHUP, SIGQUIT) ends it with one line on stderr and the shell's
    128+signal code.

    The ranks are stopped and the run directory removed by the `finally` blocks on the way out; a traceback
    (torch's elastic launcher turns SIGINT into its own SignalException) would only hide that line. The
    caller's signal handlers are as they were once it returns (`run` is the process entry point).
    """
    return _guarded(argv, late_stop=False)


def run(argv: Sequence[str] | None = None) -> int:
    """`main` as the process's entry point (`python -m simulator`): once the verdict is out, a stopping signal
    ends the process with the verdict's exit code (`exit_on_a_late_stop`), through the interpreter's exit.
    Not for a process that goes on: its later Ctrl-C would end it at once with this run's code."""
    return _guarded(argv, late_stop=True)


def _guarded(argv: Sequence[str] | None, *, late_stop: bool) -> int:
    on_main = threading.current_thread() is threading.main_thread()
    ending = [s for s in ENDING_SIGNALS if on_main and signal.getsignal(s) is signal.SIG_DFL]
    for signum in ending:
        signal.signal(signum, _raise_terminated)
    try:
        return _main(argv, late_stop=late_stop)
    except BaseException as exc:
        code = _interrupt_signal(exc)
        if code is None:
            raise
        name = "Ctrl-C" if code == signal.SIGINT else signal.Signals(code).name
        print(f"simulator: interrupted ({name}); ranks stopped, nothing left running", file=sys.stderr)
        return 128 + code
    finally:
        for sig in ending:
            if signal.getsignal(sig) is _raise_terminated:  # not once the verdict's exit code took it over
                signal.signal(sig, signal.SIG_DFL)


def _interrupt_signal(exc: BaseException) -> int | None:
    """The signal number behind an interruption, or None for any other exception."""
    if isinstance(exc, KeyboardInterrupt):
        return int(signal.SIGINT)
    if isinstance(exc, Terminated):
        return exc.signum
    sigval = getattr(exc, "sigval", None)  # torch.distributed.elastic's SignalException, raised on SIGINT/SIGTERM
    if type(exc).__name__ == "SignalException" and isinstance(sigval, int):
        return int(sigval)
    return None


class Terminated(BaseException):
    """One of `ENDING_SIGNALS` (torch's elastic launcher no longer sets a handler: the ranks are spawned off the
    main thread), raised as Ctrl-C's KeyboardInterrupt is, so that the `finally` blocks stop the ranks and remove
    the run directory."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = int(signum)


def _raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def _import_holding_signals(module: str) -> ModuleType:
    """`module` imported (deferred: --help must not import torch) with a Ctrl-C or SIGTERM during the import held
    until it is done, then delivered to the handler it would have run.

    Importing torch runs seconds of C++ that a Python exception cannot cross: a KeyboardInterrupt landing there
    was swallowed (the run went on as if no key was pressed), turned into `ImportError: cannot load module more
    than once per process` (torch had tried numpy and cleared the error) or aborted the process from C++.

    torch_checkpointing's entry point (`__main__`) holds its import of the CLI the same way, and reports the
    signal instead of raising it. It stays a copy: the simulator uses only a backend's public API (the house
    plan), which has no such helper, and the engine does not import the simulator.
    """
    with signals_held() as held:
        imported = importlib.import_module(module)
    held.deliver()  # runs the handler now restored: KeyboardInterrupt, or Terminated
    return imported


def _main(argv: Sequence[str] | None, *, late_stop: bool) -> int:
    run_plan = _import_holding_signals("simulator.run").run_plan

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_outputs(args)
        check_backend(args.backend)
        plan = plan_from_args(args, root="")
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    keep: Path | None = args.keep
    if keep is not None:
        try:
            keep.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--keep {str(keep)!r}: cannot be created ({exc}); name a directory you can write to")
        root = str(keep.resolve())
    else:
        root = tempfile.mkdtemp(prefix="simulator-")
    plan = dataclasses.replace(plan, root=root)
    try:
        report = run_plan(plan, timeout=args.timeout, out=sys.stdout, keep=keep is not None)
        if args.json is not None:
            args.json.write_text(report.to_json())
    except BaseException:
        if keep is None:
            _remove_run_directory(root)
        raise
    if keep is not None:
        print(f"checkpoints kept under {plan.checkpoints_at}")
    code = 0 if report.passed else 1
    if late_stop:  # the report is out: a stop no longer changes the code
        exit_on_a_late_stop(code, over=(_raise_terminated,))
    if keep is None:
        with signals_held() as held:  # a stop now waits for the removal, then ends the run (`late_stop`: with `code`)
            _remove_run_directory(root)
        held.deliver()
    return code


def _remove_run_directory(root: str) -> None:
    import shutil

    def report(path: str, exc: BaseException) -> None:
        print(f"warning: could not remove {path} ({exc}); delete {root} by hand", file=sys.stderr)

    if sys.version_info >= (3, 12):
        shutil.rmtree(root, onexc=lambda _f, path, exc: report(path, exc))
    else:
        shutil.rmtree(root, onerror=lambda _f, path, info: report(path, info[1]))
