"""Fault machinery for the durability profile: kill saves at chosen instants, fill the disk, corrupt and craft files.

All of it lives in the suite, none in the backend: the backend is driven through its public API
from real processes, real signals and real resource limits. Subprocesses run this module
(``python -m conformance.faults <command> <json>``) and print one JSON line as their result.

* ``kill-series``: a zygote that imports torch and the backend once, then forks one saving child per
  instant (each in its own session) and SIGKILLs the child and every process it started at that instant.
* ``fsize``: saves under ``RLIMIT_FSIZE`` (Python ignores SIGXFSZ, so writes fail with EFBIG), then
  lifts the limit and saves again.
* ``overwrite-loop`` / ``load-loop``: one process saves two payloads in turn to one id, another loads it.
* ``load-many``: loads checkpoints in threads, reporting a load still blocked after a bound (FIFO clause).

A save over a committed id is never wrapped in a blanket ``except``: whether the backend replaced the id,
refused (and with what error) or was killed with the save in flight is returned, so a backend that refuses
to replace a checkpoint is reported as *not measured* on those clauses instead of holding them by construction.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from conformance import backend
from conformance.helpers import WRITE_TIMEOUT_S, Where, location, read_bytes, save, storage_config, write_bytes

SUBPROCESS_TIMEOUT_S = 180.0
_W = TypeVar("_W", bound=Where)  # a location made on disk stays the kind it was
# The payloads: every item in a different format, values that tell OLD and NEW apart everywhere.
ITEMS = ("model", "extra", "misc", "st")


def layouts() -> dict[str, Any]:
    """ItemSpecs putting the payload's items in three formats (the document's names only)."""
    from conformance.helpers import layout, spec

    return {
        "model": spec(),
        "extra": spec(),
        "misc": spec(layout=layout("misc.json", "JsonSerialization")),
        "st": spec(layout=layout("st.safetensors", "SafetensorsSerialization")),
    }


def payload(version: int, numel: int = 1 << 16) -> dict[str, Any]:
    """A payload whose every value encodes ``version``; distinct per item so swaps show up too."""
    base = torch.arange(numel, dtype=torch.float32)
    return {
        "model": {"w": base + 1000.0 * version, "b": torch.full((7,), float(version))},
        "extra": {"v": base * (version + 2)},
        "misc": {"step": 1000 + version, "name": f"v{version}"},
        "st": {"x": base - version},
    }


def template(numel: int = 1 << 16) -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(numel), "b": torch.zeros(7)},
        "extra": {"v": torch.zeros(numel)},
        "misc": {"step": -1, "name": ""},
        "st": {"x": torch.zeros(numel)},
    }


def config(mode: str = "sync", timeout_s: int | None = None) -> Any:
    """CheckpointManager.Config for the profile: the suite's storage, the given save mode and wait timeout.

    Buffered local storage, or the store under ``--storage-url`` for the clauses that are judged there.
    """
    manager_cls = backend.name("", "CheckpointManager")
    saver = backend.name("config", "SyncCheckpointSaverConfig" if mode == "sync" else "AsyncCheckpointSaverConfig")
    save_cfg = saver() if timeout_s is None else saver(wait_timeout_secs=timeout_s)
    return manager_cls.Config(items=layouts(), save=save_cfg, storage_config=storage_config())


def manager(mode: str = "sync", timeout_s: int | None = None) -> Any:
    return backend.name("", "CheckpointManager")(config(mode, timeout_s))


def same(a: Any, b: Any) -> bool:
    """Exact equality of nested payloads (tensors bit for bit, dtype included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def classify(path: Where | str, versions: Mapping[str, int]) -> str:
    """Load ``path`` with a default-config manager: the name of the version it returned, 'raised', or 'WRONG'."""
    m = manager()
    try:
        try:
            got = m.load(str(path), into=template())
        except Exception:
            return "raised"
        for label, version in versions.items():
            if same({k: got[k] for k in ITEMS}, payload(version)):
                return label
        return "WRONG"
    finally:
        with contextlib.suppress(Exception):
            m.close()


# ------------------------------------------------------------------ processes
def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc), so a child that left our session is killed too."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group/session and every descendant."""
    victims = descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in [pid, *victims]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def run_json(command: str, args: Mapping[str, Any], timeout: float = SUBPROCESS_TIMEOUT_S) -> dict[str, Any]:
    """Run ``python -m conformance.faults command`` in a new session; its last stdout line is JSON.

    On timeout the whole session is killed, and ``{"timeout": True}`` is returned.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "conformance.faults", command, json.dumps(dict(args))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=str(Path(__file__).resolve().parent.parent),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        return {"timeout": True}
    finally:
        kill_tree(proc.pid)  # nothing it started outlives it
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"faults {command} exited {proc.returncode}:\n{err[-3000:]}")
    result = json.loads(lines[-1])
    if not isinstance(result, dict):
        raise RuntimeError(f"faults {command} printed {lines[-1][:300]!r}, not a JSON object")
    return result


def _fork_session(fn: Callable[[], None]) -> int:
    """Fork a child in a new session that runs ``fn`` and exits (0 on success, 1 on an exception)."""
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.setsid()
            fn()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


# What a saving child tells the killing process through its pipe.
_READY, _REPLACED, _REFUSED = b"r", b"d", b"e"


def _save_child(case: Where, mode: str, signal_w: int) -> Callable[[], None]:
    """Warm up, then save NEW over the committed id ``case/ck``; report ready, then replaced or refused."""

    def run() -> None:
        m = manager(mode)
        try:
            save(m, case / f"warm-{os.getpid()}", payload(9, numel=16))
            os.write(signal_w, _READY)
            try:
                save(m, case / "ck", payload(2))
            except Exception as exc:  # reported to the killing process, which judges it
                os.write(signal_w, _REFUSED + _error(exc).encode())
                return
            os.write(signal_w, _REPLACED)
        finally:
            m.close()

    return run


def _error(exc: BaseException, limit: int = 500) -> str:
    return f"{type(exc).__name__}: {exc}"[:limit]


def _read_to_eof(fd: int, bound_s: float = SUBPROCESS_TIMEOUT_S) -> bytes:
    """Everything left in the pipe once every writer closed it (bounded: a stray holder must not hang us)."""
    out, deadline = b"", time.monotonic() + bound_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            break
        out += chunk
    return out


def _overwrite_outcome(message: bytes, killed: bool) -> dict[str, Any]:
    """What became of the save over the committed id: replaced, refused (with the error), in flight or died."""
    if message.startswith(_REPLACED):
        return {"overwrite": "replaced"}
    if message.startswith(_REFUSED):
        return {"overwrite": "refused", "error": message[1:].decode(errors="replace")}
    return {"overwrite": "in flight" if killed else "died"}


def _timed_save(case: Where, mode: str, kill_after: float | None) -> dict[str, Any]:
    """Fork a child saving over ``case/ck``; ``kill_after`` seconds after it is warm, kill it and its descendants.

    Without a kill, ``elapsed`` is how long the save over the id took (the instants are fractions of it).
    """
    r, w = os.pipe()
    pid = _fork_session(_save_child(case, mode, w))
    os.close(w)
    try:
        if os.read(r, 1) != _READY:  # the writer (if any) is up: the instant is measured from the save() call
            os.waitpid(pid, 0)
            raise RuntimeError(f"the saving child for {case} died before its save over the committed id")
        start = time.monotonic()
        if kill_after is None:
            message = os.read(r, 1)  # the save over the id returned or raised (or the child died)
            elapsed = time.monotonic() - start
        else:
            time.sleep(kill_after)
            kill_tree(pid)
            message, elapsed = b"", kill_after
        _, status = os.waitpid(pid, 0)
        message += _read_to_eof(r)
    finally:
        os.close(r)
    return {"elapsed": elapsed, "status": status, **_overwrite_outcome(message, kill_after is not None)}


def _mkdir(where: _W) -> _W:
    """A local case directory is made (a backend need not make an id's parents); a store has no directories."""
    if isinstance(where, Path):
        where.mkdir(parents=True, exist_ok=True)
    return where


def _committed_case(case: Where) -> Where:
    """``case/earlier`` (version 0) and ``case/ck`` (version 1) committed by a child process."""
    pid = _fork_session(lambda: _commit_old(_mkdir(case)))
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise RuntimeError(f"committing the old checkpoint failed in {case}")
    return case


def _instants(full_s: float, n: int) -> list[float]:
    """``n`` instants spread over a save of ``full_s`` seconds, and one after it."""
    return [full_s * (i + 0.5) / n for i in range(n)] + [full_s * 1.5]


def kill_series(args: dict[str, Any]) -> dict[str, Any]:
    """Per case: commit OLD (the id and an earlier id), then save NEW over the id and kill it at an instant.

    The instants are fractions of an uninterrupted calibration run of the same save. When that run's save
    over the committed id did not replace it (refused, or the child died), no case is run: there would be no
    overwrite in flight to kill. Each case records whether its save over the id was still in flight when killed.
    """
    root, mode, n = location(args["root"]), args["mode"], int(args["instants"])
    calibration = _timed_save(_committed_case(root / "calibration"), mode, None)
    if calibration["overwrite"] != "replaced":
        return {"calibration": calibration, "delays": [], "at_kill": []}
    delays = _instants(calibration["elapsed"], n)
    at_kill = [_timed_save(_committed_case(root / f"case{i}"), mode, d)["overwrite"] for i, d in enumerate(delays)]
    return {"calibration": calibration, "delays": delays, "at_kill": at_kill}


def _launch_child(control: Path, case: Where) -> Callable[[], None]:
    def run() -> None:
        from conformance import durability_programs
        from simulator.launcher import launch

        launch(durability_programs.save_for_kill, 2, args=(str(control), str(case)), timeout=SUBPROCESS_TIMEOUT_S)

    return run


def _wait_file(path: Path, pid: int, bound_s: float = SUBPROCESS_TIMEOUT_S) -> bool:
    """Wait until ``path`` exists; False if the child ``pid`` ended first or the bound passed."""
    deadline = time.monotonic() + bound_s
    while not path.exists():
        if os.waitpid(pid, os.WNOHANG) != (0, 0) or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def ranks_overwrite(control: Path, world: int = 2) -> dict[str, Any]:
    """What the ranks' save over the committed id became, from their stamps in ``control``."""
    refused = {r: (control / f"refused-{r}").read_text() for r in range(world) if (control / f"refused-{r}").exists()}
    if refused:
        return {"overwrite": "refused", "error": "; ".join(f"rank {r}: {e}" for r, e in sorted(refused.items()))}
    if all((control / f"replaced-{r}").exists() for r in range(world)):
        return {"overwrite": "replaced"}
    return {"overwrite": "in flight"}


def kill_series_ranks(args: dict[str, Any]) -> dict[str, Any]:
    """2 ranks through simulator.launcher: kill the launcher, both ranks and their children at each instant.

    The ranks keep their checkpoints under ``root`` (any storage) and their time stamps under ``control``
    (the local disk this process polls). As :func:`kill_series`, nothing is killed unless the uninterrupted
    calibration run replaced the committed id.
    """
    root, control, n = location(args["root"]), Path(args["control"]), int(args["instants"])
    stamps = _mkdir(control / "calibration")
    pid = _fork_session(_launch_child(stamps, _mkdir(root / "calibration")))
    _, status = os.waitpid(pid, 0)
    if status != 0 or not (stamps / "done").exists():
        raise RuntimeError("the uninterrupted 2-rank save failed")
    calibration = ranks_overwrite(stamps)
    if calibration["overwrite"] != "replaced":
        return {"calibration": calibration, "delays": [], "at_kill": []}
    replaced = max(float((stamps / f"replaced-{r}").read_text()) for r in range(2))
    delays = _instants(replaced - float((stamps / "ready").read_text()), n)
    at_kill = []
    for i, delay in enumerate(delays):
        stamps = _mkdir(control / f"case{i}")
        pid = _fork_session(_launch_child(stamps, _mkdir(root / f"case{i}")))
        started = _wait_file(stamps / "ready", pid)
        if started:
            time.sleep(max(0.0, float((stamps / "ready").read_text()) + delay - time.time()))
        kill_tree(pid)
        with contextlib.suppress(ChildProcessError):  # already reaped by _wait_file
            os.waitpid(pid, 0)
        at_kill.append(ranks_overwrite(stamps)["overwrite"] if started else "not started")
    return {"calibration": calibration, "delays": delays, "at_kill": at_kill}


def _commit_old(case: Where) -> None:
    m = manager("sync")
    try:
        save(m, case / "earlier", payload(0))
        save(m, case / "ck", payload(1))
    finally:
        m.close()


def overwrite_probe(m: Any, probe: Where) -> dict[str, Any]:
    """Whether ``m`` replaces a committed checkpoint: commit OLD (1) at ``probe``, save NEW (2) over it, load it.

    The premise of every clause that saves over a committed id under a fault: a backend that refuses to
    replace a checkpoint (``overwrite`` 'refused', with the ``error`` it raised) holds such a clause by
    construction, and one whose save returns without replacing the id (``after`` not 'new') fails silently.
    """
    save(m, probe, payload(1))
    error = save_error(m, probe, payload(2))
    outcome = {"overwrite": "refused", "error": error} if error else {"overwrite": "replaced"}
    return {**outcome, "after": classify(probe, {"old": 1, "new": 2})}


def fsize(args: dict[str, Any]) -> dict[str, Any]:
    """For each limit, in its own directory: :func:`fsize_case`. One process for all, to keep the profile fast.

    ``overwrite`` is :func:`overwrite_probe` without a limit: the premise of the part saved over a committed id.
    """
    root, mode = location(args["root"]), args["mode"]
    m = manager(mode)
    probe: dict[str, Any] = {}
    try:
        probe = overwrite_probe(m, _mkdir(root / "probe") / "ck")
    finally:
        try:
            m.close()
        except Exception:
            # A backend whose close() raises the refused save once more (it waits on its last write) has already
            # answered the probe; anything else is the backend failing, and is raised.
            if probe.get("overwrite") != "refused":
                raise
    limits = {str(limit): fsize_case(_mkdir(root / f"limit{limit}"), int(limit), mode) for limit in args["limits"]}
    return {"overwrite": probe, "limits": limits}


def fsize_case(root: Where, limit: int, mode: str) -> dict[str, Any]:
    """Save NEW over a committed OLD under a file-size limit; then lift it and save again with a new manager.

    Each error is returned for the test to judge: the saves under the limit must raise, the next one must not.
    """
    m = manager("sync")
    try:
        save(m, root / "ck", payload(1))
    finally:
        m.close()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    m = manager(mode)
    try:
        error = save_error(m, root / "fresh", payload(2))
        over_error = save_error(m, root / "ck", payload(2))
    finally:
        with contextlib.suppress(Exception):  # closing a manager whose write failed may repeat the failure
            m.close()
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    m = manager(mode)
    try:
        after = save_error(m, root / "next", payload(3))
    finally:
        with contextlib.suppress(Exception):
            m.close()
    return {"error": error, "over_error": over_error, "next_error": after}


def save_error(m: Any, path: Where, value: Mapping[str, Any], timeout: float = WRITE_TIMEOUT_S) -> str | None:
    """The error the save raised (from save() or its Future), or None when it returned normally."""
    try:
        save(m, path, value, timeout=timeout)
    except Exception as exc:
        return _error(exc)
    return None


def overwrite_loop(args: dict[str, Any]) -> dict[str, Any]:
    """Save versions 2 and 1 in turn over a committed id until the stop file appears (or a deadline).

    After the first save (version 2 over the committed 1) the id is loaded here: ``first`` says whether that
    save replaced it, so a backend that returns without replacing does not hold the clause by construction.
    """
    path, stop, deadline = location(args["path"]), Path(args["stop"]), time.monotonic() + float(args["max_s"])
    m = manager(args.get("mode", "sync"))
    saves, refused, first = 0, None, None
    try:
        while not stop.exists() and time.monotonic() < deadline:
            try:
                save(m, path, payload(2 - saves % 2))
            except Exception as exc:
                refused = _error(exc, 300)
                break
            saves += 1
            if saves == 1:  # the loading side starts its window now, not while this process imports torch
                first = classify(path, {"old": 1, "new": 2})
                stop.with_name("saving").touch()
    finally:
        stop.with_name("saving").touch()  # also when refused: the loading side must not wait for nothing
        m.close()
    return {"saves": saves, "refused": refused, "first": first}


def load_loop(args: dict[str, Any]) -> dict[str, Any]:
    """Once the overwriting process has saved, load the id for ``window_s`` seconds; count each outcome.

    In its own process: a backend that maps files a concurrent writer truncates dies of SIGBUS here,
    which the test reports, instead of taking pytest down.
    """
    path, started = Path(args["path"]), Path(args["started"])
    bound = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not started.exists() and time.monotonic() < bound:
        time.sleep(0.05)
    seen: dict[str, int] = {}
    deadline = time.monotonic() + float(args["window_s"])
    while time.monotonic() < deadline:
        got = classify(path, {"one": 1, "two": 2})
        seen[got] = seen.get(got, 0) + 1
    return {"seen": seen}


def load_many(args: dict[str, Any]) -> dict[str, Any]:
    """Load each path in its own thread; a load still running after ``timeout_s`` is reported as 'hung'.

    Threads, not processes: one interpreter start for every case. A load blocked on a FIFO cannot
    be interrupted, so the process ends with ``os._exit`` once the result is printed.
    """
    results: dict[str, str] = {}

    def one(key: str, path: str) -> None:
        results[key] = classify(path, {"old": 1, "new": 2})

    threads = {k: threading.Thread(target=one, args=(k, p), daemon=True) for k, p in args["paths"].items()}
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + float(args["timeout_s"])
    for t in threads.values():
        t.join(max(0.0, deadline - time.monotonic()))
    return {"results": {k: results.get(k, "hung") for k in threads}}


COMMANDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "kill-series": kill_series,
    "kill-series-ranks": kill_series_ranks,
    "fsize": fsize,
    "overwrite-loop": overwrite_loop,
    "load-loop": load_loop,
    "load-many": load_many,
}


# ------------------------------------------------------------------ files
def flip_byte(path: Where, where: float = 0.5) -> None:
    """Flip every bit of one byte at ``where`` (fraction of the file)."""
    data = bytearray(read_bytes(path))
    i = min(len(data) - 1, int(len(data) * where))
    data[i] ^= 0xFF
    write_bytes(path, bytes(data))


def truncate(path: Where) -> None:
    """Keep the first half of the file (an object is rewritten whole: a store has no truncate)."""
    data = read_bytes(path)
    write_bytes(path, data[: len(data) // 2])


def replace_with_symlink(where: Where, target: Path) -> None:
    path = _local(where, "a symbolic link")
    path.unlink()
    path.symlink_to(target)


def replace_with_fifo(where: Where) -> None:
    path = _local(where, "a FIFO")
    path.unlink()
    os.mkfifo(path)


def _local(where: Where, what: str) -> Path:
    """``where`` as a local path: ``what`` is a filesystem's special file, which an object store cannot hold."""
    if not isinstance(where, Path):
        raise TypeError(f"{what} cannot replace {where}: it is on an object store, not a local filesystem")
    return where


if __name__ == "__main__":
    if backend.prefer_installed_requested():  # resolve the backend as the pytest process does
        backend.prefer_installed_backend(Path(__file__).resolve().parent.parent)
    config("sync")  # import the backend once, before any fork
    result = COMMANDS[sys.argv[1]](json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)
    os._exit(0)  # do not wait for threads stuck in a FIFO open
