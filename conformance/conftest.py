"""pytest wiring for the conformance suite: backend choice, clause markers, clause summary."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from pluggy import Result

_REPO_ROOT = Path(__file__).resolve().parent.parent

from conformance import backend  # noqa: E402

if backend.prefer_installed_requested():
    backend.prefer_installed_backend(_REPO_ROOT)

from conformance import helpers  # noqa: E402
from conformance.clauses import LOCAL_ONLY, area_table, fold, load_clauses  # noqa: E402
from conformance.report import build_report, render_md  # noqa: E402

_OUTCOMES: dict[str, list[str]] = {}
_ADAPTED_CLAUSES: set[str] = set()
_REASONS: dict[str, str] = {}
_CLAUSE_PROP = "clauses"
_ADAPTED_PROP = "adapted"
_NOT_MEASURED_PROP = "not_measured"
NOT_MEASURED = "not measured: "
LOCAL_ONLY_REASON = "local filesystem only"
_ADAPTED_START: dict[str, int] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance")
    group.addoption(
        "--backend",
        default=None,
        help=f"module implementing the checkpointing API (default: ${backend.BACKEND_ENV} or "
        f"{backend.DEFAULT_BACKEND})",
    )
    group.addoption("--clause-report", default=None, help="write per-clause outcomes as JSON to this path")
    group.addoption("--clause-report-md", default=None, help="write the per-area and per-clause tables as Markdown")
    group.addoption(
        "--backend-adapter",
        default=None,
        help=f"module mapping names the backend moved or renamed onto the document's names (or ${backend.ADAPTER_ENV})",
    )
    group.addoption(
        "--storage-url",
        default=None,
        help=f"run the clauses against this store (s3://bucket/prefix; or ${helpers.STORAGE_URL_ENV}): every "
        "checkpoint id is a URL under a fresh prefix, managers get the backend's FsspecStorageConfig(url=...), and "
        "clauses that can only be judged on a local filesystem are reported as not measured",
    )
    group.addoption(
        "--compare-report",
        default=None,
        help="after a run that measured every clause, fail the session if any clause's status differs from this "
        "committed clause-report JSON (keeps the generated docs table honest)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "clause(*ids): the design-document clauses a conformance test checks")
    config.addinivalue_line("markers", "multirank: launches real gloo ranks through simulator.launcher")
    config.addinivalue_line(
        "markers",
        "local_only(reason): the clause can only be judged on a local filesystem (why, in reason); "
        "not measured under a non-local --storage-url",
    )
    config.addinivalue_line(
        "markers", "durability: the durability profile (beyond the design document); skip with -m 'not durability'"
    )
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
    adapter = config.getoption("--backend-adapter", default=None)
    if adapter:  # an environment variable, so rank and writer subprocesses use it too
        os.environ[backend.ADAPTER_ENV] = adapter
    for flag in ("--clause-report", "--clause-report-md"):
        _refuse_unwritable(config.getoption(flag), flag)
    committed = config.getoption("--compare-report")
    if committed and not Path(committed).is_file():
        raise pytest.UsageError(f"--compare-report {committed!r}: no such file; name the committed clause report")
    url = config.getoption("--storage-url", default=None)
    if url:  # likewise; set before xdist starts its workers, so they share one run prefix
        os.environ[helpers.STORAGE_URL_ENV] = url
    if helpers.storage_url():
        helpers.run_id()


def _refuse_unwritable(path: str | None, flag: str) -> None:
    """A report path the run could not write at its end (it is written in the terminal summary, after every
    clause): a directory, a folder that is missing or read-only, a file set immutable. Found by opening the file
    (never truncated) or by creating a probe beside it, before any test runs; a full run's results were lost to
    a traceback."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise pytest.UsageError(f"{flag} {path!r}: is a directory; name a file to write")
    try:
        if target.exists():
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".conformance-probe-", dir=target.parent))
    except OSError as exc:
        raise pytest.UsageError(f"{flag} {path!r}: cannot be written there ({exc}); name a writable path") from None


def pytest_report_header(config: pytest.Config) -> list[str]:
    try:
        lines = [backend.describe()]
    except Exception as exc:  # the header must not hide the real error behind a crash
        lines = [f"conformance backend: {backend.backend_name()} FAILED TO IMPORT: {exc!r}"]
    if helpers.storage_url():
        lines.append(f"conformance storage: {helpers.storage_url()}/{helpers.run_id()}/ (one prefix per test)")
    return lines


def _clause_ids(item: pytest.Item) -> list[str]:
    ids: list[str] = []
    for mark in item.iter_markers("clause"):
        ids.extend(str(a) for a in mark.args)
    return ids


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # user_properties travel with xdist reports, marker arguments do not.
    clauses = load_clauses()
    for item in items:
        ids = _clause_ids(item)
        if ids:
            item.user_properties.append((_CLAUSE_PROP, ids))
        if any(cid in clauses and clauses[cid].durability for cid in ids):
            item.add_marker(pytest.mark.durability)
        _skip_local_only(item)


def _skip_local_only(item: pytest.Item) -> None:
    """Under a non-local storage URL, a local-only clause is not measured (not passed), with its premise."""
    mark = item.get_closest_marker("local_only")
    if mark is None or not helpers.remote():
        return
    premise = str(mark.args[0]) if mark.args else "(no reason given)"
    reason = f"{NOT_MEASURED}{LOCAL_ONLY_REASON}, not judged on {helpers.storage_url()}: {premise}"
    item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _ADAPTED_START[item.nodeid] = len(backend.ADAPTED)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Result[pytest.TestReport], None]:
    """Tag reports: not measured (missing name, setup error, not-measured skip) and adapter use."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if call.excinfo is not None and call.excinfo.errisinstance(backend.MissingName):
        path, line, _ = item.reportinfo()
        report.outcome = "skipped"
        report.longrepr = (str(path), (line or 0) + 1, f"Skipped: {NOT_MEASURED}{call.excinfo.value}")
    if report.skipped and _skip_reason(report).startswith(NOT_MEASURED):
        report.user_properties.append((_NOT_MEASURED_PROP, _skip_reason(report).removeprefix(NOT_MEASURED)))
    elif report.when == "setup" and report.failed:
        report.user_properties.append((_NOT_MEASURED_PROP, f"error in setup: {_first_line(report.longreprtext)}"))
    if call.when == "call":
        used = sorted(set(backend.ADAPTED[_ADAPTED_START.get(item.nodeid, 0) :]))
        if used:
            report.user_properties.append((_ADAPTED_PROP, used))


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("E ")] or text.strip().splitlines()[-1:]
    return (lines[0].removeprefix("E").strip() if lines else "")[:300]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    props = dict(report.user_properties)
    ids = props.get(_CLAUSE_PROP)
    if not isinstance(ids, list) or not ids:  # set by pytest_collection_modifyitems, a list through xdist too
        return
    if _ADAPTED_PROP in props:
        _ADAPTED_CLAUSES.update(ids)
    if report.when != "call" and report.outcome == "passed":
        return
    if _NOT_MEASURED_PROP in props:
        reason = str(props[_NOT_MEASURED_PROP])
        outcome = LOCAL_ONLY if reason.startswith(LOCAL_ONLY_REASON) else "not measured"
    else:
        outcome = "skipped" if report.skipped else report.outcome
        reason = _first_line(report.longreprtext) if report.failed else ""
    for cid in ids:
        _OUTCOMES.setdefault(cid, []).append(outcome)
        if reason and outcome in ("failed", "not measured", LOCAL_ONLY):
            _REASONS.setdefault(cid, reason)


def _write_summary(tr: Any, clauses: dict[str, Any], status: dict[str, str]) -> None:
    for cid in sorted(c for c, s in status.items() if s == "failed"):
        tr.write_line(f"FAILED clause {cid}: {clauses[cid].statement if cid in clauses else '(not in CLAUSES.md)'}")
    by_reason: dict[str, list[str]] = {}
    for cid in sorted(c for c, s in status.items() if s == "not measured"):
        by_reason.setdefault(_REASONS.get(cid, "?"), []).append(cid)
    for reason, cids in by_reason.items():  # one line per cause, e.g. a launch that could not start
        tr.write_line(f"NOT MEASURED ({reason}): {', '.join(cids)}")
    if _ADAPTED_CLAUSES:
        tr.write_line(f"clauses whose result used the adapter: {', '.join(sorted(_ADAPTED_CLAUSES))}")
    for line in area_table(clauses, status):
        tr.write_line(line)


def _stale_clauses(config: pytest.Config, clauses: dict[str, Any], status: dict[str, str]) -> dict[str, Any]:
    """Clause id -> its status in the --compare-report file, for each clause this run gave another status."""
    committed_path = config.getoption("--compare-report")
    if not committed_path or set(clauses) - set(status):
        return {}  # only a run that measured every clause can be compared
    committed = json.loads(Path(committed_path).read_text())["clauses"]
    return {c: committed.get(c) for c in clauses if committed.get(c) != status.get(c)}


def _compare(tr: Any, config: pytest.Config, clauses: dict[str, Any], status: dict[str, str]) -> None:
    stale = _stale_clauses(config, clauses, status)
    for cid in sorted(stale):
        tr.write_line(f"REPORT DIFFERS {cid}: committed {stale[cid]}, this run {status.get(cid)}")
    if stale:
        committed_path = config.getoption("--compare-report")
        tr.write_line(
            f"{committed_path} is stale: rerun with --clause-report {committed_path}, then "
            "python -m conformance.report docs"
        )


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
    _write_summary(tr, clauses, status)
    report = build_report(
        backend.describe(),
        backend.adapter_name(),
        status,
        sorted(_ADAPTED_CLAUSES & set(status)),
        {c: r for c, r in _REASONS.items() if status.get(c) in ("failed", "not measured")},
    )
    out = config.getoption("--clause-report")
    if out:
        Path(out).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    md = config.getoption("--clause-report-md")
    if md:
        Path(md).write_text(render_md(report, clauses))
    _compare(tr, config, clauses, status)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A stale --compare-report fails the run. Decided here, not in the terminal summary that prints the
    differences: pytest calls the summary from inside this hook, after the exit status is read."""
    config = session.config
    if hasattr(config, "workerinput") or not _OUTCOMES or exitstatus != 0:
        return
    if _stale_clauses(config, load_clauses(), fold(_OUTCOMES)):
        session.exitstatus = 1


@pytest.fixture
def ckpt_root(tmp_path: Path, request: pytest.FixtureRequest) -> helpers.Where:
    """Where a test puts its checkpoints: ``tmp_path``, or a fresh prefix under ``--storage-url``."""
    return helpers.fresh_root(tmp_path, request.node.name)


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
