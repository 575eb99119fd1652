"""Every number of seconds the engine takes is any real number but a bool, kept as its float (round 33).

`SyncCheckpointSaverConfig(wait_timeout_secs=np.float64(1.5))` was taken, `np.float32(1.5)` was refused
("must be a number of seconds"), and so were a `Fraction`: both are real numbers (`numbers.Real`), which the
engine's waits use only as a float. Now each is taken as its float; a bool (Python's or numpy's) is still refused,
and so is a `Decimal`, which is no `numbers.Real` (it does not mix with floats).
"""

from __future__ import annotations

import decimal
import fractions
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from torch_checkpointing.barriers import TCPStoreBarrierConfig
from torch_checkpointing.config import (
    AsyncCheckpointSaverConfig,
    CheckpointProcessConfig,
    SyncCheckpointSaverConfig,
)
from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.futures import SettledFuture
from torch_checkpointing.retention import RetentionPolicy
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


def _done_future_waits(v: Any) -> float:
    future: SettledFuture[float] = SettledFuture()
    future.set_result(1.5)
    return future.result(timeout=v)  # the wait's own check; the result says the timeout was taken


# (argument, build with the value -> the seconds kept)
_SECONDS: list[tuple[str, Callable[[Any], Any]]] = [
    ("RetentionPolicy.unowned_after_s", lambda v: RetentionPolicy(unowned_after_s=v).unowned_after_s),
    (
        "CheckpointProcessConfig.subprocess_init_timeout_secs",
        lambda v: CheckpointProcessConfig(subprocess_init_timeout_secs=v).subprocess_init_timeout_secs,
    ),
    (
        "CheckpointProcessConfig.subprocess_shutdown_timeout_secs",
        lambda v: CheckpointProcessConfig(subprocess_shutdown_timeout_secs=v).subprocess_shutdown_timeout_secs,
    ),
    (
        "SyncCheckpointSaverConfig.wait_timeout_secs",
        lambda v: SyncCheckpointSaverConfig(wait_timeout_secs=v).wait_timeout_secs,
    ),
    (
        "AsyncCheckpointSaverConfig.wait_timeout_secs",
        lambda v: AsyncCheckpointSaverConfig(wait_timeout_secs=v).wait_timeout_secs,
    ),
    (
        "FsspecStorageConfig.request_timeout_s",
        lambda v: FsspecStorageConfig(url="memory://b", request_timeout_s=v).request_timeout_s,
    ),
    (
        "TCPStoreBarrierConfig.timeout_barrier_init_sec",
        lambda v: TCPStoreBarrierConfig(v, False, 1, "127.0.0.1").timeout_barrier_init_sec,
    ),
    ("SettledFuture.result(timeout=...)", _done_future_waits),
]
_IDS = [n for n, _ in _SECONDS]

_REALS = [np.float32(1.5), np.float16(1.5), np.float64(1.5), fractions.Fraction(3, 2)]


@pytest.mark.parametrize("value", _REALS, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize(("name", "build"), _SECONDS, ids=_IDS)
def test_a_real_number_of_seconds_is_taken_as_its_float(name: str, build: Callable[[Any], Any], value: Any) -> None:
    """Defect: np.float32(1.5) and Fraction(3, 2) were refused as "must be a number of seconds"."""
    kept = build(value)
    assert kept == 1.5
    assert type(kept) is float  # what a config pickled to the writer process or dumped as JSON holds


@pytest.mark.parametrize("value", [True, np.bool_(True), decimal.Decimal("1.5"), "1.5"], ids=repr)
@pytest.mark.parametrize(("name", "build"), _SECONDS, ids=_IDS)
def test_a_bool_or_a_decimal_is_still_refused_naming_the_argument(
    name: str, build: Callable[[Any], Any], value: Any
) -> None:
    with pytest.raises(ConfigTypeError) as caught:
        build(value)
    assert name.split(".")[-1].split("(")[0] in str(caught.value)


@pytest.mark.parametrize(("name", "build"), _SECONDS, ids=_IDS)
def test_a_fraction_past_a_float_is_refused_naming_the_argument(name: str, build: Callable[[Any], Any]) -> None:
    """A Fraction that no float holds raised float()'s bare OverflowError once taken; it is refused as a config
    error naming the argument."""
    with pytest.raises(ConfigError) as caught:
        build(fractions.Fraction(10**400, 3))
    assert not isinstance(caught.value, OverflowError)
    assert name.split(".")[-1].split("(")[0] in str(caught.value)


@pytest.mark.parametrize(("name", "build"), _SECONDS, ids=_IDS)
def test_a_nan_real_is_still_refused(name: str, build: Callable[[Any], Any]) -> None:
    with pytest.raises(ConfigError):
        build(np.float32("nan"))
