"""A copy of a config (copy.copy, copy.deepcopy, a pickle: what the writer process receives) keeps what the
engine noted about it: the protocol FsspecStorageConfig filled in from its url follows an edited url on the copy
as on the original, and rebuilding from `vars()` still sees only the fields."""

import copy
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from torch_checkpointing import CheckpointManager
from torch_checkpointing import config as config_module
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

COPIES: dict[str, Callable[[Any], Any]] = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": lambda config: pickle.loads(pickle.dumps(config)),
}


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_config_takes_its_edited_urls_protocol(how: str, tmp_path: Any) -> None:
    config = FsspecStorageConfig(url="memory://notes-travel/a")
    copied = COPIES[how](config)
    copied.url = tmp_path.as_uri()
    copied.create_storage()  # refused before: "is a file:// path, but this storage talks to memory://"
    assert copied.protocol == "file"
    assert config.protocol == "memory"


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_config_rebuilds_from_its_fields(how: str) -> None:
    copied = COPIES[how](FsspecStorageConfig(url="memory://notes-travel/b"))
    rebuilt = type(copied)(**vars(copied))
    assert rebuilt == copied


def test_a_protocol_the_user_gave_is_still_kept_on_a_copy(tmp_path: Any) -> None:
    copied = copy.deepcopy(FsspecStorageConfig(url="memory://notes-travel/c", protocol="memory"))
    copied.url = tmp_path.as_uri()
    with pytest.raises(Exception, match="talks to memory://"):
        copied.create_storage()


@dataclass(slots=True)
class _Credentials:
    """A user's value in a config's dict: a slots dataclass takes no weak reference."""

    key: str = "k"


def test_a_dataclass_without_weak_references_in_a_config_builds_a_manager() -> None:
    storage = FsspecStorageConfig(url="memory://notes-travel/d", storage_options={"creds": _Credentials()})
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage)
    with CheckpointManager(config) as manager:  # TypeError: cannot create weak reference to '_Credentials' object
        assert manager.config.storage_config is storage
    assert config_module._NOTES.get(id(storage.storage_options["creds"])) is None
