"""The manifest: the JSON file whose presence makes a checkpoint directory a complete checkpoint.

It is written last, by rank 0, after every rank's files are durable; the directory is then renamed into
place. A directory with the `.incomplete` marker and no manifest is a save that never finished.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_checkpointing.storage.base_storage import Storage

__all__ = ["MANIFEST_FILE_NAME", "INCOMPLETE_MARKER", "FileRecord", "Manifest", "read_manifest"]

MANIFEST_FILE_NAME = "manifest.json"
INCOMPLETE_MARKER = ".incomplete"
_KIND = "torch_checkpointing.manifest"


@dataclass(frozen=True)
class FileRecord:
    key: str
    rank: int
    path: str
    size: int
    crc32: int
    format: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "rank": self.rank, "path": self.path, "size": self.size, "crc32": self.crc32, "format": self.format}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileRecord:
        return cls(d["key"], int(d["rank"]), d["path"], int(d["size"]), int(d["crc32"]), d["format"])


@dataclass(frozen=True)
class Manifest:
    world_size: int
    library_version: str
    files: tuple[FileRecord, ...]
    metadata_file: str | None = None
    # Optional facts about the save, for discovery/retention tools; absent from older manifests.
    step: int | None = None
    metrics: dict[str, float] | None = None
    commit_time: float | None = None  # unix seconds, taken just before the manifest is written

    def to_json(self) -> str:
        items: dict[str, dict[str, Any]] = {}
        for rec in sorted(self.files, key=lambda r: (r.key, r.rank)):
            items.setdefault(rec.key, {})[str(rec.rank)] = rec.to_dict()
        return json.dumps(
            {
                "kind": _KIND,
                "manifest_version": 1,
                "library_version": self.library_version,
                "world_size": self.world_size,
                "metadata_file": self.metadata_file,
                "items": items,
                **_extras(self),
            },
            sort_keys=True,
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        if d.get("kind") != _KIND:
            raise ValueError(f"not a torch_checkpointing manifest (kind={d.get('kind')!r})")
        files = tuple(FileRecord.from_dict(rec) for per_rank in d["items"].values() for rec in per_rank.values())
        step, metrics, when = d.get("step"), d.get("metrics"), d.get("commit_time")
        return cls(
            int(d["world_size"]),
            d["library_version"],
            files,
            d.get("metadata_file"),
            None if step is None else int(step),
            None if metrics is None else {str(k): float(v) for k, v in metrics.items()},
            None if when is None else float(when),
        )

    def record(self, key: str, rank: int) -> FileRecord | None:
        for rec in self.files:
            if rec.key == key and rec.rank == rank:
                return rec
        return None

    def keys(self) -> set[str]:
        return {rec.key for rec in self.files}


def _extras(manifest: Manifest) -> dict[str, Any]:
    """The optional fields that are set (so a manifest without them reads exactly as before)."""
    extras = {"step": manifest.step, "metrics": manifest.metrics, "commit_time": manifest.commit_time}
    return {k: v for k, v in extras.items() if v is not None}


def read_manifest(storage: Storage, checkpoint_dir: Path) -> Manifest | None:
    """The manifest, None for a directory written without one (the published release), or an error if incomplete."""
    if storage.exists(checkpoint_dir / INCOMPLETE_MARKER):
        # Checked first: a writer killed between writing the manifest and removing the marker leaves both.
        raise RuntimeError(
            f"Checkpoint {checkpoint_dir} is incomplete: its save never committed. Load an earlier checkpoint."
        )
    path = checkpoint_dir / MANIFEST_FILE_NAME
    if not storage.exists(path):
        return None
    try:
        return Manifest.from_json(storage.read(path).decode("utf-8"))
    except (ValueError, KeyError) as exc:
        raise RuntimeError(f"Checkpoint {checkpoint_dir} has an unreadable manifest ({exc}); it cannot be trusted.") from exc
