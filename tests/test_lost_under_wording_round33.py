"""What a rank logs when its exchange broke and then something else was raised: an interrupt is named as one,
an ordinary error (the roll call deciding who was lost failed) is not called an interrupt."""

from __future__ import annotations

import logging

import pytest

from torch_checkpointing.agreement import _say_lost_under


def test_an_ordinary_error_after_a_broken_exchange_is_not_called_an_interrupt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        _say_lost_under("save step_1", "Connection closed by peer", OSError("store went away"))
    assert "Connection closed by peer" in caplog.text and "store went away" in caplog.text
    assert "interrupt" not in caplog.text


def test_an_interrupt_after_a_broken_exchange_is_named_as_one(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        _say_lost_under("save step_1", "Connection closed by peer", KeyboardInterrupt())
    assert "Connection closed by peer" in caplog.text and "interrupted" in caplog.text
