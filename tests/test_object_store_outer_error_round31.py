"""An object store's failure inside a caller's `except` block is that failure, not the handled error (round 31).

The error scope of a storage call looks through the client's error for what it wraps (a shortage, an S3 error
code, a client failure with a fix): Python chains every exception raised inside an `except` block to the one
being handled there, so the walk also reached the caller's own exception. A store that cannot be reached, asked
while the caller handled a `MemoryError` (freeing memory, then deleting a damaged checkpoint), was raised as
"Out of memory ... this process's shortage, not the store's"; asked while the caller handled a store's
AccessDenied, it was told with AccessDenied's fix instead of the endpoint's. The store here is a real endpoint
where nothing listens: the connection is really refused.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

pytest.importorskip("s3fs")


@pytest.fixture
def unreachable() -> FsspecStorage:
    """A storage whose endpoint refuses every connection (a port bound, then closed: nothing listens there)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "key": "testing",
        "secret": "testing",
        "skip_instance_cache": True,
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    return FsspecStorageConfig(url="s3://bucket/run", storage_options=options).create_storage()


def _lookup_while_handling(storage: FsspecStorage, handled: BaseException) -> BaseException:
    """What a lookup on `storage` raises inside an `except` block handling `handled`."""
    try:
        try:
            raise handled
        except type(handled):
            storage.exists(Path("s3://bucket/run/ck"))
    except BaseException as exc:
        return exc
    raise AssertionError("the lookup of an unreachable store succeeded")


def test_a_refused_connection_while_the_caller_handles_a_memory_error_is_the_stores_failure(
    unreachable: FsspecStorage,
) -> None:
    """Defect: "MemoryError EndpointConnectionError: Could not connect to the endpoint URL: ..." with the note
    "Out of memory during the lookup of s3://bucket/run/ck (told by the client as EndpointConnectionError): this
    process's shortage, not the store's"."""
    bare = _lookup_while_handling(unreachable, ValueError("the caller's own"))
    raised = _lookup_while_handling(unreachable, MemoryError("the caller's own, handled"))
    assert isinstance(bare, ObjectStoreError), repr(bare)
    assert isinstance(raised, ObjectStoreError), f"{raised!r} {getattr(raised, '__notes__', None)}"
    assert "AWS_ENDPOINT_URL" in str(raised)


def test_a_refused_connection_while_the_caller_handles_a_descriptor_shortage_is_the_stores_failure(
    unreachable: FsspecStorage,
) -> None:
    """Defect: "OSError [Errno 24] EndpointConnectionError: ..." for a store that refused the connection."""
    raised = _lookup_while_handling(unreachable, OSError(24, "Too many open files"))
    assert isinstance(raised, ObjectStoreError), f"{raised!r} {getattr(raised, '__notes__', None)}"


def test_a_refused_connection_while_the_caller_handles_a_store_error_names_the_endpoint_fix(
    unreachable: FsspecStorage,
) -> None:
    """Defect: the refused connection was told with the handled error's S3 code and its fix ("AccessDenied: ...")
    and no word of the endpoint."""
    from botocore.exceptions import ClientError

    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "denied"}}, "GetObject")
    raised = _lookup_while_handling(unreachable, denied)
    assert isinstance(raised, ObjectStoreError), repr(raised)
    assert "AWS_ENDPOINT_URL" in str(raised), str(raised)
    assert "AccessDenied" not in str(raised), str(raised)


_CONDITIONAL = {
    "replace_object": lambda storage, path: storage.replace_object(path, b"claim", '"etag"'),
    "delete_object": lambda storage, path: storage.delete_object(path, '"etag"'),
}


@pytest.mark.parametrize("code", ["NoSuchKey", "PreconditionFailed"])
@pytest.mark.parametrize("call", sorted(_CONDITIONAL))
def test_a_conditional_write_to_an_unreachable_store_inside_a_handler_raises(
    unreachable: FsspecStorage, call: str, code: str
) -> None:
    """A conditional replace or delete answers False for "the object changed or went" (another save took it
    over): inside a caller's handler of a store error with that code, an unreachable store was such an answer.

    Defect: "returned False" for each, where outside a handler each raises the ObjectStoreError naming the
    endpoint."""
    from botocore.exceptions import ClientError

    handled = ClientError({"Error": {"Code": code, "Message": "the caller's"}}, "HeadObject")
    try:
        raise handled
    except ClientError:
        with pytest.raises(ObjectStoreError, match="AWS_ENDPOINT_URL"):
            _CONDITIONAL[call](unreachable, Path("s3://bucket/run/ck/marker"))
