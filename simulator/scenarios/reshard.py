"""Scenario 3: DTensor model + AdamW state and a custom-resharded dataloader, saved on N ranks, loaded on M.

Every full tensor is a function of --seed, so each rank computes the exact local
shard it must end up with; after the load, two AdamW steps on the target mesh
are compared with the same two steps on unsharded tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from simulator.dataloader_resharder import DataloaderResharder, dataloader_state
from simulator.report import FAIL, PASS, CheckResult
from simulator.scenarios.common import Meter, RankCtx, closing, ranks_label, same

NAME = "reshard"
SHAPES: dict[str, tuple[int, ...]] = {
    "embed.weight": (32, 24),
    "fc1.weight": (48, 24),
    "fc1.bias": (48,),
    "fc2.weight": (24, 48),
    "fc2.bias": (24,),
}
HYPER = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
STEP = 3
SAMPLES = 1003
MISC_PATH = "misc/misc_state_{rank}.json"


def placements(mesh_ndim: int, tensor_ndim: int, side: str) -> tuple[Placement, ...]:
    """Source: FSDP-like Shard(0) (TP×DP on 2-D meshes). Target: TP-like Shard(1), a different split."""
    if mesh_ndim == 1:
        return (Shard(0),) if side == "save" or tensor_ndim == 1 else (Shard(1),)
    if side == "save":
        return (Shard(0), Shard(1)) if tensor_ndim == 2 else (Replicate(), Shard(0))
    return (Shard(1), Shard(0)) if tensor_ndim == 2 else (Shard(0), Replicate())


def placement_label(mesh_ndim: int) -> str:
    def fmt(p: tuple[Placement, ...]) -> str:
        text = ",".join(f"S({x.dim})" if isinstance(x, Shard) else "R" for x in p)
        return text if len(p) == 1 else f"[{text}]"

    return f"{fmt(placements(mesh_ndim, 2, 'save'))}→{fmt(placements(mesh_ndim, 2, 'load'))}"


def full_state(seed: int) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """The unsharded ground truth: parameters and AdamW moments after STEP steps."""
    gen = torch.Generator().manual_seed(seed * 15485863 + 11)
    params = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    state = {
        i: {
            "step": torch.tensor(float(STEP)),
            "exp_avg": torch.randn(s, generator=gen) * 0.1,
            "exp_avg_sq": torch.rand(s, generator=gen) * 0.01,
        }
        for i, s in enumerate(SHAPES.values())
    }
    return params, state


def _mesh(ctx: RankCtx) -> DeviceMesh:
    names = ("dp",) if len(ctx.mesh) == 1 else ("dp", "tp")
    return init_device_mesh("cpu", ctx.mesh, mesh_dim_names=names)


def _shard(full: torch.Tensor, mesh: DeviceMesh, side: str) -> DTensor:
    # src_data_rank=None: every rank already holds the full tensor, so no communication is needed.
    return distribute_tensor(full, mesh, placements(mesh.ndim, full.dim(), side), src_data_rank=None)


def _sharded(
    seed: int, mesh: DeviceMesh, side: str, fill: float | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    params, state = full_state(seed)

    def pick(t: torch.Tensor) -> DTensor:
        return _shard(t if fill is None else torch.full_like(t, fill), mesh, side)

    model = {n: pick(t) for n, t in params.items()}
    opt = torch.optim.AdamW(list(model.values()), **HYPER, foreach=False)  # type: ignore[arg-type]
    optim = {
        "state": {
            i: {
                "step": torch.tensor(float(STEP) if fill is None else 0.0),
                "exp_avg": pick(s["exp_avg"]),
                "exp_avg_sq": pick(s["exp_avg_sq"]),
            }
            for i, s in state.items()
        },
        "param_groups": opt.state_dict()["param_groups"],
    }
    return model, optim


def _specs(ctx: RankCtx) -> dict[str, Any]:
    b = ctx.b
    reshard = b.dtensor_resharder.DTensorResharder
    lay = b.layout
    return {
        "model": b.ItemSpec(requires_copy=True, resharder=reshard()),
        "optimizer": b.ItemSpec(requires_copy=True, resharder=reshard()),
        "dataloader": b.ItemSpec(requires_copy=False, resharder=DataloaderResharder()),
        "misc_state": b.ItemSpec(
            requires_copy=False, layout=lay.LayoutInfo(MISC_PATH, lay.JsonSerialization()), required=False
        ),
    }


def save(ctx: RankCtx) -> list[CheckResult]:
    meter = Meter()
    mesh = _mesh(ctx)
    model, optim = _sharded(ctx.plan.seed, mesh, "save")
    source = dataloader_state(ctx.rank, ctx.world, SAMPLES)
    payload = {
        "model": model,
        "optimizer": optim,
        "dataloader": source,
        "misc_state": {"step": STEP, "rank": ctx.rank, "world": ctx.world},
    }
    root = ctx.ckpt(NAME)
    with closing(ctx.manager(_specs(ctx))) as mgr:
        mgr.save(root, payload)
    mine = [
        f"model_{ctx.rank}.pt",
        f"optimizer_{ctx.rank}.pt",
        f"dataloader_{ctx.rank}.pt",
        MISC_PATH.replace("{rank}", str(ctx.rank)),
    ]
    notes = [f"checkpoint files: {ctx.all_files(root)[:12]}"] if ctx.rank == 0 else []
    return [
        ctx.row(
            NAME,
            "save",
            PASS,
            placements=placement_label(mesh.ndim),
            notes=notes,
            written=ctx.file_bytes(root, mine),
            seconds=meter.seconds,
        )
    ]


def load(ctx: RankCtx) -> list[CheckResult]:
    meter = Meter()
    mesh = _mesh(ctx)
    label = placement_label(mesh.ndim)
    model, optim = _sharded(ctx.plan.seed, mesh, "load", fill=float("nan"))
    into: dict[str, Any] = {
        "model": model,
        "optimizer": optim,
        "dataloader": {"rank": -1, "world": -1, "samples_consumed": -1, "next_sample": -1},
    }
    with closing(ctx.manager(_specs(ctx))) as mgr:
        restored = dict(mgr.load(ctx.ckpt(NAME), into=into))
    rows = _check_values(ctx, mesh, restored, meter, label)
    rows.append(_check_misc(ctx))
    rows.append(_check_training(ctx, mesh, restored, label))
    return rows


def _check_misc(ctx: RankCtx) -> CheckResult:
    """A separate load (the same rank-local call on every rank) so a refusal cannot desync the others.

    The design document: on a resharded resume "each rank directly reads its own misc_state copy";
    ranks beyond the source world have no copy and do not ask for one (the item is required=False).
    """
    meter = Meter()
    source = ctx.plan.save_world
    into = {"misc_state": None} if ctx.rank < source else {}
    try:
        with closing(ctx.manager({"misc_state": _specs(ctx)["misc_state"]})) as mgr:
            got = dict(mgr.load(ctx.ckpt(NAME), into=into))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ctx.row(
            NAME,
            "misc_state",
            FAIL,
            placements="JSON per rank",
            seconds=meter.seconds,
            notes=[f"rank {ctx.rank}: direct read of its own misc_state refused: {type(exc).__name__}: {first[:300]}"],
        )
    if ctx.rank >= source:
        note = (
            [f"{ranks_label(source, ctx.world - 1)}: no misc_state copy of its own, skipped"]
            if ctx.rank == source
            else []
        )
        return ctx.row(NAME, "misc_state", PASS, placements="JSON per rank", notes=note, seconds=meter.seconds)
    want = {"step": STEP, "rank": ctx.rank, "world": source}
    diffs = same(got.get("misc_state"), want, "misc_state")
    return ctx.row(
        NAME,
        "misc_state",
        PASS if not diffs else FAIL,
        placements="JSON per rank",
        read=meter.read,
        seconds=meter.seconds,
        notes=[f"rank {ctx.rank}: {d}" for d in diffs[:3]],
    )


def _check_values(ctx: RankCtx, mesh: DeviceMesh, got: dict[str, Any], meter: Meter, label: str) -> list[CheckResult]:
    params, state = full_state(ctx.plan.seed)
    want_model = {n: _shard(t, mesh, "load").to_local() for n, t in params.items()}
    got_model = {n: t.to_local() if isinstance(t, DTensor) else t for n, t in got["model"].items()}
    diffs = same(got_model, want_model, "model")
    for i, s in state.items():
        entry = got["optimizer"]["state"][i]
        for k in ("exp_avg", "exp_avg_sq"):
            t = entry[k]
            diffs += same(
                t.to_local() if isinstance(t, DTensor) else t,
                _shard(s[k], mesh, "load").to_local(),
                f"optimizer.state.{i}.{k}",
            )
        diffs += same(entry["step"], s["step"], f"optimizer.state.{i}.step")
    rows = [
        ctx.row(
            NAME,
            "model+optimizer",
            PASS if not diffs else FAIL,
            placements=label,
            notes=[f"rank {ctx.rank}: {d}" for d in diffs[:4]],
            read=meter.read,
            seconds=meter.seconds,
        )
    ]
    want_loader = dataloader_state(ctx.rank, ctx.world, SAMPLES)
    loader_diffs = same(dict(got["dataloader"]), want_loader, "dataloader")
    note = (
        [
            f"{SAMPLES} samples consumed by {ctx.plan.save_world} ranks → rank 0 of {ctx.world} resumes at "
            f"sample {want_loader['next_sample']}"
        ]
        if ctx.rank == 0 and not loader_diffs
        else []
    )
    rows.append(
        ctx.row(
            NAME,
            "dataloader",
            PASS if not loader_diffs else FAIL,
            placements="custom Resharder",
            notes=note + [f"rank {ctx.rank}: {d}" for d in loader_diffs[:3]],
        )
    )
    return rows


def _loss(p: dict[str, torch.Tensor], seed: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 31 + step)
    tokens = torch.randint(0, SHAPES["embed.weight"][0], (8,), generator=gen)
    target = torch.randn(8, SHAPES["fc2.bias"][0], generator=gen)
    h = torch.tanh(F.linear(p["embed.weight"][tokens], p["fc1.weight"], p["fc1.bias"]))
    return F.mse_loss(F.linear(h, p["fc2.weight"], p["fc2.bias"]), target)


def _grads(full: dict[str, torch.Tensor], seed: int, step: int) -> dict[str, torch.Tensor]:
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in full.items()}
    grads = torch.autograd.grad(_loss(leaves, seed, step), list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


def _check_training(ctx: RankCtx, mesh: DeviceMesh, got: dict[str, Any], label: str) -> CheckResult:
    """Two AdamW steps on the resharded state vs. two steps on the unsharded ground truth."""
    meter = Meter()
    params = got["model"]
    opt = torch.optim.AdamW(list(params.values()), **HYPER, foreach=False)  # type: ignore[arg-type]
    opt.load_state_dict(got["optimizer"])
    ref_params, ref_state = full_state(ctx.plan.seed)
    ref = {n: t.clone() for n, t in ref_params.items()}
    ref_opt = torch.optim.AdamW(list(ref.values()), **HYPER, foreach=False)  # type: ignore[arg-type]
    ref_opt.load_state_dict(
        {
            "state": {i: {k: v.clone() for k, v in s.items()} for i, s in ref_state.items()},
            "param_groups": opt.state_dict()["param_groups"],
        }
    )
    for step in range(2):
        full = {n: p.full_tensor() for n, p in params.items()}
        for n, g in _grads(full, ctx.plan.seed, step).items():
            params[n].grad = distribute_tensor(g, mesh, params[n].placements, src_data_rank=None)
        opt.step()
        for n, g in _grads(ref, ctx.plan.seed, step).items():
            ref[n].grad = g
        ref_opt.step()
    worst = max(float((params[n].full_tensor() - ref[n]).abs().max()) for n in SHAPES)
    ok = all(torch.allclose(params[n].full_tensor(), ref[n], rtol=1e-5, atol=1e-6) for n in SHAPES)
    note = [f"max |sharded - reference| after 2 AdamW steps: {worst:.2e}"] if ctx.rank == 0 or not ok else []
    return ctx.row(
        NAME,
        "2 train steps",
        PASS if ok else FAIL,
        placements=f"{label} vs unsharded",
        notes=note,
        seconds=meter.seconds,
    )
