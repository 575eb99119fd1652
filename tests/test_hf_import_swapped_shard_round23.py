"""`import_hf` of a directory whose shard is swapped for a FIFO after its type was checked (round 23).

A downloaded directory is untrusted input. `import_hf` checked that each shard was a regular file, then opened
it by name (twice: once to read its header, once in safetensors): a FIFO put in its place between the check and
the open blocked the import forever, and a file swapped between the two opens was read by safetensors unchecked.
The index is already read without blocking (`_regular_bytes`); the shards now are too: each is opened once,
without blocking, its type checked on the open descriptor, and read through that descriptor only.

The swap is made at the moment it matters (right after the type check) by wrapping that check, so the race is
the same on every run; the import runs in a child with a timeout, so the old hang fails the test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60

_CHILD = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch
    from torch_checkpointing import hf
    from torch_checkpointing.errors import CheckpointError

    checked = hf.os.stat

    def swap_after_check(path, *args, **kwargs):
        st = checked(path, *args, **kwargs)
        if str(path).endswith("model.safetensors") and not os.path.exists(str(path) + ".done"):
            open(str(path) + ".done", "w").close()
            os.replace(path, str(path) + ".orig")
            os.mkfifo(path)
        return st

    hf.os.stat = swap_after_check
    template = {"w": torch.zeros(4)}
    try:
        hf.import_hf(sys.argv[1], into=template)
        print("RESULT loaded", template["w"].tolist())
    except CheckpointError as exc:
        print("RESULT refused", type(exc).__name__, exc)
    print("RESULT unchanged" if not template["w"].any() else "RESULT changed")
    """
)


def test_a_shard_swapped_for_a_fifo_after_its_check_is_refused_not_waited_on(tmp_path: Path) -> None:
    """Defect: the import blocked opening the FIFO (the child ran past its timeout)."""
    save_file({"w": torch.arange(4.0)}, str(tmp_path / "model.safetensors"))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-2000:]
    assert lines[0].startswith("RESULT refused UnsafeCheckpointError"), lines
    assert "model.safetensors" in lines[0] and "regular file" in lines[0], lines
    assert lines[-1] == "RESULT unchanged", lines
