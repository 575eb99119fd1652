"""A Ctrl-C during the roll call after a broken exchange runs its handler at once, as before round 30 (round 31).

Round 30 moved the gather's `except` inside the signal hold (so that a held handler's own exception is raised as
itself at the hold's end). The roll call that follows a broken gather (`RollCall.lost`: rank 0 waits up to the
group's timeout and a grace for the survivors to report in, the others up to twice that for the verdict) moved
into the hold with it: a Ctrl-C there was held, with a WARNING promising it would run "once every rank's answer
is in", for an exchange that had already ended, until the roll call was over. Here the exchange breaks for real
(torch's gather, with no process group to gather over), and the roll call, waiting as the store's does, sends
this process a real SIGINT and waits; whether it ran to its end is the outcome.
"""

from __future__ import annotations

from tests.probes import fresh_process

_CHILD = r"""
import os, signal, time
from torch_checkpointing.agreement import Contribution, GroupTransport
from torch_checkpointing.errors import CommitError

ran_to_its_end = []

class WaitingRollCall:
    def next_exchange(self):
        return 0

    def lost(self, exchange, step, reason, started):
        os.kill(os.getpid(), signal.SIGINT)
        end = time.monotonic() + 30  # the wait for the survivors (a hang bound: a SIGINT run at once ends it)
        while time.monotonic() < end:
            time.sleep(0.05)
        ran_to_its_end.append(True)
        return CommitError(f"{step}: rank 0 lost contact ({reason})", {0: reason})

transport = GroupTransport(rank=0, world_size=2, group=None, roll_call=WaitingRollCall())
try:
    transport.exchange("Checkpoint save of ck: planning", Contribution(value=1))
    print("returned")
except BaseException as exc:
    print(type(exc).__name__, bool(ran_to_its_end))
"""


def test_a_ctrl_c_during_the_roll_call_is_not_held() -> None:
    """Defect: "KeyboardInterrupt True": the SIGINT was held until the roll call had waited to its end."""
    done = fresh_process(_CHILD, timeout=120)
    assert done.stdout.split() == ["KeyboardInterrupt", "False"], done.stdout + done.stderr
