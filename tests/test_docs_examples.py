"""The examples in the README and docs/ run as written (each in a fresh interpreter, as a user would)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(script: Path, cwd: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_resume_example_restores_model_and_optimizer(tmp_path: Path) -> None:
    out = _run(ROOT / "docs" / "examples" / "resume.py", tmp_path, str(tmp_path / "ckpt"))
    assert "resumed at step 3; weights identical: True; optimizer identical: True" in out


def test_readme_example(tmp_path: Path) -> None:
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert code is not None, "README lost its example"
    script = tmp_path / "readme_example.py"
    script.write_text(code.group(1))
    out = _run(script, tmp_path)
    assert "{'step': 3}" in out
    assert (tmp_path / "ckpt" / "step3" / "manifest.json").exists()
