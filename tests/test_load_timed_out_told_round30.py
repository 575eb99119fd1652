"""A load that a signal handler's own exception left says what the caller's templates hold (round 30).

Round 29's note (tests/test_interrupted_load_told_round29.py) was added to a KeyboardInterrupt or SystemExit
only. A handler may raise any exception: the signals held during a load's copy include SIGALRM, whose handler
raising TimeoutError is how a program bounds a call (the `signals` module names it). Such a load raised a bare
TimeoutError having changed the templates: whole after the held alarm ran past the copy, or partly restored
where the alarm was sent again, and the caller could not tell which from an error that changed nothing. An
error that leaves the templates as they were (the check phase's) gets no note: it changed nothing.
"""

from __future__ import annotations

import pytest

from tests.probes import fresh_json
from tests.test_interrupted_load_told_round29 import CHILD

_ALARM = """
def _alarm(signum, frame):
    raise TimeoutError("the load took too long")
signal.signal(signal.SIGALRM, _alarm)
"""
_CHILD = (
    CHILD.replace("os.kill(os.getpid(), signal.SIGINT)", "os.kill(os.getpid(), signal.SIGALRM)")
    .replace("point = sys.argv[1]\n", "point = sys.argv[1]\n" + _ALARM)
    .replace("except KeyboardInterrupt as exc:", "except TimeoutError as exc:")
)

# point -> what the templates hold after the alarm, and the words of the note that say so (None: no note)
_EXPECTED = {
    "check": ({"model": 0.0, "extra": 0.0}, None),
    "copy": ({"model": 7.0, "extra": 7.0}, "after the copy had finished: every template holds the checkpoint"),
    "copy_cut_short": ({"model": 7.0, "extra": 0.0}, "the templates may be partly restored"),
    "after": ({"model": 7.0, "extra": 7.0}, "after the copy had finished: every template holds the checkpoint"),
}


@pytest.mark.parametrize("point", sorted(_EXPECTED))
def test_a_timeout_raised_by_a_handler_says_what_the_templates_hold(point: str) -> None:
    """Defect: `notes == []` at every point, the templates whole or partly restored."""
    assert _CHILD != CHILD and "SIGALRM" in _CHILD  # the round-29 child, with the alarm in place of Ctrl-C
    out = fresh_json(_CHILD, point)
    held, words = _EXPECTED[point]
    assert out["raised"] == "KeyboardInterrupt", out  # (the child's word for: the TimeoutError left load())
    assert out["held"] == held, out
    if words is None:
        assert out["notes"] == [], out
    else:
        assert len(out["notes"]) == 1 and words in out["notes"][0] and "TimeoutError" in out["notes"][0], out
    assert out["again"] == 7.0, out
