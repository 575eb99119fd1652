"""pytest wiring for the conformance suite: backend choice, clause markers, clause summary."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_REPO_ROOT = Path(__file__).resolve().parent.parent

from conformance import backend  # noqa: E402

if backend.prefer_installed_requested():
    backend.prefer_installed_backend(_REPO_ROOT)

from conformance import helpers  # noqa: E402
from conformance.clauses import area_table, fold, load_clauses  # noqa: E402

_OUTCOMES: dict[str, list[str]] = {}
_CLAUSE_PROP = "clauses"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance")
    group.addoption(
        "--backend",
        default=None,
        help=f"module implementing the checkpointing API (default: ${backend.BACKEND_ENV} or "
        f"{backend.DEFAULT_BACKEND})",
    )
    group.addoption("--clause-report", default=None, help="write per-clause outcomes as JSON to this path")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "clause(*ids): the design-document clauses a conformance test checks")
    config.addinivalue_line("markers", "multirank: launches real gloo ranks through simulator.launcher")
    if backend.prefer_installed_requested() and str(config.getoption("importmode")) in (
        "prepend",
        "ImportMode.prepend",
    ):
        raise pytest.UsageError(
            f"{backend.PREFER_INSTALLED_ENV} is set but pytest prepends the checkout to sys.path for every test "
            "module, which would shadow the installed backend: add --import-mode=append"
        )
    chosen = config.getoption("--backend", default=None)
    if chosen:
        os.environ[backend.BACKEND_ENV] = chosen


def pytest_report_header(config: pytest.Config) -> list[str]:
    try:
        return [backend.describe()]
    except Exception as exc:  # the header must not hide the real error behind a crash
        return [f"conformance backend: {backend.backend_name()} FAILED TO IMPORT: {exc!r}"]


def _clause_ids(item: pytest.Item) -> list[str]:
    ids: list[str] = []
    for mark in item.iter_markers("clause"):
        ids.extend(str(a) for a in mark.args)
    return ids


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # user_properties travel with xdist reports, marker arguments do not.
    for item in items:
        ids = _clause_ids(item)
        if ids:
            item.user_properties.append((_CLAUSE_PROP, ids))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    ids = next((v for k, v in report.user_properties if k == _CLAUSE_PROP), None)
    if not ids:
        return
    if report.when == "call" or report.outcome != "passed":
        outcome = "skipped" if report.skipped else report.outcome
        for cid in ids:
            _OUTCOMES.setdefault(cid, []).append(outcome)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # xdist worker: the controller reports
        return
    if not _OUTCOMES:
        return
    clauses = load_clauses()
    status = fold(_OUTCOMES)
    tr = terminalreporter
    tr.write_sep("=", "conformance clauses by area")
    tr.write_line(backend.describe())
    for cid in sorted(c for c, s in status.items() if s == "failed"):
        tr.write_line(f"FAILED clause {cid}: {clauses[cid].statement if cid in clauses else '(not in CLAUSES.md)'}")
    for line in area_table(clauses, status):
        tr.write_line(line)
    out = config.getoption("--clause-report")
    if out:
        Path(out).write_text(json.dumps({"backend": backend.describe(), "clauses": status}, indent=2, sort_keys=True))


@pytest.fixture
def manager_factory() -> Iterator[Callable[..., Any]]:
    """Build managers with helpers.make_config(...) and close them all at teardown."""
    made: list[Any] = []
    manager_cls = backend.name("", "CheckpointManager")

    def build(*args: Any, **kwargs: Any) -> Any:
        m = manager_cls(helpers.make_config(*args, **kwargs))
        made.append(m)
        return m

    yield build
    for m in made:
        # A test about a failed write has already asserted on that failure; close() may repeat it.
        with contextlib.suppress(Exception):
            m.close()
