"""Probes the tests share to look at the process from outside the engine's API.

* `connections_to(port)`: the TCP connections made to a port on this machine lately (open, or closed less than
  a minute ago), read from /proc/net/tcp: how many clients a store host was connected by, without asking either.
* `memory_maps()`: this process's memory mappings, read from /proc/self/maps, to see which files (staging
  slabs, memory-mapped checkpoint files) are mapped right now, without asking the engine.
* `run_fresh()`, `fresh_process()`, `fresh_json()`, `modules_after()`: run code in a new interpreter, where
  nothing of the package is imported yet, to see what an import loads or starts; this test process has long
  since imported it all.
* `fresh_fork_statuses()`: fork children from a new interpreter and read their exit statuses. Never fork this
  test process: its child would inherit every earlier test's threads and garbage (a forked child of a pytest
  worker died of SIGSEGV under CI's coverage, 1 run in many, in code the test did not call).
* `sigint_storm()`, `stormed_child()`: SIGINT to a child process about every millisecond, real signals for the
  interrupt tests; the child prints "ready", runs until the stop file exists, then prints "RESULT <json>";
  `armed_sigint()`, in the child, makes each signal an interrupt only where the test wants one.
* `interrupted_at()`: a KeyboardInterrupt raised at one chosen point (a line, a call's entry or a return) of the
  Python frames of chosen files, on the calling thread: every point a signal handler could raise at, in turn.
* `published_store()`: the TCPStore of ranks spawned by a test, on a port rank 0's kernel picks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = [
    "REPO",
    "MappedRegion",
    "armed_sigint",
    "connections_to",
    "fresh_fork_statuses",
    "fresh_json",
    "fresh_process",
    "interrupted_at",
    "memory_maps",
    "modules_after",
    "run_fresh",
    "run_script",
    "sigint_storm",
    "stormed_child",
]

REPO = Path(__file__).resolve().parents[1]
FRESH_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class MappedRegion:
    """One line of /proc/self/maps: an address range and what backs it (`path` is "" for anonymous memory)."""

    start: int
    end: int
    perms: str
    inode: str
    path: str


def _region(line: str) -> MappedRegion:
    # address perms offset dev inode [path]; the path may hold spaces (and ends " (deleted)" once unlinked)
    fields = line.split(maxsplit=5)
    start, end = (int(x, 16) for x in fields[0].split("-"))
    path = fields[5].strip() if len(fields) > 5 else ""
    return MappedRegion(start, end, fields[1], fields[4], path)


def memory_maps() -> list[MappedRegion]:
    """Every mapping of this process, in address order, read now."""
    return [_region(line) for line in Path("/proc/self/maps").read_text(errors="surrogateescape").splitlines() if line]


_LISTEN = "0A"


def connections_to(port: int) -> set[int]:
    """The client ports of every TCP connection to `port` on this machine that is open, or closed less than a
    minute ago (its client's side is left in TIME_WAIT that long): one per connection made. Not one per client
    where a client connects meanwhile: a TCPStore client retries its whole connect (a new connection) when its
    first exchange fails on a busy machine; count the clients held open (`open_clients_of`) there.

    Each line of /proc/net/tcp is one side of a connection: `local rem st ...` with addresses as `HEX:PORT`. A
    connection on loopback has both sides listed while open; once its client closed, only the client's side.
    """
    clients: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, remote, state = line.split()[1:4]
                local_port, remote_port = (int(a.rsplit(":", 1)[1], 16) for a in (local, remote))
                if remote_port == port:
                    clients.add(local_port)
                elif local_port == port and state != _LISTEN:
                    clients.add(remote_port)
    return clients


_ESTABLISHED = "01"


def open_clients_of(port: int) -> set[int]:
    """The client ports of the TCP connections to `port` on this machine that their client still holds open
    (`connections_to` also counts those closed less than a minute ago)."""
    clients: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, remote, state = line.split()[1:4]
                if int(remote.rsplit(":", 1)[1], 16) == port and state == _ESTABLISHED:
                    clients.add(int(local.rsplit(":", 1)[1], 16))
    return clients


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until the kernel shows every thread of it stopped: kill() only queues the signal,
    and a process busy on another CPU (a loaded machine) can still answer a request sent right after it. Every
    thread, not the process's first: a group stop reaches the other threads only once one thread has taken the
    signal, and until then a thread of its own (a TCPStore's server, a writer's reader) answers as before."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} did not stop within {timeout_s}s of SIGSTOP")
        time.sleep(0.001)


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in ("T", "t") for state in states)


def run_fresh(code: str, *args: str, timeout: float = FRESH_TIMEOUT_S) -> str:
    """Run `code` (dedented; `args` are its sys.argv[1:]) in a new interpreter from the checkout's root and
    return what it printed. A probe that exits non-zero fails the test with its output, not a bare status."""
    return fresh_process(code, *args, timeout=timeout).stdout


def fresh_process(code: str, *args: str, timeout: float = FRESH_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """`run_fresh`, for a probe whose stderr (its logging, say) is read too: what it printed on each."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"the probe exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def run_script(
    path: Path, source: str, *args: str, timeout: float = FRESH_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Write `source` (dedented) to `path` and run it as a script (`args`: its sys.argv[1:]) from the checkout's
    root, the checkout on its path (a script imports `tests.memory_storage` by name, and its `__main__` guard
    keeps spawned children from running it again). A script that exits non-zero fails the test with its output."""
    path.write_text(textwrap.dedent(source))
    done = subprocess.run(
        [sys.executable, str(path), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{path.name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def fresh_json(code: str, *args: str, timeout: float = FRESH_TIMEOUT_S) -> Any:
    """The last line `code` printed in a new interpreter, parsed as JSON (earlier lines are free for logs)."""
    lines = run_fresh(code, *args, timeout=timeout).strip().splitlines()
    assert lines, "the probe printed nothing"
    return json.loads(lines[-1])


def modules_after(code: str, *, timeout: float = FRESH_TIMEOUT_S) -> set[str]:
    """The names in sys.modules once a new interpreter has run `code`."""
    report = "import json as _json, sys as _sys\nprint(_json.dumps(sorted(_sys.modules)))\n"
    return set(fresh_json(textwrap.dedent(code) + "\n" + report, timeout=timeout))


_FORK_CHILDREN = """
import json as _json, os as _os, signal as _signal, traceback as _traceback
_statuses = []
for _expression in _json.loads(_CHILDREN):
    _pid = _os.fork()
    if _pid == 0:
        _code = 2
        try:
            _signal.alarm(int(_CHILD_TIMEOUT_S))  # a child that hangs dies of SIGALRM, and its status says so
            _code = 0 if eval(_expression) else 1
        except BaseException:
            _traceback.print_exc()
        finally:
            _os._exit(_code)
    _statuses.append(_os.waitstatus_to_exitcode(_os.waitpid(_pid, 0)[1]))
print(_json.dumps(_statuses))
"""


def fresh_fork_statuses(setup: str, children: list[str], *, child_timeout_s: float = 60.0) -> list[int]:
    """In a new interpreter: run `setup` (dedented), then for each expression of `children` in turn fork a child
    that evaluates it and exits 0 if it is true, 1 if false, 2 if it raised (the traceback goes to stderr); each
    child's exit status as `os.waitstatus_to_exitcode` gives it (-9: killed by SIGKILL, -14: it ran past
    `child_timeout_s`)."""
    code = (
        textwrap.dedent(setup)
        + f"\n_CHILDREN = {json.dumps(json.dumps(children))}\n_CHILD_TIMEOUT_S = {child_timeout_s!r}\n"
        + _FORK_CHILDREN
    )
    statuses = fresh_json(code, timeout=FRESH_TIMEOUT_S + child_timeout_s * len(children))
    assert isinstance(statuses, list) and len(statuses) == len(children), statuses
    return [int(s) for s in statuses]


def sigint_storm(proc: subprocess.Popen[str], seconds: float, pause_s: float = 0.001) -> int:
    """SIGINT to `proc` every one to three `pause_s` for `seconds` (an uneven rhythm lands in more places), or
    until it exits; returns how many were sent."""
    sent, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
        sent += 1
        time.sleep(pause_s * (1 + sent % 3))
    return sent


def stormed_child(code: str, stop: Path, *args: str, seconds: float, pause_s: float = 0.001) -> tuple[Any, int]:
    """Run `code` (argv: stop file, then `args`) under a SIGINT storm of `seconds`; its RESULT and the count sent.
    The child is killed if it has not ended 120 s after the storm (a hang fails here, bounded)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(stop), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
        sent = sigint_storm(proc, seconds, pause_s)
        stop.touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result; stderr:\n{err[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :]), sent


def armed_sigint(counts: dict[str, Any]) -> list[bool]:
    """In a stormed child: SIGINT raises KeyboardInterrupt (as Python's own Ctrl-C does) only while `armed[0]` is
    set, and disarms it, so that every interrupt lands inside the calls under test and none in the loop's own
    bookkeeping; the others are counted as `counts["ignored"]`. Returns `armed`."""
    armed = [False]

    def on_sigint(signum: int, frame: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        counts["ignored"] = counts.get("ignored", 0) + 1

    signal.signal(signal.SIGINT, on_sigint)
    return armed


@dataclass
class InterruptPoint:
    """Where `interrupted_at` raised (`where`: "file:line event function"), or None: the block ran past every
    point, so `point` was beyond the last one and a sweep is complete."""

    point: int
    where: str | None = None


class interrupted_at:  # used as a function: `with interrupted_at(k, files) as at:`
    """`with interrupted_at(point, files) as at:` interrupts the block at the `point`-th (0-based) place on this
    thread where CPython would run a signal handler inside the frames whose code lives in a file ending with one
    of `files`.

    What runs there is the handler of `signum` (SIGINT unless told) installed at that moment, as for a real
    signal: Python's SIGINT handler raises KeyboardInterrupt, one that defers the signal records it (a
    non-Python handler counts as Python's SIGINT handler). CPython runs a handler at a function's entry
    and just after a call into C returns, before the caller stores its result (also at loop back-edges, not
    modelled here). A profile function sees both (its "call" and "c_return" events), and a raise there lands
    exactly where the handler's KeyboardInterrupt would: a `with lock:` acquires and releases in C with no such
    point between the acquire and the block (the way Python makes it safe), while `x = lock.acquire(); try:`
    has one before the `try`. Sweeping `point` from 0 until `where` stays None visits every such place the
    block reaches. CPython unsets a profile function that raises; the one before the block is put back after
    it. A class, not a generator context manager: its own `__exit__` would be a contextlib frame, which a sweep
    may be told to interrupt.
    """

    def __init__(self, point: int, files: tuple[str, ...], signum: int = signal.SIGINT) -> None:
        self._at = InterruptPoint(point)
        self._files = files
        self._signum = signum
        self._seen = 0
        self._previous: Any = None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        at = self._at
        if at.where is not None or event not in ("call", "c_return"):
            return
        if not frame.f_code.co_filename.endswith(self._files):
            return
        if self._seen == at.point:
            code = frame.f_code
            callee = f" of {getattr(arg, '__qualname__', arg)}" if event == "c_return" else ""
            at.where = f"{Path(code.co_filename).name}:{frame.f_lineno} {event}{callee} in {code.co_name}"
            handler = signal.getsignal(self._signum)  # what a real signal would run here, a deferring one too
            if not callable(handler):
                raise KeyboardInterrupt(f"interrupted at {at.where}")
            handler(self._signum, frame)
        self._seen += 1

    def __enter__(self) -> InterruptPoint:
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self._at

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._previous)


@contextlib.contextmanager
def gloo_world1(store: Any) -> Iterator[None]:
    """A world-1 gloo group on `store`, destroyed after. torch's init_process_group also replaces sys.excepthook
    (to name the rank in a traceback) and destroy_process_group leaves it: every test that made a group wrapped
    the hook once more, for the rest of the worker's tests. Put back here."""
    import torch.distributed as dist

    excepthook = sys.excepthook
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


@contextlib.contextmanager
def children_import_from(repo: Path) -> Iterator[None]:
    """`repo` first on PYTHONPATH for the processes started inside the block (a spawned rank reads it as it
    starts), and the variable as it was after. Set for good, it grew by one entry per launch and reached every
    later child of the pytest worker, whatever tests ran after."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(repo), before or ""])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def published_store(rank: int, world: int, out_dir: str, timeout: timedelta) -> Any:
    """A TCPStore for a spawned `rank` of `world`: rank 0 hosts it on a port the kernel picks and publishes the
    port in `out_dir`, the others wait for it there (at most `timeout`). A port picked free in the parent could
    be taken by another process before rank 0, seconds later, binds it."""
    import torch.distributed as dist

    published = Path(out_dir, "port")
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timeout)
        Path(out_dir, "port.tmp").write_text(str(store.port))
        os.replace(Path(out_dir, "port.tmp"), published)
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while not published.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return dist.TCPStore("127.0.0.1", int(published.read_text()), world, is_master=False, timeout=timeout)
