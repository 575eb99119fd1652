"""Smoke test of the benchmark harness: it runs end to end on a few MiB and
reports every ratio with a target and a verdict. No timing assertions: the
numbers of a smoke run on a busy machine mean nothing, their presence does."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from benchmarks.cli import main, parse_size
from benchmarks.config import MiB, BenchConfig
from benchmarks.report import RATIO_KEYS, TARGET_KEYS, compute_ratios, format_table
from benchmarks.sweep import plot


@pytest.mark.multirank
def test_quick_run_reports_every_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.json"
    rc = main(["--quick", "--size", "4M", "--runs", "2", "--memory-saves", "3", "--device", "cpu",
               "--workdir", str(tmp_path / "work"), "--out", str(out), "--timeout", "240"])
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    by_key = {r["key"]: r for r in doc["ratios"]}
    assert set(by_key) == set(RATIO_KEYS)
    broken = {k: r["error"] for k, r in by_key.items() if r["error"]}
    assert not broken, f"ratios that could not be measured: {broken}"
    for key, row in by_key.items():
        assert isinstance(row["value"], float) and math.isfinite(row["value"]), key
        assert key in printed, f"{key} missing from the printed table"
        if key in TARGET_KEYS:
            assert row["verdict"] in ("PASS", "FAIL") and row["passed"] is (row["verdict"] == "PASS"), key
    assert rc == 0
    assert doc["summary"]["targets"] == len(TARGET_KEYS)
    assert doc["machine"]["cores"] and doc["command"].startswith("python -m benchmarks")
    # the benchmark must clean up its checkpoints
    assert not any((tmp_path / "work").iterdir())


def test_failed_section_still_lists_every_ratio() -> None:
    results = {"engine": {"error": "ImportError: no engine", "wall_s": 0.1}}
    rows = compute_ratios(results)
    assert [r.key for r in rows] == list(RATIO_KEYS)
    engine_rows = [r for r in rows if r.key == "blocked_vs_memcpy"]
    assert engine_rows[0].error and "no engine" in engine_rows[0].error
    table = format_table(rows)
    assert table.count("ERROR") == len(rows)


def test_parse_size_and_bad_config() -> None:
    assert parse_size("1G") == 1 << 30
    assert parse_size("256MiB") == 256 * MiB
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="Unknown benchmark section"):
        BenchConfig(sections=("nope",))
    with pytest.raises(SystemExit):
        main(["--size", "lots"])


def test_plot_is_skipped_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    doc = {"sizes": [MiB], "blocked": {"ours": [0.1]}, "durable": {"ours": [0.2]},
           "machine": {"cpu": "x", "cores": 2}}
    msg = plot(doc, tmp_path / "p.png")
    assert "skipped" in msg and "matplotlib" in msg
    assert not (tmp_path / "p.png").exists()
