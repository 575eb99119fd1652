"""A resharding load copies the bytes it checked, read from the file, never a view of its mapping (round 24).

The engine's DTensorResharder job checked each source block in the check phase and then copied it from a
memory map of the file in the copy phase: a source file written into in place between the two phases put
bytes nobody checked into the template, and one truncated between them killed the process with SIGBUS.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120

_CHILD = textwrap.dedent(
    """
    import os, sys, warnings
    import torch
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing import checkpoint_loader
    from torch_checkpointing.dtensor_resharder import DTensorResharder
    from torch_checkpointing.errors import CheckpointError

    warnings.simplefilter("ignore")
    root, damage = sys.argv[1], sys.argv[2]
    N = 1 << 17

    class AlwaysReshard(DTensorResharder):
        def should_reshard(self, source_metadata, target_metadata):
            return source_metadata is not None and target_metadata is not None

    config = CheckpointManager.Config.with_sync_save()
    config.items = {"model": ItemSpec(resharder=AlwaysReshard())}
    manager = CheckpointManager(config)
    saved = torch.arange(N, dtype=torch.float32)
    manager.save(root, {"model": {"w": saved}})
    source = os.path.join(root, "model_0.pt")
    restore = checkpoint_loader.CheckedLoad.restore

    def damage_then_restore(self):  # between the check phase and the copy
        data = open(source, "rb").read()
        at = data.find(torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes())
        if damage == "truncate":
            os.truncate(source, at + 4096)
        else:
            with open(source, "r+b") as handle:
                handle.seek(at + 4 * (N // 2))
                handle.write(b"\\xff" * 64)
        return restore(self)

    checkpoint_loader.CheckedLoad.restore = damage_then_restore
    template = {"w": torch.zeros(N)}
    try:
        manager.load(root, {"model": template})
        print("RESULT loaded", "saved" if torch.equal(template["w"], saved) else "other")
    except CheckpointError as exc:
        print("RESULT refused", type(exc).__name__, exc)
    """
)


@pytest.mark.parametrize("damage", ["truncate", "write"])
def test_a_source_changed_between_check_and_copy_is_refused_not_copied(tmp_path: Path, damage: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "ck"), damage],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode != -signal.SIGBUS, "the copy read a mapping of the truncated source: SIGBUS"
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    assert lines[0].startswith("RESULT refused CorruptCheckpointError"), lines
    assert "model_0.pt" in lines[0], lines
