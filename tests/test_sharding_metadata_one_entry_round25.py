"""Sharding metadata naming one nested path or one rank twice, in two spellings, is refused (issue #10).

metadata.json keys are JSON text (a nested path '["w"]', a rank "0"), parsed after the duplicate-key check of the
file (which compares the strings). Two spellings of one key ('["w"]' and '[ "w" ]', "0" and "00") passed it, and
the parsed dict kept the last silently: one entry of the metadata was dropped, the load went on with the other
(the class of a JSON object naming a key twice, refused since round 9). Now refused, naming both spellings.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.test_verified_loads import _reshard_load, _reshard_save, _rewrite_metadata
from torch_checkpointing import CorruptCheckpointError


def _path_twice(d: dict[str, Any]) -> None:
    paths = d["metadata"]["model"]["nested_path_to_metadata"]
    paths['[ "w" ]'] = paths['["w"]']


def _rank_twice(d: dict[str, Any]) -> None:
    layouts = d["metadata"]["model"]["rank_to_layout_info"]
    layouts["00"] = layouts["0"]


@pytest.mark.parametrize(("craft", "spelling"), [(_path_twice, '[ "w" ]'), (_rank_twice, "00")], ids=["path", "rank"])
def test_a_key_given_twice_in_two_spellings_is_refused(tmp_path: Path, craft: Any, spelling: str) -> None:
    """Defect: both loads succeeded, one of the two entries dropped without a word."""
    root, _ = _reshard_save(tmp_path)
    _rewrite_metadata(root, craft)
    with warnings.catch_warnings(), pytest.raises(CorruptCheckpointError) as caught:
        warnings.filterwarnings("ignore", message=".*plain.*")
        _reshard_load(root)
    message = str(caught.value)
    assert "metadata.json" in message and "twice" in message and spelling in message, message
