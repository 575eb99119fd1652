"""The store's "now" read from a clock probe (`store_now`) errs, where it must err, toward ages too young.

A probe's stamp is made at some moment while the probe runs: a create held up by a file server that stalls (an
NFS hard mount waiting for its server) or a PUT retried by an object store's client is stamped when it is
finally done. Counted from the probe's start, that stamp made "now" later than it is by the whole stall, for the
30 s it stands for the store: every age judged meanwhile read older by as much, and gc removed a live save's
temporary, or put back a live replace's copy aside, that was still younger than its threshold.
"""

from __future__ import annotations

import time
from pathlib import Path

from torch_checkpointing.storage.base_storage import store_now

# How long the probe's create is held up before the store executes (and stamps) it.
_STALL_S = 1.5


def _stalled_probe() -> float:
    """A store that answers after a stall and stamps the create when it executes it, at the end."""
    time.sleep(_STALL_S)
    return time.time()


def test_a_probe_stamped_late_never_makes_the_stores_now_later_than_it_is(tmp_path: Path) -> None:
    where = str(tmp_path / "stalled")
    first = store_now(where, _stalled_probe)
    assert first <= time.time() + 0.05, f"read {first - time.time():.2f}s ahead of the store's clock"
    cached = store_now(where, _stalled_probe)  # within the period: the cached reading, advanced
    assert cached <= time.time() + 0.05, f"the cached reading is {cached - time.time():.2f}s ahead"
    assert time.time() - cached < 0.5  # and still the store's now, not far behind it
