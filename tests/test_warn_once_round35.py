"""A config warns once per field, also when two threads build managers from it at the same moment.

`warn_once` read the config's note, warned, then wrote the note: two threads building a manager each from one
config (an evaluation thread beside training) both read "not said yet" while the other was inside
`warnings.warn`, and the FutureWarning came twice (docs/api_differences.md: "building many managers from one
config warns once"). The race is made certain with a `showwarning` that holds the first warning until a second
one comes (or a while passes: a second that waits for the first is never shown meanwhile).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from torch_checkpointing import CheckpointManager

SECOND_S = 5.0  # how long the first warning waits for a racing second one; no outcome depends on it


def test_two_threads_building_managers_from_one_config_warn_once() -> None:
    config = CheckpointManager.Config.with_sync_save()
    config.save.writer_config.checkpoint_write_barrier_timeout_sec = 5  # set after construction: said at a build
    shown: list[str] = []
    second = threading.Event()

    def show(message: Any, *_args: Any, **_kwargs: Any) -> None:
        shown.append(str(message))
        if len(shown) == 1:
            second.wait(SECOND_S)  # the second's arrival, if it can come before this returns
        else:
            second.set()

    managers: list[CheckpointManager] = []
    failures: list[BaseException] = []

    def build() -> None:
        try:
            managers.append(CheckpointManager(config))
        except BaseException as exc:  # named by the assertion below
            failures.append(exc)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        threads = [threading.Thread(target=build) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    for manager in managers:
        manager.close()
    assert not failures, failures
    barrier = [m for m in shown if "checkpoint_write_barrier_timeout_sec" in m]
    assert len(barrier) == 1, shown
