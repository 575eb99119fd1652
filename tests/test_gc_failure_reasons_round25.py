"""A leftover that `gc` fails to remove is reported with why, in `--json` and in the text table, as `prune`
reports a checkpoint it could not delete.

Before: `GcReport.failed` held the leftovers alone; `gc --json` listed them under "failed" with no reason at
all and the text table said "FAILED (see log)", so a script (or an operator reading a cron job's stdout) could
not tell a permission problem from a store outage. The failure here is a real one: gc runs as an unprivileged
user in a child, and a folder inside the dead save's temporary belongs to root.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_unreadable_files_round24 import NOBODY, run_as_nobody
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage

CHILD = """
import contextlib, io, json, os, sys
from torch_checkpointing import cli
from torch_checkpointing.retention import collect_garbage
root = sys.argv[1]
cli.main(["--plain", "ls", root])  # imports what the commands import, while root can
import encodings.ascii  # what gc's trash names read the boot id with (the interpreter may be root's alone)
os.setgid(%(nobody)d)
os.setuid(%(nobody)d)
out = {}
for mode in ("--json", "--plain"):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli.main([mode, "gc", "--older-than", "0", root])
    out[mode] = {"code": code, "stdout": stdout.getvalue()}
report = collect_garbage(root, unowned_after_s=0.0)
out["api"] = [[os.path.basename(f[0].path), f[1]] if isinstance(f, tuple) else [f.path, None] for f in report.failed]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture
def blocked_leftover() -> Iterator[Path]:
    """A root an unprivileged user owns, holding a dead save's temporary whose subfolder only root may change."""
    base = Path(tempfile.mkdtemp(prefix="round25-gc-failure-"))
    try:
        root = base / "run"
        temporary = root / ".step_7.tmp-0123456789ab-1"  # no owner lock of it here: judged by age
        (temporary / "blocked").mkdir(parents=True)
        (temporary / INCOMPLETE_MARKER).touch()
        (temporary / "blocked" / "model_0.pt").write_bytes(b"x" * 10)
        os.chmod(base, 0o755)
        for p in (root, temporary, temporary / INCOMPLETE_MARKER):
            os.chown(p, NOBODY, NOBODY)
        yield root
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="drops to another user: needs root")
def test_gc_says_why_it_could_not_remove_a_leftover(blocked_leftover: Path) -> None:
    out = run_as_nobody(CHILD, str(blocked_leftover))
    said = out["--json"]
    assert said["code"] == 1, said
    doc = json.loads(said["stdout"])
    assert len(doc["failed"]) == 1 and doc["removed"] == [], doc
    reason = doc["failed"][0]["reason"]
    assert "Permission denied" in reason and "model_0.pt" in reason, reason
    text = out["--plain"]
    assert text["code"] == 1, text
    failed_rows = [row for row in text["stdout"].splitlines() if "FAILED" in row]
    assert len(failed_rows) == 1 and "Permission denied" in failed_rows[0], text["stdout"]
    assert "see log" not in text["stdout"], text["stdout"]
    ((name, why),) = out["api"]  # the API's report says it too: what the CLI shows comes from there
    assert name.startswith(".step_7.") and "Permission denied" in why, out["api"]


def test_a_leftover_gc_removes_is_no_failure(tmp_path: Path) -> None:
    """The other side: a dead temporary gc can remove is removed, and `failed` stays empty."""
    temporary = tmp_path / ".step_7.tmp-0123456789ab-1"
    (temporary / "sub").mkdir(parents=True)
    (temporary / INCOMPLETE_MARKER).touch()
    report = collect_garbage(tmp_path, unowned_after_s=0.0)
    assert report.failed == [] and [lo.path for lo in report.removed] == [str(temporary)], report
    assert not temporary.exists()
