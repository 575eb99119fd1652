"""A key an object store cannot name (no UTF-8: a surrogate, even one standing for a byte of a non-UTF-8 file
name) is refused naming it, against the real moto server (tests/s3_server.py).

Before, `save("run/\\udcff")` on S3 failed as an `ObjectStoreError` ("lookup of s3://.../run/\\udcff failed:
UnicodeEncodeError: 'utf-8' codec can't encode character ...: surrogates not allowed"): a store failure, which
a caller retries or falls back from, for an id no retry can store; the readers said the same of a root.
"""

from __future__ import annotations

import pytest
import torch

from tests.s3_server import S3Server
from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError, ObjectStoreError

_ID = "run/step_\udcff"


def test_a_save_to_a_key_no_utf8_holds_is_refused_naming_it(s3_server: S3Server) -> None:
    config = s3_server.config()
    manager_config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=config)
    with CheckpointManager(manager_config) as manager:
        with pytest.raises(ConfigError) as caught:
            manager.save(_ID, {"m": {"x": torch.ones(2)}})
        assert not isinstance(caught.value, ObjectStoreError)
        assert "\\udcff" in str(caught.value) and "UTF-8" in str(caught.value), str(caught.value)
        manager.save("run/step_1", {"m": {"x": torch.ones(2)}})  # the store itself works
    assert [c.path for c in list_checkpoints("run", config.create_storage())] == ["run/step_1"]


@pytest.mark.parametrize("spelling", ["relative", "url"])
def test_a_reader_root_no_utf8_holds_is_refused_naming_it(s3_server: S3Server, spelling: str) -> None:
    config = s3_server.config()
    root = "run\udcff" if spelling == "relative" else f"{config.url}/run\udcff"
    with pytest.raises(ConfigError) as caught:
        list_checkpoints(root, config.create_storage())
    assert "\\udcff" in str(caught.value) and "UTF-8" in str(caught.value), str(caught.value)
