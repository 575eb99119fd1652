"""Round 17: saves that must not lose data, delete what is not theirs, hang, or fail silently."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# ------------------------------------------------------------------ a save() made from inside a save()

_NESTED = textwrap.dedent(
    """
    import os, sys, torch
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.errors import CheckpointError

    if __name__ == "__main__":
        root, which = sys.argv[1], sys.argv[2]
        config = CheckpointManager.Config.with_sync_save()
        seen = []

        def callback(checkpoint_id, _):
            try:
                manager.save(f"{root}/inner", {"model": {"w": torch.zeros(2)}})
                seen.append("returned")
            except CheckpointError as exc:
                seen.append(str(exc))

        setattr(config, which, callback)
        manager = CheckpointManager(config)
        manager.save(f"{root}/outer", {"model": {"w": torch.ones(2)}})
        manager.config.pre_finalize_callback = manager.config.finalize_callback = None
        manager.save(f"{root}/after", {"model": {"w": torch.full((2,), 3.0)}})  # the manager still saves
        manager.close()
        print("RESULT", seen, sorted(os.listdir(root)), flush=True)
    """
)


@pytest.mark.parametrize("which", ["finalize_callback", "pre_finalize_callback"])
def test_a_save_from_a_save_callback_is_refused_instead_of_hanging(tmp_path: Path, which: str) -> None:
    # Before: the callback's save() waited for the save that called the callback, which waited for the callback:
    # the process hung for good (no timeout applies to that lock).
    script = tmp_path / "nested.py"
    script.write_text(_NESTED)
    root = tmp_path / "run"
    root.mkdir()
    try:
        run = subprocess.run(
            [sys.executable, str(script), str(root), which], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"a save() from the {which} hung: {exc.stdout!r} {exc.stderr!r}")
    assert run.returncode == 0, run.stdout + run.stderr
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT"))
    assert "'after', 'outer']" in line and "inner" not in line.split("]")[-2], line
    assert "from inside the save of" in line and "outer" in line and "Save it after" in line, line
