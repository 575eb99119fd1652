"""gc's claim found beside a manifest: the manifest of the save it collects is unfinished, another save's is not.

gc holds a dead save's prefix with its own claim, naming in `"collects"` the save it collects (or, for an
earlier version's save whose marker named none, a name no save's token equals). Beside that save's manifest the
claim means the prefix is on its way out (a gc killed there must not leave it committed); beside a manifest
another save wrote it is a stray claim, and that checkpoint stays committed (gc must not delete it whole).
"""

from __future__ import annotations

import json

from torch_checkpointing.manifest import GC_TOKEN_PREFIX, UNNAMED_SAVE, Manifest, stray_claim


def _gc_marker(collects: str) -> bytes:
    claim = {"token": f"{GC_TOKEN_PREFIX}0", "uid": "u", "host": "h", "pid": 1, "created": 1.0, "collects": collects}
    return json.dumps(claim).encode()


def _manifest(claim: str) -> Manifest:
    return Manifest(world_size=1, library_version="0", files=(), claim=claim)


def test_gc_claim_beside_the_manifest_of_the_save_it_collects_is_no_stray() -> None:
    assert not stray_claim(_gc_marker("save-A"), _manifest("save-A"))


def test_gc_claim_over_an_earlier_versions_save_is_no_stray_beside_its_manifest() -> None:
    assert not stray_claim(_gc_marker(UNNAMED_SAVE), _manifest("save-A"))


def test_gc_claim_naming_another_save_beside_a_manifest_is_a_stray_claim() -> None:
    assert stray_claim(_gc_marker("save-B"), _manifest("save-A"))
