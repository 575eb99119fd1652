"""Scenario outcomes, merged across ranks, rendered as a table, a verdict and JSON."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

PASS = "PASS"
FAIL = "FAIL"
HAZARD = "EXPECTED HAZARD"
NOT_OBSERVED = "RACE NOT OBSERVED"
SKIPPED = "SKIPPED"
_RANK_WORD = re.compile(r"^rank (\d+)\b")
_RANK_ORDER = {FAIL: 0, HAZARD: 1, NOT_OBSERVED: 2, PASS: 3, SKIPPED: 4}


@dataclass
class CheckResult:
    """One row of the report: one check of one scenario, as one rank saw it or merged over ranks."""

    scenario: str
    check: str
    world: str
    placements: str
    result: str
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.scenario}/{self.check}" if self.check else self.scenario

    @property
    def ok(self) -> bool:
        return self.result != FAIL


def merge_ranks(per_rank: list[CheckResult]) -> CheckResult:
    """Fold the same check from every rank: worst result wins, bytes add up, time is the slowest rank."""
    first = per_rank[0]
    worst = min((r.result for r in per_rank), key=lambda res: _RANK_ORDER.get(res, 0))
    return CheckResult(
        scenario=first.scenario,
        check=first.check,
        world=first.world,
        placements=first.placements,
        result=worst,
        bytes_written=sum(r.bytes_written for r in per_rank),
        bytes_read=sum(r.bytes_read for r in per_rank),
        seconds=max(r.seconds for r in per_rank),
        notes=collapse_notes([n for r in per_rank for n in r.notes]),
    )


def collapse_notes(notes: list[str]) -> list[str]:
    """The same message from many ranks becomes one line naming the ranks, so 8 ranks do not print 8 copies."""
    groups: dict[str, list[str]] = {}
    for note in notes:
        m = _RANK_WORD.match(note)
        key = note.replace(f"rank {m.group(1)}", "rank N") if m else note
        groups.setdefault(key, []).append(note)
    out: list[str] = []
    for key, members in groups.items():
        ranks = sorted({int(m.group(1)) for note in members if (m := _RANK_WORD.match(note))})
        if len(members) == 1 or not ranks:
            out.append(members[0])
        else:
            out.append(f"{key} [ranks {', '.join(map(str, ranks))}]")
    return out


def _human_bytes(n: int) -> str:
    if n == 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@dataclass
class Report:
    """All rows of a run plus what the run was; knows how to print and serialise itself."""

    backend: str
    world: str
    mesh: str
    seed: int
    rows: list[CheckResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows) and not self.errors

    def verdict(self) -> str:
        failed = [r.name for r in self.rows if not r.ok]
        hazards = sum(r.result == HAZARD for r in self.rows)
        if self.passed:
            extra = f"; {hazards} expected hazard(s) demonstrated" if hazards else ""
            checks = f"{len(self.rows)} checks on {self.backend}, world {self.world}"
            return f"VERDICT: PASS — {checks}{extra} ({self.seconds:.1f}s)"
        what = ", ".join(failed) if failed else "the run did not complete"
        return f"VERDICT: FAIL — {what} (backend {self.backend}, world {self.world}, {self.seconds:.1f}s)"

    def table(self) -> str:
        header = ("scenario", "world", "placements", "result", "written", "read", "time")
        body = [
            (
                r.name,
                r.world,
                r.placements,
                r.result,
                _human_bytes(r.bytes_written),
                _human_bytes(r.bytes_read),
                f"{r.seconds:.2f}s",
            )
            for r in self.rows
        ]
        widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
        line = "  ".join("-" * w for w in widths)

        def fmt(row: tuple[str, ...]) -> str:
            return "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()

        out = [fmt(header), line, *(fmt(row) for row in body)]
        notes = [(r.name, n) for r in self.rows for n in r.notes]
        if notes:
            out.append("")
            out.extend(f"  {name}: {note}" for name, note in notes)
        if self.errors:
            out.append("")
            out.extend(f"ERROR: {e}" for e in self.errors)
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "world": self.world,
            "mesh": self.mesh,
            "seed": self.seed,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
            "verdict": self.verdict(),
            "rows": [asdict(r) | {"name": r.name} for r in self.rows],
            "errors": list(self.errors),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"
