"""Cross-rank coordination over a TCPStore: publish a value, gather everyone's.

Used by the commit protocol from the writer process, which has no process group; the store is hosted by
rank 0's trainer process, so it never touches the training's collectives. Every wait is bounded, and every
failure is a `CommitError` that names the rank(s) that went silent or away (never a raw `DistNetworkError`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from torch_checkpointing.errors import CommitError

__all__ = ["StoreAddress", "StoreChannel"]

_POLL_S = 0.005
T = TypeVar("T")


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int
    namespace: str


class StoreChannel:
    """Key-value rendezvous under one namespace; every wait is bounded and names who is late."""

    def __init__(self, address: StoreAddress, timeout_s: float, store: Any = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._store = store if store is not None else self._connect(address, timeout_s)

    @staticmethod
    def _connect(address: StoreAddress, timeout_s: float) -> Any:
        try:
            return dist.TCPStore(  # type: ignore[attr-defined]
                address.host,
                address.port,
                is_master=False,
                timeout=timedelta(seconds=max(timeout_s, 1.0)),
                wait_for_workers=False,
            )
        except Exception as exc:  # DistNetworkError, DistStoreError, RuntimeError
            raise _lost_host(exc) from None

    def _key(self, name: str) -> str:
        return f"{self.address.namespace}/{name}"

    def _call(self, op: Callable[[], T]) -> T:
        try:
            return op()
        except Exception as exc:  # the store's host (rank 0's trainer) is gone
            raise _lost_host(exc) from None

    def publish(self, name: str, value: str) -> None:
        self._call(lambda: self._store.set(self._key(name), value))

    def gather(self, name: str, world_size: int, what: str, timeout_s: float | None = None) -> list[str]:
        """Every rank's value for `name`, or a `CommitError` naming the ranks that never published."""
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
                    f"Checkpoint commit: rank(s) {silent} did not report {what} within {timeout_s:.0f}s (a rank "
                    f"died, hung, or never called save()). No checkpoint was committed.",
                    dict.fromkeys(silent, f"did not report {what} within {timeout_s:.0f}s"),
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return [self._get(k) for k in keys]

    def missing(self, name: str, world_size: int) -> list[int]:
        return [r for r in range(world_size) if not self._has(self._key(f"{name}/{r}"))]

    def _has(self, key: str) -> bool:
        return self._call(lambda: bool(self._store.check([key])))

    def _get(self, key: str) -> str:
        return str(self._call(lambda: self._store.get(key)).decode("utf-8"))


def _lost_host(exc: BaseException) -> CommitError:
    first = (str(exc).strip().splitlines() or [""])[0]
    return CommitError(
        f"Checkpoint commit: lost contact with rank 0, which hosts the checkpoint store ({type(exc).__name__}: "
        f"{first}); rank 0 died or closed its CheckpointManager. No checkpoint was committed by this save.",
        {0: "went away (its checkpoint store is unreachable)"},
    )
