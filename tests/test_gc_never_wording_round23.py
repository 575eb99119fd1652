"""`gc --older-than inf` (and `RetentionPolicy(unowned_after_s=math.inf)`) means "never collect a temporary whose
owner cannot be checked here". Before, each kept one said "owner unknown on this host and only 3s old (< infs)":
a number of seconds that is none. Now it says the threshold is never reached, and how to collect it."""

from __future__ import annotations

import math
from pathlib import Path

from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage


def test_an_infinite_age_threshold_is_said_as_never(tmp_path: Path) -> None:
    temporary = tmp_path / ".step_7.tmp-0123456789ab-1"  # a save from another host (no lock file of it here)
    temporary.mkdir()
    (temporary / INCOMPLETE_MARKER).touch()
    report = collect_garbage(tmp_path, unowned_after_s=math.inf, dry_run=True)
    assert [leftover.path for leftover, _ in report.kept] == [str(temporary)], report
    why = report.kept[0][1]
    assert "infs" not in why and "never reached" in why and "--older-than" in why, why
    finite = collect_garbage(tmp_path, unowned_after_s=3600.0, dry_run=True).kept[0][1]
    assert "(< 3600s)" in finite, finite
