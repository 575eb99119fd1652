"""Importing this module is the proof that a backend imported a name it read from a checkpoint.

SAFE-CRAFT-3 writes ``conformance.canary.Canary`` into a checkpoint's metadata; the module
records its own import in a file named by ``CONFORMANCE_CANARY_FILE`` (and in ``sys.modules``).
"""

from __future__ import annotations

import os
from pathlib import Path

_marker = os.environ.get("CONFORMANCE_CANARY_FILE")
if _marker:
    Path(_marker).write_text("imported\n")


class Canary:
    """Constructing it is as bad as importing it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        if _marker:
            Path(_marker).write_text("constructed\n")
