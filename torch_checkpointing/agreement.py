"""Cross-rank agreement: every collective step of a save goes through `agree`.

Each rank contributes a result or an error; every rank receives every contribution; if any rank failed, every
rank raises the *same* `CommitError` naming the failed ranks and their reasons. A rank therefore never waits
in a collective that a peer has already left, and no rank reports success for a save another rank refused.

Two transports carry the contributions: the manager's gloo group (`GroupTransport`, for the plan) and the
TCPStore hosted by rank 0's trainer (`StoreTransport`, for the commit verdict from the writer processes, which
have no process group). A transport failure (a peer or the store's host went away, a timeout) is itself turned
into a `CommitError` naming the rank that went silent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from torch_checkpointing.errors import CommitError

__all__ = ["Contribution", "GroupTransport", "StoreTransport", "Transport", "agree", "describe", "raise_if_failed"]

logger = logging.getLogger("torch_checkpointing.agreement")

T = TypeVar("T")


@dataclass(frozen=True)
class Contribution:
    """One rank's answer to one step: a JSON/pickle-friendly value, or the reason it failed."""

    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> str:
        return json.dumps({"ok": self.value} if self.ok else {"error": self.error})

    @classmethod
    def from_json(cls, text: str) -> Contribution:
        d = json.loads(text)
        return cls(error=str(d["error"])) if "error" in d else cls(value=d["ok"])


class Transport(Protocol):
    """Moves one contribution per rank to every rank, in rank order; raises on a lost or silent peer."""

    rank: int
    world_size: int

    def exchange(self, step: str, mine: Contribution) -> list[Contribution]: ...


def describe(exc: BaseException) -> str:
    """The one-line reason a rank reports for a failure."""
    if isinstance(exc, CommitError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def raise_if_failed(step: str, contributions: Sequence[Contribution], cause: BaseException | None = None) -> None:
    """The same `CommitError` on every rank when any contribution failed."""
    failures = {r: c.error for r, c in enumerate(contributions) if c.error is not None}
    if not failures:
        return
    reasons = "; ".join(f"rank {r}: {why.rstrip('.')}" for r, why in sorted(failures.items()))
    error = CommitError(f"{step} failed on rank(s) {sorted(failures)}: {reasons}. Nothing was committed.", failures)
    raise error from cause


def agree(step: str, transport: Transport, compute: Callable[[], T]) -> list[T]:
    """Run `compute` on this rank, share its result or error, and return every rank's result.

    Raises one `CommitError` (identical on every rank) if any rank's `compute` failed or a rank went silent.
    A `BaseException` that is not an `Exception` (KeyboardInterrupt) is still reported to the peers, then re-raised.
    """
    if transport.world_size == 1:
        return [compute()]  # nobody to agree with: the original error (ValueError, ...) is the clearest
    cause: BaseException | None = None
    try:
        mine = Contribution(value=compute())
    except BaseException as exc:
        cause, mine = exc, Contribution(error=describe(exc))
        if not isinstance(exc, Exception):
            _best_effort_exchange(step, transport, mine)
            raise
    contributions = transport.exchange(step, mine)
    raise_if_failed(step, contributions, cause)
    return [c.value for c in contributions]


def _best_effort_exchange(step: str, transport: Transport, mine: Contribution) -> None:
    try:
        transport.exchange(step, mine)
    except Exception as exc:  # we are leaving anyway; the peers learn from the timeout
        logger.debug("Could not tell the other ranks about the failure at %s: %r", step, exc)


@dataclass
class GroupTransport:
    """`all_gather_object` over the manager's own gloo group; a peer's failure becomes a `CommitError`."""

    rank: int
    world_size: int
    group: Any

    def exchange(self, step: str, mine: Contribution) -> list[Contribution]:
        if self.world_size == 1:
            return [mine]
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, (mine.value, mine.error), group=self.group)
        except Exception as exc:  # gloo: a peer died or timed out (DistError / RuntimeError with C++ frames)
            reason = _first_line(exc)
            raise CommitError(
                f"{step}: rank {self.rank} lost contact with its peers ({reason}); a rank died, hung, or never "
                f"called save(). Nothing was committed.",
                {self.rank: f"lost contact with the other ranks: {reason}"},
            ) from None
        return [Contribution(value=v, error=e) for v, e in out]


@dataclass
class StoreTransport:
    """Publish-and-gather over a `StoreChannel` (keys `<step>/<rank>`); silent ranks are named."""

    rank: int
    world_size: int
    channel: Any

    def exchange(self, step: str, mine: Contribution) -> list[Contribution]:
        self.channel.publish(f"{step}/{self.rank}", mine.to_json())
        texts = self.channel.gather(step, self.world_size, f"its answer to {step!r}")
        return [Contribution.from_json(t) for t in texts]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
