"""A real number of seconds past what a float holds is refused naming the argument, whatever its type.

Round 33's `real_as_number` refused a `Fraction` past a float's range ("past what a float holds"), as an int so
large is refused, but numpy's `longdouble` (which holds up to about 1e4932) became `inf` in silence: a wait
given `np.longdouble("1e400")` waited with no limit at all, and a config timeout was refused as "got inf",
a value the caller never wrote.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from torch_checkpointing.config import SyncCheckpointSaverConfig, check_number, wait_seconds
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.retention import RetentionPolicy

_HUGE = np.longdouble("1e400")


def test_a_wait_refuses_a_longdouble_past_a_float() -> None:
    with pytest.raises(ConfigError, match=r"Future\.result's timeout .*past what a float holds"):
        wait_seconds("Future.result's timeout", _HUGE)


@pytest.mark.parametrize(
    "build",
    [
        lambda: check_number("Owner", "timeout", _HUGE),
        lambda: SyncCheckpointSaverConfig(wait_timeout_secs=_HUGE),
        lambda: RetentionPolicy(keep_last=1, unowned_after_s=_HUGE),
    ],
    ids=["check_number", "wait_timeout_secs", "unowned_after_s"],
)
def test_a_config_refuses_a_longdouble_past_a_float_naming_it(build) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=r"past what a float holds"):
        build()


def test_an_infinite_longdouble_is_still_infinity() -> None:
    assert wait_seconds("a timeout", np.longdouble("inf")) == math.inf
    assert wait_seconds("a timeout", np.longdouble("1e300")) == 1e300
