"""Keep the sample run in docs/simulator.md true: it is produced by the program, and checked against it.

    python -m simulator.docs_sample docs/simulator.md     # rerun the command shown on the page, rewrite the sample

The page marks its sample with ``<!-- simulator-output: python -m simulator ARGS -->`` followed by a ```text
block. :func:`normalise` removes what legitimately differs between two runs (timings, byte counts, temporary
paths, column widths), so a test can compare a fresh run's output with the page and fail when they drift.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

_MARKER = re.compile(
    r"^<!-- simulator-output: (?P<command>python -m simulator[^\n]*?) -->\n```text\n(?P<body>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)
_RULES = (
    (re.compile(r"(checkpoints under) \S+"), r"\1 DIR"),
    (re.compile(r"\b\d+(?:\.\d+)? (?:B|KiB|MiB|GiB)\b"), "SIZE"),
    (re.compile(r"\b\d+(?:\.\d+)?s\b"), "Ns"),
    (re.compile(r"-{3,}"), "---"),
    (re.compile(r" {2,}"), "  "),
)


def page_sample(page: Path) -> tuple[list[str], str]:
    """The simulator arguments the page's sample was produced with, and the sample as shown."""
    match = _MARKER.search(page.read_text(encoding="utf-8"))
    if match is None:
        raise ValueError(
            f"{page}: no '<!-- simulator-output: python -m simulator ... -->' marker before a ```text block"
        )
    return shlex.split(match.group("command"))[3:], match.group("body")


def normalise(output: str) -> list[str]:
    """The lines two honest runs of the same command share."""
    lines = []
    for line in output.splitlines():
        if line.startswith("checkpoints kept under"):  # printed only with --keep
            continue
        for pattern, repl in _RULES:
            line = pattern.sub(repl, line)
        lines.append(line.rstrip())
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run(argv: list[str], timeout_s: float = 900.0) -> str:
    """Run the simulator as a reader would; its stdout, whatever the verdict (the page shows what it prints)."""
    done = subprocess.run([sys.executable, "-m", "simulator", *argv], capture_output=True, text=True, timeout=timeout_s)
    if not done.stdout.strip():
        raise RuntimeError(f"python -m simulator {shlex.join(argv)} printed nothing:\n{done.stderr[-3000:]}")
    return done.stdout


def rewrite(page: Path) -> None:
    """Rerun the page's command and put its output in place of the old sample."""
    argv, _ = page_sample(page)
    output = run(argv)
    text = page.read_text(encoding="utf-8")
    match = _MARKER.search(text)
    assert match is not None
    body = output if output.endswith("\n") else output + "\n"
    page.write_text(text[: match.start("body")] + body + text[match.end("body") :], encoding="utf-8")


def main(args: list[str]) -> int:
    if len(args) != 1:
        print("usage: python -m simulator.docs_sample PAGE.md", file=sys.stderr)
        return 2
    rewrite(Path(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
