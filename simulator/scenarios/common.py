"""What every scenario needs inside a rank: the plan, the backend, timers, byte counts, row helpers."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from simulator.backend import Backend, load_backend
from simulator.plan import Plan
from simulator.report import FAIL, PASS, CheckResult
from simulator.storage import InstrumentedStorageConfig, bytes_read


@dataclass
class RankCtx:
    """One rank's view of one phase ("save" on the source world, "load" on the target world)."""

    plan: Plan
    phase: str
    rank: int = field(init=False)
    world: int = field(init=False)
    b: Backend = field(init=False)
    _store: Any = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.b = load_backend()

    @property
    def mesh(self) -> tuple[int, ...]:
        return self.plan.save_mesh if self.phase == "save" else self.plan.load_mesh

    def path(self, *parts: str) -> Path:
        """A local path under the run's directory: for the simulator's own files (signals, results)."""
        return Path(self.plan.root, *parts)

    def ckpt(self, *parts: str) -> str:
        """A checkpoint id: a local path, or a URL under this run's prefix with --storage-url."""
        if self.plan.storage_url:
            return "/".join([self.plan.storage_url, *parts])
        return str(self.path(*parts))

    def storage(self, write_delay_s: float = 0.0) -> InstrumentedStorageConfig:
        return InstrumentedStorageConfig(write_delay_s=write_delay_s, url=self.plan.storage_url)

    @property
    def store(self) -> Any:
        """The same storage the managers use, for looking at what a save left (never a local path: S3 has none)."""
        if self._store is None:
            self._store = self.storage().create_storage()
        return self._store

    def _at(self, ckpt_id: str, rel: str = "") -> Path:
        return Path(f"{ckpt_id}/{rel}" if rel else ckpt_id)

    def is_file(self, ckpt_id: str, rel: str) -> bool:
        where = self._at(ckpt_id, rel)
        return bool(self.store.exists(where)) and not self.store.isdir(where)

    def size(self, ckpt_id: str, rel: str) -> int:
        return int(self.store.getsize(self._at(ckpt_id, rel)))

    def file_bytes(self, ckpt_id: str, rel_paths: list[str]) -> int:
        """Bytes of those files of a checkpoint that exist."""
        return sum(self.size(ckpt_id, p) for p in rel_paths if self.is_file(ckpt_id, p))

    def all_files(self, ckpt_id: str) -> list[str]:
        """Every file under a checkpoint, relative to it, sorted (a walk of ls/isdir through the storage)."""
        found: list[str] = []
        pending = [""]
        while pending:
            rel = pending.pop()
            try:
                names = self.store.ls(self._at(ckpt_id, rel))
            except FileNotFoundError:
                continue
            for name in names:
                child = f"{rel}/{name}" if rel else name
                (pending if self.store.isdir(self._at(ckpt_id, child)) else found).append(child)
        return sorted(found)

    def manager(self, items: Mapping[str, Any], *, sync: bool = True, write_delay_s: float = 0.0) -> Any:
        """A manager built only from public presets and fields."""
        cm = self.b.CheckpointManager
        cfg = cm.Config.with_sync_save() if sync else cm.Config.with_async_save()
        cfg.items = dict(items)
        cfg.storage_config = self.storage(write_delay_s)
        return cm(cfg)

    def row(
        self,
        scenario: str,
        check: str,
        result: str,
        *,
        placements: str = "-",
        notes: list[str] | None = None,
        written: int = 0,
        read: int = 0,
        seconds: float = 0.0,
        world: str | None = None,
    ) -> CheckResult:
        label = str(self.plan.save_world) if self.phase == "save" else self.plan.world_label
        return CheckResult(
            scenario, check, world or label, placements, result, written, read, seconds, list(notes or [])
        )


@dataclass
class Meter:
    """Time and bytes read for one check, measured in this rank."""

    start: float = field(default_factory=time.perf_counter)
    read_start: int = field(default_factory=bytes_read)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    @property
    def read(self) -> int:
        return bytes_read() - self.read_start


def same(a: Any, b: Any, path: str = "") -> list[str]:
    """Bit-exact structural comparison; returns human-readable differences (empty = identical)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path or '<root>'}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        if not torch.equal(_bits(a), _bits(b)):
            return [f"{path}: values differ"]
        return []
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in same(a[k], b[k], f"{path}.{k}" if path else str(k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same(x, y, f"{path}.{i}")]
    return [] if a == b else [f"{path or '<root>'}: {a!r} vs {b!r}"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, so -0.0 vs 0.0 and NaN payloads count as differences."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def verdict(diffs: list[str]) -> str:
    return PASS if not diffs else FAIL


@contextmanager
def closing(manager: Any) -> Iterator[Any]:
    try:
        yield manager
    finally:
        manager.close()


def clone_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_tree(v) for v in value)
    return value


def zeros_like_tree(value: Any) -> Any:
    """A load template with the same structure and fresh tensors (values must come from the file)."""
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, -7) if not value.dtype.is_floating_point else torch.full_like(value, float("nan"))
    if isinstance(value, Mapping):
        return {k: zeros_like_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [zeros_like_tree(v) for v in value]
    if isinstance(value, tuple):
        return tuple(zeros_like_tree(v) for v in value)
    return type(value)() if isinstance(value, (int, float, str)) else value


def ranks_label(first: int, last: int) -> str:
    """`rank 2` or `ranks 2..7`: how a note names a run of ranks."""
    return f"rank {first}" if first == last else f"ranks {first}..{last}"


def brief(text: str, limit: int = 200) -> str:
    """The first line of a message, cut at a word boundary so a note never ends mid-word."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    if len(first) <= limit:
        return first
    return first[:limit].rsplit(" ", 1)[0] + " …"


def gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
