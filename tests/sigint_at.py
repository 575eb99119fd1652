"""A real SIGINT sent to this process at a chosen call, for the interrupt tests: in a rank of a multi-rank job or
in a child process, on the main thread, where Python's own handler raises KeyboardInterrupt (unless the engine
holds the signal). Both a job's ranks and a child's code import it by name, so it is a plain module-level name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

__all__ = ["disarm", "sigint_at"]

_BETWEEN_S = 0.1  # between two signals of one call: the first is taken (or held) before the next is sent
_ARMED: list[tuple[Any, str, Any]] = []  # (owner, name, the real one) of each `sigint_at` not yet sent


def sigint_at(
    owner: Any,
    name: str,
    wait_s: float,
    *,
    when: Callable[..., bool] = lambda *args, **kwargs: True,
    nth: int = 1,
    times: int = 1,
    after: bool = False,
    from_kill: bool = False,
    signum: int = signal.SIGINT,
) -> None:
    """At the `nth` call of `owner.name` whose arguments `when` accepts (the real one put back then: once),
    `times` real SIGINTs to this process, then a wait of `wait_s` in which the handler raises unless the engine
    holds the signal; before the real call runs, or once it has returned (`after`). `from_kill`: sent by
    another process (`kill -INT`), as a scheduler does, not by this one. `signum`: another signal in place of
    SIGINT (SIGALRM, whose handler a program has raise TimeoutError to bound a call)."""
    real, seen = getattr(owner, name), [0]

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        if not when(*args, **kwargs):
            return real(*args, **kwargs)
        seen[0] += 1
        if seen[0] != nth:
            return real(*args, **kwargs)
        _put_back(owner, name, real)
        result = real(*args, **kwargs) if after else None
        _send(times, from_kill, signum)
        time.sleep(wait_s)  # the handler raises in here, unless the engine holds the signal
        return result if after else real(*args, **kwargs)

    _ARMED.append((owner, name, real))
    setattr(owner, name, interrupted)


def disarm() -> int:
    """Put back every call a `sigint_at` armed that was never reached (a step skipped where the engine failed
    otherwise), so that it does not interrupt a later, unrelated call; returns how many."""
    left = list(_ARMED)
    for owner, name, real in reversed(left):  # the last armed first: it may wrap an earlier one
        _put_back(owner, name, real)
    return len(left)


def _put_back(owner: Any, name: str, real: Any) -> None:
    setattr(owner, name, real)
    _ARMED.remove((owner, name, real))


def _send(times: int, from_kill: bool, signum: int) -> None:
    for sent in range(times):
        if sent:
            time.sleep(_BETWEEN_S)
        if from_kill:
            subprocess.run(["kill", "-s", signal.Signals(signum).name, str(os.getpid())], check=True)
        else:
            os.kill(os.getpid(), signum)
