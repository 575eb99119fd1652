"""Scenario 4: faults in the middle of a save, and a corrupted shard before a resharding load.

Every fault is injected on purpose, at a point the engine cannot race past, so each verdict is the same on
every run:

* kill rank: a rank of a real gloo job is SIGKILLed while it writes (its storage announces the write and
  holds it; :mod:`simulator.faults_job`). Every survivor's save() must raise within ``wait_timeout_secs``
  (+ grace), and the checkpoint saved before at the same id must still load exactly on every rank.
* kill writer: rank 0's async writer process is SIGKILLed while it writes. That save's Future must fail on
  every rank, nothing may be committed, and the next save on the same managers must work.
* disk full: RLIMIT_FSIZE is lowered inside one rank just before a sync save, so its file writes fail with
  EFBIG, as on a full disk. Every rank must raise, nothing may be committed, and once the limit is lifted a
  save at the same id must work.
* corrupt shard: a DTensor checkpoint saved on the source world gets one bit flipped in one file after
  commit; the resharding load on the target world (Shard(0)→Shard(1): every target rank reads every source
  file) must raise on every rank, and no tensor of the live ``into=`` templates may change.
"""

from __future__ import annotations

import concurrent.futures
import os
import resource
import signal
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from simulator.faults_job import GRACE_S, KillJob, KillOutcome, rank_state, run_kill_job
from simulator.faults_storage import SignallingStorageConfig, wait_for_signal
from simulator.report import FAIL, PASS, CheckResult
from simulator.scenarios.common import Meter, RankCtx, brief, closing, gather, same, zeros_like_tree

NAME = "faults"
WAIT_TIMEOUT_S = 20  # save.wait_timeout_secs of every manager here: a lost peer must surface within this
_GRACE_S = 10.0  # allowed beyond WAIT_TIMEOUT_S before "raised in time" fails
_HOLD_S = 45.0  # how long an announced write holds when nothing kills it (the check then fails, bounded)
_FSIZE_LIMIT = 16 * 1024  # bytes a file may grow to in the rank whose disk is "full"; each file is ~64 KiB
_CORRUPT_ITEM = "optimizer"  # payload order and name order both put it last: earlier items load first
_SHAPES = {"embed.weight": (24, 16), "fc.weight": (24, 24), "fc.bias": (24,)}
HUNG = "no answer within our bound (hung)"  # what _attempt reports for a Future that never resolved
_CHECK_NAMES = {
    "_disk_full": "disk full",
    "_kill_writer": "kill writer",
    "_kill_rank": "kill rank",
    "_save_shard_checkpoint": "corrupt shard",
    "_corrupt_shard": "corrupt shard",
}


def save(ctx: RankCtx) -> list[CheckResult]:
    """Source world: disk full, kill writer, kill rank; then the checkpoint the load phase will corrupt."""
    rows = [_aligned(check, ctx) for check in (_disk_full, _kill_writer, _kill_rank)]
    setup = _aligned(_save_shard_checkpoint, ctx)
    return rows + ([setup] if setup is not None else [])


def load(ctx: RankCtx) -> list[CheckResult]:
    """Target world: a bit flipped in one committed file, then the resharding load."""
    return [_aligned(_corrupt_shard, ctx)]


# ------------------------------------------------------------------------------------------------ shared


def _aligned(check: Callable[[RankCtx], Any], ctx: RankCtx) -> Any:
    """Start each check together (ranks reach it seconds apart on a loaded machine), and keep the rows of the
    other checks when one breaks outside the engine calls it guards: that check alone becomes a FAIL row."""
    dist.barrier()
    try:
        return check(ctx)
    except Exception as exc:
        name = _CHECK_NAMES.get(check.__name__, check.__name__)
        return ctx.row(NAME, name, FAIL, notes=[f"rank {ctx.rank}: {type(exc).__name__}: {brief(str(exc), 200)}"])


def _manager(
    ctx: RankCtx, items: dict[str, Any], *, sync: bool = True, storage: SignallingStorageConfig | None = None
) -> Any:
    """A manager from public presets and fields, with a short save.wait_timeout_secs so faults surface fast.

    Building one is collective (the engine connects its own gloo group, bounded by wait_timeout_secs), and after
    a fault the ranks learn of it up to wait_timeout_secs apart (the victim at once, the others on timeout), so
    the ranks line up on the simulator's own group first.
    """
    if dist.is_initialized():
        dist.barrier()
    cm = ctx.b.CheckpointManager
    cfg = cm.Config.with_sync_save() if sync else cm.Config.with_async_save()
    cfg.save.wait_timeout_secs = WAIT_TIMEOUT_S
    cfg.items = dict(items)
    cfg.storage_config = storage or SignallingStorageConfig()
    return cm(cfg)


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str, float]:
    """Run one engine call: (value, "" or 'ErrorType: first line', seconds it took)."""
    start = time.perf_counter()
    try:
        value = fn()
    except concurrent.futures.TimeoutError:
        return None, HUNG, time.perf_counter() - start
    except Exception as exc:
        return None, f"{type(exc).__name__}: {brief(str(exc), 160)}".rstrip(": "), time.perf_counter() - start
    return value, "", time.perf_counter() - start


def _not_committed(ctx: RankCtx, directory: str, like: dict[str, Any]) -> str:
    """ "" if the id holds no checkpoint (missing, or refused as incomplete), else what a load found there."""
    incomplete = getattr(ctx.b.top, "IncompleteCheckpointError", None)
    with closing(_manager(ctx, {"model": ctx.b.ItemSpec()})) as reader:
        try:
            reader.load(directory, into={"model": zeros_like_tree(like)})
        except FileNotFoundError:
            return ""
        except Exception as exc:
            if incomplete is not None and isinstance(exc, incomplete):
                return ""
            return f"loading it raised {type(exc).__name__}: {brief(str(exc), 120)}, not 'no checkpoint here'"
    return "it loads: the failed save was committed"


def _loads_exactly(ctx: RankCtx, directory: str, expected: dict[str, Any]) -> str:
    """ "" if the checkpoint at `directory` loads on this rank and equals `expected` bit for bit."""
    with closing(_manager(ctx, {"model": ctx.b.ItemSpec()})) as reader:
        got, error, _ = _attempt(lambda: reader.load(directory, into={"model": zeros_like_tree(expected)}))
    if error:
        return f"load raised {error}"
    diffs = same(dict(got)["model"], expected)
    return f"differs: {diffs[:2]}" if diffs else ""


def _check_row(
    ctx: RankCtx, check: str, placements: str, problems: list[str], seen: list[str], seconds: float, summary: str = ""
) -> CheckResult:
    """One rank's row: PASS only without problems; notes say what this rank saw, then what went wrong."""
    notes = [f"rank {ctx.rank}: {s}" for s in seen] + [f"rank {ctx.rank}: {p}" for p in problems]
    if summary and ctx.rank == 0:
        notes.insert(0, summary)
    return ctx.row(NAME, check, FAIL if problems else PASS, placements=placements, notes=notes, seconds=seconds)


# --------------------------------------------------------------------------------------------- disk full


def _disk_full(ctx: RankCtx) -> CheckResult:
    victim = ctx.world - 1
    directory = str(ctx.path(NAME, "disk-full"))
    state = rank_state(ctx.plan.seed, ctx.rank, 10)
    problems: list[str] = []
    with closing(_manager(ctx, {"model": ctx.b.ItemSpec()})) as mgr:
        _, error, took = _with_file_size_limit(ctx.rank == victim, lambda: mgr.save(directory, {"model": state}))
        seen = [f"save() raised {error} after {took:.1f}s" if error else f"save() returned after {took:.1f}s"]
        if not error:
            problems.append(f"save() did not raise although rank {victim} could not write its files")
        elif took > WAIT_TIMEOUT_S + _GRACE_S:
            problems.append(f"raised only after {took:.1f}s (wait_timeout_secs={WAIT_TIMEOUT_S})")
        leftover = _not_committed(ctx, directory, state)
        problems += [f"after the failed save: {leftover}"] if leftover else []
        retry = rank_state(ctx.plan.seed, ctx.rank, 11)
        _, again, _ = _attempt(lambda: mgr.save(directory, {"model": retry}))
        problems += [f"the save after lifting the limit raised {again}"] if again else []
    if not again:
        bad = _loads_exactly(ctx, directory, retry)
        problems += [f"the save after lifting the limit: {bad}"] if bad else []
    summary = (
        f"rank {victim}'s files were capped at {_FSIZE_LIMIT // 1024} KiB (RLIMIT_FSIZE: writes fail with "
        "EFBIG, as on a full disk); nothing committed, the retry at the same id after lifting it loads exactly"
    )
    return _check_row(
        ctx, "disk full", f"RLIMIT_FSIZE on rank {victim}", problems, seen, took, summary if not problems else ""
    )


def _with_file_size_limit(limited: bool, fn: Callable[[], Any]) -> tuple[Any, str, float]:
    """Run fn with this process's file size capped (when `limited`); the cap is always lifted afterwards."""
    if not limited:
        return _attempt(fn)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FSIZE_LIMIT, hard))
    try:
        return _attempt(fn)  # Python ignores SIGXFSZ, so a write past the cap fails with OSError(EFBIG)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# ------------------------------------------------------------------------------------------- kill writer


def _kill_writer(ctx: RankCtx) -> CheckResult:
    """Rank 0's writer process dies mid-write: every rank's Future fails, nothing is committed, the next save works."""
    victim = 0
    signal_path = str(ctx.path(NAME, "writer-killed.signal"))
    killed_dir, next_dir = str(ctx.path(NAME, "writer-killed")), str(ctx.path(NAME, "after-writer-death"))
    storage = SignallingStorageConfig(
        signal_path=signal_path if ctx.rank == victim else "", trigger="model_", hold_s=_HOLD_S
    )
    state, retry = rank_state(ctx.plan.seed, ctx.rank, 20), rank_state(ctx.plan.seed, ctx.rank, 21)
    problems: list[str] = []
    with closing(_manager(ctx, {"model": ctx.b.ItemSpec()}, sync=False, storage=storage)) as mgr:
        future, error, _ = _attempt(lambda: mgr.save(killed_dir, {"model": state}))
        kill = _kill_announced_writer(signal_path) if ctx.rank == victim and not error else (0.0, "")
        kill_time, victim_note = gather(kill)[victim]
        if not error:
            _, error, _ = _attempt(lambda: future.result(timeout=WAIT_TIMEOUT_S + 2 * _GRACE_S))
        took = time.time() - kill_time if kill_time else 0.0
        seen = [victim_note] if victim_note and ctx.rank == victim else []
        seen.append(_future_outcome(error, took))
        problems += [] if kill_time else [f"rank {victim}'s writer was not killed: {victim_note}"]
        problems += [] if error and error != HUNG else ["the Future of the killed save did not fail on this rank"]
        leftover = _not_committed(ctx, killed_dir, state)
        problems += [f"after the killed save: {leftover}"] if leftover else []
        _, again, _ = _attempt(lambda: mgr.save(next_dir, {"model": retry}).result(timeout=WAIT_TIMEOUT_S * 4))
        problems += [f"the next save raised {again}"] if again else []
    if not again:
        bad = _loads_exactly(ctx, next_dir, retry)
        problems += [f"the next save: {bad}"] if bad else []
    summary = (
        "rank 0's async writer process was SIGKILLed while writing; the Future failed on every rank, "
        "nothing committed, the next save on the same managers loads exactly"
    )
    return _check_row(
        ctx, "kill writer", "async, rank 0's writer SIGKILL", problems, seen, took, summary if not problems else ""
    )


def _future_outcome(error: str, after_kill_s: float) -> str:
    if error == HUNG:
        return f"the Future neither failed nor succeeded within {WAIT_TIMEOUT_S + 2 * _GRACE_S:.0f}s (hung)"
    return f"the Future failed with {error}, {after_kill_s:.1f}s after the kill" if error else "the Future succeeded"


def _kill_announced_writer(signal_path: str) -> tuple[float, str]:
    """(kill time, what was done) once the writing process announces itself; never kills this rank itself."""
    got = wait_for_signal(signal_path, 60.0)
    if got is None:
        return 0.0, "no process started writing the save within 60s"
    pid, _, writing = got
    if pid == os.getpid():
        return 0.0, f"the save was written by the trainer process itself (pid {pid}), not a writer process"
    os.kill(pid, signal.SIGKILL)
    return time.time(), f"SIGKILLed the writer process (pid {pid}) while it wrote {Path(writing).name}"


# --------------------------------------------------------------------------------------------- kill rank


def _kill_rank(ctx: RankCtx) -> CheckResult:
    """Rank 0 runs a fresh job whose last rank is killed mid-save; every rank here then loads that id's v1."""
    meter = Meter()
    job = KillJob(
        directory=str(ctx.path(NAME, "kill-rank")),
        world=ctx.world,
        seed=ctx.plan.seed,
        victim=ctx.world - 1,
        wait_timeout_s=WAIT_TIMEOUT_S,
    )
    box: list[Any] = [None]
    if ctx.rank == 0:
        result, error, _ = _attempt(lambda: run_kill_job(job))
        box[0] = result if not error else KillOutcome(victim=job.victim, problem=f"the job failed: {error}")
    dist.broadcast_object_list(box, src=0)
    outcome: KillOutcome = box[0]
    seen, problems = _judge_survivor(ctx, outcome)
    if not outcome.problem:
        bad = _loads_exactly(ctx, job.checkpoint_id, rank_state(ctx.plan.seed, ctx.rank, 1))
        problems += [f"the checkpoint saved before at the same id: {bad}"] if bad else []
    summary = (
        f"rank {job.victim} SIGKILLed while writing {outcome.killed_while_writing}; every survivor raised "
        f"within wait_timeout_secs={WAIT_TIMEOUT_S}s, and the earlier checkpoint at that id loads exactly "
        "on every rank"
    )
    slowest = max((r.get("end", 0.0) - outcome.kill_time for r in outcome.ranks.values()), default=0.0)
    return _check_row(
        ctx,
        "kill rank",
        f"rank {job.victim} SIGKILL mid-write",
        problems,
        seen,
        max(slowest, 0.0) or meter.seconds,
        summary if not problems else "",
    )


def _judge_survivor(ctx: RankCtx, outcome: KillOutcome) -> tuple[list[str], list[str]]:
    """What this rank's counterpart in the job saw, and what is wrong with it."""
    if outcome.problem:
        return [], [outcome.problem] if ctx.rank == 0 else []
    if ctx.rank == outcome.victim:
        where = "" if outcome.victim_pid_matches else " (another process announced the write)"
        return [f"SIGKILLed while writing {outcome.killed_while_writing}{where}"], []
    record = outcome.ranks.get(ctx.rank, {})
    if ctx.rank in outcome.hung:
        return [f"save() neither returned nor raised within {WAIT_TIMEOUT_S + GRACE_S:.0f}s of the kill (hung)"], [
            "a survivor hung"
        ]
    if record.get("stage") != "v2":
        return [f"left no record: {record}"], ["a survivor left no record"]
    after = record["end"] - outcome.kill_time
    if not record["raised"]:
        return [f"save() returned normally {after:.1f}s after the kill"], [
            "save() reported success although a rank died mid-save"
        ]
    problems = [f"raised only after {after:.1f}s"] if after > WAIT_TIMEOUT_S + _GRACE_S else []
    problems += [f"raised {-after:.1f}s before the kill"] if after < 0 else []
    return [f"save() raised {record['error']} {after:.1f}s after the kill"], problems


# ----------------------------------------------------------------------------------------- corrupt shard


def _mesh(world: int) -> DeviceMesh:
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))


def _full(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed * 104723 + 5)
    return {item: {n: torch.randn(s, generator=gen) for n, s in _SHAPES.items()} for item in ("model", _CORRUPT_ITEM)}


def _sharded(
    full: dict[str, dict[str, torch.Tensor]], mesh: DeviceMesh, dim: int, fill: float | None = None
) -> dict[str, dict[str, DTensor]]:
    """Each tensor as a DTensor (Shard(dim), 1-D tensors always Shard(0)); `fill` replaces the values."""

    def one(t: torch.Tensor) -> DTensor:
        value = t if fill is None else torch.full_like(t, fill)
        return distribute_tensor(value, mesh, [Shard(min(dim, t.dim() - 1))], src_data_rank=None)

    return {item: {n: one(t) for n, t in tensors.items()} for item, tensors in full.items()}


def _reshard_specs(ctx: RankCtx) -> dict[str, Any]:
    reshard = ctx.b.dtensor_resharder.DTensorResharder
    return {item: ctx.b.ItemSpec(resharder=reshard()) for item in ("model", _CORRUPT_ITEM)}


def _save_shard_checkpoint(ctx: RankCtx) -> CheckResult | None:
    """Save (Shard(0)) the checkpoint the load phase corrupts; a row only if that fails."""
    meter = Meter()
    payload = _sharded(_full(ctx.plan.seed), _mesh(ctx.world), 0)
    with closing(_manager(ctx, _reshard_specs(ctx))) as mgr:
        _, error, _ = _attempt(lambda: mgr.save(str(ctx.path(NAME, "shard")), payload))
    if not error:
        return None
    return ctx.row(
        NAME,
        "corrupt shard",
        FAIL,
        placements="S(0) save",
        seconds=meter.seconds,
        notes=[f"rank {ctx.rank}: saving the checkpoint to corrupt raised {error}"],
    )


def _locals(tree: dict[str, dict[str, DTensor]]) -> dict[str, dict[str, torch.Tensor]]:
    return {i: {n: t.to_local().clone() for n, t in d.items()} for i, d in tree.items()}


def _corrupt_shard(ctx: RankCtx) -> CheckResult:
    """Load intact (control), flip one bit in source rank 0's optimizer file, load again: raise, change nothing."""
    meter = Meter()
    directory = ctx.path(NAME, "shard")
    mesh, full = _mesh(ctx.world), _full(ctx.plan.seed)
    expected = _locals(_sharded(full, mesh, 1))
    problems: list[str] = []
    control = _sharded(full, mesh, 1, fill=float("nan"))
    with closing(_manager(ctx, _reshard_specs(ctx))) as reader:
        _, error, _ = _attempt(lambda: reader.load(str(directory), into=control))
    diffs = same(_locals(control), expected) if not error else []
    problems += [f"the intact checkpoint did not load: {error or diffs[:2]}"] if error or diffs else []
    flipped = _flip_one_bit(directory / f"{_CORRUPT_ITEM}_0.pt") if ctx.rank == 0 else ""
    flipped = gather(flipped)[0]
    if not flipped.startswith("bit"):
        return _check_row(ctx, "corrupt shard", "S(0)→S(1)", [flipped] if ctx.rank == 0 else [], [], 0.0)
    live = _sharded(full, mesh, 1, fill=-3.5)
    before = _locals(live)
    with closing(_manager(ctx, _reshard_specs(ctx))) as reader:
        _, error, took = _attempt(lambda: reader.load(str(directory), into=live))
    changed = same(_locals(live), before)
    seen = [f"load raised {error} after {took:.1f}s" if error else f"load returned after {took:.1f}s"]
    problems += [] if error else [f"the load of a corrupted checkpoint did not raise ({flipped})"]
    problems += [f"the failed load changed live tensors: {changed[:3]}"] if changed and error else []
    summary = (
        f"flipped {flipped}; every rank reads that file (S(0)→S(1)); the load raised on every rank and "
        "left every live tensor untouched (the control load before the flip was exact)"
    )
    return _check_row(
        ctx,
        "corrupt shard",
        f"S(0)→S(1), bit flip in {_CORRUPT_ITEM}_0.pt",
        problems,
        seen,
        max(took, 0.0) or meter.seconds,
        summary if not problems else "",
    )


def _flip_one_bit(path: Path) -> str:
    """Flip one bit inside the first tensor's bytes (the file still parses: only a checksum can tell)."""
    if not path.is_file():
        return f"cannot corrupt {path.name}: the save phase left no such file"
    offset = _tensor_data_offset(path)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0x10]))
        fh.flush()
        os.fsync(fh.fileno())
    return f"bit 4 of byte {offset} of {path.name} ({path.stat().st_size} bytes)"


def _tensor_data_offset(path: Path) -> int:
    """Middle of the first stored tensor of a torch.save zip; the file's middle byte for any other format."""
    try:
        with zipfile.ZipFile(path) as archive:
            info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 0)
        with open(path, "rb") as fh:
            fh.seek(info.header_offset + 26)
            name_len, extra_len = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
        return info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    except (zipfile.BadZipFile, StopIteration):
        return path.stat().st_size // 2
