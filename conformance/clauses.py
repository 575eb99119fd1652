"""Read the clause register (CLAUSES.md) and fold test outcomes into clause outcomes."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

CLAUSES_FILE = Path(__file__).with_name("CLAUSES.md")
_ROW = re.compile(r"^\|\s*`(?P<id>[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)+)`\s*\|(?P<section>[^|]*)\|(?P<text>[^|]*)\|")


@dataclass(frozen=True)
class Clause:
    """One numbered, testable statement of the design document."""

    id: str
    section: str
    statement: str

    @property
    def area(self) -> str:
        return self.id.split("-", 1)[0]


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


# Outcome precedence: one failing test fails the clause; a clause passes when at
# least one of its tests passed and none failed; it is skipped only when every
# test that ran for it skipped.
_RANK = {"failed": 3, "passed": 2, "skipped": 1}


def fold(outcomes: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Clause id -> 'passed' | 'failed' | 'skipped' from the outcomes of its tests."""
    folded: dict[str, str] = {}
    for cid, results in outcomes.items():
        best = max(results, key=lambda r: _RANK[r], default=None)
        if best is not None:
            folded[cid] = best
    return folded


def area_table(clauses: Mapping[str, Clause], status: Mapping[str, str]) -> list[str]:
    """Rows of the per-area summary: clauses passed / failed / skipped / not run."""
    areas: dict[str, dict[str, int]] = {}
    for cid, clause in clauses.items():
        row = areas.setdefault(clause.area, {"passed": 0, "failed": 0, "skipped": 0, "not run": 0})
        row[status.get(cid, "not run")] += 1
    head = f"{'area':<10} {'clauses':>7} {'passed':>7} {'failed':>7} {'skipped':>7} {'not run':>7}"
    lines = [head, "-" * len(head)]
    total = {"passed": 0, "failed": 0, "skipped": 0, "not run": 0}
    for area, row in areas.items():
        for k in total:
            total[k] += row[k]
        lines.append(
            f"{area:<10} {sum(row.values()):>7} {row['passed']:>7} {row['failed']:>7} "
            f"{row['skipped']:>7} {row['not run']:>7}"
        )
    lines.append("-" * len(head))
    lines.append(
        f"{'total':<10} {sum(total.values()):>7} {total['passed']:>7} {total['failed']:>7} "
        f"{total['skipped']:>7} {total['not run']:>7}"
    )
    return lines
