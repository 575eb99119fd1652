"""Cross-rank agreement: every collective step of a save goes through `agree`, each step of a load through
`agree_outcome`.

Each rank contributes a result or an error; every rank receives every contribution; if any rank failed, every
rank raises the *same* `CommitError` naming the failed ranks and their reasons. A rank therefore never waits
in a collective that a peer has already left, and no rank reports success for a save another rank refused.

Two transports carry the contributions: the manager's gloo group (`GroupTransport`, for the plan) and the
TCPStore hosted by rank 0's trainer (`StoreTransport`, for the commit verdict from the writer processes, which
have no process group). A transport failure (a peer or the store's host went away, a timeout) is itself turned
into a `CommitError` naming the rank that went silent.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from torch_checkpointing import errors
from torch_checkpointing.errors import CheckpointError, CommitError, CommitOutcomeUnknownError, add_note, log_safely
from torch_checkpointing.signals import Held, signals_deferred

__all__ = [
    "Contribution",
    "GroupTransport",
    "RollCall",
    "StoreTransport",
    "Transport",
    "agree",
    "agree_outcome",
    "describe",
    "raise_if_failed",
]

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
    """The reason a rank reports for a failure, read by the other ranks. A `CommitOutcomeUnknownError` keeps its
    name, so that every rank raises one (`raise_if_failed`) rather than "Nothing was committed"."""
    if isinstance(exc, CommitError) and not isinstance(exc, CommitOutcomeUnknownError):
        return str(exc)
    return f"{type(exc).__name__}: {_what_it_says(exc, str(exc).strip())}"


def _what_it_says(exc: BaseException, text: str) -> str:
    """`exc`'s message, or what it means where it says nothing. Ctrl-C's KeyboardInterrupt carries no message:
    the other ranks read "rank 1: KeyboardInterrupt: ." and were not told that rank 1 was interrupted; a
    SystemExit's message is its bare exit code."""
    if isinstance(exc, SystemExit):
        return f"the rank's process is exiting (sys.exit({exc.code!r}), e.g. from a signal handler) during this step"
    if text:
        return text
    if isinstance(exc, KeyboardInterrupt):
        # Not "SIGINT" alone: any signal's handler may raise it (a SIGTERM handled by `default_int_handler`).
        return "the rank was interrupted (Ctrl-C, or a signal whose handler raises KeyboardInterrupt) during this step"
    return "raised without a message"


def raise_if_failed(step: str, contributions: Sequence[Contribution], cause: BaseException | None = None) -> None:
    """The same `CommitError` on every rank when any contribution failed."""
    failures = _failures(contributions)
    if not failures:
        return
    if any(why.startswith(f"{CommitOutcomeUnknownError.__name__}: ") for why in failures.values()):
        # A rank that could not tell whether the step took effect (rank 0's trainer that could not read the id
        # for its dead writer): before, every rank said "Nothing was committed" of a checkpoint that could be in
        # place and load.
        raise CommitOutcomeUnknownError(
            f"{step} failed on rank(s) {sorted(failures)}: {_reasons(failures)}. Whether it was committed is not "
            f"known: the id holds its previous checkpoint or this one, whole. Load it to check, or save again.",
            failures,
        ) from cause
    raise _failed(step, failures) from cause


def _failed(step: str, failures: Mapping[int, str]) -> CommitError:
    """The error every rank raises for a step that failed on the ranks `failures` names, and why."""
    return CommitError(
        f"{step} failed on rank(s) {sorted(failures)}: {_reasons(failures)}. Nothing was committed.", dict(failures)
    )


def agree(step: str, transport: Transport, compute: Callable[[], T]) -> list[T]:
    """Run `compute` on this rank, share its result or error, and return every rank's result.

    Raises one `CommitError` (identical on every rank) if any rank's `compute` failed or a rank went silent.
    A `BaseException` that is not an `Exception` (KeyboardInterrupt) is still reported to the peers, then re-raised.
    """
    if transport.world_size == 1:
        return [compute()]  # nobody to agree with: the original error (ValueError, ...) is the clearest
    _entering(transport)
    cause: BaseException | None = None
    try:
        mine = Contribution(value=compute())
    except BaseException as exc:
        cause, mine = exc, Contribution(error=describe(exc))
        if not isinstance(exc, Exception):
            _best_effort_exchange(step, transport, mine)
            raise
    try:
        contributions = transport.exchange(step, mine)
    except _CallsDiffer as exc:  # the engine's own class, not the marker
        raise CommitError(str(exc), exc.failures) from cause
    raise_if_failed(step, contributions, cause)
    return [c.value for c in contributions]


def agree_outcome(
    step: str,
    transport: Transport,
    compute: Callable[[], T],
    shared: Any = None,
    discard: Callable[[T], None] | None = None,
    shared_of: Callable[[T], Any] | None = None,
) -> tuple[T, list[Any]]:
    """Run `compute` on this rank and keep its result here; tell every rank only whether it succeeded.

    For collective steps whose results stay on each rank (a load's checked plan, then its restore): if any rank
    failed, every rank raises, so either every rank goes on or none does. The failing rank raises its own
    exception (the other ranks' failures added as a note); the others raise an error of the same kind (when
    every failure was one kind of `CheckpointError`, or every one a shortage of memory or of file descriptors:
    `MemoryError`, `OSError`; else `CheckpointError`) naming each failed rank and why. Where ranks were short of
    different resources, every rank raises the lowest failed rank's shortage, a failing rank short of another one
    too (from its own); that, `discard`ing their own result
    after `discard`ing their own result (a checked load holds descriptors open: dropped, they leaked for good).
    Returns `compute()`'s result and every rank's `shared` value (JSON/pickle-friendly), in rank order; with
    `shared_of`, a rank whose `compute` succeeded shares `shared_of(result)` instead (what it found, e.g. which
    commit it opened).
    """
    if transport.world_size == 1:
        value = compute()
        return value, [shared if shared_of is None else shared_of(value)]
    _entering(transport)
    try:
        value = compute()
    except BaseException as exc:
        mine = Contribution(value=shared, error=describe(exc))
        if not isinstance(exc, Exception):
            _best_effort_exchange(step, transport, mine)
            raise
        failures = _failures(_exchange_or_raise(step, transport, mine))
        others = {r: why for r, why in failures.items() if r != transport.rank}
        if others:
            add_note(exc, f"{step} failed on other rank(s) too: {_reasons(others)}")
            _raise_agreed_shortage(step, failures, exc)
        raise
    try:
        if shared_of is not None:
            shared = shared_of(value)
        contributions = _exchange_or_raise(step, transport, Contribution(value=shared))
        failures = _failures(contributions)
        if failures:
            raise _failed_elsewhere(step, failures)
    except BaseException:
        if discard is not None:
            _discard_quietly(step, discard, value)
        raise
    return value, [c.value for c in contributions]


def _discard_quietly(step: str, discard: Callable[[T], None], value: T) -> None:
    """Release this rank's result of a step that failed elsewhere; the step's own error is the one raised."""
    try:
        discard(value)
    except Exception:
        log_safely(logger, logging.WARNING, "%s: could not release this rank's result", step, exc_info=True)


def _exchange_or_raise(step: str, transport: Transport, mine: Contribution) -> list[Contribution]:
    """`transport.exchange`, with a lost peer reported as this step's failure (a `CheckpointError`)."""
    try:
        return transport.exchange(step, mine)
    except _CallsDiffer as exc:
        raise CheckpointError(str(exc)) from exc
    except CommitError as exc:  # the transports say "commit"; this step may be no commit at all
        raise CheckpointError(f"{step}: {_reasons(exc.failures) or exc}.") from exc


def _failures(contributions: Sequence[Contribution]) -> dict[int, str]:
    return {r: c.error for r, c in enumerate(contributions) if c.error is not None}


def _reasons(failures: Mapping[int, str]) -> str:
    return "; ".join(f"rank {r}: {why.rstrip('.')}" for r, why in sorted(failures.items()))


def _raise_agreed_shortage(step: str, failures: Mapping[int, str], exc: Exception) -> None:
    """Raise, from this rank's shortage `exc`, the shortage every rank agrees on (`errors.shortage_told_by_peers`)
    when it is of another resource than this rank's: ranks short of memory and of descriptors raised a
    `MemoryError` on one, an `OSError` on another, and a `CheckpointError` elsewhere, so a handler for either
    shortage (free it, then load again, together) ran on some ranks and left the others waiting."""
    agreed = errors.shortage_told_by_peers(list(failures.values()), _failed_message(step, failures))
    if agreed is not None and isinstance(agreed, MemoryError) != isinstance(exc, MemoryError):
        raise agreed from exc


def _failed_message(step: str, failures: Mapping[int, str]) -> str:
    return f"{step} failed on rank(s) {sorted(failures)}: {_reasons(failures)}."


def _failed_elsewhere(step: str, failures: Mapping[int, str]) -> Exception:
    """What a rank that did not fail raises for the others' `failures`: the same kind of error (`_kind_of`), and a
    shortage of memory or descriptors as that (`errors.shortage_told_by_peers`). Before, a shortage was a plain
    `CheckpointError` on every rank but the short one, and a caller's handler for it (free memory or files, then
    load again, together) ran on that rank alone: its retry waited for ranks that had given up."""
    message = _failed_message(step, failures)
    shortage = errors.shortage_told_by_peers(list(failures.values()), message)
    if shortage is not None:
        return shortage
    kinds = {_kind_of(why) for why in failures.values()}
    return (kinds.pop() if len(kinds) == 1 else CheckpointError)(message)


def _kind_of(reason: str) -> type[CheckpointError]:
    """The engine's error class a peer's reason (`describe`: "TypeName: message") names, else CheckpointError.

    Only the engine's own message-only error classes are looked up: a peer's text never names what is built."""
    name = reason.split(":", 1)[0]
    return _MESSAGE_ONLY_ERRORS.get(name, CheckpointError)


_MESSAGE_ONLY_ERRORS: dict[str, type[CheckpointError]] = {
    name: cls
    for name in errors.__all__
    if isinstance(cls := getattr(errors, name), type) and issubclass(cls, CheckpointError) and cls is not CommitError
}  # every error class of the engine that takes a message alone (CommitError also takes the failures)


def _best_effort_exchange(step: str, transport: Transport, mine: Contribution) -> None:
    if isinstance(transport, GroupTransport) and transport.roll_call is not None:
        # On the way out (Ctrl-C): no roll call to wait for, but the collective is numbered like every rank's.
        transport.roll_call.next_exchange()
        transport = dataclasses.replace(transport, roll_call=None)
    try:
        transport.exchange(step, mine)
    except Exception as exc:  # we are leaving anyway; the peers learn from the timeout
        logger.debug("Could not tell the other ranks about the failure at %s: %r", step, exc)


def _entering(transport: Transport) -> None:
    """This rank gives its answer to the next step of its call (its own failure, if `compute` fails)."""
    if isinstance(transport, GroupTransport) and transport.steps is not None:
        transport.steps.answered += 1


@dataclass
class CallSteps:
    """The agreed steps of one collective call over the gloo group, in order (`GroupTransport.leave`): how far
    this rank got.

    A rank that leaves between two of them (Ctrl-C once every answer to one step was in, before it began the
    next) left the others waiting in the next one: they had gone on, and waited the group's whole timeout for an
    answer that never came, then called this rank silent. `names` are the steps as a leaving rank answers them
    (only the call they belong to is checked, `_call_of`).
    """

    names: tuple[str, ...]
    answered: int = 0  # steps this rank began (its answer given, or on its way)
    agreed: int = 0  # steps this rank found agreed: every rank in this call, none failed

    def owed(self) -> str | None:
        """The next step, which the others went on to and this rank has not answered yet; None if none is."""
        if 0 < self.agreed == self.answered < len(self.names):
            return self.names[self.agreed]
        return None


class RollCall(Protocol):
    """After a collective broke: which ranks are gone, one verdict for every rank that is still there."""

    def next_exchange(self) -> int: ...

    def lost(self, exchange: int, step: str, reason: str, started: float) -> CommitError: ...


@dataclass
class GroupTransport:
    """`all_gather_object` over the manager's own gloo group; a peer's failure becomes a `CommitError`.

    gloo says only that a connection broke (each survivor its own "Connection reset by peer [addr]:port", or a
    timeout), never which rank went: each survivor raised a different error naming itself. With a `roll_call`
    (the manager's TCPStore) the survivors report in and every one of them raises the same `CommitError`,
    naming the ranks that never did.
    """

    rank: int
    world_size: int
    group: Any
    roll_call: RollCall | None = None
    steps: CallSteps | None = None  # the call's agreed steps, where it says them (`for_steps`)

    def for_steps(self, *names: str) -> GroupTransport:
        """This transport, keeping count of how far this rank got through the call's agreed steps `names`."""
        return dataclasses.replace(self, steps=CallSteps(names))

    def agreed_every_step(self) -> bool:
        """Whether this rank found every step of its call agreed (`for_steps`)."""
        return self.steps is not None and self.steps.agreed == len(self.steps.names)

    def leave(self, exc: BaseException) -> None:
        """This rank leaves its call (`exc`: Ctrl-C, a signal handler's sys.exit() or its own exception, such as
        SIGALRM's TimeoutError). Where every rank's answer to one step was in and the others went on to the next,
        it answers that one with `exc` (briefly, as `agree` does on the way out), so that they raise at once,
        naming it and why, and the group's collectives stay in step for the next call. Before, an `Exception`
        left unanswered: the others waited the group's timeout and called this rank silent."""
        owed = self.steps.owed() if self.steps is not None else None
        if owed is None or self.steps is None:
            return
        self.steps.answered += 1
        _best_effort_exchange(owed, self, Contribution(error=describe(exc)))

    def exchange(self, step: str, mine: Contribution) -> list[Contribution]:
        if self.world_size == 1:
            return [mine]
        out: list[Any] = [None] * self.world_size
        exchange = self.roll_call.next_exchange() if self.roll_call is not None else 0
        started = time.monotonic()
        # The hold outside the `except`: a held handler's own exception (SIGALRM's TimeoutError) is raised as
        # itself at the hold's end, never taken for gloo's word that a peer died. Only the gather is held: the
        # roll call after it breaks (`_lost`) waits up to the group's timeout and more, and a Ctrl-C there, held
        # too, ran only once it was over.
        broken: str | None = None
        lost: CommitError | None = None
        try:
            with signals_deferred(step, held=_GATHER_HELD):  # torch's two gathers: see `_GATHER_HELD`
                try:
                    dist.all_gather_object(out, (_call_of(step), mine.value, mine.error), group=self.group)
                except Exception as exc:  # gloo: a peer died or timed out (DistError / RuntimeError with C++ frames)
                    broken = _first_line(exc)
                else:
                    if (
                        self.steps is not None
                        and len({c for c, _, _ in out}) == 1
                        and all(e is None for _, _, e in out)
                    ):
                        self.steps.agreed += 1  # in the hold: the interrupt held leaves with the next step owed
            if broken is not None:
                lost = self._lost(exchange, step, broken, started)
        except BaseException as exc:  # a Ctrl-C (held in the gather, or in the roll call) is raised as itself
            if broken is not None:
                _say_lost_under(step, broken, exc)
            raise
        if lost is not None:
            raise lost
        _refuse_other_calls(step, [call for call, _, _ in out])
        return [Contribution(value=v, error=e) for _, v, e in out]

    def _lost(self, exchange: int, step: str, reason: str, started: float) -> CommitError:
        """What every survivor of a broken `exchange` raises: the roll call's verdict, where there is one."""
        if self.roll_call is not None:
            return self.roll_call.lost(exchange, step, reason, started)
        return CommitError(
            f"{step}: rank {self.rank} lost contact with its peers ({reason}); a rank died, hung, or never "
            f"called save(). Nothing was committed.",
            {self.rank: f"lost contact with the other ranks: {reason}"},
        )


def _say_lost_under(step: str, broken: str, exc: BaseException) -> None:
    """The exchange broke (a peer died, hung or was cut off) and then `exc` was raised: an interrupt, which the
    user asked for, or the roll call's own failure. Either is raised; the lost peer, which it would hide, is said
    here. Before, a Ctrl-C as a peer died came out as a bare KeyboardInterrupt, that death said nowhere on this
    rank; and a failed roll call was logged as an interrupt."""
    what = (
        "as it was interrupted; raising the interrupt"
        if not isinstance(exc, Exception)
        else "and deciding which rank was lost failed; raising that failure"
    )
    log_safely(
        logger,
        logging.WARNING,
        "%s: this rank lost contact with the other ranks (%s: a rank died, hung, or was cut off) %s (%s). This "
        "step was not agreed with the other ranks.",
        step,
        broken,
        what,
        describe(exc),
    )


# `dist.all_gather_object` is two gathers (every rank's size, then the data) with Python between them: a rank
# interrupted there left the others waiting in the second for the group's whole timeout, then calling it silent.
# Held, the interrupt runs its handler once every answer is in (the gathers are bounded by the group's timeout),
# and the rank leaves between two steps, which it tells the others (`GroupTransport.leave`). A signal sent again
# runs its handler only when Python next runs: between the gathers at once, inside one (gloo waits in C++, where
# no Python handler runs) when that gather returns, at the latest at the group's timeout; the WARNING says so.
_GATHER_HELD = Held(
    "the exchange of answers with the other ranks",
    "every rank's answer is in (at most the process group's timeout)",
    "the other ranks wait the process group's timeout for this rank's answer",
    again=(
        "sent again, it is acted on when this rank's wait in the gather returns (no Python handler runs inside "
        "gloo's wait): at once between torch's two gathers, else when the other ranks answer or the process "
        "group's timeout ends"
    ),
)


def _call_of(step: str) -> str:
    """The public call a step belongs to ("Checkpoint save", "Checkpoint load"): its words before the id.

    Every collective gathers over the one group, so a save on one rank meets a load on another; without the
    call in each contribution, each read the other's contribution as its own and failed with a bare TypeError.
    """
    return re.split(r" of |:", step, maxsplit=1)[0]


class _CallsDiffer(CommitError):
    """The ranks were in different calls: its message is the whole story, on a load's step as on a save's."""


def _refuse_other_calls(step: str, calls: list[str]) -> None:
    """The same `CommitError` on every rank when the ranks are in different calls (save() against load())."""
    if len(set(calls)) == 1:
        return
    failures = {r: f"was in {call}" for r, call in enumerate(calls)}
    raise _CallsDiffer(
        f"{step}: the ranks are in different calls ({_reasons(failures)}). Call save() and load() on every "
        f"rank together, in the same order. Nothing was committed and nothing was restored.",
        failures,
    )


@dataclass
class StoreTransport:
    """Publish-and-gather over a `StoreChannel` (keys `<step>/<rank>`); silent ranks are named.

    Each rank waits for the others on its own clock, so one rank may give up on a step that a later rank then
    finds complete: before, that rank went on to the next step alone, and told another story (rank 1 "outcome
    unknown" after a second timeout, where rank 0 had said "no checkpoint was committed"), or rank 0 committed a
    save that a rank had already reported failed. So every rank also proposes how the step ended under
    `<step>/decided`, on rank 0's store, where only the first proposal is kept: given up (with the error), or
    complete. Every rank then raises the error decided, or goes on.
    """

    rank: int
    world_size: int
    channel: Any

    def exchange(self, step: str, mine: Contribution) -> list[Contribution]:
        try:
            self.channel.publish(f"{step}/{self.rank}", mine.to_json())
        except Exception:
            raise
        except BaseException as exc:
            self._give_up_for(step, exc)
            raise
        return self.answers(step)

    def answers(self, step: str) -> list[Contribution]:
        """Every rank's answer to `step`, once the ranks have decided that it is complete."""
        what = f"its answer to {step!r}"
        try:
            texts = self.channel.gather(step, self.world_size, what)
        except CommitError as gave_up:  # (rank 0's store gone: deciding raises that again)
            _go_on_if_complete(self.channel.decide(f"{step}/decided", _gave_up(gave_up)))
            texts = self.channel.gather(step, self.world_size, what)  # another rank found them all in
        except Exception:
            raise
        except BaseException as exc:
            self._give_up_for(step, exc)
            raise
        else:
            _go_on_if_complete(self.channel.decide(f"{step}/decided", _COMPLETE))
        return [Contribution.from_json(t) for t in texts]

    def _give_up_for(self, step: str, exc: BaseException) -> bool:
        """This rank leaves the step while it waits for the others' answers (Ctrl-C, a signal handler's
        sys.exit()): it decides the step failed, naming itself and why, so that every other rank raises that at
        once. Before, its answer stood as given: rank 0 went on to commit, waited the save's whole timeout for
        this rank's answer to the commit, and the save this rank called "not committed" was in place. If another
        rank decided first that the step is complete, the step stands (then nothing is told): returns whether it
        does."""
        failed = _failed(step, {self.rank: describe(exc)})
        try:  # briefly: the rank is leaving, and a stopped host must not hold its Ctrl-C for the save's timeout
            decided: str = self.channel.decide(f"{step}/decided", _gave_up(failed), wait_s=_LEAVING_WAIT_S)
            return decided == _COMPLETE
        except Exception as lost:  # leaving anyway: rank 0's store gone (or silent) tells the others itself
            logger.debug("Could not tell the other ranks that rank %s left %s: %r", self.rank, step, lost)
            return False

    def agreed_as_it_left(self, step: str, exc: BaseException) -> bool:
        """Whether `step`, which this rank left (`exc`: Ctrl-C, a signal handler's sys.exit()) once it had given
        its own answer, succeeded all the same: another rank found every answer first, decided the step complete
        and went on with no failure among them. Where the step was not decided yet, this rank decides that it
        failed (`_give_up_for`).

        A rank interrupted between giving its answer and hearing the decision took the step for failed; the
        others, which had heard it first, went on to the next step without it."""
        if not self._give_up_for(step, exc):
            return False
        try:  # every answer is in (the step was decided complete): no wait
            texts = self.channel.gather(step, self.world_size, f"its answer to {step!r}", timeout_s=0)
        except Exception as lost:
            logger.debug("Rank %s could not read the answers to %s as it left: %r", self.rank, step, lost)
            return False
        return all(Contribution.from_json(text).error is None for text in texts)

    def leave_before(self, step: str, exc: BaseException) -> None:
        """This rank leaves (`exc`) before the `step` the others went on to: its answer is its failure, and the
        step is decided failed, so that every other rank hears it at once. Before, rank 0 waited the save's whole
        timeout for an answer to the commit that never came."""
        try:
            self.channel.publish(f"{step}/{self.rank}", Contribution(error=describe(exc)).to_json())
        except Exception as lost:  # leaving anyway: rank 0's store gone (or silent) tells the others itself
            logger.debug("Could not tell the other ranks that rank %s left before %s: %r", self.rank, step, lost)
            return
        self._give_up_for(step, exc)


_COMPLETE = "complete"
# How long a rank that leaves a step waits for rank 0's store to take its decision (a compare-and-set: a live
# store answers in milliseconds).
_LEAVING_WAIT_S = 3.0


def _gave_up(error: CommitError) -> str:
    unknown = isinstance(error, CommitOutcomeUnknownError)  # kept: every rank raises the one class too
    failures = {str(r): why for r, why in error.failures.items()}
    return json.dumps({"message": str(error), "failures": failures, "outcome_unknown": unknown})


def _go_on_if_complete(decided: str) -> None:
    """Raise the error a rank that gave up on the step decided for every rank."""
    if decided == _COMPLETE:
        return
    error = json.loads(decided)
    kind = CommitOutcomeUnknownError if error.get("outcome_unknown") is True else CommitError
    raise kind(str(error["message"]), {int(r): str(why) for r, why in error["failures"].items()})


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {_what_it_says(exc, text[0] if text else '')}"
