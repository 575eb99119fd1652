"""A backend whose close() raises a refused async save again (the published 0.1.1) is not measured, not failed.

Before: the full-disk clause's overwrite probe closed its manager unguarded, so the refusal it had already
recorded escaped from close(), the fault process exited 1, and DUR-DISKFULL-1 was reported failed.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_conformance_premises import DURABILITY, KILL_ASYNC, _assert_refusal_not_measured, _run_clauses

REFUSES_IN_WRITER = "tests.conformance_backends.refuses_in_writer"
DISK_FULL_ASYNC = DURABILITY + "test_disk_full_fails_cleanly[async]"


def test_a_refusal_repeated_by_close_leaves_the_async_overwrite_clauses_not_measured(tmp_path: Path) -> None:
    result, out = _run_clauses(tmp_path, [DISK_FULL_ASYNC, KILL_ASYNC], ["--backend", REFUSES_IN_WRITER])
    _assert_refusal_not_measured(result, ["DUR-DISKFULL-1", "DUR-KILL-2"], out)
