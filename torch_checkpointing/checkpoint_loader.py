"""Reading a checkpoint back into templates: a direct read of this rank's file, or a resharder's load.

Nothing is read before every item has been checked (templates for resharded items, world-size changes for
per-rank files without a resharder), so a refused load leaves the caller's objects untouched.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from torch_checkpointing.config import CheckpointLoaderConfig
from torch_checkpointing.encoding import decode
from torch_checkpointing.manifest import Manifest, read_manifest
from torch_checkpointing.schema import ResolvedItem
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.types import CheckpointPath, RankInfo
from torch_checkpointing.walk_utils import walk_checkpoint_structure

__all__ = ["CheckpointLoader"]


class CheckpointLoader:
    def __init__(self, storage: Storage, config: CheckpointLoaderConfig, rank_info: RankInfo) -> None:
        self.storage = storage
        self.config = config
        self.rank_info = rank_info

    def load(
        self,
        checkpoint_id: str,
        items: list[ResolvedItem],
        *,
        map_location: Any = None,
        strict: bool = False,
    ) -> dict[str, Any]:
        root = Path(checkpoint_id)
        no_target = sorted(i.key for i in items if i.spec.resharder is not None and i.value is None)
        if no_target:
            raise ValueError(
                f"Resharding load requires a live target in into= for: {no_target}. Pass the live objects to "
                f"restore into (e.g. into={{'model': model.state_dict()}})."
            )
        if not self.storage.isdir(root):
            raise FileNotFoundError(f"Checkpoint path {checkpoint_id} does not exist.")
        manifest = read_manifest(self.storage, root)
        source_metadata = self._distributed_metadata(root, items)
        for item in items:
            self._check_world_size(item, manifest)

        result: dict[str, Any] = {}
        missing: list[CheckpointPath] = []
        for item in items:
            if self._try_reshard(root, item, source_metadata, missing):
                result[item.key] = item.value
                continue
            loaded = self._read_direct(root, item, manifest, map_location, missing)
            if loaded is not _ABSENT:
                result[item.key] = loaded
        if strict and missing:
            raise RuntimeError(f"Checkpoint at {checkpoint_id} is missing keys: {[str(p) for p in missing]}")
        return result

    def _distributed_metadata(self, root: Path, items: list[ResolvedItem]) -> Any:
        if not any(i.spec.resharder is not None and not i.spec.resharder.skip_resharding for i in items):
            return None
        from torch_checkpointing.distributed_metadata import load_distributed_metadata

        return load_distributed_metadata(root, self.storage)

    def _check_world_size(self, item: ResolvedItem, manifest: Manifest | None) -> None:
        """Refuse default-layout shards across world sizes; explicit `{rank}` layouts read this rank's own copy.

        The default per-rank layout is "what sharded state wants" (the design document), so reading rank r's
        file on another world size would hand back a different shard. An explicit per-rank layout is the
        document's per-rank bookkeeping (misc_state): "each rank directly reads its own copy", if it has one.
        """
        if manifest is None or manifest.world_size == self.rank_info.global_world_size:
            return
        if item.spec.resharder is None and item.is_default_layout and item.key in manifest.keys():
            raise RuntimeError(
                f"Item '{item.key}' was saved by {manifest.world_size} rank(s) into per-rank files and is being loaded "
                f"by {self.rank_info.global_world_size}; without a resharder rank {self.rank_info.global_rank} would "
                f"read the wrong shard. Declare ItemSpec(resharder=...) for '{item.key}' (DTensorResharder for "
                f"DTensor state, a custom Resharder otherwise), or load on {manifest.world_size} rank(s)."
            )

    def _try_reshard(self, root: Path, item: ResolvedItem, source_metadata: Any, missing: list[CheckpointPath]) -> bool:
        resharder = item.spec.resharder
        if resharder is None or resharder.skip_resharding or source_metadata is None:
            return False
        source_item = source_metadata.metadata.get(item.key)
        target = resharder.extract_sharding_metadata(item.key, item.value) or None
        if not resharder.should_reshard(source_item, target):
            return False
        unhandled = resharder.load(root, item.key, target, source_item, item.value, self.storage)
        missing.extend(CheckpointPath(item.key, tuple(p)) for p in unhandled)
        return True

    def _read_direct(
        self,
        root: Path,
        item: ResolvedItem,
        manifest: Manifest | None,
        map_location: Any,
        missing: list[CheckpointPath],
    ) -> Any:
        path = root / item.layout.file_path
        if not self.storage.exists(path):
            if not item.spec.required:
                return _ABSENT
            raise RuntimeError(
                f"Missing file {path} for key {item.key}. Save it, or declare ItemSpec(required=False) to allow "
                f"checkpoints without it."
            )
        record = manifest.record(item.key, self.rank_info.global_rank) if manifest is not None else None
        if record is not None:
            self._verify(path, record.size, record.crc32, item.key)
        value = decode(
            item.layout.serialization_format,
            self.storage,
            path,
            item.key,
            template=item.value,
            map_location=map_location,
            weights_only=self.config.weights_only,
            use_mmap=self.config.use_mmap,
        )
        merged, item_missing = walk_checkpoint_structure(item_key=item.key, source=value, target=item.value)
        missing.extend(item_missing)
        return merged

    def _verify(self, path: Path, size: int, crc: int, key: str) -> None:
        actual = self.storage.getsize(path)
        if actual != size:
            raise RuntimeError(
                f"File {path} for key {key} has {actual} bytes but the manifest records {size}: the checkpoint "
                f"was modified or damaged after it was committed."
            )
        if self.config.verify_checksums and zlib.crc32(self.storage.read(path)) != crc:
            raise RuntimeError(f"File {path} for key {key} fails its CRC32 check: the checkpoint is damaged.")

    def close(self) -> None:
        return None


_ABSENT: Any = object()
