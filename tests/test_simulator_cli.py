"""Argument parsing and plan validation of `python -m simulator` (no ranks launched)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.cli import build_parser, parse_mesh, parse_scenarios, parse_world, plan_from_args
from simulator.plan import DEFAULT_SCENARIOS, SCENARIOS, Plan

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4→8", (4, 8)), ("4->8", (4, 8)), ("4:8", (4, 8)), ("3", (3, 3)), (" 8 → 3 ", (8, 3)), ("1->4", (1, 4))],
)
def test_world_accepts_every_documented_spelling(text: str, expected: tuple[int, int]) -> None:
    assert parse_world(text) == expected


@pytest.mark.parametrize("text", ["0", "4→0", "a→b", "4→8→2", "-1", "", "4.5"])
def test_bad_world_names_the_flag_and_the_value(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--world"):
        parse_world(text)


@pytest.mark.parametrize(("parse", "text"), [(parse_world, "9999"), (parse_world, "4→65"), (parse_mesh, "2x2→16x8")])
def test_more_ranks_than_one_machine_launches_is_refused_before_anything_starts(parse: object, text: str) -> None:
    # 9999 ranks used to start launching and die with "OSError: Too many open files" and a traceback.
    with pytest.raises(argparse.ArgumentTypeError, match=r"at most 64.*--sections scale"):
        parse(text)  # type: ignore[operator]
    assert parse_world("64") == (64, 64)


def test_mesh_parses_two_dimensional_shapes_and_rejects_mismatched_ranks() -> None:
    assert parse_mesh("2x2→2x4") == ((2, 2), (2, 4))
    assert parse_mesh("2x3") == ((2, 3), (2, 3))
    with pytest.raises(argparse.ArgumentTypeError, match="same number of dimensions"):
        parse_mesh("4→2x2")
    with pytest.raises(argparse.ArgumentTypeError, match="--mesh"):
        parse_mesh("2x0→2x2")


def test_scenarios_default_to_all_and_accept_repeats_and_commas() -> None:
    assert parse_scenarios(None) == DEFAULT_SCENARIOS == ("layouts", "async-race", "reshard")  # faults: named only
    assert parse_scenarios(["reshard", "layouts,reshard"]) == ("reshard", "layouts")
    assert parse_scenarios(["all"]) == tuple(SCENARIOS)
    with pytest.raises(argparse.ArgumentTypeError, match="'nope'"):
        parse_scenarios(["nope"])


def _plan(*argv: str) -> Plan:
    return plan_from_args(build_parser().parse_args(list(argv)), root="/tmp/x")


def test_mesh_implies_world_and_must_agree_with_an_explicit_world() -> None:
    plan = _plan("--mesh", "2x2→2x4")
    assert (plan.save_world, plan.load_world, plan.save_mesh, plan.load_mesh) == (4, 8, (2, 2), (2, 4))
    assert plan.mesh_label == "2x2→2x4" and plan.world_label == "4→8"
    with pytest.raises(argparse.ArgumentTypeError, match="disagrees"):
        _plan("--mesh", "2x2→2x4", "--world", "4→4")


def test_defaults_are_four_to_eight_on_the_default_backend() -> None:
    plan = _plan()
    assert (plan.save_world, plan.load_world, plan.backend, plan.seed) == (4, 8, "torch_checkpointing", 0)
    assert plan.scenarios == DEFAULT_SCENARIOS
    assert _plan("--seed", "7", "--backend", "other_impl", "--world", "2").backend == "other_impl"


def test_plan_rejects_a_mesh_that_does_not_cover_the_world() -> None:
    with pytest.raises(ValueError, match="mesh"):
        Plan(backend="b", seed=0, root="/r", save_world=4, load_world=2, save_mesh=(2, 3), load_mesh=(2,))


def test_help_explains_every_scenario_without_starting_anything() -> None:
    out = subprocess.run([sys.executable, "-m", "simulator", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for name in SCENARIOS:
        assert f"  {name}: " in out.stdout
    for flag in ("--world", "--mesh", "--scenario", "--backend", "--seed", "--keep", "--json", "--timeout"):
        assert flag in out.stdout


def test_bad_arguments_exit_with_usage_error_naming_the_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "simulator", "--world", "4→x"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "--world" in out.stderr and "'x'" in out.stderr


@pytest.mark.parametrize(("text", "shown"), [("8-", "'8->"), ("4-", "'4->"), (" 8 - ", "'8->")])
def test_a_value_cut_by_a_shell_redirect_says_to_quote_the_argument(text: str, shown: str) -> None:
    """Unquoted `--world 8->3` in bash leaves `8-` (and a file named `3`): say what happened and what to type."""
    with pytest.raises(argparse.ArgumentTypeError, match="quote the argument: " + shown):
        parse_world(text)


def test_the_file_bash_created_supplies_the_load_size_in_the_hint(tmp_path: Path) -> None:
    """`--world 8->3` unquoted: bash creates ./3 before the command starts, so the hint can show '8->3' exactly."""
    (tmp_path / "3").write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "simulator", "--world", "8-"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 2
    assert "quote the argument: '8->3'" in out.stderr and "file named '3'" in out.stderr


def test_an_unquoted_mesh_arrow_gets_the_same_hint() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"--mesh 2x2-: .*quote the argument: '2x2->"):
        parse_mesh("2x2-")


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--timeout", "0"], "--timeout"),
        (["--timeout", "nan"], "--timeout"),
        (["--timeout", "inf"], "--timeout"),
        (["--write-delay", "-1"], "--write-delay"),
        (["--backend", "no_such_backend_module"], "--backend"),
        (["--json", "{tmp}/missing/report.json"], "--json"),
        (["--json", "{tmp}"], "--json"),
        (["--keep", "{tmp}/a-file"], "--keep"),
    ],
)
def test_a_run_that_could_not_finish_or_report_is_refused_before_launching(
    tmp_path: Path, extra: list[str], named: str
) -> None:
    # Each used to launch ranks: `nan`/`inf` timeouts and negative delays ran, an unimportable backend failed
    # every check on every rank, and an unwritable --json or a file given as --keep ended in a traceback
    # after the whole run.
    (tmp_path / "a-file").write_text("not a directory")
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "simulator", "--world", "1", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert named in out.stderr and "Traceback" not in out.stderr
    assert (tmp_path / "a-file").read_text() == "not a directory"
    assert not list(tmp_path.glob("simulator-*")), "a refused run left its temporary directory behind"
