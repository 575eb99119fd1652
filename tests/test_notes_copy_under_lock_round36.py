"""A copy of a config carrying notes is taken whole, never half-way through a check (round 36).

`CarriesNotes.__getstate__` (what `copy.copy`, `copy.deepcopy` and a pickle call: a manager's snapshot, the
writer process's config) copied the fields and the notes without the lock that a check holds while it rewrites
them: a copy taken while another thread rechecked the config (a manager being built from it) caught the check
half-way, an `FsspecStorageConfig` whose protocol the check had cleared to take it again from its url.
"""

from __future__ import annotations

import copy
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from torch_checkpointing.config import recheck, snapshot
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

_SECONDS = 3.0


@pytest.fixture
def switch_often() -> Iterator[None]:
    """Threads switch every microsecond, so a copy meets a check at any of its steps."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _rechecking(config: FsspecStorageConfig, stop: threading.Event, failed: list[BaseException]) -> None:
    try:
        while not stop.is_set():
            recheck(config)
    except BaseException as exc:  # reported by the test's thread
        failed.append(exc)


@pytest.mark.usefixtures("switch_often")
@pytest.mark.parametrize(
    "copier",
    [copy.copy, copy.deepcopy, lambda config: pickle.loads(pickle.dumps(config)), snapshot],
    ids=["copy", "deepcopy", "pickle", "snapshot"],
)
def test_a_copy_meets_no_check_half_way(copier: Callable[[FsspecStorageConfig], FsspecStorageConfig]) -> None:
    config = FsspecStorageConfig(url="s3://bucket/prefix")
    assert config.protocol == "s3"
    stop, failed = threading.Event(), list[BaseException]()
    checker = threading.Thread(target=_rechecking, args=(config, stop, failed), daemon=True)
    checker.start()
    torn, copies, deadline = list[str](), 0, time.monotonic() + _SECONDS
    try:
        while time.monotonic() < deadline and not torn:
            made = copier(config)
            copies += 1
            if made.protocol != "s3":
                torn.append(made.protocol)
    finally:
        stop.set()
        checker.join(timeout=30)
    assert not checker.is_alive() and not failed, failed
    assert not torn, f"copy {copies} was taken half-way through a check: protocol {torn[0]!r}, not 's3'"
