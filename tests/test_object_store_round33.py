"""Object-store leftovers of round 32, against the real moto server (tests/s3_server.py)."""

from __future__ import annotations

import pickle
from pathlib import Path

from tests.s3_server import S3Server


def test_repeated_requests_reuse_one_wrapper_per_method(s3_server: S3Server) -> None:
    """Every S3 request looked its method up on the filesystem that names a missing bucket, and each lookup
    built a new wrapper (a closure and its `functools.wraps` copy): work per request for the same answer."""
    storage = s3_server.config().create_storage()
    io = storage._backend("s3").io
    seen = [io.call_s3 for _ in range(100)] + [io.call_s3 for _ in range(100)]
    assert len({id(call) for call in seen}) == 1
    assert storage.exists(Path("run/absent")) is False  # the wrapper still works
    copied = pickle.loads(pickle.dumps(io))  # the kept wrappers are no state of a copy
    assert copied.call_s3 is copied.call_s3 and copied.call_s3 is not io.call_s3
