"""Crafted item files for tests: bytes put in place of a saved item's file, as a crafter would."""

from __future__ import annotations

import json
import zlib
from pathlib import Path


def replace_item_file(checkpoint: Path, data: bytes, key: str = "model") -> Path:
    """Rank 0's file of item `key` holds `data`, its manifest record's size and checksum made to match (no block
    checksums); the file's path."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    record = manifest["items"][key]["0"]
    path: str = record["path"]
    (checkpoint / path).write_bytes(data)
    record["crc32"], record["size"] = zlib.crc32(data), len(data)
    record.pop("blocks", None)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    return checkpoint / path
