"""Committed clause reports carry no machine paths: what a run against this checkout records as its backend.

`conformance/reports/ours.json` used to be edited by hand after each run, because the backend line a run
writes names the checkout's absolute path; a report regenerated without that edit committed a machine path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import conformance
from conformance.report import build_report

ROOT = Path(conformance.__file__).resolve().parent.parent


def _revision() -> str:
    run = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT, capture_output=True)
    return run.stdout.decode().strip()


def test_the_checkout_path_becomes_this_checkout_at_its_revision() -> None:
    line = f"conformance backend: torch_checkpointing 0.2.0 ({ROOT / 'torch_checkpointing' / '__init__.py'})"
    backend = build_report(line, "", {}, [], {})["backend"]
    assert str(ROOT) not in backend, backend
    assert backend == f"conformance backend: torch_checkpointing 0.2.0 (this checkout at {_revision()})"


def test_checkout_paths_in_reasons_are_relative_to_it() -> None:
    reason = f'failed: File "{ROOT / "conformance" / "test_formats.py"}", line 3, in test_x'
    reasons = build_report("b", "", {"X-1": "failed"}, [], {"X-1": reason})["reasons"]
    assert reasons == {"X-1": 'failed: File "conformance/test_formats.py", line 3, in test_x'}


def test_a_real_report_line_names_no_path_of_this_machine(tmp_path: Path) -> None:
    """The backend line exactly as a conformance run describes this checkout, through the writer of the JSON."""
    code = (
        "import json, sys; from conformance import backend; from conformance.report import build_report; "
        "print(json.dumps(build_report(backend.describe(), '', {}, [], {})))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFORMANCE_")}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    backend = json.loads(run.stdout)["backend"]
    assert str(ROOT) not in backend and "this checkout at " in backend, backend


def test_a_traceback_in_a_reason_names_no_virtualenv_or_interpreter_path() -> None:
    """A backend error relayed from its writer process carries a traceback with the installed package's and
    the interpreter's own paths (0.1.1's refusal on an async save), not inside parentheses."""
    venv = "/opt/venvs/upstream/lib/python3.11/site-packages"
    stdlib = "/usr/local/lib/python3.11"
    reason = (
        f'FileExistsError: Traceback:\n  File "{venv}/torch_checkpointing/storage/filesystem.py", line 334\n'
        f'  File "{stdlib}/concurrent/futures/_base.py", line 401, in __get_result\n'
        f"(imported from ({venv}/torch_checkpointing/__init__.py))"
    )
    got = build_report("b", "", {"X-1": "failed"}, [], {"X-1": reason})["reasons"]["X-1"]
    assert venv not in got and stdlib not in got, got
    assert '"<site-packages>/torch_checkpointing/storage/filesystem.py", line 334' in got, got
    assert '"<stdlib>/concurrent/futures/_base.py", line 401' in got, got
    assert "from (site-packages))" in got, got
