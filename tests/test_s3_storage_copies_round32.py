"""An S3 storage copied (pickle, `copy.deepcopy`) keeps working, its request wrappers included (round 32).

The storage's filesystem is wrapped (request timeouts, NoSuchBucket named) by objects that forward attributes
through `__getattr__`; unpickled without their state, the lookup of the wrapped filesystem went through
`__getattr__` itself, and a copy died of a RecursionError naming nothing.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

from tests.s3_server import S3Server, missing_s3_packages
from torch_checkpointing.errors import ObjectStoreError

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")


@pytest.mark.parametrize("timeout", [300.0, None], ids=["bounded", "unbounded"])
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_copied_s3_storage_reads_and_names_a_missing_bucket(s3_server: S3Server, how: str, timeout: float) -> None:
    config = s3_server.config(request_timeout_s=timeout)
    storage = config.create_storage()
    storage.write(Path("run/a"), b"1")
    copied = pickle.loads(pickle.dumps(storage)) if how == "pickle" else copy.deepcopy(storage)
    assert copied.ls(Path("run")) == ["a"] and copied.read(Path("run/a")) == b"1"
    storage.fs.rm_file(f"{config.url[len('s3://') :]}/run/a")
    storage.fs.call_s3("delete_bucket", Bucket=config.url[len("s3://") :])
    with pytest.raises(ObjectStoreError, match="NoSuchBucket"):
        copied.isdir(Path("run"))
