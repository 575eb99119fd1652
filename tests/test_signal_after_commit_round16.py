"""A signal handler's exception that lands right after a sync save's commit (round 16).

Defect: a preemption handler (`signal.signal(SIGTERM, lambda *a: sys.exit(3))`) whose SIGTERM landed after the
swap that puts a save in place over an existing id, while the replaced copy was being removed, left that copy
beside the id (`.<id>.tmp-*` after an atomic exchange, `.old_<id>_<pid>-<nonce>` after the fallback's two
renames), logged nowhere; and the note on the SystemExit said "it was committed ...; an earlier checkpoint
there, if any, is intact", which is false once the commit replaced it.

Each case runs a child process with the real handler; the child sends itself a real SIGTERM from a storage hook
placed at one step of the commit, so the signal lands at a known point.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.probes import REPO
from torch_checkpointing import CheckpointManager
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.retention import collect_garbage

_CHILD = r"""
import json, logging, os, signal, sys
from dataclasses import dataclass
from pathlib import Path
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage import filesystem
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

root, case = sys.argv[1], sys.argv[2]
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def term(times):
    for _ in range(times):
        os.kill(os.getpid(), signal.SIGTERM)


class Hooked(LocalFileSystemStorage):
    # Sends SIGTERM at the step `case` names; "fallback" cases replace without the atomic exchange (NFS).
    fired = False

    def _hook(self, step, path):
        if Hooked.fired or not case.endswith(step):
            return
        Hooked.fired = True
        term(2 if case.startswith("twice") else 1)

    def replace_directory(self, src, dst):
        if "fallback" in case:
            return Storage.replace_directory(self, src, dst)
        return super().replace_directory(src, dst)

    def rmdir(self, path):
        if path.name.startswith(".") and ("removal" in case):
            self._hook("removal", path)
        return super().rmdir(path)

    def rename(self, src, dst, *args, **kwargs):
        super().rename(src, dst, *args, **kwargs)
        if Path(dst).name == "ck" and ".tmp-" in Path(src).name:
            self._hook("renamed", Path(dst))

    def sync_directory(self, path):
        if ".tmp-" in path.name and not os.path.exists(path / ".incomplete"):
            self._hook("precommit", path)  # the manifest is written, the swap not yet done
        return super().sync_directory(path)


def exchange_then_term():
    # The atomic exchange itself (renameat2), then the signal: it lands right after the commit step.
    real = exchange()

    def exchanged(*args):
        result = real(*args)
        if result == 0:
            Hooked._hook(None, "renamed", None)
        return result

    return exchanged


exchange = filesystem._renameat2
if case == "exchange-renamed":
    filesystem._renameat2 = exchange_then_term


@dataclass
class HookedConfig(LocalFileSystemStorageConfig):
    use_direct_io: bool = False

    def create_storage(self):
        return Hooked(self)


signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))  # a job's preemption handler
with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
    manager.save(f"{root}/ck", {"model": {"w": torch.ones(4)}})
config = CheckpointManager.Config.with_sync_save()
config.storage_config = HookedConfig()
manager = CheckpointManager(config)
try:
    manager.save(f"{root}/ck", {"model": {"w": torch.full((4,), 2.0)}})
except SystemExit as exc:
    print("REPORT " + json.dumps({"code": exc.code, "notes": getattr(exc, "__notes__", []), "fired": Hooked.fired}))
    raise
print("REPORT " + json.dumps({"code": None, "notes": [], "fired": Hooked.fired}))
"""


def _run(tmp_path: Path, case: str) -> tuple[dict[str, object], str, Path]:
    script, root = tmp_path / "child.py", tmp_path / "ckpts"
    script.write_text(_CHILD)
    done = subprocess.run(
        [sys.executable, str(script), str(root), case], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("REPORT ")]
    assert lines, f"{done.stdout}\n{done.stderr}"
    report = json.loads(lines[0][len("REPORT ") :])
    assert report["fired"], f"the hook for {case} never ran:\n{done.stderr}"
    assert done.returncode == 3 and report["code"] == 3, f"{done.returncode}\n{done.stderr}"
    return report, done.stderr, root


def _loaded(root: Path) -> float:
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        out = manager.load(str(root / "ck"), into={"model": {"w": torch.zeros(4)}})
    return float(out["model"]["w"][0])


@pytest.mark.parametrize("case", ["exchange-removal", "fallback-removal", "exchange-renamed", "fallback-renamed"])
def test_a_sigterm_right_after_the_commit_leaves_nothing_beside_the_id(tmp_path: Path, case: str) -> None:
    """Defect: a SIGTERM handler's sys.exit() landing after the swap (or while the replaced copy was removed)
    left a hidden `.tmp-*`/`.old_*` directory beside the id; the removal now finishes before the handler runs."""
    report, err, root = _run(tmp_path, case)
    assert sorted(p.name for p in root.iterdir()) == ["ck"], err
    assert _loaded(root) == 2.0  # the new checkpoint is in place
    note = " ".join(str(n) for n in report["notes"])  # type: ignore[union-attr]
    assert "the new checkpoint is in place" in note, note
    assert "earlier checkpoint there, if any, is intact" not in note, note
    assert "nothing was committed" not in err, err  # the save's log line says the same as its note


def test_a_sigterm_before_the_commit_says_the_earlier_checkpoint_is_intact(tmp_path: Path) -> None:
    """The message says the truth when nothing was committed: the earlier checkpoint is intact."""
    report, err, root = _run(tmp_path, "exchange-precommit")
    assert sorted(p.name for p in root.iterdir()) == ["ck"], err
    assert _loaded(root) == 1.0
    note = " ".join(str(n) for n in report["notes"])  # type: ignore[union-attr]
    assert "nothing was committed" in note and "earlier checkpoint there, if any, is intact" in note, note


@pytest.mark.parametrize("case", ["twice-exchange-removal", "twice-fallback-removal"])
def test_a_second_sigterm_during_the_removal_is_logged_with_the_leftover_for_gc(tmp_path: Path, case: str) -> None:
    """A signal sent again while the replaced copy is removed runs its handler at once (the way out of a long
    removal): what is left is named in a WARNING on the torch_checkpointing logger, and gc lists and removes it."""
    report, err, root = _run(tmp_path, case)
    assert _loaded(root) == 2.0
    left = [Path(o.path) for o in list_leftovers(root)]
    on_disk = sorted(p.name for p in root.iterdir() if p.name != "ck")
    assert on_disk and sorted(p.name for p in left) == on_disk, (on_disk, left)
    for path in left:
        assert str(path) in err and "torch_checkpointing" in err, err
    note = " ".join(str(n) for n in report["notes"])  # type: ignore[union-attr]
    assert "the new checkpoint is in place" in note, note
    assert sorted(o.path for o in collect_garbage(root).removed) == sorted(map(str, left))  # its process is gone
    assert sorted(p.name for p in root.iterdir()) == ["ck"] and _loaded(root) == 2.0
