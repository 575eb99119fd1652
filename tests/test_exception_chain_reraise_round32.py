"""An error scope whose body raises the very exception the caller is handling passes it on as it is.

Before, `shortage_within(exc, outside=exc)` raised a bare StopIteration (the walk, stopped at `outside`, had no
first link to skip), which `shortage_named`, a generator-based context manager, turned into "RuntimeError:
generator raised StopIteration" in place of the caller's own error; `_ErrorScope` let the StopIteration out.
"""

from __future__ import annotations

import pytest

from torch_checkpointing.errors import ObjectStoreError, shortage_within
from torch_checkpointing.storage import fsspec_storage


def test_shortage_within_its_own_outside_is_none() -> None:
    handled = ValueError("the caller's")
    assert shortage_within(handled, handled) is None


def test_shortage_named_passes_the_handled_error_on() -> None:
    with pytest.raises(ValueError, match="the caller's"):
        try:
            raise ValueError("the caller's")
        except ValueError as handled:
            with fsspec_storage.shortage_named("write of x"):
                raise handled


def test_an_error_scope_passes_the_handled_error_on_as_a_store_error() -> None:
    """The scope turns a store's error into an ObjectStoreError naming the object, as for any other error."""
    with pytest.raises(ObjectStoreError) as caught:
        try:
            raise ValueError("the caller's")
        except ValueError as handled:
            with fsspec_storage._ErrorScope("download of s3://b/k"):
                raise handled
    assert "the caller's" in str(caught.value)
