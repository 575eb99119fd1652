"""Cross-rank coordination over a TCPStore: publish a value, gather everyone's, wait for a verdict.

Used by the commit protocol from the writer process, which has no process group; the store is hosted by
rank 0's trainer process, so it never touches the training's collectives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

__all__ = ["StoreAddress", "StoreChannel"]

_POLL_S = 0.005


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int
    namespace: str


class StoreChannel:
    """Key-value rendezvous under one namespace; every wait is bounded and names who is late."""

    def __init__(self, address: StoreAddress, timeout_s: float, store: dist.Store | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._store = store or dist.TCPStore(
            address.host,
            address.port,
            is_master=False,
            timeout=timedelta(seconds=max(timeout_s, 1.0)),
            wait_for_workers=False,
        )

    def _key(self, name: str) -> str:
        return f"{self.address.namespace}/{name}"

    def publish(self, name: str, value: str) -> None:
        self._store.set(self._key(name), value)

    def gather(self, name: str, world_size: int, what: str, timeout_s: float | None = None) -> list[str]:
        """Every rank's value for `name`, or TimeoutError naming the ranks that never published."""
        keys = [self._key(f"{name}/{r}") for r in range(world_size)]
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pending = set(range(world_size))
        delay = _POLL_S
        while pending:
            pending = {r for r in pending if not self._store.check([keys[r]])}
            if not pending:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Checkpoint commit: rank(s) {sorted(pending)} did not report {what} within "
                    f"{timeout_s:.0f}s (a rank died, hung, or never called save()). No checkpoint was committed."
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return [self._store.get(k).decode("utf-8") for k in keys]

    def missing(self, name: str, world_size: int) -> list[int]:
        return [r for r in range(world_size) if not self._store.check([self._key(f"{name}/{r}")])]

    def wait_for(self, name: str, who: str, grace_s: float = 0.0) -> str:
        key = self._key(name)
        deadline = time.monotonic() + self.timeout_s + grace_s
        delay = _POLL_S
        try:
            while not self._store.check([key]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Checkpoint commit: no word from {who} within {self.timeout_s:.0f}s; the save failed.")
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
            return self._store.get(key).decode("utf-8")
        except TimeoutError:
            raise
        except RuntimeError as exc:  # the store's host (rank 0's trainer) is gone
            raise RuntimeError(
                f"Checkpoint commit: lost contact with {who}, which hosts the checkpoint store ({exc}); rank 0 "
                f"died or closed its CheckpointManager before the commit. No checkpoint was committed by this save."
            ) from exc
