"""The suite checks itself: every clause has a test, every test names known clauses.

Static (AST) so that it holds whatever subset of the suite is selected with -k/-m
and under xdist. These are the only tests without a clause marker.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conformance.clauses import load_clauses

HERE = Path(__file__).resolve().parent
SELF = Path(__file__).name


def _marker_ids(node: ast.AST) -> list[str]:
    """String arguments of every ``clause(...)`` / ``pytest.mark.clause(...)`` call under ``node``."""
    ids: list[str] = []
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            fn = call.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name == "clause":
                ids.extend(a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return ids


def _modules() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(HERE.glob("test_*.py")) if p.name != SELF}


def _golden_ids() -> set[str]:
    from conformance.golden.cases import CASES

    return {cid for case in CASES for cid in case.clauses}


def test_every_clause_has_a_test() -> None:
    used = {cid for mod in _modules().values() for cid in _marker_ids(mod)} | _golden_ids()
    missing = sorted(set(load_clauses()) - used)
    assert not missing, f"clauses without a test: {missing}"


def test_every_marker_names_a_known_clause() -> None:
    known = set(load_clauses())
    unknown = sorted(
        {(name, cid) for name, mod in _modules().items() for cid in _marker_ids(mod) if cid not in known}
        | {("golden/cases.py", cid) for cid in _golden_ids() - known}
    )
    assert not unknown, f"markers naming clauses not in CLAUSES.md: {unknown}"


def test_every_test_names_a_clause() -> None:
    bare = []
    for name, mod in _modules().items():
        for node in mod.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                in_decorators = any(_marker_ids(d) for d in node.decorator_list)
                parametrized_with_marks = name == "test_golden.py" and node.name == "test_golden_loads_bit_exact"
                if not (in_decorators or parametrized_with_marks):
                    bare.append(f"{name}::{node.name}")
    assert not bare, f"tests without @pytest.mark.clause: {bare}"


def test_multirank_module_is_marked() -> None:
    src = (HERE / "test_multirank.py").read_text(encoding="utf-8")
    assert "pytestmark = pytest.mark.multirank" in src


def test_docs_table_is_generated_from_reports() -> None:
    """docs/conformance.md's clause table is the generator's output for the committed clause reports.

    The reports come from real runs (``--clause-report conformance/reports/<backend>.json``; ``tox -e
    conformance`` also fails when a full run of ours disagrees with ``reports/ours.json``); this check
    only re-renders them, so it is cheap and never re-runs the suite.
    """
    from conformance.report import regenerate_docs

    old, new = regenerate_docs()
    assert old == new, "docs/conformance.md is stale: run python -m conformance.report docs"


def test_reports_cover_every_clause() -> None:
    from conformance.report import load_reports

    known = set(load_clauses())
    for label, rep in load_reports():
        assert set(rep["clauses"]) <= known, f"{label}: unknown clauses {sorted(set(rep['clauses']) - known)}"


def test_markdown_report_counts() -> None:
    """The per-backend Markdown (--clause-report-md) shows each status and the adapter mark."""
    from conformance.report import build_report, render_md

    clauses = load_clauses()
    first, second, third = list(clauses)[:3]
    rep = build_report("b", "a.adapter", {first: "passed", second: "failed", third: "not measured"}, [first], {})
    md = render_md(rep, clauses)
    assert f"| `{first}` | {clauses[first].area} | pass (adapter) |" in md
    assert f"| `{second}` | {clauses[second].area} | FAIL |" in md
    assert f"| `{third}` | {clauses[third].area} | not measured |" in md
