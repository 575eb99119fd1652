"""What one simulator run does, as plain picklable data shared by the parent and every rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

SCENARIOS: dict[str, str] = {
    "layouts": (
        "default, {rank}-in-name, {rank}-in-subdirectory, JSON and safetensors items land at exactly the "
        "expected per-rank paths and read back per rank; a layout without {rank} on several ranks is "
        "shown as the collision the design document warns about."
    ),
    "async-race": (
        "a training loop mutates state right after an async save() returns while a slowed storage keeps "
        "the write in flight: requires_copy=True must save the state as of save() bit for bit, "
        "requires_copy=False shows the documented race, and lock() keeps optimizer steps whole."
    ),
    "reshard": (
        "DTensor model + AdamW state (Shard(0)/Shard(1), or a 2-D mesh) and a custom-resharded dataloader "
        "saved on the source world are loaded bit-exact on the target world with other placements, then "
        "two training steps match an unsharded reference."
    ),
    "faults": (
        "on real gloo ranks: a rank SIGKILLed mid-save, a killed async writer process, a full disk on one rank "
        "(RLIMIT_FSIZE) and a bit flipped in a shard before a resharding load must each make every affected "
        "rank raise in time, commit nothing and leave earlier checkpoints and live tensors intact. Not part "
        "of the default run (it waits out the engine's timeouts on purpose): name it, --scenario faults."
    ),
}
# Named only: a plain run stays within its time budget; `--scenario all` runs these too.
OPT_IN: frozenset[str] = frozenset({"faults"})
DEFAULT_SCENARIOS: tuple[str, ...] = tuple(name for name in SCENARIOS if name not in OPT_IN)


@dataclass(frozen=True)
class Plan:
    """Everything a rank needs to run its share of the scenarios."""

    backend: str
    seed: int
    root: str
    save_world: int
    load_world: int
    save_mesh: tuple[int, ...]
    load_mesh: tuple[int, ...]
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    write_delay_s: float = 0.25
    results_dir: str = field(default="")
    # "" = checkpoints on the local filesystem under `root`; else the URL (this run's own prefix) they go to
    # through the backend's FsspecStorageConfig. `root` still holds the per-rank result files.
    storage_url: str = ""

    def __post_init__(self) -> None:
        for name, world, mesh in (("save", self.save_world, self.save_mesh), ("load", self.load_world, self.load_mesh)):
            if prod(mesh) != world:
                raise ValueError(f"{name} mesh {mesh} has {prod(mesh)} ranks but the {name} world is {world}")
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown:
            raise ValueError(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")

    @property
    def checkpoints_at(self) -> str:
        return self.storage_url or self.root

    @property
    def world_label(self) -> str:
        return f"{self.save_world}→{self.load_world}"

    @property
    def mesh_label(self) -> str:
        def fmt(mesh: tuple[int, ...]) -> str:
            return "x".join(map(str, mesh))

        return f"{fmt(self.save_mesh)}→{fmt(self.load_mesh)}"
