"""Multi-rank agreement when a rank goes away, on real gloo ranks (round 17; one 3-rank launch).

The collective steps of a save (the plan, the target check) and of a load go over the manager's gloo group. gloo
tells a survivor only that a connection broke ("Connection reset by peer [127.0.0.1]:port") or that it timed
out, never which rank went: each survivor raised its own CommitError, "rank 0 lost contact", "rank 2 lost
contact", naming itself and not the rank that died or never called save(). Now the survivors report in on rank
0's store and every one of them raises the same CommitError naming the silent rank, within the timeout.

When rank 0 itself dies, its store (which the commit step uses) goes with it, and each survivor raised the
client's own words in its CommitError ("Connection reset by peer" on one, "Failed to recv, got 0 bytes" on
another): two different errors for one event. Now they raise one.

The ranks are spawned here (not by `simulator.launcher.launch`, which stops every rank once one dies): rank 1 is
SIGKILLed in the middle of its save, and the others must still finish.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.probes import children_import_from, published_store

pytestmark = pytest.mark.multirank
WORLD = 3
TIMEOUT_S = 6  # save.wait_timeout_secs: the gloo group's timeout too
BOUND_S = 2 * TIMEOUT_S + 15  # the roll call waits at most the collective's timeout and a grace past it
REPO = Path(__file__).resolve().parent.parent
_STORE_WAIT = timedelta(seconds=120)


def _rank(rank: int, root: str, out_dir: str, scenario: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    from tests.async_multirank_support import timed
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing import checkpoint_manager as cm
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    store = published_store(rank, WORLD, out_dir, _STORE_WAIT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=_STORE_WAIT)

    def manager() -> CheckpointManager:
        config = CheckpointManager.Config.with_sync_save()
        config.save.wait_timeout_secs = TIMEOUT_S
        config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
        return CheckpointManager(config)

    out: dict[str, Any] = {}
    state = {"model": {"w": torch.full((8,), float(rank))}}
    if scenario == "rank0":  # rank 0 is SIGKILLed while it writes its files: ranks 1 and 2 lose its store
        from torch_checkpointing import checkpoint_writer as cw

        killed = manager()
        if rank == 0:

            def dying_write(*args: Any, **kwargs: Any) -> Any:
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)

            cw._write_local_files = dying_write  # type: ignore[assignment]
        out["rank0"] = timed(lambda: killed.save(f"{root}/rank0", state))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        os._exit(0)
    # 1. rank 2 never calls save() (it is busy elsewhere): ranks 0 and 1 give up naming it, with one error.
    first = manager()
    if rank == 2:
        time.sleep(TIMEOUT_S + 12)  # past the others' roll call
        out["absent"] = None
    else:
        out["absent"] = timed(lambda: first.save(f"{root}/absent", state))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))  # rank 1 does not live to write the rest
    dist.barrier()  # the default group, not the manager's (which the failure broke)
    # 2. rank 1 is SIGKILLed in the middle of its save (in the plan step): ranks 0 and 2 name it, with one error.
    second = manager()
    if rank == 1:
        planned = cm.agree

        def dying(step: str, *args: Any, **kwargs: Any) -> Any:
            if "the plan" in step:
                os.kill(os.getpid(), signal.SIGKILL)
            return planned(step, *args, **kwargs)

        cm.agree = dying  # type: ignore[assignment]
    out["killed"] = timed(lambda: second.save(f"{root}/killed", state))
    out["killed_left"] = os.path.exists(f"{root}/killed")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    os._exit(0)  # the default group lost rank 1: no clean teardown to wait for


def _launch(root: Path, scenario: str) -> dict[int, dict[str, Any]]:
    out_dir = root / "out"
    out_dir.mkdir()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(root), str(out_dir), scenario)) for r in range(WORLD)]
    with children_import_from(REPO):
        for p in procs:
            p.start()
    deadline = time.monotonic() + 240
    try:
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    return {
        r: json.loads((out_dir / f"rank{r}.json").read_text())
        for r in range(WORLD)
        if (out_dir / f"rank{r}.json").exists()
    }


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _launch(tmp_path_factory.mktemp("round17"), "ranks")


def test_rank_0_sigkilled_mid_write_fails_the_others_with_one_error(tmp_path: Path) -> None:
    got = _launch(tmp_path, "rank0")
    assert "rank0" not in got.get(0, {}), got  # it was killed
    results = [got[r]["rank0"] for r in (1, 2)]
    for one in results:
        assert one["result"].startswith("CommitError: ") and "rank 0" in one["result"], results
        assert one["elapsed"] < BOUND_S, results
    assert results[0]["result"] == results[1]["result"], results
    assert not (tmp_path / "rank0").exists()


def test_a_rank_that_never_calls_save_is_named_by_one_error_on_every_other_rank(
    outcomes: dict[int, dict[str, Any]],
) -> None:
    got = [outcomes[r]["absent"] for r in (0, 1)]
    for one in got:
        assert one["result"].startswith("CommitError: ") and "[2]" in one["result"], got
        assert one["elapsed"] < BOUND_S, got
    assert got[0]["result"] == got[1]["result"], got  # before: "rank 0 lost contact" / "rank 1 lost contact"


def test_a_rank_sigkilled_mid_save_is_named_by_one_error_on_every_other_rank(
    outcomes: dict[int, dict[str, Any]],
) -> None:
    assert "killed" not in outcomes[1], outcomes  # it was killed
    got = [outcomes[r]["killed"] for r in (0, 2)]
    for one in got:
        assert one["result"].startswith("CommitError: ") and "rank(s) [1]" in one["result"], got
        assert one["elapsed"] < BOUND_S, got
    assert got[0]["result"] == got[1]["result"], got
    assert not outcomes[0]["killed_left"] and not outcomes[2]["killed_left"]  # nothing committed


class _GoneStore:
    """A TCPStore client whose host died, failing with the words one rank's socket saw."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def set(self, *args: Any) -> None:
        raise self.exc

    def check(self, *args: Any) -> bool:
        raise self.exc


def test_losing_rank_0s_store_is_one_error_whatever_each_client_saw() -> None:
    from torch_checkpointing.errors import CommitError
    from torch_checkpointing.store_channel import StoreAddress, StoreChannel

    said = set()
    for exc in (RuntimeError("Connection reset by peer"), RuntimeError("Failed to recv, got 0 bytes")):
        channel = StoreChannel(StoreAddress("127.0.0.1", 1, "ns"), 5.0, _GoneStore(exc))
        with pytest.raises(CommitError, match="lost contact with rank 0") as caught:
            channel.publish("step/1", "answer")
        said.add(str(caught.value))
    assert len(said) == 1, said
