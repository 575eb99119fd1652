"""A `signals_deferred` block inside another leaves the signals to the outer one (round 29).

A collective load holds signals across its copy and the ranks' word on it, around the copy's own hold. Before,
the inner block held a signal once more and handed it to the outer one on its way out as sent for the first time:
a SIGINT sent again inside the inner block (the way out of a copy that does not end) was held by the outer block
too, and ran only when both had ended.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator

import pytest

from torch_checkpointing.signals import signals_deferred


@pytest.fixture
def python_sigint() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can be set on the main thread only")
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_signal_sent_again_inside_an_inner_hold_runs_at_once(python_sigint: None) -> None:
    steps = []
    with pytest.raises(KeyboardInterrupt), signals_deferred("outer"), signals_deferred("inner"):
        signal.raise_signal(signal.SIGINT)
        steps.append("held")
        signal.raise_signal(signal.SIGINT)
        steps.append("not interrupted")  # before: reached, the second SIGINT held by the outer block
    assert steps == ["held"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_inside_both_is_said_once_and_runs_after_the_outer(
    python_sigint: None, caplog: pytest.LogCaptureFixture
) -> None:
    steps = []
    caplog.set_level(logging.WARNING, "torch_checkpointing")
    with pytest.raises(KeyboardInterrupt), signals_deferred("outer"):
        with signals_deferred("inner"):
            signal.raise_signal(signal.SIGINT)
        steps.append("after the inner block")
    assert steps == ["after the inner block"]
    held = [r.getMessage() for r in caplog.records if "during" in r.getMessage()]
    assert len(held) == 1 and held[0].startswith("outer: "), held  # before: "inner: …", then "outer: …"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
