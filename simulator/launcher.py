"""Run a function on N local ranks with torch.distributed's own launcher machinery.

This is the process layer ``torchrun`` sits on
(``torch.distributed.elastic.multiprocessing.start_processes``): one spawned
process per rank, stdout/stderr redirected to per-rank log files, return values
carried back through the elastic return queues. We add the three things a test
harness needs and ``torchrun`` does not give us directly:

* a rendezvous that cannot collide with another run: the parent process hosts
  the ``TCPStore`` on a port the OS picks (port 0), so there is no
  "pick a free port, hope nobody takes it" race between concurrent runs;
* a hard wall-clock bound: a hung rank never hangs the caller, every rank is
  killed and :class:`LaunchError` names the rank and its last log lines;
* a progress channel (:func:`report_progress`) so a long multi-rank run can
  show a person what phase it is in while it runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # a re-export torch does not mark public
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

from simulator.held_signals import StepTimedOut, off_the_main_thread, signals_held

__all__ = ["LaunchError", "RankFailure", "launch", "report_progress"]

_PROGRESS_ENV = "SIMULATOR_PROGRESS_FILE"
_STORE_PORT_ENV = "SIMULATOR_STORE_PORT"
_PG_TIMEOUT_ENV = "SIMULATOR_PG_TIMEOUT"
_TAIL_LINES = 20
_POLL_PERIOD_S = 0.05
_DONE_KEY = "simulator_fn_done"
_STARTED_KEY = "simulator_fn_started"
_HAND_OVER_FILE = "hand_over.pickle"
_ERROR_KEY = "simulator_fn_error"
# After a rank fails only because a peer went away, wait this long for the peer's own exception to arrive.
_ROOT_CAUSE_GRACE_S = 5.0
# After a rank failed on its own, wait this long for the ranks it takes down to record their errors.
_CONSEQUENCE_GRACE_S = 2.0
# How long the ranks of a spawn given up on are killed as it starts them, waiting for it to end.
_SPAWN_STOP_S = 2.0
# What a collective raises when another rank died under it: a consequence, not a cause.
_COMM_ERROR = re.compile(
    r"gloo|nccl|connection (reset|closed|refused)|broken pipe|socket|peer|DistBackendError|DistNetworkError",
    re.IGNORECASE,
)
_NOISY_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


@dataclass
class RankFailure:
    """Why one rank did not return: kept structured so callers can name the rank."""

    rank: int
    cause: str
    log_tail: list[str] = field(default_factory=list)
    traceback_tail: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"rank {self.rank}: {self.cause}"]
        if self.traceback_tail:
            lines.append(f"  traceback (last {len(self.traceback_tail)} lines) of rank {self.rank}:")
            lines.extend(f"    | {line}" for line in self.traceback_tail)
        if self.log_tail:
            lines.append(f"  last {len(self.log_tail)} log lines of rank {self.rank}:")
            lines.extend(f"    | {line}" for line in self.log_tail)
        return "\n".join(lines)


class LaunchError(RuntimeError):
    """Message names each failed rank, its cause (exit code, exception, or
    'timed out after Ns') and its last log lines."""

    def __init__(self, what: str, failures: list[RankFailure]) -> None:
        self.failures = failures
        body = "\n".join(f.describe() for f in failures)
        super().__init__(f"{what}\n{body}")


def report_progress(message: str) -> None:
    """Send one progress line to the launching process (no-op outside :func:`launch`).

    Lines are appended to a file the parent tails while it waits; appends of a
    single short line are atomic enough on POSIX for several ranks to share it.
    """
    path = os.environ.get(_PROGRESS_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(message.replace("\n", " ") + "\n")


def _loopback_ifname() -> str | None:
    """Name of the loopback interface, so gloo never tries a routable address."""
    for _, name in socket.if_nameindex():
        if name in ("lo", "lo0"):
            return name
    return None


def _hand_over(log_root: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    """Write what every rank runs (`fn`, `args`) to a file of the launch, for `_rank_entry` to read: the path.

    Handed over in the spawn itself, it went down a pipe to each rank, once per rank for every rank, and the spawn
    blocked until that rank read it all. A rank that never did (its interpreter's startup hung) held the spawn,
    and once the spawn was given up and the rank killed, the spawn's thread stayed blocked for good
    (multiprocessing holds the pipe's other end until the hand-over is done). The spawn now hands each rank a
    path and returns at once, and a rank stuck at startup is one the launch's timeout names."""
    path = os.path.join(log_root, _HAND_OVER_FILE)
    with open(path, "wb") as fh:
        pickle.dump((fn, args), fh, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def _rank_entry(hand_over: str) -> Any:
    """Runs inside each spawned rank: join the process group, run the launch's function, leave cleanly."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    pg_timeout = timedelta(seconds=float(os.environ[_PG_TIMEOUT_ENV]))
    store = TCPStore(
        "127.0.0.1",
        int(os.environ[_STORE_PORT_ENV]),
        world_size,
        is_master=False,
        timeout=pg_timeout,
    )
    store.set(f"{_STARTED_KEY}/{rank}", "1")
    try:
        # Everything after joining the store records what it raised: the group's setup and the final barrier
        # fail too when a peer raised and dropped its connections (init_process_group can return on one rank
        # while another is still in gloo's connectFullMesh), and unrecorded they read as failures of their own.
        try:
            with open(hand_over, "rb") as fh:
                fn, args = pickle.load(fh)
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=pg_timeout,
            )
            result = fn(*args)
            store.set(f"{_DONE_KEY}/{rank}", "1")
            if dist.is_initialized():  # fn may have replaced the group with its own and destroyed it (torchrun)
                dist.barrier()
        except BaseException as exc:
            _record_error(store, rank, exc)
            raise
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _is_comm_error(exc: BaseException) -> bool:
    """A collective broken by another rank's death (gloo/NCCL I/O error), rather than a failure of its own."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return bool(_COMM_ERROR.search(f"{type(exc).__name__}: {exc}"))


def _record_error(store: TCPStore, rank: int, exc: BaseException) -> None:
    """Tell the parent, before this process exits, what this rank raised and when.

    The parent can only see which process exited first, and a rank that dies takes its peers' collectives
    down with it: the exit order often blames an innocent rank. The time and kind recorded here let the
    parent put the rank that failed on its own first. It returns only once the store holds the record, so
    the parent, which reads the records after it has seen a rank exit, always finds that rank's record.
    """
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    record = {
        "time": time.time(),
        "error": f"{type(exc).__name__}: {first}" if first else type(exc).__name__,
        "comm": _is_comm_error(exc),
        "traceback": [ln for ln in traceback.format_exc().splitlines() if ln.strip()][-8:],
    }
    key = f"{_ERROR_KEY}/{rank}"
    with contextlib.suppress(Exception):  # the parent may be gone; the exit code still tells it something failed
        store.set(key, json.dumps(record))
        # set() only sends the record: it returns before the store has taken it in, so this process could exit
        # first, and the parent would report the bare exit code. The store answers one connection's requests in
        # order, so once it answers this check the record is there for the parent to read.
        store.check([key])


def _tail(path: str | None, n: int = _TAIL_LINES) -> list[str]:
    if not path or not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().splitlines()
    return lines[-n:]


def _rank_log_tail(stdouts: Mapping[int, str], stderrs: Mapping[int, str], rank: int) -> list[str]:
    return (_tail(stdouts.get(rank)) + _tail(stderrs.get(rank)))[-_TAIL_LINES:]


def _message_text(message: Any) -> str:
    if isinstance(message, dict):
        return str(message.get("message", ""))
    return message if isinstance(message, str) else ""


def _failure_cause(exitcode: int, message: Any) -> str:
    text = _message_text(message)
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
        cause = f"killed by {sig}"
    else:
        cause = f"exited with code {exitcode}"
    last = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if last and not last[-1].startswith("To enable traceback"):
        cause += f": {last[-1]}"
    return cause


def _traceback_tail(message: Any, n: int = 8) -> list[str]:
    """The last frames of the rank's Python traceback, as recorded by the elastic error file."""
    stack = ""
    if isinstance(message, dict):
        stack = str(message.get("extraInfo", {}).get("py_callstack", ""))
    lines = [line for line in stack.splitlines() if line.strip()]
    return lines[-n:]


def _finished_ranks(store: TCPStore, world_size: int, key: str = _DONE_KEY) -> set[int]:
    return {r for r in range(world_size) if store.check([f"{key}/{r}"])}


@contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    """The elastic agent logs every failure with a full traceback; we report it ourselves."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _child_pids() -> set[int]:
    """This process's children that multiprocessing spawned to run a function (ranks; not its resource tracker,
    which serves the whole process), as /proc lists them (none where there is no /proc)."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").glob("[0-9]*/stat") if Path("/proc/self/stat").exists() else []:
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The fields after the command's closing parenthesis: state, then the parent's pid.
            if int(entry.read_text().rpartition(")")[2].split()[1]) != me:
                continue
            if b"spawn_main" in (entry.parent / "cmdline").read_bytes():
                found.add(int(entry.parent.name))
    return found


def _stop_spawn(spawn: threading.Thread, before: set[int]) -> list[int]:
    """Kill the ranks a spawn given up on has started, until it ends or `_SPAWN_STOP_S` passed (a slow rank's
    hand-over may finish meanwhile, and the spawn start the next). The pids killed. A spawn blocked handing
    itself to a rank stays blocked once that rank is killed (multiprocessing keeps the rank's end of the pipe open
    until the hand-over is done) on its daemon thread, and starts no other rank."""
    killed: set[int] = set()
    deadline = time.monotonic() + _SPAWN_STOP_S
    while True:
        killed.update(_kill_children_since(before | killed))
        if not spawn.is_alive() or time.monotonic() > deadline:
            break
        spawn.join(_POLL_PERIOD_S)
    killed.update(_kill_children_since(before | killed))  # one started right before the spawn ended
    return sorted(killed)


def _kill_children_since(before: set[int]) -> list[int]:
    """SIGKILL the children this process made since `before` was listed (the ranks of a spawn given up on)."""
    killed = sorted(_child_pids() - before)
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return killed


def _drain_progress(path: Path, offset: int, sink: Callable[[str], None] | None) -> int:
    """Forward complete new lines of the progress file; return the new byte offset."""
    if sink is None:
        return offset
    with open(path, "rb") as fh:
        fh.seek(offset)
        chunk = fh.read()
    end = chunk.rfind(b"\n")
    if end < 0:
        return offset
    for line in chunk[: end + 1].decode("utf-8", errors="replace").splitlines():
        sink(line)
    return offset + end + 1


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
    name: str = "simulator",
) -> list[Any]:
    """Run fn(*args) on `world_size` local processes with torch.distributed initialised as gloo on
    127.0.0.1 (free port picked at run time; MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK set),
    return the per-rank return values in rank order. `fn` must be a module-level importable function,
    `args` and its return value picklable (`args` by plain pickle, through a file: tensors go by value).
    Any crashed rank or the timeout kills every rank and raises LaunchError.

    ``progress`` receives each line ranks send with :func:`report_progress` while the run is going.
    """
    if world_size < 1:
        raise ValueError(f"launch(world_size={world_size}): world_size must be at least 1")
    if timeout <= 0:
        raise ValueError(f"launch(timeout={timeout}): timeout must be positive seconds")
    if getattr(fn, "__name__", "<lambda>") == "<lambda>" or "<locals>" in getattr(fn, "__qualname__", ""):
        raise ValueError(
            f"launch(fn={fn!r}): ranks are spawned processes, so fn must be a module-level "
            "function they can import by name (not a lambda or a nested function)"
        )

    log_root = tempfile.mkdtemp(prefix=f"{name}-ranks-")
    progress_file = Path(log_root) / "progress.log"
    progress_file.touch()
    store = TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    port = store.port
    ifname = _loopback_ifname()
    envs: dict[int, dict[str, str]] = {}
    for rank in range(world_size):
        rank_env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": name,
            "OMP_NUM_THREADS": "1",
            _STORE_PORT_ENV: str(port),
            _PROGRESS_ENV: str(progress_file),
            _PG_TIMEOUT_ENV: str(max(5.0, timeout)),
        }
        if ifname:
            rank_env["GLOO_SOCKET_IFNAME"] = ifname
        rank_env.update(env or {})
        envs[rank] = rank_env

    try:  # the hand-over under the clean-up too: args that cannot be pickled left the directory behind
        job = _Job(_hand_over(log_root, fn, tuple(args)), world_size, timeout, name, store, progress_file, progress)
        with _quiet_elastic_logs():
            return job.run(envs, DefaultLogsSpecs(log_dir=log_root, redirects=Std.ALL))
    finally:
        shutil.rmtree(log_root, ignore_errors=True)


@dataclass
class _Job:
    """One launch in flight: the processes, the wall-clock bound and the progress tail."""

    hand_over: str  # `_hand_over`'s file
    world_size: int
    timeout: float
    name: str
    store: TCPStore
    progress_file: Path
    progress: Callable[[str], None] | None

    def run(self, envs: dict[int, dict[str, str]], logs: DefaultLogsSpecs) -> list[Any]:
        deadline = time.monotonic() + self.timeout
        ctx = self._spawn(envs, logs)
        offset = 0
        first_error_at: float | None = None
        result = None
        try:
            while True:
                records = self._error_records()
                if records and first_error_at is None:
                    first_error_at = time.monotonic()
                if not self._awaiting_root_cause(records, first_error_at):
                    # ctx.wait() stops every rank at the first exit it sees, so it is not called while a
                    # rank that only lost its peers may still be followed by the rank that caused it.
                    result = ctx.wait(timeout=0)
                offset = _drain_progress(self.progress_file, offset, self.progress)
                if result is not None:
                    break
                if time.monotonic() >= deadline:
                    raise self._timed_out(ctx)
                time.sleep(_POLL_PERIOD_S)
        finally:
            ctx.close(death_sig=signal.SIGKILL, timeout=5)
        if result.is_failed():
            raise self._failed(result, self._error_records())
        return [result.return_values[r] for r in range(self.world_size)]

    def _spawn(self, envs: dict[int, dict[str, str]], logs: DefaultLogsSpecs) -> Any:
        """Every rank started whole (signals held meanwhile, delivered once it is), within the launch's timeout.
        A spawn still blocked then (a rank stuck before it read what it is handed, which `_hand_over` keeps small:
        only a spawn of very many ranks, or a huge `env`, overfills a pipe) is given up: the ranks it started are
        killed, and a `LaunchError` lists every rank as not started. Before, the launch waited for it without
        bound, its timeout counted only once every rank had started."""
        before = _child_pids()
        spawned: Any = None
        with signals_held() as held:
            try:
                spawned = off_the_main_thread(
                    lambda: start_processes(
                        name=self.name,
                        entrypoint=_rank_entry,
                        args=dict.fromkeys(range(self.world_size), (self.hand_over,)),
                        envs=envs,
                        logs_specs=logs,
                        start_method="spawn",
                    ),
                    self.timeout,
                )
            except StepTimedOut as late:
                killed = _stop_spawn(late.thread, before)
        if spawned is None:
            held.deliver()
            raise LaunchError(
                f"{self.name}: the ranks' spawn did not finish within {self.timeout:g}s; killed {len(killed)} rank "
                f"process(es) it had started",
                [
                    RankFailure(r, f"not started: the ranks' spawn was given up after {self.timeout:g}s")
                    for r in range(self.world_size)
                ],
            )
        try:
            held.deliver()
        except BaseException:
            spawned.close(death_sig=signal.SIGKILL, timeout=5)
            raise
        return spawned

    def _error_records(self) -> dict[int, dict[str, Any]]:
        """What each rank that raised recorded about its exception (see :func:`_record_error`)."""
        keys = {r: f"{_ERROR_KEY}/{r}" for r in range(self.world_size)}
        return {r: json.loads(self.store.get(k)) for r, k in keys.items() if self.store.check([k])}

    def _awaiting_root_cause(self, records: Mapping[int, dict[str, Any]], first_error_at: float | None) -> bool:
        """Whether to hold off ctx.wait(), which stops every rank at the first exit it sees.

        Only communication errors so far: give the rank that broke the links a moment to report its own.
        A rank's own failure recorded: give the ranks it takes down a moment to record theirs, so the report
        can show them as consequences rather than as ranks that were merely stopped.
        """
        if not records or first_error_at is None:
            return False
        waited = time.monotonic() - first_error_at
        if all(rec["comm"] for rec in records.values()):
            return waited < _ROOT_CAUSE_GRACE_S
        settled = set(records) | _finished_ranks(self.store, self.world_size)
        return len(settled) < self.world_size and waited < _CONSEQUENCE_GRACE_S

    def _failed(self, result: Any, records: dict[int, dict[str, Any]]) -> LaunchError:
        """Blame in order: the rank that failed on its own first, other own failures, then the consequences."""
        logs = (result.stdouts, result.stderrs)
        exits = {r: f for r, f in result.failures.items() if r not in records}
        by_time = sorted(records, key=lambda r: records[r]["time"])
        own = [r for r in by_time if not records[r]["comm"]]
        if not own and not exits:
            own = by_time[:1]  # every rank lost a peer: the earliest is the best guess
        consequences = [r for r in by_time if r not in own]
        failures = [self._own_failure(r, records[r], logs) for r in own]
        failures += [
            RankFailure(r, _failure_cause(f.exitcode, f.message), _rank_log_tail(*logs, r), _traceback_tail(f.message))
            for r, f in sorted(exits.items())
        ]
        culprit = failures[0].rank
        for r in consequences:
            failure = self._own_failure(r, records[r], logs)
            failure.cause = f"failed as a consequence of rank {culprit}'s failure: {failure.cause}"
            failures.append(failure)
        return LaunchError(self._headline(failures, len(consequences)), failures)

    def _headline(self, failures: list[RankFailure], consequences: int) -> str:
        first = failures[0]
        line = f"{self.name}: rank {first.rank} failed ({first.cause})"
        others = len(failures) - 1 - consequences
        if others:
            line += f"; {others} other rank(s) failed on their own"
        if consequences:
            line += f"; {consequences} rank(s) failed as a consequence"
        return f"{line} — {len(failures)} of {self.world_size} ranks failed"

    @staticmethod
    def _own_failure(
        rank: int, record: dict[str, Any], logs: tuple[Mapping[int, str], Mapping[int, str]]
    ) -> RankFailure:
        return RankFailure(rank, f"raised {record['error']}", _rank_log_tail(*logs, rank), list(record["traceback"]))

    def _timed_out(self, ctx: Any) -> LaunchError:
        """Every rank, those that never started first (their interpreter's startup hung), then those still in the
        function, then those that had returned from it."""
        stdouts, stderrs = dict(ctx.stdouts), dict(ctx.stderrs)
        finished = _finished_ranks(self.store, self.world_size)
        started = _finished_ranks(self.store, self.world_size, _STARTED_KEY)
        ctx.close(death_sig=signal.SIGKILL, timeout=5)
        waiting = " (its function had returned; it was waiting for the others)"
        never = (
            " (it never started: its interpreter did not get as far as the launch; look at sitecustomize, "
            "PYTHONPATH or a stalled filesystem)"
        )
        failures = [
            RankFailure(
                r,
                f"timed out after {self.timeout:g}s" + (waiting if r in finished else "" if r in started else never),
                _rank_log_tail(stdouts, stderrs, r),
            )
            for r in range(self.world_size)
        ]
        failures.sort(key=lambda f: (f.rank in started, f.rank in finished, f.rank))
        return LaunchError(f"{self.name}: {self.world_size} ranks did not finish within {self.timeout:g}s", failures)
