"""A load whose custom resharders' templates were being put back when a signal stopped it says that they may be
partly restored, not that nothing was (round 29).

A custom resharder's own `load` writes into its template; the load puts every such template back when one fails
or is interrupted. Three SIGINTs (the first held, the second cutting the copy short, the third cutting the put-back
short: the way out of a block that hangs) left the templates as the resharders had filled them, and the
KeyboardInterrupt's note said "before any template was changed: nothing was restored". Runs in a child process
(`CheckpointLoaderConfig(collective=False)`: the load on this rank alone, which puts back once).

A collective load (one rank here) interrupted once its custom resharders ran puts their templates back between
its agreed steps: a second SIGINT there cut that short at once. It is now held until they are put back.
"""

from __future__ import annotations

from tests.probes import fresh_json

CHILD = """
import json, os, signal, sys, tempfile, time, warnings
import torch
from torch_checkpointing import CheckpointManager, ItemSpec, checkpoint_loader
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.resharding import Resharder

warnings.simplefilter("ignore")
collective = sys.argv[1] == "collective"

def sigint(times):
    for _ in range(times):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the held one: nothing; the others: Python's own handler raises in here

class Filling(Resharder):
    def __init__(self, interrupt):
        self.interrupt = interrupt
    def extract_sharding_metadata(self, item_key, item_value):
        return DTensorResharder().extract_sharding_metadata(item_key, item_value)
    def should_reshard(self, source_metadata, target_metadata):
        return source_metadata is not None
    def load(self, source_path, item_key, target_metadata, source_metadata, target, storage):
        target["w"].fill_(7.0)
        if self.interrupt:
            sigint(1 if collective else 2)
        return []

real_put_back = checkpoint_loader._TemplatesBefore.put_back
def put_back(self):
    sigint(1)  # alone: the third, run at once; collective: the second, in the steps' put-back
    real_put_back(self)
checkpoint_loader._TemplatesBefore.put_back = put_back

config = CheckpointManager.Config.with_sync_save()
config.load.collective = collective
config.items = {"a": ItemSpec(resharder=Filling(False)), "b": ItemSpec(resharder=Filling(True))}
manager = CheckpointManager(config)
root = tempfile.mkdtemp()
manager.save(f"{root}/ck", {k: {"w": torch.ones(4)} for k in ("a", "b")})
into = {k: {"w": torch.zeros(4)} for k in ("a", "b")}
out = {}
try:
    manager.load(f"{root}/ck", into)
except KeyboardInterrupt as exc:
    out["notes"] = getattr(exc, "__notes__", [])
out["held"] = {k: float(into[k]["w"][0]) for k in ("a", "b")}
checkpoint_loader._TemplatesBefore.put_back = real_put_back
manager.close()
print(json.dumps(out))
"""


def test_a_put_back_cut_short_is_told() -> None:
    out = fresh_json(CHILD, "alone")
    assert out["held"] == {"a": 7.0, "b": 7.0}, out  # what the resharders wrote: not put back
    # Before: ["Load of …/ck was interrupted (KeyboardInterrupt) before any template was changed: nothing was
    # restored."]
    assert len(out["notes"]) == 1 and "the templates may be partly restored" in out["notes"][0], out


def test_a_second_signal_while_a_collective_load_puts_back_is_held() -> None:
    out = fresh_json(CHILD, "collective")
    # Before: {'a': 7.0, 'b': 7.0}, the put-back cut short by the second SIGINT.
    assert out["held"] == {"a": 0.0, "b": 0.0}, out
    assert len(out["notes"]) == 1 and "nothing was restored" in out["notes"][0], out
