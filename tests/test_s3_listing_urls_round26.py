"""Warnings of a listing on an object store name URLs a user can pass on.

`Path` folds `s3://bucket/run` into `s3:/bucket/run`, which neither `aws s3` nor this library's CLI takes back:
round 23 made leftovers and gc's report name `s3://` URLs; the warnings of a listing (a checkpoint left aside
by a killed replace, with the gc command to run; a damaged manifest; a checkpoint passed as the root) and the
manifest errors behind them still named the folded spelling.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager
from torch_checkpointing import list_checkpoints
from torch_checkpointing.manifest import MANIFEST_FILE_NAME


def _left_aside(storage: Any, bucket: str) -> str:
    """`run/step_9` moved aside by a replace killed between its renames: nothing at the id."""
    for key in storage.fs.find(f"{bucket}/run/step_9"):
        storage.fs.cp_file(key, key.replace("/step_9/", "/.old_step_9_999999/"))
    storage.rmdir(Path("run/step_9"))
    return "run"


def _damaged(storage: Any, bucket: str) -> str:
    storage.fs.pipe_file(f"{bucket}/run/step_9/{MANIFEST_FILE_NAME}", b'{"kind": "torch_checkpointing.manifest", ')
    return "run"


@pytest.mark.parametrize(
    ("make", "listed", "said"),
    [
        (_left_aside, "run", ["run/.old_step_9_999999", "`torch-checkpointing gc {url}/run`"]),
        (_damaged, "run", ["{url}/run/step_9, a damaged checkpoint"]),
        (lambda storage, bucket: "run/step_9", "run/step_9", ["pass its parent directory {url}/run"]),
    ],
    ids=["left-aside", "damaged", "a-checkpoint-as-root"],
)
def test_what_a_listing_on_s3_warns_of_names_urls_a_user_can_pass_on(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture, make: Any, listed: str, said: list[str]
) -> None:
    """Before, these warnings named `s3:/bucket/run/...` (the spelling `Path` folds a URL into), which neither
    `aws s3` nor this library's CLI takes: "Run `torch-checkpointing gc s3:/bucket/run`" ran gc on a local path."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_9", state(9.0))
    storage = config.create_storage()
    make(storage, config.url.split("://", 1)[1])
    caplog.set_level(logging.WARNING, logger="torch_checkpointing")
    list_checkpoints(f"{config.url}/{listed}", storage)
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    for words in said:
        assert words.format(url=config.url) in text, text
    assert re.search(r"s3:/[^/]", text) is None, text
