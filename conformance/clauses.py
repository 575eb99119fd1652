"""Read the clause register (CLAUSES.md) and fold test outcomes into clause outcomes."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

CLAUSES_FILE = Path(__file__).with_name("CLAUSES.md")
# The durability profile's prefixes: one area in the summary, "DURABILITY".
DURABILITY_PREFIXES = frozenset({"DUR", "INTEG", "SAFE"})
_ROW = re.compile(r"^\|\s*`(?P<id>[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+)`\s*\|(?P<section>[^|]*)\|(?P<text>[^|]*)\|")


@dataclass(frozen=True)
class Clause:
    """One numbered, testable statement of the design document."""

    id: str
    section: str
    statement: str

    @property
    def area(self) -> str:
        prefix = self.id.split("-", 1)[0]
        return "DURABILITY" if prefix in DURABILITY_PREFIXES else prefix

    @property
    def durability(self) -> bool:
        """True for the durability profile: beyond the design document, skippable with -m 'not durability'."""
        return self.id.split("-", 1)[0] in DURABILITY_PREFIXES


def load_clauses(path: Path = CLAUSES_FILE) -> dict[str, Clause]:
    """Clause id -> Clause, in document order; duplicate ids are an error in the register."""
    out: dict[str, Clause] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        cid = m.group("id")
        if cid in out:
            raise ValueError(f"{path.name}: clause {cid} is listed twice")
        out[cid] = Clause(cid, m.group("section").strip(), m.group("text").strip())
    return out


# Outcome precedence: one failing test fails the clause; a test that could not be
# measured (error in setup, a name the backend lacks) leaves the clause not measured
# unless another failed; a clause passes when at least one of its tests passed and the
# others passed or skipped; it is skipped only when every test that ran for it skipped.
# A test that can only be judged on a local filesystem, run against a storage URL, is
# LOCAL_ONLY: the clause is not measured unless another of its tests measured it there.
STATUSES = ("passed", "failed", "not measured", "skipped", "not run")
LOCAL_ONLY = "local only"
_RANK = {"failed": 4, "not measured": 3, "passed": 2, LOCAL_ONLY: 1.5, "skipped": 1}


def fold(outcomes: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Clause id -> 'passed' | 'failed' | 'not measured' | 'skipped' from the outcomes of its tests."""
    folded: dict[str, str] = {}
    for cid, results in outcomes.items():
        best = max(results, key=lambda r: _RANK[r], default=None)
        if best is not None:
            folded[cid] = "not measured" if best == LOCAL_ONLY else best
    return folded


def area_counts(clauses: Mapping[str, Clause], status: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """Area -> status -> number of clauses, areas in register order."""
    areas: dict[str, dict[str, int]] = {}
    for cid, clause in clauses.items():
        row = areas.setdefault(clause.area, dict.fromkeys(STATUSES, 0))
        row[status.get(cid, "not run")] += 1
    return areas


def area_table(clauses: Mapping[str, Clause], status: Mapping[str, str]) -> list[str]:
    """Rows of the per-area summary: clauses passed / failed / not measured / skipped / not run."""
    areas = area_counts(clauses, status)
    head = f"{'area':<10} {'clauses':>7} " + " ".join(f"{k:>12}" for k in STATUSES)
    lines = [head, "-" * len(head)]
    total = dict.fromkeys(STATUSES, 0)
    for area, row in areas.items():
        for k in total:
            total[k] += row[k]
        lines.append(f"{area:<10} {sum(row.values()):>7} " + " ".join(f"{row[k]:>12}" for k in STATUSES))
    lines.append("-" * len(head))
    lines.append(f"{'total':<10} {sum(total.values()):>7} " + " ".join(f"{total[k]:>12}" for k in STATUSES))
    return lines
