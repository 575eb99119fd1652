"""Two real gloo ranks where only rank 1's save holds an item its writer could not encode (round 8).

An async save encodes JSON and safetensors items in the writer process, so such an item was refused only through
rank 1's Future, after every rank had handed its save over. The refusal now comes from save() itself, in the plan
every rank agrees on: every rank raises the same `CommitError` from save(), naming rank 1, nothing is written, and
the next save works on every rank.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from simulator.launcher import launch
from tests.rank_outcomes import record_outcome
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo, SafetensorsSerialization
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

pytestmark = pytest.mark.multirank
WORLD = 2
WAIT_S = 20


def unencodable_on_rank_1(root: str, fmt_name: str) -> dict[str, Any]:
    rank = dist.get_rank()
    json_fmt = fmt_name == "json"
    fmt = JsonSerialization() if json_fmt else SafetensorsSerialization()
    layout = LayoutInfo("meta_{rank}.json" if json_fmt else "meta_{rank}.safetensors", fmt)
    config = CheckpointManager.Config(
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False), items={"meta": ItemSpec(layout=layout)}
    )
    config.save.wait_timeout_secs = WAIT_S
    out: dict[str, Any] = {"rank": rank}
    good: Any = {"step": 1} if json_fmt else {"a": {"b": torch.ones(2)}}
    bad: Any = {"seen": {1, 2}} if json_fmt else {"a.b": torch.ones(2), "a": {"b": torch.ones(2)}}
    with CheckpointManager(config) as manager:
        started = time.monotonic()
        payload = {"model": torch.ones(4), "meta": bad if rank == 1 else good}
        record_outcome(out, "bad", lambda: manager.save(f"{root}/bad", payload), returned="save() returned")
        out["bad_s"] = time.monotonic() - started
        dist.barrier()
        out["bad_exists"] = Path(root, "bad").exists()
        future = manager.save(f"{root}/after", {"model": torch.full((4,), 3.0), "meta": good})
        assert future is not None
        future.result(WAIT_S * 3)
        out["after"] = float(manager.load(f"{root}/after", {"model": torch.zeros(4), "meta": None})["model"][0])
    return out


FORMATS = ("json", "safetensors")


def each_format_one_after_another(root: str) -> dict[str, dict[str, Any]]:
    """Both formats' cases in one launch (ranks are seconds each to start), each in a directory and with a manager
    of its own, its result under the format's name."""
    return {fmt_name: unencodable_on_rank_1(f"{root}/{fmt_name}", fmt_name) for fmt_name in FORMATS}


@pytest.fixture(scope="module")
def each_format(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("round8c")
    for fmt_name in FORMATS:
        (root / fmt_name).mkdir()
    return launch(each_format_one_after_another, WORLD, args=(str(root),), timeout=480)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_an_item_rank_1_could_not_encode_is_refused_from_save_on_every_rank(
    each_format: list[dict[str, dict[str, Any]]], fmt_name: str
) -> None:
    for r in (per_rank[fmt_name] for per_rank in each_format):
        assert r["bad"].startswith("CommitError:"), r  # before: save() returned a Future on every rank
        assert r["failures"] == [1], r
        assert r["bad_s"] < WAIT_S, r  # a wait of the save's timeout at least is a rank not told at once
        assert not r["bad_exists"], r
        assert r["after"] == 3.0, r
