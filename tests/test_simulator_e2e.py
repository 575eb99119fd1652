"""A short real run of `python -m simulator` (2 ranks save, 3 ranks load) against the engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from simulator.docs_sample import normalise, page_sample

pytestmark = pytest.mark.multirank

_RUN_TIMEOUT_S = 420
SIMULATOR_PAGE = Path(__file__).resolve().parent.parent / "docs" / "simulator.md"


def _simulate(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "simulator",
            *argv,
            "--json",
            str(report),
            "--keep",
            str(tmp_path / "ckpt"),
            "--timeout",
            "180",
        ],
        capture_output=True,
        text=True,
        timeout=_RUN_TIMEOUT_S,
    )
    assert report.is_file(), f"no JSON report; stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    return proc, json.loads(report.read_text())


@pytest.fixture(scope="module")
def two_to_three(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    """The run docs/simulator.md shows (its marker names the arguments: 2 ranks save, 3 load)."""
    tmp = tmp_path_factory.mktemp("sim")
    argv, _ = page_sample(SIMULATOR_PAGE)
    assert argv[:2] == ["--world", "2->3"], f"the tests below assume the page's sample is a 2→3 run, not {argv}"
    proc, report = _simulate(tmp, *argv)
    return proc, report, tmp


def test_the_sample_run_on_the_simulator_page_is_what_the_program_prints(two_to_three: Any) -> None:
    proc, _, _ = two_to_three
    _, shown = page_sample(SIMULATOR_PAGE)
    assert normalise(shown) == normalise(proc.stdout), (
        "docs/simulator.md's sample run no longer matches the program; regenerate it with "
        "`python -m simulator.docs_sample docs/simulator.md` and review the page's prose. Fresh output:\n" + proc.stdout
    )


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["rows"]}


def test_every_scenario_reports_its_checks_with_progress_and_a_table(two_to_three: Any) -> None:
    proc, report, _ = two_to_three
    rows = _rows(report)
    for name in (
        "layouts/paths",
        "layouts/read-back",
        "layouts/no-{rank}",
        "layouts/reload",
        "async-race/requires_copy=True",
        "async-race/requires_copy=False",
        "async-race/lock()",
        "reshard/save",
        "reshard/model+optimizer",
        "reshard/dataloader",
        "reshard/misc_state",
        "reshard/2 train steps",
    ):
        assert name in rows, f"{name} missing from {sorted(rows)}"
    assert "save ×2 · layouts · started" in proc.stdout and "load ×3 · reshard · started" in proc.stdout
    assert "scenario" in proc.stdout and "VERDICT:" in proc.stdout


def test_layouts_land_per_rank_and_the_shared_path_is_the_expected_hazard(two_to_three: Any) -> None:
    _, report, tmp = two_to_three
    rows = _rows(report)
    assert rows["layouts/paths"]["result"] == "PASS", rows["layouts/paths"]
    assert rows["layouts/read-back"]["result"] == "PASS", rows["layouts/read-back"]
    assert rows["layouts/no-{rank}"]["result"] == "EXPECTED HAZARD"
    for rank in (0, 1):
        for rel in (
            f"model_{rank}.pt",
            f"rank_{rank}/shard.pt",
            f"meta/meta_{rank}.json",
            f"weights/rank_{rank}.safetensors",
        ):
            assert (tmp / "ckpt" / "layouts" / rel).is_file(), rel
    assert json.loads((tmp / "ckpt" / "layouts" / "meta" / "meta_1.json").read_text())["rank"] == 1


def test_requires_copy_true_saves_the_state_at_save_time_and_lock_prevents_torn_steps(two_to_three: Any) -> None:
    rows = _rows(two_to_three[1])
    assert rows["async-race/requires_copy=True"]["result"] == "PASS", rows["async-race/requires_copy=True"]
    assert rows["async-race/lock()"]["result"] == "PASS", rows["async-race/lock()"]
    assert rows["async-race/requires_copy=False"]["result"] == "EXPECTED HAZARD"


def test_reshard_is_bit_exact_and_training_matches_the_reference(two_to_three: Any) -> None:
    rows = _rows(two_to_three[1])
    for name in ("reshard/save", "reshard/model+optimizer", "reshard/dataloader", "reshard/2 train steps"):
        assert rows[name]["result"] == "PASS", rows[name]
    assert rows["reshard/model+optimizer"]["bytes_read"] > 0


def test_the_whole_run_passes_with_exit_code_zero(two_to_three: Any) -> None:
    proc, report, _ = two_to_three
    failing = {r["name"]: r["notes"] for r in report["rows"] if r["result"] == "FAIL"}
    assert report["passed"] and proc.returncode == 0, f"failing checks: {failing}; errors: {report['errors']}"


def test_a_backend_that_cannot_be_imported_fails_fast_naming_it(tmp_path: Path) -> None:
    # A usage error like any other bad argument (exit 2, before any rank starts, so no report); it used to
    # launch the ranks and report every scenario failed.
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "simulator", "--world", "1", "--backend", "no_such_backend_pkg", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--backend 'no_such_backend_pkg'" in proc.stderr and "install" in proc.stderr
    assert not report.exists()
