"""`signals_deferred`: the load's copy phase runs a signal's handler after the copy, a repeated one at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest

from tests.probes import interrupted_at
from torch_checkpointing.signals import handlers_replaced, signals_deferred, start_thread


@pytest.fixture
def handlers() -> Iterator[list[str]]:
    """SIGINT as Python's own (KeyboardInterrupt), SIGUSR1 recording its calls; restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can be set on the main thread only")
    calls: list[str] = []
    before = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGUSR1: signal.signal(signal.SIGUSR1, lambda n, f: calls.append("usr1")),
    }
    yield calls
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_a_signal_inside_runs_its_handler_once_the_block_ends(handlers: list[str]) -> None:
    steps = []
    with pytest.raises(KeyboardInterrupt), signals_deferred("test"):
        signal.raise_signal(signal.SIGINT)
        steps.append("after the signal")  # not interrupted
        signal.raise_signal(signal.SIGUSR1)
        steps.append("the end of the block")
        assert handlers == []
    assert steps == ["after the signal", "the end of the block"]
    assert handlers == ["usr1"]  # the KeyboardInterrupt did not lose the other pending signal
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_the_same_signal_twice_runs_its_handler_at_once(handlers: list[str], caplog: pytest.LogCaptureFixture) -> None:
    steps = []
    with pytest.raises(KeyboardInterrupt), signals_deferred("Load of ck"):
        signal.raise_signal(signal.SIGINT)
        steps.append("deferred")
        signal.raise_signal(signal.SIGINT)
        steps.append("not reached")
    assert steps == ["deferred"]
    messages = [r.getMessage() for r in caplog.records]
    assert any("Load of ck: SIGINT (Ctrl-C) during the copy" in m for m in messages), messages
    assert any("Load of ck: SIGINT (Ctrl-C) again" in m for m in messages), messages


def test_a_block_without_signals_changes_nothing(handlers: list[str]) -> None:
    with signals_deferred("test"):
        pass
    assert handlers == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_off_the_main_thread_signals_are_left_alone(handlers: list[str]) -> None:
    seen: list[object] = []

    def body() -> None:
        with signals_deferred("test"):
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    assert seen == [signal.default_int_handler]


def test_the_same_signal_twice_in_a_quiet_block_logs_nothing(
    handlers: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(KeyboardInterrupt), signals_deferred("start", quiet=True):
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGINT)
        assert handlers == []  # deferred, as in a loud block
    assert handlers == ["usr1"]
    assert [r.getMessage() for r in caplog.records if r.name == "torch_checkpointing"] == []


def test_a_signal_while_the_handlers_are_replaced_leaves_every_handler_as_it_was(handlers: list[str]) -> None:
    # Before: the handlers were replaced before the `try`; a SIGTERM whose handler raised (SystemExit, as a
    # preemption handler does) just after SIGINT's was replaced left SIGINT deferring for good: each later
    # Ctrl-C was recorded and never run.
    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(143)

    before = signal.signal(signal.SIGTERM, on_term)
    try:
        for point in range(100):
            with interrupted_at(point, ("torch_checkpointing/signals.py",), signal.SIGTERM) as at:
                try:
                    with signals_deferred("test"):
                        pass
                except SystemExit:
                    pass
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, at.where
            assert signal.getsignal(signal.SIGTERM) is on_term, at.where
            if at.where is None:
                break
        assert point > 5  # the sweep reached the replacing and the restoring
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_ctrl_c_at_any_point_of_start_thread_leaves_the_thread_running_or_never_started(
    handlers: list[str],
) -> None:
    # Thread.start() waits on an Event that the new thread sets: a KeyboardInterrupt in that wait left the
    # Event's lock held, and the new thread blocked before running its target.
    files = ("threading.py", "contextlib.py", "torch_checkpointing/signals.py")
    for point in range(1000):
        ran = threading.Event()
        thread = threading.Thread(target=ran.set, daemon=True)
        with interrupted_at(point, files) as at:
            try:  # noqa: SIM105 - contextlib.suppress's frames are among those interrupted
                start_thread(thread)
            except KeyboardInterrupt:
                pass
        if thread.ident is not None:  # started: it runs its target
            thread.join(10)
            assert ran.is_set() and not thread.is_alive(), at.where
        if at.where is None:
            break
    assert point > 10


def test_a_raising_replacement_interrupting_any_point_leaves_the_handlers_as_they_were(handlers: list[str]) -> None:
    # Before: a sync save replaced the handlers before its `try`, and restored them in a generator's `finally`,
    # so a replaced handler raising there (or at contextlib's __exit__) left SIGINT's replacement in force.
    def raising(signum: int, handler: object) -> object:
        def replaced(signum: int, frame: object) -> None:
            raise KeyboardInterrupt("from the replacement")

        return replaced

    body = 0
    for point in range(100):
        with interrupted_at(point, ("torch_checkpointing/signals.py",)) as at:
            try:
                with handlers_replaced(raising):
                    body += 1
            except KeyboardInterrupt:
                pass
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, at.where
        assert callable(signal.getsignal(signal.SIGUSR1)) and signal.getsignal(signal.SIGUSR1).__name__ == "<lambda>"
        if at.where is None:
            break
    assert point > 5 and body > 0
