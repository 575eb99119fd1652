"""A `dataclasses.replace(config, url=...)` of an FsspecStorageConfig whose protocol its first url filled in is
refused with the fix that works: pass `protocol=""` with the new url.

`__post_init__` fills `protocol` from `url`, and a later check takes it anew where the url was edited in place.
A copy made by `dataclasses.replace` is built afresh from the old fields, the filled-in protocol among them,
as if the user had set it: the new url was refused with "Fix: leave protocol empty (it is taken from url)",
which is what the user had done, and which repeated does the same.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from torch_checkpointing.errors import ConfigError
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig


def test_a_replaced_url_of_another_store_is_refused_naming_protocol_empty(tmp_path: Path) -> None:
    first = FsspecStorageConfig(url="memory://bucket/run")
    with pytest.raises(ConfigError, match=r"dataclasses\.replace.*protocol=''") as refused:
        dataclasses.replace(first, url=tmp_path.as_uri())
    fixed = dataclasses.replace(first, url=tmp_path.as_uri(), protocol="")  # what the message says to do
    assert fixed.protocol == "file", refused.value
