"""Cross-rank coordination over a TCPStore: publish a value, gather everyone's.

Used by the commit protocol from the writer process, which has no process group; the store is hosted by
rank 0's trainer process, so it never touches the training's collectives. Every wait is bounded, and every
failure is a `CommitError` that names the rank(s) that went silent or away (never a raw `DistNetworkError`).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

import torch.distributed as dist

from torch_checkpointing.errors import CommitError, CommitOutcomeUnknownError, log_safely
from torch_checkpointing.signals import start_thread

__all__ = ["StoreAddress", "StoreChannel", "StoreRollCall", "let_go_of_clients", "let_go_of_host"]

logger = logging.getLogger("torch_checkpointing.store_channel")

_POLL_S = 0.005
# How long past the collective's own timeout rank 0 waits for the survivors of a broken one to report in.
_ROLL_CALL_GRACE_S = 5.0
_REASON_CHARS = 300
# How long past the client's own timeout a call on the store is waited for: the client's own error (a host that
# refuses the connection, a key that never came) is the clearer one where it has one.
_CALL_GRACE_S = 2.0
_CALLER_IDLE_S = 10.0
# How often a new client's connect, not done yet, looks whether its host went away (`_within`).
_GONE_CHECK_S = 0.5
# How long one such check's connect may wait. A refusal (the only answer that says "gone") comes at once; a
# connect a busy host drops is no answer, and waiting the channel's whole timeout on it doubled the connect's.
_GONE_CHECK_WAIT_S = 1.0
_CALLERS_PER_HOST = 4
T = TypeVar("T")


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int
    namespace: str


class StoreChannel:
    """Key-value rendezvous under one namespace; every wait is bounded and names who is late.

    Its client of the host is this process's one for that host (`_Clients`), kept across saves: a TCPStore
    client's connect stalled exactly 5 s in about 1 of 30 connects, and a new client for every multi-rank save
    made about 1 save in 25 take 5 s more to be durable.

    Every call on the store is bounded too (`_call`): a TCPStore client waits for its host's reply without a
    timeout (its own applies to waiting for a key), so a host that is alive but does not answer (rank 0's
    trainer stopped with SIGSTOP, frozen, or cut off by the network) held every other rank in its save, well
    past the save's timeout, for as long as rank 0 stayed stopped.
    """

    def __init__(self, address: StoreAddress, timeout_s: float, store: Any = None, shared: bool = True) -> None:
        """`store`: a client (or the host) of the caller's to use. Else the process's client of the host
        (`_Clients`), or with `shared=False` one of this channel's own, gone with it: for a caller that outlives
        no manager and has no close() to let go of a kept one (a `TCPStoreBarrier`)."""
        self.address = address
        self.timeout_s = timeout_s
        self._unanswered = False  # a call got no answer: the client is stuck behind it, so no later call is made
        self.spent = False  # a call on the client failed or went unanswered: the client is not used for a new save
        self._shared = store is None and shared  # the process's client of the host (`_Clients`)
        self._store: Any = store
        if self._shared:
            kept = _Clients.kept(self._host)
            self._store = kept if kept is not None and self._still_connected(kept) else None
        if self._store is None:
            if self._shared and _refuses_connections(self._host, _GONE_CHECK_WAIT_S):
                # The store's address is learnt from rank 0 once it listens: refused now, it is gone. A TCPStore
                # client's connect would retry for its whole timeout (a barrier's peer, `shared=False`, may come
                # before its host listens, and waits).
                self.spent = True
                raise _lost_host(ConnectionRefusedError(f"nothing listens at {address.host}:{address.port}"))
            self._store = self._connect_once(address, timeout_s)

    def _still_connected(self, kept: Any) -> bool:
        """Whether the kept client's host still answers it. Its host may have been started again on its port
        since the last save (a new job, rank 0's trainer restarted), its connection dead with no call having
        noticed; a `set` on it is lost without an error (it reads no reply), so the save's first publish went
        nowhere and the save failed on a host that is up. A call that reads a reply tells; a dead one is dropped."""
        try:
            _within(self._host, lambda: kept.check([self._key("connected")]), max(self.timeout_s, 1.0) + _CALL_GRACE_S)
        except _NoAnswer:
            self._store = kept
            self._unanswered = True
            self._spend()
            raise _silent_host(self.timeout_s) from None
        except Exception as exc:  # the host it connected to is gone; the one on its port now (if any) is new
            logger.debug("The kept client of the checkpoint store at %s:%s is dead: %r", *self._host, exc)
            _Clients.drop(self._host, kept)
            if not _accepts_connections(self._host, max(self.timeout_s, 1.0)):
                self.spent = True  # nobody there: a new client's connect would retry for its whole timeout
                raise _lost_host(exc) from None
            return False
        return True

    def _connect_once(self, address: StoreAddress, timeout_s: float) -> Any:
        """A new client of `address`'s host, kept for this process's later channels to it (`_Clients`) if the
        channel is shared."""
        # The client's connect retries with a random back-off past its own timeout: allowed for here.
        connect_s = 2 * (max(timeout_s, 1.0) + _CALL_GRACE_S)
        # Rank 0 killed as this connect began: the client's retries of the refused connect (and of a reset one)
        # ran past the save's timeout, where the host had been gone from the first retry.
        gone = None if not self._shared else lambda: _refuses_connections(self._host, _GONE_CHECK_WAIT_S)
        client = self._call(lambda: self._connect(address, timeout_s), connect_s, gone=gone)
        return _Clients.keep(self._host, client) if self._shared else client

    @staticmethod
    def _connect(address: StoreAddress, timeout_s: float) -> Any:
        return dist.TCPStore(  # type: ignore[attr-defined]
            address.host,
            address.port,
            is_master=False,
            timeout=timedelta(seconds=max(timeout_s, 1.0)),
            wait_for_workers=False,
        )

    @property
    def _host(self) -> tuple[str, int]:
        return (self.address.host, self.address.port)

    def _key(self, name: str) -> str:
        return f"{self.address.namespace}/{name}"

    def _call(
        self,
        op: Callable[[], T],
        wait_s: float | None = None,
        deliver_late: bool = False,
        gone: Callable[[], bool] | None = None,
    ) -> T:
        """`op()` on the store, waited for at most `wait_s` (default: the channel's timeout, plus a grace).

        `deliver_late`: the call is still made after an earlier one went unanswered (by one of the host's caller
        threads; this rank does not wait for it), so that a host that comes back hears it (a rank's decision to
        give up on a step, which the host then raises too rather than commit alone).
        """
        wait_s = max(self.timeout_s, 1.0) + _CALL_GRACE_S if wait_s is None else wait_s
        if self._unanswered:
            if deliver_late:
                _Caller.submit(self._host, _Call(lambda: _quietly(op)))
            raise _silent_host(self.timeout_s)
        try:
            return _within(self._host, op, wait_s, gone)
        except _NoAnswer:
            self._unanswered = True
            self._spend()
            raise _silent_host(self.timeout_s) from None
        except Exception as exc:  # the store's host (rank 0's trainer) is gone
            self._spend()
            raise _lost_host(exc) from None

    def _spend(self) -> None:
        """A call on the client failed or went unanswered: it may hold a half-read reply (or still wait for one),
        so no later save uses it; the next channel to the host connects anew."""
        self.spent = True
        if self._shared and self._store is not None:
            _Clients.drop(self._host, self._store)

    def publish(self, name: str, value: str) -> None:
        self._call(lambda: self._store.set(self._key(name), value))

    def forget(self, names: list[str]) -> None:
        """Remove the host's keys `names` (missing ones are no error): for a step that no rank reads any more."""
        self._call(lambda: [self._store.delete_key(self._key(name)) for name in names])

    def count(self, name: str) -> int:
        """Add one to the host's counter `name` and return it: a number the host keeps, whoever asks next."""
        return self._call(lambda: int(self._store.add(self._key(name), 1)))

    def gather(
        self,
        name: str,
        world_size: int,
        what: str,
        timeout_s: float | None = None,
        during: str = "Checkpoint commit",
        call: str = "save()",
        outcome: str = "No checkpoint was committed.",
    ) -> list[str]:
        """Every rank's value for `name`, or a `CommitError` naming the ranks that never published.

        Its message is `during: rank(s) ... never called <call> ... <outcome>`: only the caller knows what the
        wait was for and what a silent rank means there (nothing committed, before the commit; nothing at all, at
        a user's barrier).
        """
        keys = [self._key(f"{name}/{r}") for r in range(world_size)]
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pending = set(range(world_size))
        delay = _POLL_S
        while pending:
            pending = {r for r in pending if not self._has(keys[r])}
            if not pending:
                break
            if time.monotonic() > deadline:
                silent = sorted(pending)
                raise CommitError(
                    f"{during}: rank(s) {silent} did not report {what} within {timeout_s:.0f}s (a rank died, hung, "
                    f"or never called {call}). {outcome}".rstrip(),
                    dict.fromkeys(silent, f"did not report {what} within {timeout_s:.0f}s"),
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return [self._get(k) for k in keys]

    def decide(self, name: str, proposal: str, wait_s: float | None = None) -> str:
        """The value of `name`: `proposal` if no rank set it first (a compare-and-set: the first one stays).
        `wait_s`: how long to wait for the answer (default: the channel's timeout, plus a grace)."""
        op = lambda: self._store.compare_set(self._key(name), "", proposal)  # noqa: E731
        decided = self._call(op, wait_s, deliver_late=True)
        return str(decided.decode("utf-8"))

    def wait_for(self, name: str, ranks: list[int], timeout_s: float) -> list[int]:
        """The ranks among `ranks` that have not published `name/<rank>` within `timeout_s` (none: all did)."""
        deadline = time.monotonic() + timeout_s
        pending = list(ranks)
        while True:
            pending = [r for r in pending if not self._has(self._key(f"{name}/{r}"))]
            if not pending or time.monotonic() > deadline:
                return pending
            time.sleep(0.05)

    def wait_value(self, name: str, timeout_s: float) -> str | None:
        """The value published under `name`, or None if none came within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self._has(self._key(name)):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return self._get(self._key(name))

    def missing(self, name: str, world_size: int) -> list[int]:
        return [r for r in range(world_size) if not self._has(self._key(f"{name}/{r}"))]

    def _has(self, key: str) -> bool:
        return self._call(lambda: bool(self._store.check([key])))

    def _get(self, key: str) -> str:
        return str(self._call(lambda: self._store.get(key)).decode("utf-8"))


class _NoAnswer(Exception):
    """A call on the store got no answer in time."""


@dataclass
class _Call:
    """One call on a store host, handed to that host's caller thread (`_Caller`)."""

    op: Callable[[], Any]
    wanted: bool = True  # False: its caller gave up waiting, so it is not made if it has not started
    done: threading.Event = field(default_factory=threading.Event)
    outcome: tuple[bool, Any] = (False, None)

    def run(self) -> None:
        if not self.wanted:
            return
        try:
            self.outcome = (True, self.op())
        except BaseException as exc:
            self.outcome = (False, exc)
        finally:
            self.done.set()


class _Caller:
    """The daemon threads of this process that make the calls on one store host (at most `_CALLERS_PER_HOST`).

    Why not a new thread per call: starting one cost about 0.3 ms (20 times the call itself), several dozen
    times in each save; and with the host stopped, every save left one more thread blocked on it for good. Now
    a thread is reused, and ends once idle for `_CALLER_IDLE_S`; past the cap (every thread stuck on a host that
    does not answer) a call waits for one within its own bound, and is dropped unmade if its caller gave up.
    """

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _callers: ClassVar[dict[tuple[str, int], _Caller]] = {}

    def __init__(self, host: tuple[str, int]) -> None:
        self.host = host
        self.calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()  # None: end (`let_go`)
        self.threads = 0
        self.idle = 0  # threads waiting for a call that no queued call has taken yet
        self.backlog = 0  # queued calls that no thread was free for

    @classmethod
    def submit(cls, host: tuple[str, int], call: _Call) -> bool:
        """Queue `call` on `host`'s threads; False if none runs and none can be started (at interpreter exit)."""
        with cls._lock:
            caller = cls._callers.setdefault(host, cls(host))
            if caller.idle > 0:
                caller.idle -= 1
            elif caller.threads < _CALLERS_PER_HOST:
                try:
                    start_thread(threading.Thread(target=caller._serve, name="ckpt-store-call", daemon=True))
                except RuntimeError:  # Python 3.12+ at interpreter exit (close() from atexit)
                    if caller.threads == 0:
                        return False
                    caller.backlog += 1
                else:
                    caller.threads += 1
            else:
                caller.backlog += 1
            caller.calls.put(call)
            return True

    def _serve(self) -> None:
        while True:
            try:
                call = self.calls.get(timeout=_CALLER_IDLE_S)
            except queue.Empty:
                if self._retire():
                    return
                continue
            if call is None:
                return
            call.run()
            del call  # its op holds the channel's client (a socket): kept by an idle thread, it outlived its manager
            with self._lock:
                if self.backlog > 0:
                    self.backlog -= 1
                else:
                    self.idle += 1

    def _retire(self) -> bool:
        """Whether this idle thread ends (a submit holds the lock while it queues: no call is left unmade)."""
        with self._lock:
            if self.idle == 0 or not self.calls.empty():
                return False
            self.idle -= 1
            self.threads -= 1
            if self.threads == 0 and self._callers.get(self.host) is self:
                del self._callers[self.host]
            return True

    @classmethod
    def let_go(cls, host: tuple[str, int]) -> None:
        """End `host`'s threads once the calls queued before this are made: its manager closed, and an idle
        thread kept for a host no one calls again outlived the manager (a job building managers left them)."""
        with cls._lock:
            caller = cls._callers.pop(host, None)
            for _ in range(caller.threads if caller is not None else 0):
                caller.calls.put(None)  # type: ignore[union-attr]

    @classmethod
    def forget_all(cls) -> None:
        """In a forked child: the parent's threads are not there (a call queued to one would never be made)."""
        cls._lock = threading.Lock()
        cls._callers = {}


os.register_at_fork(after_in_child=_Caller.forget_all)


class _Clients:
    """This process's client of each store host, one per host, kept across saves and replaced once a call on it
    failed or went unanswered (`StoreChannel._spend`). Clients handed to a channel (`store=`) are not kept here."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _by_host: ClassVar[dict[tuple[str, int], Any]] = {}
    _forked_away: ClassVar[list[Any]] = []

    @classmethod
    def kept(cls, host: tuple[str, int]) -> Any:
        with cls._lock:
            return cls._by_host.get(host)

    @classmethod
    def keep(cls, host: tuple[str, int], client: Any) -> Any:
        """The client kept for `host`: `client`, unless another thread kept one first (then that one)."""
        with cls._lock:
            return cls._by_host.setdefault(host, client)

    @classmethod
    def drop(cls, host: tuple[str, int], client: Any) -> None:
        """Stop keeping `client` (if it is still the one kept for `host`); the channels holding it keep it."""
        with cls._lock:
            if cls._by_host.get(host) is client:
                del cls._by_host[host]

    @classmethod
    def let_go(cls, host: tuple[str, int] | None = None) -> None:
        """Stop keeping the client of `host` (of every host: None); one no call holds any more disconnects."""
        with cls._lock:
            if host is None:
                cls._by_host.clear()
            else:
                cls._by_host.pop(host, None)

    @classmethod
    def forget_all(cls) -> None:
        """In a forked child: the parent's clients share their sockets with the parent, so the child never calls
        on them (a reply would go to either process) nor closes them; it connects its own."""
        cls._lock = threading.Lock()
        cls._forked_away.extend(cls._by_host.values())
        cls._by_host = {}


os.register_at_fork(after_in_child=_Clients.forget_all)


def let_go_of_host(address: StoreAddress) -> None:
    """The manager that calls `address`'s host closed: the threads that make its calls end (see `_Caller`), and
    this process's client of it is let go of."""
    _Caller.let_go((address.host, address.port))
    _Clients.let_go((address.host, address.port))


def let_go_of_clients() -> None:
    """This process is about to exit (a writer process told to stop): its clients of every host disconnect."""
    _Clients.let_go()


def _accepts_connections(host: tuple[str, int], timeout_s: float) -> bool:
    """Whether anything listens at `host` now: a refused connection is told at once, where a TCPStore client's
    connect retries until its timeout (rank 0's trainer gone, its store with it)."""
    return _probe(host, timeout_s) is None


def _probe(host: tuple[str, int], timeout_s: float) -> OSError | None:
    """How a plain connection to `host`, closed at once, failed; None if it was accepted."""
    try:
        socket.create_connection(host, timeout=timeout_s).close()
    except OSError as exc:
        return exc
    return None


def _refuses_connections(host: tuple[str, int], timeout_s: float) -> bool:
    """Whether `host` refuses a connection now (nothing listens there). A connect that times out or is dropped
    is not a refusal: a host busy with thousands of ranks' connects drops some, and the client's own retries
    are the remedy there. On this machine's loopback, its sockets are looked at first (`_listening_here`): one
    listening there is no connection made. Only a refused connect says the host is gone: a sandbox's own /proc
    lists no socket at all, and read as "nothing listens" every new channel to a live store raised "lost
    contact with rank 0"."""
    if _is_loopback(host[0]) and _listening_here(host[0], host[1]):
        return False
    return isinstance(_probe(host, timeout_s), ConnectionRefusedError)


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


_LISTEN = "0A"  # /proc/net/tcp's state of a listening socket


def _listening_here(name: str, port: int) -> bool | None:
    """Whether a socket of this machine (its network namespace, as loopback is) listens on `port` where a
    connection to the loopback host `name` reaches it: on a wildcard address or on that host's own address; None
    where /proc/net/tcp cannot be read. Each line is `sl local_address rem_address st ...`, addresses `HEX:PORT`.

    Before, a socket on any address counted: one bound to another address of this machine (a program that took
    the port once rank 0 was gone) accepts no connection to 127.0.0.1, yet the host counted as there, and the
    client retried its refused connect for the save's whole timeout. So did one on another loopback address
    (127.0.0.2, or ::1 alone), which takes no connection to 127.0.0.1 either."""
    wanted = _loopback_addresses(name)
    tables = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as lines:
                rows = lines.read().splitlines()[1:]
        except OSError:
            continue
        tables += 1
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == _LISTEN and _reached_from(fields[1], port, wanted):
                return True
    return False if tables else None


def _loopback_addresses(name: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses a client's connect to the loopback host `name` tries: "localhost" is what it resolves to
    here, as for the client (none where it does not resolve: the connect decides). Taken for 127.0.0.1 and ::1
    both, a socket on ::1 alone kept a "localhost" that resolves to 127.0.0.1 alone (an /etc/hosts without `::1
    localhost`, as in many containers) counted as there, while every connect to it was refused."""
    if name != "localhost":
        return {_unmapped(ipaddress.ip_address(name))}
    try:
        found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {_unmapped(ipaddress.ip_address(str(info[4][0]).partition("%")[0])) for info in found}


def _unmapped(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None else ip


def _reached_from(local: str, port: int, wanted: set[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> bool:
    """Whether a listening socket at `local` (/proc/net/tcp's `HEX:PORT`, the address in 32-bit words of this
    machine's byte order) takes a connection to `port` on one of the addresses `wanted`: bound to one of them, or
    to a wildcard of their family (IPv6's also takes IPv4 unless the socket is IPv6-only, which /proc does not
    say: counted). An address that cannot be read counts."""
    address, _, hex_port = local.rpartition(":")
    if int(hex_port, 16) != port:
        return False
    try:
        raw = bytes.fromhex(address)
        words = [raw[i : i + 4] for i in range(0, len(raw), 4)]
        ip = ipaddress.ip_address(b"".join(w[::-1] if sys.byteorder == "little" else w for w in words))
    except ValueError:
        return True
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return bool(wanted) if ip.version == 6 else any(w.version == 4 for w in wanted)
    return ip in wanted


def _within(host: tuple[str, int], op: Callable[[], T], timeout_s: float, gone: Callable[[], bool] | None = None) -> T:
    """`op()`, made by `host`'s caller thread and waited for at most `timeout_s`; else `_NoAnswer` (the call
    is left to finish, or to block, on that thread). `gone`: asked every `_GONE_CHECK_S` while the call is not
    done; once it says the host is gone, `ConnectionRefusedError` (the call is left as for `_NoAnswer`)."""
    call = _Call(op)
    if not _Caller.submit(host, call):
        return op()  # no new thread now: unbounded, as before the bound
    deadline = time.monotonic() + timeout_s
    while not call.done.wait(min(_GONE_CHECK_S, max(deadline - time.monotonic(), 0.0)) if gone else timeout_s):
        if gone is None or time.monotonic() >= deadline:
            call.wanted = False
            raise _NoAnswer
        if gone():
            call.wanted = False
            raise ConnectionRefusedError(f"nothing listens at {host[0]}:{host[1]} any more")
    ok, value = call.outcome
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _quietly(op: Callable[[], Any]) -> None:
    try:
        op()
    except Exception as exc:  # nobody waits for this call any more: what became of it is only logged
        logger.debug("A late call on the checkpoint store failed: %r", exc)


def _silent_host(timeout_s: float) -> CommitOutcomeUnknownError:
    """The same error on every rank whose call on rank 0's store went unanswered: rank 0 is alive (its store
    accepted the connection) but does not answer, and may still go on with the save once it does.

    It names the save's timeout, not the wait that ran out: a rank that connected after rank 0 stopped waits
    longer (the connect's own bound) than one whose call went unanswered, and their errors differed by it."""
    return CommitOutcomeUnknownError(
        f"Checkpoint commit: rank 0, which hosts the checkpoint store, did not answer within the save's "
        f"timeout ({timeout_s:g}s; it is stopped, hung, or cut off from this rank); this rank gave up on the "
        f"save. Whether rank 0 commits it when it answers again is not known: the id then holds either its "
        f"previous checkpoint or this one, whole. Load it to check, or save again.",
        {0: f"did not answer within the save's timeout ({timeout_s:g}s; stopped, hung, or cut off)"},
    )


def _lost_host(exc: BaseException) -> CommitError:
    """The same error on every rank that lost rank 0's store: the client's own words differ from rank to rank
    ("Connection reset by peer" on one, "Failed to recv, got 0 bytes" on another), so they are logged here and
    kept out of the message."""
    first = (str(exc).strip().splitlines() or [""])[0]
    log_safely(
        logger, logging.WARNING, "Lost contact with rank 0's checkpoint store: %s: %s", type(exc).__name__, first
    )
    return CommitError(
        "Checkpoint commit: lost contact with rank 0, which hosts the checkpoint store: rank 0 died or closed its "
        "CheckpointManager. No checkpoint was committed by this save.",
        {0: "went away (its checkpoint store is unreachable)"},
    )


class StoreRollCall:
    """Who is still there after a collective over the manager's gloo group broke (`agreement.GroupTransport`).

    gloo tells a survivor only that a connection broke (or that it timed out), not which rank went; each
    survivor raised its own "rank N lost contact" naming itself. Here every survivor reports in on rank 0's
    store; rank 0 waits until the collective's own timeout (by then every survivor's gloo call has ended) and
    publishes one verdict: the ranks that never reported. Every survivor raises the same `CommitError` from it.
    If rank 0 itself is gone, so is its store: every survivor says that rank 0 went away.
    """

    def __init__(self, rank: int, world_size: int, address: StoreAddress, timeout_s: float, store: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.address = address
        self.timeout_s = timeout_s
        self._store = store  # rank 0 hosts it; the others connect when a collective breaks
        self._exchanges = 0

    def next_exchange(self) -> int:
        """Numbers the collectives: every rank makes the same ones, in the same order."""
        self._exchanges += 1
        return self._exchanges

    def lost(self, exchange: int, step: str, reason: str, started: float) -> CommitError:
        name = f"rollcall/{exchange}"
        reason = reason if len(reason) <= _REASON_CHARS else reason[:_REASON_CHARS] + "..."
        try:
            # Connecting to a store that is gone retries until its timeout: bounded by the grace, not the save's.
            channel = StoreChannel(self.address, min(self.timeout_s, _ROLL_CALL_GRACE_S), self._store)
            channel.publish(f"{name}/{self.rank}", reason)
            if self.rank == 0:
                # Every survivor's gloo call has ended by `started + timeout_s` (ranks enter a little apart).
                wait = max(started + self.timeout_s + _ROLL_CALL_GRACE_S - time.monotonic(), _ROLL_CALL_GRACE_S)
                silent = channel.wait_for(name, list(range(1, self.world_size)), wait)
                text = json.dumps({"step": step, "silent": silent, "reason": reason})
                channel.publish(f"{name}/verdict", text)
                # The store lives in this process: keep it up until every survivor has read the verdict.
                survivors = [r for r in range(1, self.world_size) if r not in silent]
                channel.wait_for(f"{name}/seen", survivors, _ROLL_CALL_GRACE_S)
            else:
                wait = max(started + 2 * self.timeout_s + 2 * _ROLL_CALL_GRACE_S - time.monotonic(), _ROLL_CALL_GRACE_S)
                found = channel.wait_value(f"{name}/verdict", wait)
                if found is None:
                    return _lost(step, [0], "never gave its verdict", reason)
                text = found
                channel.publish(f"{name}/seen/{self.rank}", "1")
        except CommitOutcomeUnknownError:  # rank 0's store accepts calls but does not answer them
            return _lost(step, [0], "did not answer (it is stopped, hung, or cut off from the other ranks)")
        except CommitError:  # rank 0's store is unreachable: rank 0 died (or closed its manager)
            return _lost(step, [0], "went away (its checkpoint store is unreachable: it died or closed its manager)")
        verdict = json.loads(text)
        return _lost(str(verdict["step"]), [int(r) for r in verdict["silent"]], "", str(verdict["reason"]))


def _lost(step: str, silent: list[int], how: str, reason: str = "") -> CommitError:
    """The one error every survivor of a broken collective raises."""
    said = f" (rank 0 saw: {reason})" if reason else ""
    if not silent:
        return CommitError(
            f"{step}: the ranks lost contact over the checkpoint's gloo group, though every rank reported in "
            f"afterwards{said}. Nothing was committed.",
            {0: f"lost contact with the other ranks{said}"},
        )
    how = how or "went silent: it died, hung, or never made this call (save() or load())"
    return CommitError(
        f"{step}: rank(s) {silent} {how}; every other rank lost contact with it{said}. Nothing was committed.",
        dict.fromkeys(silent, how),
    )
