"""Object-store defects found in round 25, against a real S3 API server (moto) on loopback.

* A directory move on S3 (retention putting a whole copy back under its id, gc putting a trash back) put its
  `.incomplete` marker up with a plain PUT. The caller checked that no save held the id first, but a save that
  claimed the id after that check lost its claim to the PUT (and the move's copy then mixed its files with the
  save's): the marker is now created only if absent, or replaces only a dead claim of ours still as judged.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch

from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager
from torch_checkpointing.commit import Claim
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.manifest import INCOMPLETE_MARKER

pytest.importorskip("s3fs")


def _live_claim_of_a_save() -> bytes:
    """The claim a save of this (live) process makes before its first upload."""
    return Claim("step_9.tmp-ab12cd34-1", "", socket.gethostname(), os.getpid(), time.time(), tags=True).to_bytes()


def test_a_move_onto_an_id_a_save_has_claimed_leaves_the_claim_and_moves_nothing(s3_server: S3Server) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    claim = _live_claim_of_a_save()
    marker = Path("run/step_9") / INCOMPLETE_MARKER
    assert storage.create_object(marker, claim)  # a save claims the id after the mover's check
    with pytest.raises(ObjectStoreError, match=r"run/step_9/\.incomplete") as refused:
        storage.rename(Path("run/step_1"), Path("run/step_9"), is_directory=True)
    assert "another save" in str(refused.value), refused.value
    assert storage.read(marker) == claim  # the save still holds its id
    assert storage.ls(Path("run/step_9")) == [INCOMPLETE_MARKER]  # and nothing was copied among its files
    with sync_manager(config) as manager:  # the source is as it was
        assert torch.equal(manager.load("run/step_1")["model"]["w"], state(1.0)["model"]["w"])
