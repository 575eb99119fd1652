"""`agreement.agree_outcome`: a collective step whose results stay local either goes on on every rank or on none.

The ranks here are threads exchanging through an in-memory `Transport` (the protocol `agree_outcome` is written
against); tests/test_load_agreement_multirank.py runs the loads that use it on real gloo ranks.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from torch_checkpointing.agreement import Contribution, agree_outcome
from torch_checkpointing.errors import CheckpointError, CommitError, CorruptCheckpointError, TemplateMismatchError


@dataclass
class _Board:
    """What every thread-rank posted for the current step."""

    world_size: int
    posted: dict[int, Contribution] = field(default_factory=dict)
    barrier: threading.Barrier = field(init=False)

    def __post_init__(self) -> None:
        self.barrier = threading.Barrier(self.world_size, timeout=30)


@dataclass
class _ThreadTransport:
    rank: int
    world_size: int
    board: _Board

    def exchange(self, step: str, mine: Contribution) -> list[Contribution]:
        self.board.posted[self.rank] = mine
        self.board.barrier.wait()
        out = [self.board.posted[r] for r in range(self.world_size)]
        self.board.barrier.wait()
        return out


def _run(computes: list[Callable[[], Any]], shared: list[Any] | None = None) -> list[Any]:
    """Each rank's `agree_outcome` result, or the exception it raised."""
    board = _Board(len(computes))
    results: list[Any] = [None] * len(computes)

    def rank(r: int) -> None:
        transport = _ThreadTransport(r, len(computes), board)
        try:
            results[r] = agree_outcome("Checkpoint load of ck", transport, computes[r], (shared or [None] * 9)[r])
        except BaseException as exc:
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(computes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _raise(exc: BaseException) -> Callable[[], Any]:
    def compute() -> Any:
        raise exc

    return compute


def test_every_rank_goes_on_when_every_rank_succeeded() -> None:
    results = _run([lambda: "a", lambda: "b"], shared=["ck/1", "ck/2"])
    assert results == [("a", ["ck/1", "ck/2"]), ("b", ["ck/1", "ck/2"])]


def test_one_rank_failing_makes_every_rank_raise_the_same_kind() -> None:
    damaged = CorruptCheckpointError("File ck/model_1.pt fails its CRC32 check")
    results = _run([lambda: "a", _raise(damaged), lambda: "c"])
    assert results[1] is damaged  # the failing rank raises its own exception
    for peer in (results[0], results[2]):
        assert type(peer) is CorruptCheckpointError, peer
        assert "rank(s) [1]" in str(peer) and "model_1.pt" in str(peer)


def test_the_failing_rank_hears_of_the_other_failures() -> None:
    first, second = CorruptCheckpointError("model_0.pt damaged"), CorruptCheckpointError("model_1.pt damaged")
    results = _run([_raise(first), _raise(second)])
    assert results == [first, second]
    if sys.version_info >= (3, 11):
        assert any("model_1.pt" in note for note in first.__notes__)
        assert any("model_0.pt" in note for note in second.__notes__)


@pytest.mark.parametrize(
    "failure",
    [ValueError("bad into="), TemplateMismatchError("shape (4,) vs (2,)")],
    ids=["not a checkpoint error", "another kind"],
)
def test_mixed_or_foreign_failures_raise_checkpoint_error_on_the_peers(failure: Exception) -> None:
    results = _run([lambda: "a", _raise(CorruptCheckpointError("model_1.pt damaged")), _raise(failure)])
    if isinstance(failure, ValueError):
        assert results[2] is failure
    assert type(results[0]) is CheckpointError
    assert "rank 1: CorruptCheckpointError" in str(results[0]) and type(failure).__name__ in str(results[0])


def test_a_lost_peer_is_this_steps_failure_not_a_commit() -> None:
    class Lost:
        rank, world_size = 0, 2

        def exchange(self, step: str, mine: Contribution) -> list[Contribution]:
            raise CommitError("x: lost contact. Nothing was committed.", {0: "lost contact with the other ranks"})

    with pytest.raises(CheckpointError, match="Checkpoint load of ck: rank 0: lost contact") as info:
        agree_outcome("Checkpoint load of ck", Lost(), lambda: "a")
    assert not isinstance(info.value, CommitError)


@pytest.mark.parametrize(
    ("failure", "said"),
    [
        (KeyboardInterrupt(), "KeyboardInterrupt: the rank was interrupted (Ctrl-C"),
        (SystemExit(3), "SystemExit: the rank's process is exiting (sys.exit(3)"),
        (ValueError(), "ValueError: raised without a message"),
    ],
    ids=["ctrl-c", "sys.exit", "no message"],
)
def test_a_peers_failure_without_words_still_says_what_happened(failure: BaseException, said: str) -> None:
    """Round 25: the other ranks read a Ctrl-C on rank 1 as "rank 1: KeyboardInterrupt: ." (a SystemExit as its
    bare exit code "SystemExit: 3"): nothing told them that rank 1 was interrupted or exiting."""
    results = _run([lambda: "a", _raise(failure)])
    assert results[1] is failure
    assert said in str(results[0]), results[0]
