"""Round 27: a load whose /proc went away, or was replaced, after the engine's import.

A load holds each checked file open and hands its mapping and decoding callers `/proc/self/fd/N`, the path of
the held descriptor. Whether /proc names descriptors was judged once, at import. Where /proc was unmounted or
covered since (as a sandbox that hides it does), every load with `use_mmap=True` (the default) failed, calling
an intact checkpoint "damaged or crafted". And where another filesystem was mounted there, the path named
whatever file it held: the load decoded that file, not the checked one. Run in a mount namespace of the child's
own (`unshare -m`), skipped where that is not allowed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_CHILD = """
import os, shutil, subprocess, sys
import torch
from torch_checkpointing import CheckpointManager, ItemSpec, SyncCheckpointSaverConfig
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization

root, how = sys.argv[1], sys.argv[2]
items = {"weights": ItemSpec(layout=LayoutInfo("w.safetensors", SafetensorsSerialization())), "model": ItemSpec()}
config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), items=items)


def state(value):
    return {"weights": {"w": torch.full((4,), value)}, "model": {"b": torch.full((3,), value), "n": int(value)}}


with CheckpointManager(config) as manager:  # /proc is whole here: the import and the saves see it
    manager.save(os.path.join(root, "good"), state(1.0))
    manager.save(os.path.join(root, "other"), state(7.0))
subprocess.run(["mount", "-t", "tmpfs", "none", "/proc"], check=True)  # this mount namespace's alone
if how == "replaced":  # a /proc of another filesystem, naming other files where the held descriptors' are
    os.makedirs("/proc/self/fd")
    planted = next(n for n in os.listdir(os.path.join(root, "other")) if n.startswith("model"))
    for fd in range(3, 256):
        shutil.copyfile(os.path.join(root, "other", planted), f"/proc/self/fd/{fd}")
assert not os.path.exists("/proc/self/fd/0")
with CheckpointManager(config) as manager:
    into = state(0.0)
    loaded = manager.load(os.path.join(root, "good"), into)
print(repr((loaded["weights"]["w"].tolist(), loaded["model"]["b"].tolist(), loaded["model"]["n"])))
"""


def _unshare() -> None:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("no unshare(1) or mount(8) here")
    if subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode != 0:
        pytest.skip("no right to make a mount namespace here")


@pytest.mark.parametrize("how", ["hidden", "replaced"])
def test_a_load_after_proc_went_away_or_was_replaced_reads_the_checked_files(tmp_path: Path, how: str) -> None:
    # Before: hidden: UndecodableFileError "... cannot be decoded (FileNotFoundError: ... '/proc/self/fd/N');
    # the file is damaged or crafted"; replaced: the other checkpoint's file decoded in place of the checked one.
    _unshare()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    (tmp_path / "root").mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = ["unshare", "-m", "--propagation", "private", sys.executable, str(script), str(tmp_path / "root"), how]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == repr(([1.0] * 4, [1.0] * 3, 1)), done.stdout
