"""The wheel installs `torch_checkpointing` and nothing else; the sdist carries the whole project.

Builds from a copy of the checkout (so a stale `build/` here cannot leak into the result), through
setuptools' PEP 517 hooks with no build isolation and no network: a few seconds. See docs/packaging.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[1]
# Top-level names a wheel may install: the package and its metadata directory, nothing generic.
WHEEL_TOP_LEVEL = {"torch_checkpointing", "torch_checkpointing-{version}.dist-info"}
# What a third party needs from the sdist to run the suite and the simulator against its backend.
SDIST_MUST_HOLD = [
    "simulator/__main__.py",
    "conformance/conftest.py",
    "conformance/golden",
    "tests",
    "docs/packaging.md",
]
_IGNORED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".tox", ".venv", ".hypothesis", "bench-out"
)


def _checkout_copy(dest: Path) -> Path:
    """The files of the checkout that git would see (tracked or not ignored), else a filtered copy."""
    src = dest / "src"
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:
        shutil.copytree(ROOT, src, ignore=_IGNORED)
        return src
    for name in filter(None, listed.stdout.decode().split("\0")):
        path = ROOT / name
        if path.is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    return src


def _build(src: Path, hook: str, out: Path) -> Path:
    """Run one setuptools PEP 517 hook in a fresh interpreter (as a frontend would) and return the file."""
    out.mkdir()
    code = f"import setuptools.build_meta as b; print(b.{hook}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{hook} failed:\n{done.stdout}\n{done.stderr}"
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkout_copy(tmp_path_factory.mktemp("packaging"))


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(source, "build_wheel", tmp_path_factory.mktemp("wheel") / "out")


def test_wheel_installs_only_torch_checkpointing(source: Path, wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    version = wheel.name.split("-")[1]
    top = {name.split("/", 1)[0] for name in names}
    assert top == {n.format(version=version) for n in WHEEL_TOP_LEVEL}
    # No generic top-level name anywhere (benchmarks, simulator, conformance, tests).
    assert not any(name.startswith(("benchmarks/", "simulator/", "conformance/", "tests/")) for name in names)
    # The engine is complete and typed.
    assert "torch_checkpointing/py.typed" in names
    assert "torch_checkpointing/storage/filesystem.py" in names
    modules = {p.relative_to(source).as_posix() for p in (source / "torch_checkpointing").rglob("*.py")}
    assert modules <= set(names), sorted(modules - set(names))


def test_installed_wheel_imports_on_its_own(wheel: Path, tmp_path: Path) -> None:
    """Every module of the wheel imports from the wheel alone (unpacked: a pure wheel's install), away from
    the checkout: nothing the engine needs was left out (a subpackage, a data file, a checkout-only import)."""
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = (
        "import importlib, pkgutil, sys\n"
        "import torch_checkpointing as t\n"
        f"assert t.__file__.startswith({str(target)!r}), t.__file__\n"
        "for info in pkgutil.walk_packages(t.__path__, 'torch_checkpointing.'):\n"
        "    if not info.name.endswith('.__main__'):\n"
        "        importlib.import_module(info.name)\n"
        "checkout_only = ('simulator', 'conformance', 'benchmarks', 'tests')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in checkout_only)\n"
        "assert not bad, bad\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COVERAGE_PROCESS_START")}
    env["PYTHONPATH"] = str(target)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr


def test_sdist_carries_the_harness(source: Path, tmp_path: Path) -> None:
    sdist = _build(source, "build_sdist", tmp_path / "sdist")
    with tarfile.open(sdist) as tar:
        members = [m.split("/", 1)[1] for m in tar.getnames() if "/" in m]
    for needed in SDIST_MUST_HOLD:
        assert any(m == needed or m.startswith(needed + "/") for m in members), needed
    assert not any("__pycache__" in m for m in members)


def test_docs_name_every_extra_and_what_it_installs() -> None:
    """docs/packaging.md's "Extras" line names every extra of pyproject.toml and every package each installs:
    it listed four of the seven extras, and `test` without moto and the `s3` extra it pulls in."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    page = (ROOT / "docs" / "packaging.md").read_text(encoding="utf-8")
    line = next(part for part in page.split("\n* ") if part.startswith("Extras:"))
    unnamed = []
    for extra, requirements in extras.items():
        named = [f"`{extra}`"]
        for requirement in requirements:
            project = re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0]
            if project == "torch-checkpointing":  # another extra of this package, "torch-checkpointing[s3]"
                named += [f"`{e.strip()}`" for e in requirement.split("[", 1)[1].split("]", 1)[0].split(",")]
            else:
                named.append(project)
        unnamed += [f"{extra}: {name}" for name in named if name not in line]
    assert not unnamed, f"docs/packaging.md's Extras line does not name: {unnamed}"
