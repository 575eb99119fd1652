"""A real SIGINT at each point of a single-rank load: what the caller's templates hold, and what the
KeyboardInterrupt says of them (round 29; the entry of load(), round 30).

The promise: load() returns exactly what was committed or raises having changed nothing. An interrupt in the
check phase changes nothing; one during the copy is held until the copy has finished (`signals`); one after it
(the read context closing) finds the templates whole. Before, each raised a bare KeyboardInterrupt, and the
caller could not tell an untouched template from a restored one. Now a note says which: nothing changed, loaded
whole, or (the signal sent again, the documented way out of a copy that does not end) cut short in the copy.
Each point runs in a child process, so that the interrupt lands on a main thread with Python's own handler.
"""

from __future__ import annotations

import pytest

from tests.probes import fresh_json

CHILD = """
import json, logging, signal, sys, tempfile
import torch
from tests.sigint_at import sigint_at
from torch_checkpointing import CheckpointManager, checkpoint_loader, checkpoint_manager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

point, signum = sys.argv[1], signal.Signals[sys.argv[2]]
if signum == signal.SIGALRM:  # how a program bounds a call: its handler raises TimeoutError
    def on_alarm(signum, frame):
        raise TimeoutError("the load took too long")
    signal.signal(signal.SIGALRM, on_alarm)
lines = []
class Lines(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("torch_checkpointing").addHandler(Lines(logging.WARNING))

def state(value):
    return {"model": {"a": torch.full((8,), float(value))}, "extra": {"b": torch.full((8,), float(value))}}

config = CheckpointManager.Config.with_sync_save()
config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
manager = CheckpointManager(config)
root = tempfile.mkdtemp()
manager.save(f"{root}/c", state(7))
copying = lambda *a, **k: not k.get("dry_run", False) and "unexpected" in k
if point == "entry":  # the call token load() makes first (a C call: a handler runs at its return)
    checkpoint_manager.object = object
    sigint_at(checkpoint_manager, "object", 5, signum=signum)
elif point == "check":
    sigint_at(checkpoint_loader, "check_shared_targets", 5, signum=signum)
elif point == "copy":
    sigint_at(checkpoint_loader, "walk_checkpoint_structure", 5, when=copying, signum=signum)
elif point == "copy_cut_short":
    sigint_at(checkpoint_loader, "walk_checkpoint_structure", 5, times=2, nth=2, when=copying, signum=signum)
elif point == "after":
    sigint_at(checkpoint_loader.CheckedLoad, "close", 5, signum=signum)
into = state(0)
out = {}
try:
    manager.load(f"{root}/c", into)
    out["raised"] = "nothing"
except (KeyboardInterrupt, TimeoutError) as exc:
    out["raised"] = type(exc).__name__
    out["notes"] = getattr(exc, "__notes__", [])
out["held"] = {k: float(into[k][n][0]) for k, n in (("model", "a"), ("extra", "b"))}
out["warnings"] = lines
out["again"] = float(manager.load(f"{root}/c", state(0))["model"]["a"][0])
manager.close()
print(json.dumps(out))
"""

_NOTHING = "before any template was changed: nothing was restored"
_WHOLE = "after the copy had finished: every template holds the checkpoint"
# (signal, point) -> what the load raised, what the templates hold after it, and the words of the note that say
# so (None: no note). SIGINT: Python's own handler raises KeyboardInterrupt; before, no note at all ([]),
# whatever the templates held (round 30: one landing as load() is entered, too). SIGALRM, round 30: a handler's
# own exception (raising TimeoutError is how a program bounds a call) is held during the copy too; such a load
# raised a bare TimeoutError having changed the templates (whole, or partly restored where the alarm was sent
# again). One that changed nothing (the check phase's) gets no note.
EXPECTED = {
    ("SIGINT", "entry"): ("KeyboardInterrupt", {"model": 0.0, "extra": 0.0}, _NOTHING),
    ("SIGINT", "check"): ("KeyboardInterrupt", {"model": 0.0, "extra": 0.0}, _NOTHING),
    ("SIGINT", "copy"): ("KeyboardInterrupt", {"model": 7.0, "extra": 7.0}, _WHOLE),
    ("SIGINT", "copy_cut_short"): ("KeyboardInterrupt", {"model": 7.0, "extra": 0.0}, "cut short during the copy"),
    ("SIGINT", "after"): ("KeyboardInterrupt", {"model": 7.0, "extra": 7.0}, _WHOLE),
    ("SIGALRM", "check"): ("TimeoutError", {"model": 0.0, "extra": 0.0}, None),
    ("SIGALRM", "copy"): ("TimeoutError", {"model": 7.0, "extra": 7.0}, _WHOLE),
    ("SIGALRM", "copy_cut_short"): (
        "TimeoutError",
        {"model": 7.0, "extra": 0.0},
        "the templates may be partly restored",
    ),
    ("SIGALRM", "after"): ("TimeoutError", {"model": 7.0, "extra": 7.0}, _WHOLE),
}


@pytest.mark.parametrize(("signum", "point"), sorted(EXPECTED))
def test_the_interrupt_says_what_the_templates_hold(signum: str, point: str) -> None:
    out = fresh_json(CHILD, point, signum)
    raised, held, words = EXPECTED[signum, point]
    assert out["raised"] == raised, out
    assert out["held"] == held, out
    if words is None:
        assert out["notes"] == [], out
    else:
        assert len(out["notes"]) == 1 and words in out["notes"][0] and raised in out["notes"][0], out
        assert "Load of" in out["notes"][0] and "/c" in out["notes"][0], out
    assert out["again"] == 7.0, out  # the manager loads again afterwards


def test_a_single_rank_hold_speaks_of_the_copy_alone() -> None:
    out = fresh_json(CHILD, "copy", "SIGINT")
    held = [line for line in out["warnings"] if "during the copy into the templates" in line]
    # Before: "…: SIGINT (Ctrl-C) during the copy into the templates and the ranks' word on it; its handler runs
    # once every rank has said whether its copy finished (at most the process group's timeout) …", on one rank.
    assert len(held) == 1 and "rank" not in held[0] and "process group" not in held[0], out["warnings"]
