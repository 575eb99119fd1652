"""Kill one rank of a real gloo job mid-save, and record what every surviving rank saw.

The simulator's launcher stops every rank as soon as one dies, which is right for scenarios but hides what
this fault is about: how the *surviving* ranks of a save learn that a peer is gone. So this module runs its
own small job: the caller hosts the rendezvous ``TCPStore`` on a port the OS picks, starts one plain Python
process per rank (``python -m simulator.faults_job SPEC``), and each rank joins a gloo group on 127.0.0.1.

Each rank saves checkpoint v1 at one id (a sync save), then v2 at the same id. The victim's storage
announces its first v2 write and holds it (:mod:`simulator.faults_storage`); the caller then SIGKILLs the
victim, so the kill lands mid-save on every run. Each survivor records what its ``save()`` did (raised what,
when) in a JSON file and exits. Every wait is bounded: survivors that neither return nor raise are killed and
reported as hung. The caller (rank 0 of the simulator's save phase) has the simulator's ranks check that v1
still loads exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

import simulator
from simulator.backend import BACKEND_ENV, backend_name
from simulator.faults_storage import SignallingStorageConfig, wait_for_signal

# Launcher variables of the enclosing rank that must not leak into the job's own ranks.
_INHERITED = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_",
    "SIMULATOR_PROGRESS_FILE",
    "SIMULATOR_STORE_PORT",
    "SIMULATOR_PG_TIMEOUT",
)
_STARTUP_S = 120.0  # rank start (import torch, join gloo) plus the v1 save, on a loaded 2-core machine
GRACE_S = 20.0  # beyond wait_timeout_secs, how long survivors may take to raise before they count as hung
_HOLD_S = 90.0  # how long the victim holds its write; the kill comes within one poll of the announcement


def rank_state(seed: int, rank: int, version: int) -> dict[str, torch.Tensor]:
    """A rank's tensors for one version of the checkpoint: recomputable anywhere from (seed, rank, version)."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank * 131 + version)
    return {f"layer{i}.weight": torch.randn(64, 64, generator=gen) for i in range(4)}


@dataclass
class KillJob:
    """What the job does: where, on how many ranks, which rank dies, and the engine's wait bound."""

    directory: str
    world: int
    seed: int
    victim: int
    wait_timeout_s: int
    backend: str = field(default_factory=backend_name)

    @property
    def checkpoint_id(self) -> str:
        return str(Path(self.directory, "ckpt"))

    @property
    def signal_path(self) -> str:
        return str(Path(self.directory, "victim-writing.signal"))

    def result_path(self, rank: int) -> Path:
        return Path(self.directory, f"rank{rank}.json")


@dataclass
class KillOutcome:
    """What happened, as plain data the simulator's rank 0 broadcasts to its peers."""

    victim: int
    kill_time: float = 0.0
    killed_while_writing: str = ""
    victim_pid_matches: bool = True
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)
    problem: str = ""  # the job could not reach the kill (a rank failed first, or never started)
    seconds: float = 0.0


def run_kill_job(job: KillJob) -> KillOutcome:
    """Start the job's ranks, kill the victim when it announces its write, collect every survivor's record."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # a re-export torch does not mark public

    start = time.perf_counter()
    Path(job.directory).mkdir(parents=True, exist_ok=True)
    store = TCPStore("127.0.0.1", 0, job.world + 1, is_master=True, wait_for_workers=False)
    procs = [_start_rank(job, rank, store.port) for rank in range(job.world)]
    outcome = KillOutcome(victim=job.victim)
    try:
        victim = procs[job.victim]
        got = wait_for_signal(job.signal_path, _STARTUP_S, alive=lambda: victim.poll() is None)
        if got is None:
            outcome.problem = _why_no_kill(job, procs)
        else:
            pid, _, writing = got
            victim.send_signal(signal.SIGKILL)
            outcome.kill_time = time.time()
            outcome.killed_while_writing = Path(writing).name
            outcome.victim_pid_matches = pid == victim.pid
            outcome.hung = _wait_survivors(procs, job.victim, job.wait_timeout_s + GRACE_S)
        outcome.ranks = {r: _read_result(job, r, procs[r]) for r in range(job.world) if r != job.victim}
    finally:
        for proc in procs:
            _reap(proc)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _clean_env(job: KillJob) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_INHERITED)}
    root = str(Path(simulator.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    env[BACKEND_ENV] = job.backend
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start_rank(job: KillJob, rank: int, port: int) -> subprocess.Popen[bytes]:
    spec = json.dumps({"job": asdict(job), "rank": rank, "port": port})
    log = open(Path(job.directory, f"rank{rank}.log"), "wb")  # noqa: SIM115 - owned by the child from here on
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "simulator.faults_job", spec],
            env=_clean_env(job),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    finally:
        log.close()


def _wait_survivors(procs: list[subprocess.Popen[bytes]], victim: int, bound_s: float) -> list[int]:
    """Wait (bounded) for every survivor to exit; the ones still running are hung: kill them and name them."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and any(p.poll() is None for r, p in enumerate(procs) if r != victim):
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if r != victim and p.poll() is None]
    for r in hung:
        procs[r].send_signal(signal.SIGKILL)
    return hung


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILLed: only an unkillable (D-state) child stays
        proc.wait(timeout=10)


def _log_tail(job: KillJob, rank: int, lines: int = 3) -> str:
    path = Path(job.directory, f"rank{rank}.log")
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def _why_no_kill(job: KillJob, procs: list[subprocess.Popen[bytes]]) -> str:
    exited = {r: p.poll() for r, p in enumerate(procs) if p.poll() is not None}
    if exited:
        r = min(exited)
        return f"rank {r} exited (code {exited[r]}) before the victim's write: {_log_tail(job, r)}"
    return f"rank {job.victim} never started writing v2 within {_STARTUP_S:.0f}s: {_log_tail(job, job.victim)}"


def _read_result(job: KillJob, rank: int, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    path = job.result_path(rank)
    if path.is_file():
        return dict(json.loads(path.read_text(encoding="utf-8")))
    return {"stage": "no record", "log": _log_tail(job, rank), "exitcode": proc.poll()}


# ---------------------------------------------------------------------------------------------- inside a rank


def _record(job: KillJob, rank: int, **fields: Any) -> None:
    tmp = job.result_path(rank).with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, **fields}), encoding="utf-8")
    os.replace(tmp, job.result_path(rank))


def _manager(job: KillJob, rank: int, armed: bool) -> Any:
    """A sync manager built from public names; ``armed`` gives the victim the announcing, holding storage."""
    from simulator.backend import backend_module

    top = backend_module()
    cfg = top.CheckpointManager.Config.with_sync_save()
    cfg.save.wait_timeout_secs = job.wait_timeout_s
    cfg.items = {"model": top.ItemSpec()}
    signalling = armed and rank == job.victim
    cfg.storage_config = SignallingStorageConfig(
        signal_path=job.signal_path if signalling else "", trigger="model_", hold_s=_HOLD_S
    )
    return top.CheckpointManager(cfg)


def rank_main(job: KillJob, rank: int, port: int) -> None:
    """One rank: join gloo, save v1, save v2 at the same id (the victim is killed during it), record the result."""
    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # a re-export torch does not mark public

    torch.set_num_threads(1)
    # Our own group waits long (ranks start seconds apart on a loaded machine); the engine's groups use
    # wait_timeout_secs, and the barriers line the ranks up before each manager builds one.
    timeout = timedelta(seconds=_STARTUP_S)
    store = TCPStore("127.0.0.1", port, job.world + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=job.world, timeout=timeout)
    dist.barrier()
    first = _manager(job, rank, armed=False)
    first.save(job.checkpoint_id, {"model": rank_state(job.seed, rank, 1)})
    first.close()
    dist.barrier()
    second = _manager(job, rank, armed=True)
    start = time.time()
    try:
        second.save(job.checkpoint_id, {"model": rank_state(job.seed, rank, 2)})
    except Exception as exc:  # the expected outcome for a survivor: its save learns the victim is gone
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _record(job, rank, stage="v2", raised=True, error=f"{type(exc).__name__}: {text}", start=start, end=time.time())
    else:
        _record(job, rank, stage="v2", raised=False, error="", start=start, end=time.time())
    os._exit(0)  # the group has a dead member: leave without collectives or exit hooks that could wait on it


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    rank_main(KillJob(**_spec["job"]), int(_spec["rank"]), int(_spec["port"]))
