"""Every signal sent to stop a program is held where Ctrl-C is, and each is reported as what it was.

A user's SIGALRM handler that raises (a timeout around a save) landing between a file's create and its record,
or in the removal of the unfinished save, left the same leftovers beside the id that Ctrl-C used to: only SIGINT,
SIGTERM, SIGHUP and SIGUSR1/2 were held. And a KeyboardInterrupt raised by a handler other than Ctrl-C's (a
SIGTERM handled by `signal.default_int_handler`) was reported as "Ctrl-C". Each test pins one instant with a
blocking storage (`tests.memory_storage.Control`) and sends real signals from another thread.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.probes import run_script
from torch_checkpointing.agreement import describe
from torch_checkpointing.signals import WATCHED_SIGNALS, signals_deferred

_SCRIPT = """
import logging, os, signal, sys, threading, time
import torch
from tests.memory_storage import Control, RecordingStorageConfig
from torch_checkpointing import CheckpointManager

logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")


def on_alarm(signum, frame):  # a user's timeout around the save
    raise TimeoutError("the save took too long")


def on_usr1(signum, frame):  # a preemption notice
    raise SystemExit(3)


signal.signal(signal.SIGALRM, on_alarm)
signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM raised as KeyboardInterrupt

if __name__ == "__main__":
    root, control, first_block, second_block = sys.argv[1], Control(sys.argv[2]), sys.argv[3], sys.argv[4]
    first, second = getattr(signal, sys.argv[5]), getattr(signal, sys.argv[6]) if sys.argv[6] else None
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = RecordingStorageConfig(control_dir=sys.argv[2])
    manager = CheckpointManager(config)
    manager.save(f"{root}/step", {"model": {"w": torch.ones(4)}, "extra": {"s": 1}})
    control.reset()
    control.block(first_block)

    def send():
        control.wait_blocked()
        if second_block:  # blocks at the next instant while the first signal unwinds the save
            control.block(second_block)
        os.kill(os.getpid(), first)
        if second_block:
            control.wait_blocked()
            os.kill(os.getpid(), second)
            time.sleep(0.5)
        control.reset()  # the blocked call goes on

    threading.Thread(target=send, daemon=True).start()
    try:
        manager.save(f"{root}/step", {"model": {"w": torch.full((4,), 2.0)}, "extra": {"s": 2}})
        print("save: returned", flush=True)
    except BaseException as exc:
        notes = " ".join(getattr(exc, "__notes__", []))
        print(f"save: {type(exc).__name__} {exc} {notes}", flush=True)
        kept = exc  # as a notebook keeps the last exception
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    print("still open:", [path for path in held if path.startswith(root)], flush=True)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    loaded = manager.load(f"{root}/step", {"model": {"w": torch.zeros(4)}})
    print(f"loaded: {loaded['model']['w'].tolist()}", flush=True)
    manager.close()
    print("entries:", sorted(os.listdir(root)), flush=True)
"""


def _run(tmp_path: Path, first_block: str, second_block: str, first: str, second: str = "") -> str:
    ckpt, control = str(tmp_path / "ckpt"), str(tmp_path / "control")
    done = run_script(tmp_path / "signalled.py", _SCRIPT, ckpt, control, first_block, second_block, first, second)
    out = f"{done.stdout}\n{done.stderr}"
    assert "loaded: [1.0, 1.0, 1.0, 1.0]" in out, out  # the earlier checkpoint is intact
    return out


def test_a_timeout_handler_between_a_files_create_and_its_record_leaves_nothing_beside_the_id(
    tmp_path: Path,
) -> None:
    # Before: SIGALRM was not held there; the file created but not recorded stayed, with its temporary directory
    # ("entries: ['.step.tmp-…', 'step']"), and the stream stayed open on it.
    out = _run(tmp_path, "after open extra_0.pt", "", "SIGALRM")
    assert "entries: ['step']" in out, out
    assert "still open: []" in out, out
    assert "SIGALRM during the create of the file; its handler runs once it is created" in out, out
    # The handler's own exception, raised as itself and saying what became of the save.
    assert "save: TimeoutError the save took too long" in out, out
    assert "interrupted by SIGALRM: nothing was committed" in out, out


def test_a_timeout_handler_during_the_removal_of_the_unfinished_save_waits_for_it(tmp_path: Path) -> None:
    # Before: the SIGALRM landing after a Ctrl-C stopped the removal: the hidden temporary directory stayed.
    out = _run(tmp_path, ".incomplete", "before rmdir", "SIGINT", "SIGALRM")
    assert "entries: ['step']" in out, out
    assert "SIGALRM during the removal of the unfinished save; its handler runs once it is removed" in out, out


def test_a_keyboard_interrupt_from_sigterm_is_not_reported_as_ctrl_c(tmp_path: Path) -> None:
    # A preemption handler's SystemExit (SIGUSR1), then a SIGTERM whose handler is `default_int_handler` during the
    # removal. Before: "KeyboardInterrupt Checkpoint save of … interrupted (Ctrl-C): …" though nobody pressed it.
    out = _run(tmp_path, ".incomplete", "before rmdir", "SIGUSR1", "SIGTERM")
    assert "entries: ['step']" in out, out
    assert "Ctrl-C" not in out, out
    assert "save: KeyboardInterrupt Checkpoint save of " in out, out
    assert "interrupted by SIGTERM: nothing was committed" in out, out


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGUSR1", "SIGUSR2"])
def test_every_signal_sent_to_stop_a_program_is_held(name: str) -> None:
    # The rule: the signals that a person, a scheduler or a timer sends to stop or notify a program.
    signum = getattr(signal, name)
    assert signum in WATCHED_SIGNALS
    seen: list[int] = []
    before = signal.signal(signum, lambda n, f: seen.append(n))
    try:
        with signals_deferred("test", quiet=True):
            signal.raise_signal(signum)
            assert seen == []
        assert seen == [signum]
    finally:
        signal.signal(signum, before)


@pytest.mark.parametrize("name", ["SIGPROF", "SIGVTALRM", "SIGCHLD", "SIGWINCH"])
def test_sampling_and_notice_signals_are_not_held(name: str) -> None:
    # A sampling profiler's timer fires many times a second and reads the frame it lands in: held, each sample
    # would be misplaced and every second one taken for "sent again" (a WARNING each). SIGCHLD and SIGWINCH do
    # not stop a program.
    assert getattr(signal, name) not in WATCHED_SIGNALS


def test_a_peer_told_of_a_bare_keyboard_interrupt_is_not_told_it_was_sigint() -> None:
    # Before: "the rank was interrupted (Ctrl-C, or SIGINT)", whichever signal's handler raised it.
    said = describe(KeyboardInterrupt())
    assert "SIGINT" not in said and "a signal whose handler raises KeyboardInterrupt" in said, said


def test_a_repeating_timer_whose_handler_returns_is_not_said_to_cut_the_block_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A heartbeat on SIGALRM (setitimer with an interval) whose handler returns: the second alarm in a block runs
    # it at once and cuts nothing short. Before: "SIGALRM again: its handler runs now, and the templates may be
    # partly restored" after a load that restored them whole.
    beats: list[int] = []
    before = signal.signal(signal.SIGALRM, lambda n, f: beats.append(n))
    try:
        with signals_deferred("Load of ck"):
            signal.raise_signal(signal.SIGALRM)
            signal.raise_signal(signal.SIGALRM)
            assert beats == [signal.SIGALRM]  # the second ran at once
        assert beats == [signal.SIGALRM, signal.SIGALRM]
    finally:
        signal.signal(signal.SIGALRM, before)
    messages = [r.getMessage() for r in caplog.records]
    assert not any("SIGALRM again" in m for m in messages), messages


def test_a_timeout_sent_again_cuts_a_held_block_short() -> None:
    # The documented way out for a timeout that lands in a block that hangs: an interval timer's repeat.
    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError("too long")

    before = signal.signal(signal.SIGALRM, on_alarm)
    steps = []
    try:
        with pytest.raises(TimeoutError), signals_deferred("Load of ck"):
            signal.raise_signal(signal.SIGALRM)
            steps.append("held")
            signal.raise_signal(signal.SIGALRM)
            steps.append("not reached")
    finally:
        signal.signal(signal.SIGALRM, before)
    assert steps == ["held"]
