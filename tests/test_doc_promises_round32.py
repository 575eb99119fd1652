"""Promises of docs/simulator.md, docs/conformance.md, docs/packaging.md and docs/api_differences.md that no
test held, each checked against the real thing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.home_dirs import home_and_work

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("flag", "target"),
    [("--keep", "/proc/simulator-keep"), ("--json", "/proc/simulator-report.json")],
)
def test_simulator_refuses_an_output_path_no_process_can_write_before_launching(
    tmp_path: Path, flag: str, target: str
) -> None:
    """docs/simulator.md: "2 for bad arguments (a `--keep DIR` that cannot be written is refused before any rank
    starts)". The check asked `os.access`, which says yes to root for any folder: under /proc (no process may
    create anything there) `--keep` ended in a FileNotFoundError traceback with exit code 1, and `--json` ran
    every scenario first, then lost the report to a traceback."""
    assert Path("/proc").is_dir(), "needs procfs"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "simulator", "--world", "1", "--scenario", "layouts", flag, target],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert flag in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "VERDICT" not in out.stdout, "the ranks were launched before the refusal"
    assert not list(tmp_path.glob("simulator-*")), "a refused run left its temporary directory behind"


def test_a_root_in_a_folder_literally_named_tilde_lists_paths_that_load_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/api_differences.md (29): `~` is the home directory, a folder literally named `~` is spelled `./~`.
    A listing of `./~/run` named its checkpoints `~/run/step_1` (`Path` drops the `./`), an id that save() and
    load() read as the home directory: `latest_checkpoint("./~/run")` was None beside a listed checkpoint, and a
    load of the listed path read the home directory's `run/step_1`."""
    import torch

    from torch_checkpointing import CheckpointManager, latest_checkpoint, list_checkpoints

    home, work = home_and_work(tmp_path, monkeypatch)
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save("./~/run/step_1", {"model": {"w": torch.ones(2)}})
        (listed,) = list_checkpoints("./~/run")
        latest = latest_checkpoint("./~/run")
        assert latest is not None and latest.path == listed.path
        assert torch.equal(manager.load(listed.path)["model"]["w"], torch.ones(2))
    assert (work / "~" / "run" / "step_1").is_dir() and not (home / "run").exists()


def test_retention_of_saves_under_a_folder_named_tilde_never_prunes_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/api_differences.md (29): a folder literally named `~` is spelled `./~`. The manager normalised a save
    id `./~/run/step_3` to `~/run/step_3`; retention took `~/run` as its root, expanded it, and pruned the
    checkpoints under the HOME directory's `run/` (steps 1 and 2 deleted there), leaving `./~/run` untouched."""
    import torch

    from torch_checkpointing import CheckpointManager, RetentionPolicy, SyncCheckpointSaverConfig

    home, work = home_and_work(tmp_path, monkeypatch)
    state = {"model": {"w": torch.ones(2)}}
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in (1, 2, 3):
            manager.save(f"~/run/step_{step}", state)
    pruning = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), retention=RetentionPolicy(keep_last=1))
    with CheckpointManager(pruning) as manager:
        for step in (1, 2, 3):
            manager.save(f"./~/run/step_{step}", state)
    assert sorted(p.name for p in (home / "run").iterdir()) == ["step_1", "step_2", "step_3"]
    assert sorted(p.name for p in (work / "~" / "run").iterdir()) == ["step_3"]


def _suite_with_one_clause(tmp_path: Path) -> Path:
    """A copy of the suite whose register holds only `SPEC-FIELDS-1`, so that one test is a run that measured
    every clause (the only kind --compare-report compares)."""
    import shutil

    copy = tmp_path / "checkout"
    for folder in ("conformance", "simulator"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__", "reports"))
    register = (copy / "conformance" / "CLAUSES.md").read_text(encoding="utf-8").splitlines()
    kept = [line for line in register if not line.startswith("| `") or line.startswith("| `SPEC-FIELDS-1`")]
    (copy / "conformance" / "CLAUSES.md").write_text("\n".join(kept) + "\n", encoding="utf-8")
    return copy


def test_conformance_compare_report_fails_the_run_when_the_committed_report_is_stale(tmp_path: Path) -> None:
    """docs/conformance.md: "`tox -e conformance` fails when a full run of ours disagrees with
    `conformance/reports/ours.json` (`--compare-report`)". The comparison ran in the terminal summary, after the
    session's exit status had been decided: the run printed "REPORT DIFFERS" and "... is stale", then exited 0,
    so the tox environment passed with a stale report."""
    import json

    copy = _suite_with_one_clause(tmp_path)
    committed = tmp_path / "committed.json"
    committed.write_text(json.dumps({"clauses": {"SPEC-FIELDS-1": "failed"}}), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), str(ROOT)])}
    args = ["-p", "no:cacheprovider", "-q", "conformance/test_schema.py", "-k", "four_fields"]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--compare-report", str(committed)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=copy,
        env=env,
    )
    assert "1 passed" in out.stdout and "REPORT DIFFERS SPEC-FIELDS-1" in out.stdout, out.stdout[-3000:]
    assert out.returncode == 1, out.stdout[-3000:]

    committed.write_text(json.dumps({"clauses": {"SPEC-FIELDS-1": "passed"}}), encoding="utf-8")
    agreeing = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--compare-report", str(committed)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=copy,
        env=env,
    )
    assert agreeing.returncode == 0 and "REPORT DIFFERS" not in agreeing.stdout, agreeing.stdout[-3000:]


@pytest.mark.parametrize(
    ("flag", "target"),
    [("--out", "/proc/benchmarks/results.json"), ("--workdir", "/proc/benchmarks-work")],
)
def test_benchmarks_refuse_an_output_path_no_process_can_write_before_measuring(
    tmp_path: Path, flag: str, target: str
) -> None:
    """docs/performance.md: the figures "go to bench-out/results.json" (`--out`), the checkpoints to a temporary
    directory under `--workdir`. Neither was checked up front: an unwritable `--out` ended, after every section had
    run (a quarter of an hour for the full run), in a FileNotFoundError traceback with the results lost; an
    unwritable `--workdir`, in a traceback."""
    args = ["--sections", "scale", "--scale-dp", "2", "--scale-layers", "1", "--runs", "1"]
    defaults = ["--out", str(tmp_path / "results.json"), "--workdir", str(tmp_path / "work")]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", *args, *defaults, flag, target],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert flag in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "targets pass" not in out.stdout, "the sections ran before the refusal"


@pytest.mark.packaging
def test_the_wheel_is_pure_python_with_the_one_console_script(tmp_path: Path) -> None:
    """docs/packaging.md: "The wheel is pure Python (`py3-none-any`)" and "the wheel installs one console script,
    `torch-checkpointing` (the CLI of docs/operations.md, also `python -m torch_checkpointing`)"."""
    import configparser
    import importlib
    import zipfile

    from tests.test_packaging import _build, _checkout_copy

    wheel = _build(_checkout_copy(tmp_path), "build_wheel", tmp_path / "out")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        (entry_points,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parsed = configparser.ConfigParser()
        parsed.read_string(zf.read(entry_points).decode())
    assert dict(parsed["console_scripts"]) == {"torch-checkpointing": "torch_checkpointing.__main__:run"}
    assert callable(importlib.import_module("torch_checkpointing.__main__").run)
