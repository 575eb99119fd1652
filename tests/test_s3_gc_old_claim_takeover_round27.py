"""gc of an earlier version's unfinished save on S3 never takes away a save that took the id over meanwhile.

An earlier version's save claims its id with an empty `.incomplete` (or a claim that names neither tags nor
records): gc collects such a prefix whole, by moving it to a trash name and removing that. A save of the id
that takes the dead claim over between gc's judgement and its move (a restarted job saving the same step)
lost its claim and every file it had uploaded to the move: gc moved them into its trash, deleted them, and the
save, knowing nothing of it, committed a manifest whose files were gone. The save runs in a real child process
on the real test server, paused just before its manifest; gc is let go on right after it judged the prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.s3_server import S3Server, missing_s3_packages
from tests.test_s3_attacks import _held_save, sync_manager
from torch_checkpointing import retention
from torch_checkpointing.retention import collect_garbage

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")


def test_gc_of_an_old_engines_unfinished_save_leaves_a_save_that_took_the_id_over(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: the save printed SAVED over an id whose files gc had removed (its load failed), or gc's move left
    the id holding only the manifest."""
    config = s3_server.config()
    storage = config.create_storage()
    # An earlier version's killed save: its claim is dead. Only the marker: files beside an empty marker that no
    # manifest lists may be a user's, and gc leaves such a prefix whole (test_gc_users_files_round33).
    storage.write(Path("run/z/.incomplete"), b"")
    children = []
    judge = retention._why_keep

    def judged_then_taken_over(leftover: Any, *args: Any, **kwargs: Any) -> str | None:
        why = judge(leftover, *args, **kwargs)
        if why is None and leftover.path.endswith("run/z") and not children:
            children.append(_held_save(s3_server, config, tmp_path, "run/z", "manifest"))  # takes the id over
        return why

    monkeypatch.setattr(retention, "_why_keep", judged_then_taken_over)
    try:
        report = collect_garbage(f"{config.url}/run", storage)
    finally:
        (tmp_path / "release").touch()
        output = children[0].communicate(timeout=120)[0].decode(errors="replace") if children else ""
    assert children, report
    assert "SAVED" in output, output
    assert not report.removed, report
    with sync_manager(config) as manager:
        assert torch.equal(manager.load("run/z")["model"]["w"], torch.full((1000,), 1.0))


# gc of `sys.argv[2]`/run on the test server, killed once it holds the earlier version's prefix, before the move.
_KILLED_GC = """
import json, os, signal, sys
from torch_checkpointing import retention
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

args = json.loads(sys.argv[1])
config = FsspecStorageConfig(url=args["url"], storage_options=args["options"])
def killed(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
retention._move_and_remove = killed
retention.collect_garbage(args["url"] + "/run", config.create_storage())
"""


def test_an_old_engines_unfinished_save_whose_gc_was_killed_holding_it_is_collected_whole(
    s3_server: S3Server,
) -> None:
    """gc's claim over an earlier version's prefix is one the next gc collects whole: had it said "records"
    (as gc's claim over a recording save's does), the next gc removed only the recorded names (none) and left
    the killed save's files for good, the marker gone."""
    import json
    import os
    import signal
    import subprocess
    import sys

    config = s3_server.config()
    storage = config.create_storage()
    # Only the marker: files beside it that no manifest lists may be a user's, and gc leaves such a prefix whole
    # (test_gc_users_files_round33), so gc holds and moves only prefixes whose every file is ours.
    storage.write(Path("run/z/.incomplete"), b"")
    args = json.dumps({"url": config.url, "options": s3_server.storage_options()})
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    gc = subprocess.run([sys.executable, "-c", _KILLED_GC, args], env=env, capture_output=True, timeout=120)
    assert gc.returncode == -signal.SIGKILL, gc.stderr.decode(errors="replace")[-2000:]
    assert b'"collects"' in storage.read(Path("run/z/.incomplete"))  # gc's claim was up when it was killed
    report = collect_garbage(f"{config.url}/run", storage)
    assert [Path(lo.path).name for lo in report.removed] == ["z"], report
    assert not storage.exists(Path("run/z/.incomplete")) and not storage.exists(Path("run/z"))
