"""The one exception-chain walker (`errors.exception_chain`) and its users: stops, bounds, cycles."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import pytest

from torch_checkpointing.errors import CHAIN_LIMIT, exception_chain, shortage_within


def _chained(*links: BaseException) -> BaseException:
    """`links[0]` raised from `links[1]`, raised from `links[2]`, ..."""
    for outer, inner in itertools.pairwise(links):
        outer.__cause__ = inner
    return links[0]


def test_the_walk_stops_before_what_the_caller_was_handling() -> None:
    outside = MemoryError()
    inner = ValueError("inner")
    top = _chained(RuntimeError("top"), inner, outside)
    assert list(exception_chain(top, (outside,))) == [top, inner]
    assert shortage_within(top, outside) is None
    assert shortage_within(top) is outside


def test_a_suppressed_context_is_not_walked_and_botocores_error_argument_is() -> None:
    try:
        try:
            raise KeyError("handled")
        except KeyError:
            raise RuntimeError("told") from None
    except RuntimeError as exc:
        told = exc
    assert list(exception_chain(told)) == [told]
    held = OSError(24, "Too many open files")
    wrapper = RuntimeError("client")
    wrapper.kwargs = {"error": held}  # type: ignore[attr-defined]  # botocore's shape
    assert list(exception_chain(wrapper)) == [wrapper, held]


def test_a_cycle_of_causes_ends_and_a_long_chain_is_cut() -> None:
    a, b = RuntimeError("a"), RuntimeError("b")
    _chained(a, b, a)
    assert list(exception_chain(a)) == [a, b]
    long = [RuntimeError(str(i)) for i in range(CHAIN_LIMIT * 4)]
    assert len(list(exception_chain(_chained(*long)))) == CHAIN_LIMIT


def test_a_store_error_with_a_cycle_of_causes_is_named_not_walked_forever() -> None:
    """An error met in a store call whose causes form a cycle (set by hand: `raise` itself breaks context cycles,
    not `__cause__` ones). Before, the storage's walker (`_chain`, which `_error_code` used) followed it forever:
    the call never returned. Now it fails with the `ObjectStoreError` naming the object."""
    script = textwrap.dedent(
        """
        from torch_checkpointing.errors import ObjectStoreError
        from torch_checkpointing.storage.fsspec_storage import _ErrorScope

        a, b = ConnectionError("a"), ConnectionError("b")
        a.__cause__, b.__cause__ = b, a
        try:
            with _ErrorScope("download of s3://bucket/run/model_0.pt"):
                raise a
        except ObjectStoreError as exc:
            print("named:", exc)
        """
    )
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the error scope walked the cycle of causes for 120 s (a few milliseconds expected)")
    assert done.returncode == 0, done.stderr
    assert "named: download of s3://bucket/run/model_0.pt failed: ConnectionError: a" in done.stdout
