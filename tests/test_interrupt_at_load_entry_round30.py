"""A SIGINT that lands as `load()` is entered says nothing was restored, like one anywhere else in it (round 30).

`load()` made its call token (`object()`, a C call: CPython runs a signal handler at its return) before the `try`
that notes an interrupt, so a Ctrl-C landing there raised a KeyboardInterrupt with no note, where one a statement
later said "nothing was restored". The signal here is real and lands deterministically in that call: the token's
maker, looked up in the manager's module, is replaced by one that sends SIGINT to its own process first.
"""

from __future__ import annotations

from tests.probes import fresh_json

CHILD = """
import json, os, signal, tempfile, time
import torch
from torch_checkpointing import CheckpointManager, checkpoint_manager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

def state(value):
    return {"model": {"a": torch.full((8,), float(value))}}

config = CheckpointManager.Config.with_sync_save()
config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
manager = CheckpointManager(config)
root = tempfile.mkdtemp()
manager.save(f"{root}/c", state(7))
made = []

def token_then_sigint():
    del checkpoint_manager.object  # once: the next call is the builtin again
    made.append(1)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # Python's own handler raises in here
    return object()

checkpoint_manager.object = token_then_sigint
into = state(0)
out = {}
try:
    manager.load(f"{root}/c", into)
    out["raised"] = "nothing"
except KeyboardInterrupt as exc:
    out["raised"] = "KeyboardInterrupt"
    out["notes"] = getattr(exc, "__notes__", [])
out["made"] = len(made)
out["held"] = float(into["model"]["a"][0])
out["again"] = float(manager.load(f"{root}/c", state(0))["model"]["a"][0])
manager.close()
print(json.dumps(out))
"""


def test_an_interrupt_at_the_entry_of_load_says_nothing_was_restored() -> None:
    """Defect: {"raised": "KeyboardInterrupt", "notes": [], ...}: no note, where the interrupt one statement later
    says "Load of .../c was interrupted (KeyboardInterrupt) before any template was changed: nothing was
    restored"."""
    out = fresh_json(CHILD)
    assert out["made"] == 1 and out["raised"] == "KeyboardInterrupt", out
    assert out["held"] == 0.0, out
    assert len(out["notes"]) == 1, out
    assert "Load of" in out["notes"][0] and "nothing was restored" in out["notes"][0], out
    assert out["again"] == 7.0, out  # and the manager loads again (the call was not left registered)
