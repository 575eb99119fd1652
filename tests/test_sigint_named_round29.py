"""A SIGINT that nobody pressed Ctrl-C for (`kill -INT pid` from another process, a scheduler) is named as the
signal it is (round 29).

Python's handler cannot tell who sent a SIGINT (it gets no siginfo), and the engine never waits for SIGINT with
`sigwaitinfo`, so a message cannot say "Ctrl-C" as a fact. Before, every message about a held or reported SIGINT
said "Ctrl-C": "Load of …: Ctrl-C during the copy into the templates", "Checkpoint save of … interrupted
(Ctrl-C): nothing was committed". Now they say "SIGINT (Ctrl-C)": the signal, and its usual sender.
Each case runs in a child process that a real `kill -INT` from another process interrupts.
"""

from __future__ import annotations

import re

from tests.probes import fresh_json

CHILD = """
import json, logging, tempfile
import torch
from tests.sigint_at import sigint_at
from torch_checkpointing import CheckpointManager, checkpoint_loader, checkpoint_writer
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

lines = []
class Lines(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("torch_checkpointing").addHandler(Lines(logging.WARNING))

config = CheckpointManager.Config.with_sync_save()
config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
manager = CheckpointManager(config)
root = tempfile.mkdtemp()
manager.save(f"{root}/c", {"m": {"a": torch.ones(4)}})
out = {}
sigint_at(checkpoint_loader.CheckpointLoader, "_copy", 0.3, from_kill=True)  # held: the copy runs after it
try:
    manager.load(f"{root}/c", {"m": {"a": torch.zeros(4)}})
except KeyboardInterrupt as exc:
    out["load"] = str(exc)
sigint_at(checkpoint_writer, "_write_entry", 5, from_kill=True)
try:
    manager.save(f"{root}/d", {"m": {"a": torch.ones(4)}})
except KeyboardInterrupt as exc:
    out["save"] = str(exc)
out["warnings"] = lines
manager.close()
print(json.dumps(out))
"""


def test_a_sigint_from_kill_is_named_sigint() -> None:
    out = fresh_json(CHILD)
    held = [line for line in out["warnings"] if "during the copy into the templates" in line]
    # Before: "Load of …/c: Ctrl-C during the copy into the templates; its handler runs once …"
    assert len(held) == 1 and ": SIGINT (Ctrl-C) during the copy" in held[0], out
    # Before: "Checkpoint save of …/d interrupted (Ctrl-C): nothing was committed at …"
    assert "interrupted by SIGINT (Ctrl-C): nothing was committed" in out["save"], out
    for said in [*out["warnings"], out["save"]]:  # never "Ctrl-C" alone, as if someone had pressed it
        assert not re.search(r"(?<!SIGINT \()Ctrl-C", said), said
