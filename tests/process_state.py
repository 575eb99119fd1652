"""An autouse check that fails the test which leaves process-wide state changed behind it.

A pytest worker runs ~1,900 tests in one process, in an order that changes from run to run: a test that left a
signal handler, an rlimit, an environment variable or a process group behind made some later test fail (or pass)
by the order alone, far from its cause. After every test this compares what a test can change for the whole
process with what it was before the test; a difference fails that test at teardown, naming what changed, and is
put back so that the tests after it run in the state they expect.

Allowed, because they are the engine's own documented process-wide state and not a test's leftovers:
- daemon threads (its WorkerPools' threads, the store-caller threads, a saver's comm thread, reapers): they are
  started once per process and kept by design; only non-daemon threads are counted, since they hold up exit;
- the non-daemon "ckpt-dropped-close" thread, which closes a manager dropped without close() in the background;
- a raised soft RLIMIT_NOFILE: a load raises it to fit its files and, once no load is in flight, puts it back only
  as far as the descriptors then open allow (read_context.descriptors_released);
- its at-fork handlers (os.register_at_fork cannot be listed, so they are not looked at).
Module- and session-scoped fixtures set up before the first snapshot and are torn down after the last check, so
what they hold for their module is not counted. Open descriptors and child processes are not counted: the
module-scoped async managers hold a writer and its pipes across tests.

Each look is a few system calls or dictionary reads (no walk of /proc beyond one read of /proc/self/status).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

_PACKAGE = "torch_checkpointing"
_ALLOWED_NON_DAEMON = {"ckpt-dropped-close"}
# Set by pytest per phase, and by torch's first (lazy) import of inductor for the rest of the process.
_NOT_A_TEST_S_ENV = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}
_THREAD_GRACE_S = 30.0  # a thread the test let go of may still be finishing on a busy machine: waited for, in all
_RLIMITS = {name: getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")}


def _umask() -> str | None:
    """The umask as /proc/self/status gives it: setting it to read it would race with the engine's threads."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return line.split()[1]
    except OSError:
        pass
    return None


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # removed under the process
        return None


def _loggers() -> dict[str, tuple[int, tuple[logging.Handler, ...], bool, bool]]:
    manager = logging.Logger.manager
    return {
        name: (lg.level, tuple(lg.handlers), lg.propagate, lg.disabled)
        for name, lg in list(manager.loggerDict.items())
        if isinstance(lg, logging.Logger) and (name == _PACKAGE or name.startswith(_PACKAGE + "."))
    }


@dataclass
class Snapshot:
    cwd: str | None
    umask: str | None
    environ: dict[str, str]
    rlimits: dict[str, tuple[int, int]]
    signals: dict[int, Any]
    alarm: tuple[float, float]
    loggers: dict[str, tuple[int, tuple[logging.Handler, ...], bool, bool]]
    sys_path: list[str]
    hooks: tuple[Any, ...]
    torch_threads: int
    process_group: bool
    threads: set[threading.Thread]

    @staticmethod
    def take() -> Snapshot:
        return Snapshot(
            cwd=_cwd(),
            umask=_umask(),
            environ=dict(os.environ),
            rlimits={name: resource.getrlimit(r) for name, r in _RLIMITS.items()},
            signals={s: signal.getsignal(s) for s in signal.valid_signals()},
            alarm=signal.getitimer(signal.ITIMER_REAL),
            loggers=_loggers(),
            sys_path=list(sys.path),
            hooks=_hooks(),
            torch_threads=torch.get_num_threads(),
            process_group=dist.is_available() and dist.is_initialized(),
            threads=set(threading.enumerate()),
        )


_HOOKS = ("sys.excepthook", "threading.excepthook", "sys.unraisablehook", "sys.getrecursionlimit()")
_HOOKS += ("gc.isenabled()", "faulthandler.is_enabled()", "sys.getprofile()")


def _hooks() -> tuple[Any, ...]:
    return (
        sys.excepthook,
        threading.excepthook,
        sys.unraisablehook,
        sys.getrecursionlimit(),
        gc.isenabled(),
        faulthandler.is_enabled(),
        sys.getprofile(),
    )


def _restore_hooks(hooks: tuple[Any, ...]) -> None:
    sys.excepthook, threading.excepthook, sys.unraisablehook, limit, collecting, faulting, profile = hooks
    sys.setrecursionlimit(limit)
    gc.enable() if collecting else gc.disable()
    if faulting and not faulthandler.is_enabled():
        faulthandler.enable()
    elif not faulting and faulthandler.is_enabled():
        faulthandler.disable()
    sys.setprofile(profile)


Leak = tuple[str, Callable[[], None]]  # what changed, and how to put it back


def _environ_leaks(before: Snapshot) -> list[Leak]:
    now = dict(os.environ)
    if now == before.environ:
        return []
    keys = set(now) | set(before.environ)
    changed = sorted(k for k in keys - _NOT_A_TEST_S_ENV if now.get(k) != before.environ.get(k))
    if not changed:
        return []

    def restore() -> None:
        for key in changed:
            if key in before.environ:
                os.environ[key] = before.environ[key]
            else:
                os.environ.pop(key, None)

    return [(f"environment variables {changed}", restore)]


def _rlimit_leaks(before: Snapshot) -> list[Leak]:
    leaks: list[Leak] = []
    for name, r in _RLIMITS.items():
        was, now = before.rlimits[name], resource.getrlimit(r)
        if now == was or (name == "RLIMIT_NOFILE" and now[1] == was[1] and now[0] >= was[0]):
            continue

        def restore(r: int = r, was: tuple[int, int] = was) -> None:
            with contextlib.suppress(OSError, ValueError):  # a lowered hard limit cannot be raised again
                resource.setrlimit(r, was)

        leaks.append((f"{name} {was} -> {now}", restore))
    return leaks


def _signal_leaks(before: Snapshot) -> list[Leak]:
    leaks: list[Leak] = []
    if threading.current_thread() is threading.main_thread():
        for signum, was in before.signals.items():
            now = signal.getsignal(signum)
            if now is not was and now != was and was is not None:

                def restore(signum: int = signum, was: Any = was) -> None:
                    signal.signal(signum, was)

                leaks.append((f"the handler of {signal.Signals(signum).name}: {was!r} -> {now!r}", restore))
    if before.alarm == (0.0, 0.0) and signal.getitimer(signal.ITIMER_REAL) != (0.0, 0.0):
        leaks.append(("a pending alarm (signal.alarm / ITIMER_REAL)", lambda: signal.setitimer(signal.ITIMER_REAL, 0)))
    return leaks


def _logger_leaks(before: Snapshot) -> list[Leak]:
    leaks: list[Leak] = []
    for name, now in _loggers().items():
        was = before.loggers.get(name, (logging.NOTSET, (), True, False))
        if now == was:
            continue

        def restore(name: str = name, was: tuple[int, tuple[logging.Handler, ...], bool, bool] = was) -> None:
            lg = logging.getLogger(name)
            lg.setLevel(was[0])
            lg.handlers[:] = list(was[1])
            lg.propagate, lg.disabled = was[2], was[3]

        leaks.append((f"the {name!r} logger's level/handlers/propagate/disabled: {was} -> {now}", restore))
    return leaks


def _thread_leaks(before: Snapshot) -> list[Leak]:
    def left() -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t not in before.threads and not t.daemon and t.is_alive() and t.name not in _ALLOWED_NON_DAEMON
        ]

    threads = left()
    for thread in threads:  # a thread still finishing what the test started is given a moment
        thread.join(_THREAD_GRACE_S / len(threads))
    threads = left()
    if not threads:
        return []
    return [(f"non-daemon threads still running {[t.name for t in threads]}", lambda: None)]


def _other_leaks(before: Snapshot) -> list[Leak]:
    leaks: list[Leak] = []
    cwd = _cwd()
    if cwd != before.cwd and before.cwd is not None:
        leaks.append((f"the working directory {before.cwd} -> {cwd}", lambda: os.chdir(str(before.cwd))))
    umask = _umask()
    if umask != before.umask and before.umask is not None:
        leaks.append((f"the umask {before.umask} -> {umask}", lambda: os.umask(int(str(before.umask), 8))))
    if sys.path != before.sys_path:
        leaks.append(("sys.path", lambda: sys.path.__setitem__(slice(None), before.sys_path)))
    hooks = _hooks()
    if hooks != before.hooks:
        changed = [
            f"{name} {was!r} -> {now!r}"
            for name, was, now in zip(_HOOKS, before.hooks, hooks, strict=True)
            if was != now
        ]
        leaks.append((", ".join(changed), lambda: _restore_hooks(before.hooks)))
    if torch.get_num_threads() != before.torch_threads:
        leaks.append(
            (
                f"torch.set_num_threads {before.torch_threads} -> {torch.get_num_threads()}",
                lambda: torch.set_num_threads(before.torch_threads),
            )
        )
    if dist.is_available() and dist.is_initialized() and not before.process_group:
        leaks.append(("a torch.distributed process group left initialised", dist.destroy_process_group))
    return leaks


def leaks_since(before: Snapshot) -> list[Leak]:
    """Every process-wide change since `before` that this module looks at."""
    return [
        *_environ_leaks(before),
        *_rlimit_leaks(before),
        *_signal_leaks(before),
        *_logger_leaks(before),
        *_other_leaks(before),
        *_thread_leaks(before),
    ]


@pytest.fixture(autouse=True)
def _no_process_state_left_behind() -> Iterator[None]:
    before = Snapshot.take()
    yield
    leaks = leaks_since(before)
    for _, restore in leaks:
        restore()
    if leaks:
        pytest.fail("this test left process-wide state changed (put back now):\n  " + "\n  ".join(w for w, _ in leaks))
