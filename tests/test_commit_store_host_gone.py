"""Rank 0's trainer (the host of the checkpoint store) gone during the commit step: what another rank is told.

Rank 0's writer publishes the checkpoint inside the commit step. If rank 0's trainer dies then, its store goes
with it, and no other rank can learn whether the publish happened. Before, they raised "lost contact with rank 0
... No checkpoint was committed by this save", which is false whenever rank 0 had published. A real store,
hosted by a real process that dies at that moment; this process plays rank 1 of 2.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from torch_checkpointing import CommitOutcomeUnknownError
from torch_checkpointing.agreement import StoreTransport
from torch_checkpointing.checkpoint_writer import _agree_on_the_commit
from torch_checkpointing.store_channel import StoreAddress, StoreChannel

HOST = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
print(store.port, flush=True)
deadline = time.monotonic() + 120
while not store.check([sys.argv[1]]) and time.monotonic() < deadline:
    time.sleep(0.01)
os._exit(0)  # rank 0's trainer dies once rank 1 has answered the commit step: its store goes with it
"""


def test_the_store_host_gone_at_the_commit_step_is_an_unknown_outcome_not_nothing_committed() -> None:
    plan = SimpleNamespace(checkpoint_dir="/run/step_7", name="/run/step_7")  # a SavePlan as messages read it
    step = f"Checkpoint {plan.checkpoint_dir}: the commit"
    host = subprocess.Popen(
        [sys.executable, "-c", HOST, f"ns/{step}/1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        channel = StoreChannel(StoreAddress("127.0.0.1", port, "ns"), 60.0)
        with pytest.raises(CommitOutcomeUnknownError) as raised:
            _agree_on_the_commit(plan, StoreTransport(1, 2, channel), channel, lambda: None)  # type: ignore[arg-type]
    finally:
        host.kill()
        host.wait(timeout=60)
    message = str(raised.value)
    assert "No checkpoint was committed" not in message, message
    assert "rank 0 did not say whether it committed" in message, message
    assert "/run/step_7" in message and 0 in raised.value.failures, message
