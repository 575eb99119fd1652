"""A wait's `timeout` argument that no wait can honour is refused naming the argument.

Before, `Future.result(timeout=10**400)` raised a bare OverflowError ("int too large to convert to float") and
`timeout=float('nan')` waited forever (NaN compares false with every deadline), on the Future `save()` returns
and on the engine's own waits (the staging lock's `hold`, a flag's `wait`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from torch_checkpointing.checkpoint_saver import WriteFuture
from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.futures import SettledFuture
from torch_checkpointing.lock import RWLock, RWLockMode
from torch_checkpointing.retention import RetentionPolicy, RetentionRunner
from torch_checkpointing.waiting import Flag

_BAD = [10**400, float("nan"), "5"]
_IDS = ["int past a float", "nan", "str"]
_HANG_S = 10.0  # only to stop a hang: each call should be refused at once


def _bounded(call: Callable[[], object]) -> BaseException | None:
    """`call()` on a daemon thread; what it raised (None if it returned), or a hang reported as a failure."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(_HANG_S)
    assert outcome, "the wait did not end: the timeout was taken as 'never'"
    return outcome[0]


def _refused(error: BaseException | None) -> None:
    assert isinstance(error, ConfigError), repr(error)
    assert "timeout" in str(error), str(error)
    if isinstance(error, ConfigTypeError):
        return
    assert "number of seconds" in str(error), str(error)


@pytest.mark.parametrize("value", _BAD, ids=_IDS)
@pytest.mark.parametrize("method", ["result", "exception"])
def test_write_future_refuses_an_unusable_timeout(method: str, value: object) -> None:
    future = WriteFuture("step_1")  # pending: the wait has to use its timeout
    _refused(_bounded(lambda: getattr(future, method)(timeout=value)))


@pytest.mark.parametrize("value", _BAD, ids=_IDS)
def test_settled_future_refuses_an_unusable_timeout_even_when_done(value: object) -> None:
    future: SettledFuture[int] = SettledFuture()
    future.set_result(1)
    _refused(_bounded(lambda: future.result(timeout=value)))


@pytest.mark.parametrize("value", _BAD, ids=_IDS)
def test_lock_hold_refuses_an_unusable_timeout(value: object) -> None:
    lock = RWLock()
    writer = lock.acquire(RWLockMode.WRITE)  # held: a reader has to wait

    def read() -> None:
        with lock.hold(RWLockMode.READ, value):  # type: ignore[arg-type]
            pass

    try:
        _refused(_bounded(read))
    finally:
        lock.release(RWLockMode.WRITE, writer)


@pytest.mark.parametrize("value", _BAD, ids=_IDS)
def test_flag_wait_refuses_an_unusable_timeout(value: object) -> None:
    _refused(_bounded(lambda: Flag().wait(value)))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [None, 0, 0.01, -1, float("inf")], ids=["None", "0", "0.01", "-1", "inf"])
def test_usable_timeouts_still_wait(value: object) -> None:
    """None and inf wait for the outcome; a negative or zero timeout on a pending Future times out at once."""
    future: SettledFuture[int] = SettledFuture()
    if value is None or value == float("inf"):
        threading.Timer(0.05, future.set_result, (7,)).start()
        assert _bounded(lambda: future.result(timeout=value)) is None
        assert future.result(timeout=value) == 7  # type: ignore[arg-type]
    else:
        assert isinstance(_bounded(lambda: future.result(timeout=value)), TimeoutError)


@pytest.mark.parametrize("value", _BAD, ids=_IDS)
@pytest.mark.parametrize("method", ["wait", "close"])
def test_retention_runner_refuses_an_unusable_timeout(method: str, value: object) -> None:
    """Before, `close(timeout=nan)` with no pass pending took it, and with one pending logged "Retention passes did
    not finish within nans of close()" for a pass that never got a usable wait."""
    runner = RetentionRunner(RetentionPolicy(keep_last=1), rank=0)
    try:
        _refused(_bounded(lambda: getattr(runner, method)(value)))
    finally:
        runner.close()
