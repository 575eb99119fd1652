"""Benchmark configuration: one dataclass so every section sees the same knobs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30

# The floors (memory copy, raw write, raw read) are measured inside "engine",
# interleaved with our runs; benchmarks/floors.py holds their code.
ALL_SECTIONS: tuple[str, ...] = ("engine", "dcp", "torch_save", "loop", "reshard", "ranks", "scale", "s3")

# The scale section run alone (--scale) is about 4 CPU-minutes of one core and took 731 s on two cores at
# load ~10; alone it protects no other section, so its bound only has to catch a hang.
SCALE_ALONE_TIMEOUT_S = 1800.0


@dataclass
class BenchConfig:
    """What to measure and how big; ``quick()`` shrinks it to a smoke run."""

    size_bytes: int = GiB
    runs: int = 5
    memory_saves: int = 20
    device: str = "cpu"
    direct_io: bool = True
    work_parent: Path = field(default_factory=lambda: Path.cwd() / "bench-out")
    out_json: Path = field(default_factory=lambda: Path.cwd() / "bench-out" / "results.json")
    loop_state_bytes: int = 64 * MiB
    reshard_bytes: int = 256 * MiB
    # --scale: a 70B-parameter layout (80 layers) saved on a scale_dp x 8 mesh, loaded on 2*scale_dp x 8.
    scale_layers: int = 80
    scale_dp: int = 128
    sections: tuple[str, ...] = ALL_SECTIONS
    section_timeout_s: float = 600.0
    saves_only: bool = False
    seed: int = 0
    quick: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sections) - set(ALL_SECTIONS))
        if unknown:
            raise ValueError(f"Unknown benchmark section(s) {unknown}; choose from {list(ALL_SECTIONS)}.")
        if self.runs < 1:
            raise ValueError(f"runs must be >= 1 (got {self.runs}); the targets use the median of the runs.")
        if self.memory_saves < 3:
            raise ValueError(f"memory_saves must be >= 3 (got {self.memory_saves}); growth is RSS after N vs after 2.")
        if self.scale_dp < 2 or self.scale_layers < 1:
            raise ValueError(
                f"scale_dp must be >= 2 (the growth fit needs a smaller mesh) and scale_layers >= 1 "
                f"(got {self.scale_dp}, {self.scale_layers})."
            )
        if self.size_bytes < MiB:
            raise ValueError(f"size_bytes must be at least 1 MiB (got {self.size_bytes}).")

    @classmethod
    def quick_config(cls, **overrides: object) -> BenchConfig:
        """A smoke run: every section, the same measurements on less data (several minutes on two cores)."""
        base = cls(
            size_bytes=64 * MiB,
            loop_state_bytes=16 * MiB,
            reshard_bytes=32 * MiB,
            scale_dp=16,
            section_timeout_s=240.0,
            quick=True,
        )
        return replace(base, **overrides)  # type: ignore[arg-type]
