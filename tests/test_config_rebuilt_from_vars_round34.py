"""A configuration rebuilt from its own fields (`type(c)(**vars(c))`, a common way to copy a dataclass with one
field changed) works after the engine checked or warned about it.

The engine kept notes about a config object in the object's own `__dict__` (the fields it had warned about; the
protocol it filled in from the url): `vars(config)` then held names no `__init__` takes, and rebuilding raised
`TypeError: ... got an unexpected keyword argument '_protocol_taken'` (four S3 race tests do exactly this).
The notes are kept outside the object now; what they promise (a warning once per config object, an edited url
taking its protocol anew) still holds.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.config import CheckpointWriterConfig, recheck


def test_an_fsspec_config_rebuilt_from_vars() -> None:
    config = FsspecStorageConfig(url="memory://bucket/run")
    rebuilt = FsspecStorageConfig(**{**vars(config), "url": "file:///tmp/run", "protocol": ""})
    assert rebuilt.protocol == "file"
    assert set(vars(config)) == {f.name for f in dataclasses.fields(FsspecStorageConfig)}


def test_a_config_warned_about_rebuilt_from_vars() -> None:
    with pytest.warns(FutureWarning, match="checkpoint_write_barrier_timeout_sec"):
        config = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=30)
    assert set(vars(config)) == {f.name for f in dataclasses.fields(CheckpointWriterConfig)}
    with pytest.warns(FutureWarning, match="checkpoint_write_barrier_timeout_sec"):
        CheckpointWriterConfig(**vars(config))  # a new object: told again


def test_the_notes_still_hold() -> None:
    with pytest.warns(FutureWarning):
        config = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recheck(config)
    assert not caught, [str(w.message) for w in caught]  # once per config object
    storage = FsspecStorageConfig(url="memory://bucket/run")
    storage.url = "file:///tmp/run"
    recheck(storage)
    assert storage.protocol == "file"  # filled in from the url, so taken anew from the edited one
