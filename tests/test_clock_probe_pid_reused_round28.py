"""gc removes a killed process's clock probe once a later process has its pid.

A probe of the store's clock (`base_storage.store_now`) that a kill left is gc's to remove once its maker is
gone. Its maker counted alive while any process of this host had its pid: in a container, where pids are few and
soon given again, a probe stayed beside the checkpoints for as long as some unrelated process held that pid. The
other hidden names of ours are judged by when that process started (`discovery.hidden_name_alive`); the probe now
is too.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.test_put_back_asides import _process_with_pid
from torch_checkpointing.discovery import OWNER_STARTED_AFTER_S
from torch_checkpointing.names import host_tag, new_nonce
from torch_checkpointing.retention import collect_garbage


def _dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def test_gc_removes_a_probe_whose_dead_makers_pid_a_later_process_has(tmp_path: Path) -> None:
    """Defect: kept, GcReport(removed=[], ..., kept=[('.../.clock-probe-<pid>-...', 'its owner is alive')])."""
    pid = _dead_pid()
    probe = tmp_path / f".clock-probe-{pid}-{new_nonce()}-{host_tag()}"
    probe.touch()  # what a prober killed between its create and its removal leaves
    time.sleep(OWNER_STARTED_AFTER_S + 1)
    reuser = _process_with_pid(pid)
    try:
        report = collect_garbage(tmp_path, unowned_after_s=0)
    finally:
        reuser.kill()
        reuser.wait()
    assert not probe.exists(), report


def test_gc_keeps_a_probe_whose_maker_ran_before_it_was_made(tmp_path: Path) -> None:
    """The guard from the other side: a live process that ran when the probe was made may be writing it."""
    maker = subprocess.Popen(["sleep", "600"])
    try:
        probe = tmp_path / f".clock-probe-{maker.pid}-{new_nonce()}-{host_tag()}"
        probe.touch()
        time.sleep(OWNER_STARTED_AFTER_S + 1)
        report = collect_garbage(tmp_path, unowned_after_s=0)
    finally:
        maker.kill()
        maker.wait()
    assert probe.exists(), report
