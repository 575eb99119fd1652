"""`signals_deferred`: the load's copy phase runs a signal's handler after the copy, a repeated one at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest

from torch_checkpointing.signals import signals_deferred


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
    assert any("Load of ck: Ctrl-C during the copy" in m for m in messages), messages
    assert any("Load of ck: Ctrl-C again" in m for m in messages), messages


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
