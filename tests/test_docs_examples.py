"""Every code block of README.md and docs/*.md is complete and checked, the way a reader would use it.

Conventions for writing docs (every page is discovered, so a new page or section follows them with no change
here):

* ```python — a complete program: imports, tiny tensors, sync saves unless async is the point. It is run as
  a script in a fresh interpreter, from an empty working directory, and must exit 0 (assert what you show).
  Guard async code with ``if __name__ == "__main__":`` (the writer process is spawned and re-imports it).
* ``<!-- docs-test: ranks=2 -->`` on the line above a ```python block: a multi-rank program, run as
  ``torchrun --nproc-per-node 2 script.py`` would run it (each rank calls ``dist.init_process_group("gloo")``
  itself; the ranks share the working directory), through ``simulator.launcher.launch``. ``ranks=1,2`` runs
  it both as a plain script and on 2 ranks.
* ``<!-- docs-test: s3 -->`` (alone or with ``ranks=...``): the block talks to S3. A local moto server
  (tests/s3_server.py) is started once, a fresh bucket is made for the block, and the block gets what a real
  user sets: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION`` and
  ``CHECKPOINT_BUCKET`` (the bucket's name) in its environment. Skipped without fsspec/s3fs/moto[server].
* ```bash — commands for the reader to type. Not run, but checked: no unquoted ``->`` (bash reads ``>`` as a
  redirect), and every ``python -m simulator ...`` line must be accepted by the simulator's own parser.
* ```text, ```console — output, diagrams and shell sessions shown as they look; never run.
* ```json, ```toml, ```yaml, ```ini — data shown; never run.
* A block without a label fails: say which of the above it is.
"""

from __future__ import annotations

import itertools
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_snippets import ROOT, Block, blocks, documents

RUN = {"python"}
COMMANDS = {"bash", "sh", "shell"}
SHOWN = {"text", "console", "output", "json", "toml", "yaml", "ini"}
_TIMEOUT_S = 240

ALL_BLOCKS = [b for doc in documents() for b in blocks(doc)]
PYTHON = [b for b in ALL_BLOCKS if b.lang in RUN]
SHELL = [b for b in ALL_BLOCKS if b.lang in COMMANDS]


def _env() -> dict[str, str]:
    """The repository root on the path, as when a reader runs a snippet from a clone."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path}


def _services(block: Block, request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment a block marked `s3` reads: a local S3 server's endpoint, credentials and a fresh bucket."""
    if "s3" not in block.needs:
        return {}
    import uuid

    server = request.getfixturevalue("s3_server")
    bucket = f"docs-{uuid.uuid4().hex[:12]}"
    server.make_bucket(bucket)
    return {**server.client_env(), "CHECKPOINT_BUCKET": bucket}


def _script(block: Block, tmp_path: Path) -> Path:
    script = tmp_path / f"{Path(block.doc).stem}_{block.line}.py"
    script.write_text(f"# {block.id}\n{block.code}", encoding="utf-8")
    return script


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda b: b.id)
def test_every_block_says_what_it_is(block: Block) -> None:
    known = RUN | COMMANDS | SHOWN
    assert block.lang in known, (
        f"{block.id}: a ```{block.lang or ''} block; label it with one of {sorted(known)} "
        "(see the conventions at the top of tests/test_docs_examples.py)"
    )
    if block.ranks != (1,):
        assert block.lang == "python", f"{block.id}: only ```python blocks run on several ranks"


@pytest.mark.parametrize("block", [b for b in PYTHON if 1 in b.ranks], ids=lambda b: b.id)
def test_python_block_runs_as_a_script(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    script = _script(block, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    env = {**_env(), **_services(block, request)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=work, capture_output=True, text=True, timeout=_TIMEOUT_S, env=env
    )
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


@pytest.mark.multirank
@pytest.mark.parametrize("block", [b for b in PYTHON if set(b.ranks) - {1}], ids=lambda b: b.id)
def test_multi_rank_python_block_runs_under_torchrun_conditions(
    block: Block, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from simulator.launcher import launch
    from tests.docs_snippets import run_script_as_torchrun_rank

    script = _script(block, tmp_path)
    for world in sorted(set(block.ranks) - {1}):
        work = tmp_path / f"work{world}"
        work.mkdir()
        launch(
            run_script_as_torchrun_rank,
            world,
            args=(str(script), str(work)),
            timeout=_TIMEOUT_S,
            env={"PYTHONPATH": _env()["PYTHONPATH"], **_services(block, request)},
            name=f"docs-{Path(block.doc).stem}-{block.line}",
        )


def _commands(code: str) -> list[list[str]]:
    """Split a block of shell lines into simple commands, the way bash tokenises them (quotes, comments, > < |)."""
    out: list[list[str]] = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token in ("&&", "||", ";", "|", "&"):
                out.append(current)
                current = []
            else:
                current.append(token)
        out.append(current)
    return [c for c in out if c]


def _redirect_cut(command: list[str]) -> str | None:
    for before, token in itertools.pairwise(command):
        if token.startswith(">") and before.endswith("-"):
            return f"{before}{token}"
    return None


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.id)
def test_shell_block_means_what_it_says_in_bash(block: Block) -> None:
    from simulator.cli import build_parser, plan_from_args

    for command in _commands(block.code):
        cut = _redirect_cut(command)
        assert cut is None, f"{block.id}: {' '.join(command)!r}: unquoted {cut!r} is a redirect in bash; quote it"
        if command[:3] == ["python", "-m", "simulator"]:
            parser = build_parser()
            try:
                plan_from_args(parser.parse_args(command[3:]), "/nonexistent")
            except SystemExit as exc:  # --help exits 0; anything else is argparse refusing the line
                if exc.code == 0:
                    continue
                pytest.fail(f"{block.id}: {' '.join(command)!r} is refused by the simulator (exit {exc.code})")


def test_the_redirect_check_catches_the_unquoted_arrow() -> None:
    """The check above can fail: `--world 8->3` unquoted is cut by bash, quoted it is one argument."""
    assert _redirect_cut(_commands("python -m simulator --world 8->3   # comment")[0]) == "8->"
    assert _redirect_cut(_commands("python -m simulator --world '8->3'")[0]) is None


def test_markers_and_indented_blocks_are_read_and_unknown_markers_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: ranks=1,2 -->\n```python\nprint(1)\n```\n\n* item\n  ```text\n  out\n  ```\n")
    assert [(b.lang, b.ranks, b.code, b.line) for b in blocks(page)] == [
        ("python", (1, 2), "print(1)\n", 2),
        ("text", (1,), "out\n", 7),
    ]
    page.write_text("<!-- docs-test: s3 ranks=2 -->\n```python\nprint(1)\n```\n")
    assert [(b.ranks, b.needs) for b in blocks(page)] == [((2,), ("s3",))]
    page.write_text("<!-- docs-test: rank=2 -->\n```python\nprint(1)\n```\n")
    with pytest.raises(ValueError, match="unknown docs-test marker"):
        blocks(page)


def test_resume_example_restores_model_and_optimizer(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples" / "resume.py"), str(tmp_path / "ckpt")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        env=_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed at step 3; weights identical: True; optimizer identical: True" in done.stdout
