"""`--json` spelt as argparse lets it be abbreviated (`--js`, `--jso`) (round 34).

argparse takes any unique prefix of a long option, so `--jso` turned JSON mode on for a command's report; but
the check for whether a script asked for the JSON document (a usage error's, or a signal's while the CLI
starts) looked for the literal `--json`, and such a script got an empty stdout instead of the documented
`{"error": ..., "kind": "UsageError"}`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torch_checkpointing.cli import main
from torch_checkpointing.cli_stops import json_requested


@pytest.mark.parametrize("spelling", ["--j", "--js", "--jso"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_an_abbreviated_json_flag_gets_the_usage_error_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spelling: str, where: str
) -> None:
    argv = (
        [spelling, "ls", str(tmp_path), "--bogus"] if where == "before" else ["ls", spelling, str(tmp_path), "--bogus"]
    )
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    doc = json.loads(capsys.readouterr().out)
    assert stopped.value.code == 2
    assert doc["kind"] == "UsageError" and "--bogus" in doc["error"], doc


def test_json_requested_reads_the_options_as_argparse_does() -> None:
    assert json_requested(["--js", "ls", "run"])
    assert json_requested(["ls", "--jso", "run"])
    assert not json_requested(["ls", "--", "--js"])  # a path after `--`
    assert not json_requested(["ls", "--jsonx", "run"])  # no prefix of --json
    assert not json_requested(["ls", "-j", "run"])  # a short option, which the CLI does not have
    assert not json_requested(["ls", "--", "--json"])
