"""`import_hf` of a shard truncated after it was opened (round 24, issue #10).

safetensors maps the shard: a shard truncated after the header check (a download rewritten, another process
truncating it) made the first touch of a page past its new end kill the whole process with SIGBUS. The import
must return what the shard held when it was opened, or raise a `CheckpointError` naming the shard, and never
change a template when it raises.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120
N = 1 << 20  # float32 values: 4 MiB, many pages past the truncation point

_CHILD = textwrap.dedent(
    """
    import os, sys
    import safetensors
    import torch
    from torch_checkpointing import hf
    from torch_checkpointing.errors import CheckpointError

    shard, template_kind = sys.argv[1], sys.argv[2]
    opened = safetensors.safe_open
    entered = []

    class open_then_truncate:
        def __init__(self, *args, **kwargs):
            self._handle = opened(*args, **kwargs)

        def __enter__(self):
            handle = self._handle.__enter__()
            entered.append(shard)
            if len(entered) == 2:  # the import's open (the first lists a lone shard's names)
                os.truncate(shard, 4096)  # after the header was read and the file mapped
            return handle

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

    safetensors.safe_open = open_then_truncate
    template = {"w": torch.zeros(int(sys.argv[3]))} if template_kind == "template" else None
    try:
        out = hf.import_hf(os.path.dirname(shard), into=template)
        print("RESULT loaded", float(out["w"].sum()))
    except CheckpointError as exc:
        print("RESULT refused", type(exc).__name__, exc)
        if template is not None:
            print("RESULT unchanged" if not template["w"].any() else "RESULT changed")
    """
)


@pytest.mark.parametrize("template_kind", ["template", "none"])
def test_a_shard_truncated_after_it_was_opened_does_not_kill_the_import(tmp_path: Path, template_kind: str) -> None:
    shard = tmp_path / "model.safetensors"
    values = torch.arange(N, dtype=torch.float32)
    save_file({"w": values}, str(shard))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(shard), template_kind, str(N)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode != -signal.SIGBUS, "the import touched a mapping of the truncated shard: SIGBUS"
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-2000:]
    if lines[0].startswith("RESULT loaded"):
        assert float(lines[0].split()[-1]) == float(values.sum()), lines
    else:
        assert lines[0].startswith("RESULT refused") and "model.safetensors" in lines[0], lines
        assert lines[1:] in ([], ["RESULT unchanged"]), lines
