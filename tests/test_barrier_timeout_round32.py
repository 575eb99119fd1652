"""`execute_barrier(timeout_secs)` refuses a timeout no wait can honour, naming the argument.

Before, on a one-rank barrier whose store answered: 10**400 raised a bare OverflowError ("int too large to
convert to float"), NaN a TimeoutError blaming the host ("rank 0 ... did not answer within nans (it is stopped,
hung, or cut off from this rank)"), and a str a bare TypeError; None was taken as no timeout the same way.
"""

from __future__ import annotations

import pytest

from tests.memory_storage import free_port
from torch_checkpointing.barriers import TCPStoreBarrier, TCPStoreBarrierConfig
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.types import RankInfo


def _barrier() -> TCPStoreBarrier:
    return TCPStoreBarrier(TCPStoreBarrierConfig(5, False, free_port(), "127.0.0.1", "b"), RankInfo(0, 1, 0, 1))


@pytest.mark.parametrize("value", [10**400, float("nan"), "5", None], ids=["int past a float", "nan", "str", "None"])
def test_an_unusable_timeout_is_refused_naming_it(value: object) -> None:
    barrier = _barrier()
    with pytest.raises(ConfigError, match="timeout_secs"):
        barrier.execute_barrier(value)  # type: ignore[arg-type]
    barrier.execute_barrier(5)  # the barrier itself still works: the refusal took nothing


def test_a_usable_timeout_passes_a_lone_ranks_barrier() -> None:
    _barrier().execute_barrier(2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value", [10**400, float("nan"), float("inf"), "5", -1], ids=["huge", "nan", "inf", "str", "-1"]
)
def test_the_configs_init_timeout_is_refused_naming_it(value: object) -> None:
    """Before, TCPStoreBarrierConfig took any value; the barrier's store then failed at its creation with a bare
    ValueError (NaN: "cannot convert float NaN to integer") or OverflowError, naming no field."""
    with pytest.raises(ConfigError, match="timeout_barrier_init_sec"):
        TCPStoreBarrierConfig(value, False, free_port(), "127.0.0.1", "b")  # type: ignore[arg-type]
