"""The report: merging ranks, the table a person reads, the verdict and the JSON."""

from __future__ import annotations

import json

from simulator.report import FAIL, HAZARD, NOT_OBSERVED, PASS, CheckResult, Report, collapse_notes, merge_ranks


def _row(
    result: str, *, rank: int = 0, written: int = 0, read: int = 0, seconds: float = 0.0, notes: list[str] | None = None
) -> CheckResult:
    return CheckResult("reshard", "model", "4→8", "S(0)→S(1)", result, written, read, seconds, notes or [])


def test_merging_takes_the_worst_result_sums_bytes_and_keeps_the_slowest_time() -> None:
    merged = merge_ranks(
        [
            _row(PASS, written=10, read=1, seconds=0.5),
            _row(FAIL, written=5, read=2, seconds=1.5),
            _row(HAZARD, seconds=0.1),
        ]
    )
    assert (merged.result, merged.bytes_written, merged.bytes_read, merged.seconds) == (FAIL, 15, 3, 1.5)
    assert merge_ranks([_row(PASS), _row(NOT_OBSERVED)]).result == NOT_OBSERVED
    assert merge_ranks([_row(NOT_OBSERVED), _row(HAZARD)]).result == HAZARD


def test_the_same_note_from_many_ranks_is_printed_once_with_the_ranks() -> None:
    notes = ["rank 0: values differ", "rank 3: values differ", "rank 1: keys differ", "plain note", "plain note"]
    assert collapse_notes(notes) == ["rank N: values differ [ranks 0, 3]", "rank 1: keys differ", "plain note"]


def test_hazards_and_unobserved_races_pass_but_a_failure_fails() -> None:
    report = Report("tc", "4→8", "4→8", 0, rows=[_row(PASS), _row(HAZARD), _row(NOT_OBSERVED)], seconds=2.0)
    assert report.passed
    assert report.verdict().startswith("VERDICT: PASS") and "1 expected hazard" in report.verdict()
    report.rows.append(CheckResult("layouts", "paths", "4", "-", FAIL))
    assert not report.passed
    assert report.verdict().startswith("VERDICT: FAIL") and "layouts/paths" in report.verdict()


def test_a_launch_error_or_an_empty_run_is_never_a_pass() -> None:
    assert not Report("tc", "2", "2", 0).passed
    failed = Report("tc", "2", "2", 0, rows=[_row(PASS)], errors=["save phase: rank 1 timed out"])
    assert not failed.passed and "ERROR: save phase: rank 1 timed out" in failed.table()


def test_table_has_the_documented_columns_and_human_bytes() -> None:
    report = Report(
        "tc",
        "4→8",
        "4→8",
        0,
        rows=[_row(PASS, written=3 * 1024 * 1024, read=512, seconds=1.234, notes=["rank 0: fine"])],
    )
    lines = report.table().splitlines()
    assert lines[0].split() == ["scenario", "world", "placements", "result", "written", "read", "time"]
    assert "reshard/model" in lines[2] and "3.0 MiB" in lines[2] and "512 B" in lines[2] and "1.23s" in lines[2]
    assert "  reshard/model: rank 0: fine" in lines


def test_json_report_round_trips_with_names_and_verdict() -> None:
    report = Report("tc", "2→3", "2→3", 5, rows=[_row(HAZARD, notes=["collision"])], seconds=1.0)
    data = json.loads(report.to_json())
    assert data["passed"] is True and data["seed"] == 5 and data["world"] == "2→3"
    assert data["rows"][0]["name"] == "reshard/model" and data["rows"][0]["result"] == HAZARD
    assert data["rows"][0]["notes"] == ["collision"] and data["verdict"] == report.verdict()
