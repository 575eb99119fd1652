"""`python -m simulator --scenario faults` (issue 12, point 3): injected faults give definite verdicts.

The end-to-end test runs the scenario on real gloo ranks (2 save, 3 load) and reads the JSON report: each
of the four faults must PASS, and the notes must say what each rank saw (the kill landed mid-write, every
rank raised, which error). The small tests pin the two mechanisms the verdicts rest on: the storage names
the process that writes (so the kill lands mid-save on every run), and the flipped bit leaves a file that
still parses (so only the engine's verification can catch it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from simulator.backend import load_backend
from simulator.faults_job import rank_state
from simulator.faults_storage import SignallingStorageConfig, read_signal
from simulator.scenarios.faults import _flip_one_bit, _loads_exactly, _not_committed

ROOT = Path(__file__).resolve().parents[1]
_RANK = re.compile(r"^rank (\d+): ")
_RANKS = re.compile(r"\[ranks ([\d, ]+)\]$")


def _ranks_saying(notes: list[str], phrase: str) -> set[int]:
    """Ranks whose note contains `phrase`, also through the report's '[ranks 0, 1]' collapsing."""
    out: set[int] = set()
    for note in notes:
        if phrase not in note:
            continue
        if (many := _RANKS.search(note)) and note.startswith("rank N: "):
            out |= {int(r) for r in many.group(1).split(",")}
        elif one := _RANK.match(note):
            out.add(int(one.group(1)))
    return out


@pytest.mark.multirank
def test_every_fault_is_injected_and_every_rank_reports_it(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "simulator",
            "--world",
            "2->3",
            "--scenario",
            "faults",
            "--json",
            str(report),
            "--timeout",
            "240",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert report.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows: dict[str, dict[str, Any]] = {r["name"]: r for r in json.loads(report.read_text())["rows"]}
    assert set(rows) == {"faults/disk full", "faults/kill writer", "faults/kill rank", "faults/corrupt shard"}
    for name, row in rows.items():
        assert row["result"] == "PASS", (name, row["notes"])
    assert proc.returncode == 0, proc.stdout[-3000:]

    killed = rows["faults/kill rank"]["notes"]
    assert any(n.startswith("rank 1: SIGKILLed while writing model_1.pt") for n in killed), killed
    assert _ranks_saying(killed, "save() raised") == {0}, killed

    writer = rows["faults/kill writer"]["notes"]
    assert any(n.startswith("rank 0: SIGKILLed the writer process") and "model_0.pt" in n for n in writer), writer
    assert _ranks_saying(writer, "the Future failed with") == {0, 1}, writer

    disk = rows["faults/disk full"]["notes"]
    assert _ranks_saying(disk, "save() raised") == {0, 1}, disk
    assert "File too large" in " ".join(disk), disk

    corrupt = rows["faults/corrupt shard"]["notes"]
    assert _ranks_saying(corrupt, "load raised") == {0, 1, 2}, corrupt
    assert any("flipped bit 4 of byte" in n and "left every live tensor untouched" in n for n in corrupt), corrupt


def test_the_storage_names_the_writing_process_once_and_only_for_data_files(tmp_path: Path) -> None:
    signal_path = tmp_path / "writing.signal"
    storage = SignallingStorageConfig(signal_path=str(signal_path), trigger="model_", hold_s=0.0).create_storage()
    storage.write(tmp_path / ".incomplete", b"")
    assert read_signal(str(signal_path)) is None  # bookkeeping files do not trigger it
    storage.write(tmp_path / "model_3.pt", b"x")
    pid, _, path = read_signal(str(signal_path)) or (0, 0.0, "")
    assert (pid, Path(path).name) == (os.getpid(), "model_3.pt")
    signal_path.write_text("1 0.0 /elsewhere\n")
    storage.write(tmp_path / "model_4.pt", b"y")  # announced once: an existing signal is left alone
    assert read_signal(str(signal_path)) == (1, 0.0, "/elsewhere")


def test_the_flipped_bit_lands_in_tensor_bytes_and_the_file_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "optimizer_0.pt"
    original = {"w": torch.arange(256, dtype=torch.float32)}
    torch.save(original, path)
    described = _flip_one_bit(path)
    assert described.startswith("bit 4 of byte ") and "optimizer_0.pt" in described
    damaged = torch.load(path, weights_only=True)  # torch does not notice: only a checksum can
    differs = (damaged["w"] != original["w"]).nonzero().flatten().tolist()
    assert len(differs) == 1, differs


def test_the_commit_probes_tell_a_committed_checkpoint_from_none(tmp_path: Path) -> None:
    """The "nothing committed" and "loads exactly" verdicts can fail: here on one process, no ranks needed."""
    ctx: Any = SimpleNamespace(b=load_backend())
    state, other = rank_state(0, 0, 1), rank_state(0, 0, 2)
    assert _not_committed(ctx, str(tmp_path / "never-saved"), state) == ""
    manager = ctx.b.CheckpointManager(ctx.b.CheckpointManager.Config.with_sync_save())
    try:
        manager.save(str(tmp_path / "saved"), {"model": state})
    finally:
        manager.close()
    assert _not_committed(ctx, str(tmp_path / "saved"), state) == "it loads: the failed save was committed"
    assert _loads_exactly(ctx, str(tmp_path / "saved"), state) == ""
    assert _loads_exactly(ctx, str(tmp_path / "saved"), other).startswith("differs: ")
    assert _loads_exactly(ctx, str(tmp_path / "never-saved"), state).startswith("load raised FileNotFoundError")
