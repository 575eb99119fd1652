"""A save's claim on this host holding a pid no process can have, or made "in the future" (round 33).

Round 33 made a claim whose pid or created is no finite number no claim. The same mistake stays with finite
numbers out of their range. A pid past what a pid holds (`99999999999`) failed gc and every save of the id
with a bare `OverflowError` from `os.kill` ("signed integer is greater than maximum"); a pid of 0 or below
asked `os.kill` about a process group (0: our own, always there), so the claim was "alive". And a claim
created a year from now is never older than 24 h: the id was refused to every later save, forever.

Against the real moto server (tests/s3_server.py): on an object store a save claims its id in place.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.s3_server import S3Server
from tests.test_claim_numbers_round33 import gc_collects_and_a_save_takes_over
from torch_checkpointing.commit import STALE_CLAIM_S
from torch_checkpointing.names import pid_alive, this_host

_YEAR_S = 365 * 86400.0


def _claim(pid: int, created: float, host: str) -> bytes:
    """A claim made on `host` by a job whose owner lock cannot be checked (no uid): on this host judged by its
    pid, on another by its age alone."""
    return json.dumps({"token": "t", "uid": "", "host": host, "pid": pid, "created": created}).encode()


@pytest.mark.parametrize("pid", [0, -1, 2**31, 99_999_999_999])
def test_a_pid_no_process_can_have_is_not_alive(pid: int) -> None:
    assert pid_alive(pid) is False


_DEAD = [
    pytest.param(99_999_999_999, 0.0, id="pid-past-pid_t"),
    pytest.param(0, 0.0, id="pid-0"),
    pytest.param(-1, 0.0, id="pid-negative"),
    pytest.param(1, _YEAR_S, id="created-a-year-ahead"),  # another host's: only the age tells
]


@pytest.mark.parametrize(("pid", "ahead_s"), _DEAD)
def test_gc_collects_and_a_save_takes_over_such_a_claim(s3_server: S3Server, pid: int, ahead_s: float) -> None:
    assert ahead_s == 0.0 or ahead_s > STALE_CLAIM_S
    marker = _claim(pid, time.time() + ahead_s, this_host() if ahead_s == 0.0 else "elsewhere#0badc0de")
    gc_collects_and_a_save_takes_over(s3_server, marker)
