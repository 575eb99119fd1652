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
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from conformance import backend
from conformance.helpers import Where, read_bytes, save, storage_config, write_bytes

SUBPROCESS_TIMEOUT_S = 180.0
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
    return a == b


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
    return json.loads(lines[-1])


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


def _save_child(path: str, version: int, mode: str, ready_w: int | None) -> Callable[[], None]:
    def run() -> None:
        m = manager(mode)
        try:
            save(m, Path(path).parent / f"warm-{os.getpid()}", payload(9, numel=16))
            if ready_w is not None:
                os.write(ready_w, b"x")
            # Over the committed id (a backend may refuse to replace a checkpoint: then the fresh id is the save).
            with contextlib.suppress(Exception):
                save(m, path, payload(version))
            save(m, Path(path).with_name("fresh"), payload(version))
        finally:
            m.close()

    return run


def _timed_save(path: str, version: int, mode: str, kill_after: float | None) -> dict[str, Any]:
    """Fork a saving child; ``kill_after`` seconds after it is warm, kill it and its descendants."""
    r, w = os.pipe()
    pid = _fork_session(_save_child(path, version, mode, w))
    os.close(w)
    os.read(r, 1)  # the writer (if any) is up: the instant is measured from the save() call
    os.close(r)
    start = time.monotonic()
    if kill_after is not None:
        time.sleep(kill_after)
        kill_tree(pid)
    _, status = os.waitpid(pid, 0)
    return {"elapsed": time.monotonic() - start, "status": status}


def kill_series(args: dict[str, Any]) -> dict[str, Any]:
    """Per case dir: commit OLD (the id and an earlier id), then save NEW over the id and kill it at an instant."""
    root, mode, n = Path(args["root"]), args["mode"], int(args["instants"])
    calib = root / "calibration"
    calib.mkdir(parents=True, exist_ok=True)
    full = _timed_save(str(calib / "ck"), 2, mode, None)["elapsed"]
    delays = [full * (i + 0.5) / n for i in range(n)] + [full * 1.5]
    for i, delay in enumerate(delays):
        case = root / f"case{i}"
        case.mkdir()
        pid = _fork_session(lambda case=case: _commit_old(case))
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"committing the old checkpoint failed in {case}")
        _timed_save(str(case / "ck"), 2, mode, delay)
    return {"full_save_s": full, "delays": delays}


def _launch_child(case: Path) -> Callable[[], None]:
    def run() -> None:
        from conformance import durability_programs
        from simulator.launcher import launch

        launch(durability_programs.save_for_kill, 2, args=(str(case),), timeout=SUBPROCESS_TIMEOUT_S)

    return run


def _wait_file(path: Path, pid: int, bound_s: float = SUBPROCESS_TIMEOUT_S) -> bool:
    """Wait until ``path`` exists; False if the child ``pid`` ended first or the bound passed."""
    deadline = time.monotonic() + bound_s
    while not path.exists():
        if os.waitpid(pid, os.WNOHANG) != (0, 0) or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def kill_series_ranks(args: dict[str, Any]) -> dict[str, Any]:
    """2 ranks through simulator.launcher: kill the launcher, both ranks and their children at each instant."""
    root, n = Path(args["root"]), int(args["instants"])
    calib = root / "calibration"
    calib.mkdir(parents=True)
    pid = _fork_session(_launch_child(calib))
    _, status = os.waitpid(pid, 0)
    if status != 0 or not (calib / "done").exists():
        raise RuntimeError("the uninterrupted 2-rank save failed")
    full = float((calib / "done").read_text()) - float((calib / "ready").read_text())
    delays = [full * (i + 0.5) / n for i in range(n)] + [full * 1.5]
    for i, delay in enumerate(delays):
        case = root / f"case{i}"
        case.mkdir()
        pid = _fork_session(_launch_child(case))
        if _wait_file(case / "ready", pid):
            time.sleep(max(0.0, float((case / "ready").read_text()) + delay - time.time()))
        kill_tree(pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return {"full_save_s": full, "delays": delays}


def _commit_old(case: Path) -> None:
    m = manager("sync")
    try:
        save(m, case / "earlier", payload(0))
        save(m, case / "ck", payload(1))
    finally:
        m.close()


def fsize(args: dict[str, Any]) -> dict[str, Any]:
    """For each limit, in its own directory: :func:`fsize_case`. One process for all, to keep the profile fast."""
    root, mode = Path(args["root"]), args["mode"]
    out = {}
    for limit in args["limits"]:
        case = root / f"limit{limit}"
        case.mkdir()
        out[str(limit)] = fsize_case(case, int(limit), mode)
    return out


def fsize_case(root: Path, limit: int, mode: str) -> dict[str, Any]:
    """Save NEW over a committed OLD under a file-size limit; then lift it and save again with a new manager."""
    m = manager("sync")
    try:
        save(m, root / "ck", payload(1))
    finally:
        m.close()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    error = None
    m = manager(mode)
    try:
        try:  # a fresh id first: a backend that refuses to replace a checkpoint still has to write this one
            save(m, root / "fresh", payload(2))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
        with contextlib.suppress(Exception):  # over the committed id: raising is expected, damage is not
            save(m, root / "ck", payload(2))
    finally:
        with contextlib.suppress(Exception):
            m.close()
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    after = None
    m = manager(mode)
    try:
        save(m, root / "next", payload(3))
    except Exception as exc:
        after = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        with contextlib.suppress(Exception):
            m.close()
    return {"error": error, "next_error": after}


def overwrite_loop(args: dict[str, Any]) -> dict[str, Any]:
    """Save versions 1 and 2 in turn to one id until the stop file appears (or a deadline)."""
    path, stop, deadline = Path(args["path"]), Path(args["stop"]), time.monotonic() + float(args["max_s"])
    m = manager(args.get("mode", "sync"))
    saves, refused = 0, None
    try:
        while not stop.exists() and time.monotonic() < deadline:
            try:
                save(m, path, payload(1 + saves % 2))
            except Exception as exc:
                refused = f"{type(exc).__name__}: {exc}"[:300]
                break
            saves += 1
            if saves == 1:  # the loading side starts its window now, not while this process imports torch
                stop.with_name("saving").touch()
    finally:
        stop.with_name("saving").touch()  # also when refused: the loading side must not wait for nothing
        m.close()
    return {"saves": saves, "refused": refused}


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


def replace_with_symlink(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


if __name__ == "__main__":
    if backend.prefer_installed_requested():  # resolve the backend as the pytest process does
        backend.prefer_installed_backend(Path(__file__).resolve().parent.parent)
    config("sync")  # import the backend once, before any fork
    result = COMMANDS[sys.argv[1]](json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)
    os._exit(0)  # do not wait for threads stuck in a FIFO open
