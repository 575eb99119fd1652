"""A check that fails the test which drops a CheckpointManager without close().

A manager that is garbage-collected unclosed is closed by its finalizer, which logs "was dropped without close()"
and releases the writer process and threads in the background. When that collection comes from a reference
cycle, it happens at whatever later garbage collection runs: inside another test's log capture, which then
failed far from its cause (and until then a writer process and its threads were kept per dropped manager).

This notes each manager a test builds (wrapping `CheckpointManager.__init__`) and each one closed (wrapping
`close`). At the test's teardown, after its fixtures are gone, a manager it built that is neither closed nor
still held is a drop: collected already, or (after one `gc.collect()`) only in a cycle. The collection runs only
when the test built a manager that is still unclosed, so the ~all tests that close theirs pay a list walk.

A manager still held after that (a module-scoped fixture's, or one kept by a failed test's traceback) is watched
further: if it is collected unclosed during a later test, that test gets a warning naming the test that built
it, and the drop's own test is not failed twice.

A test that drops a manager on purpose (it tests the finalizer) says so: `@pytest.mark.drops_manager`. Its drops
are still collected at its teardown, so that the warning lands inside it and not in a later test.
"""

from __future__ import annotations

import functools
import gc
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from torch_checkpointing import CheckpointManager

MARKER = "drops_manager"


@dataclass
class _Built:
    """One manager, by what a test can say about it once it is gone."""

    test: str
    pid: int
    alive: weakref.ref[CheckpointManager]
    closed: bool = False


@dataclass
class _Ledger:
    test: str = "<no test running>"
    by_id: dict[int, _Built] = field(default_factory=dict)
    this_test: list[_Built] = field(default_factory=list)
    collected_unclosed: list[_Built] = field(default_factory=list)


_LEDGER = _Ledger()


def _on_collected(built: _Built) -> None:
    if not built.closed and built.pid == os.getpid():  # a forked child's copy is not its to close
        _LEDGER.collected_unclosed.append(built)


def _note_built(manager: CheckpointManager) -> None:
    built = _Built(_LEDGER.test, os.getpid(), weakref.ref(manager))
    _LEDGER.by_id[id(manager)] = built
    _LEDGER.this_test.append(built)
    weakref.finalize(manager, _on_collected, built).atexit = False
    weakref.finalize(manager, _LEDGER.by_id.pop, id(manager), None).atexit = False


def _note_closed(manager: CheckpointManager) -> None:
    built = _LEDGER.by_id.get(id(manager))
    if built is not None and built.alive() is manager:
        built.closed = True


def _wrap(cls: type[CheckpointManager]) -> Callable[[], None]:
    """Wrap `cls.__init__` and `cls.close`; returns what puts them back."""
    init, close = cls.__init__, cls.close

    @functools.wraps(init)
    def noting_init(self: CheckpointManager, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _note_built(self)

    @functools.wraps(close)
    def noting_close(self: CheckpointManager) -> None:
        try:
            close(self)
        except Exception:  # a failed last save or a killed writer: raised after the manager was closed
            _note_closed(self)
            raise
        _note_closed(self)  # not on an interrupt (KeyboardInterrupt): close() then leaves the manager open

    cls.__init__, cls.close = noting_init, noting_close  # type: ignore[method-assign]

    def unwrap() -> None:
        cls.__init__, cls.close = init, close  # type: ignore[method-assign]

    return unwrap


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: the test drops a CheckpointManager without close() on purpose (it tests that)"
    )
    config.add_cleanup(_wrap(CheckpointManager))


def _drops_of_this_test() -> list[_Built]:
    """The managers this test built and let be collected unclosed: collected once, only if one is unclosed."""
    if any(not b.closed and b.alive() is not None for b in _LEDGER.this_test):
        gc.collect()
    mine = {id(b) for b in _LEDGER.this_test}
    return [b for b in _LEDGER.collected_unclosed if id(b) in mine]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture: a module-scoped one's manager is named by the test whose setup built it."""
    _LEDGER.test = item.nodeid


@pytest.fixture(autouse=True)
def _no_manager_dropped(request: pytest.FixtureRequest) -> Iterator[None]:
    """Autouse, so set up after broader-scoped fixtures (theirs are not this test's) and before the test's own
    function fixtures, and torn down after those (they close theirs)."""
    _LEDGER.this_test = []
    yield
    drops = _drops_of_this_test()
    others = [b for b in _LEDGER.collected_unclosed if all(b is not d for d in drops)]
    _LEDGER.collected_unclosed.clear()
    _LEDGER.this_test = []
    for built in others:
        warnings.warn(
            f"a CheckpointManager built by {built.test} was dropped without close() and collected during this "
            f"test: close it in that test (`with CheckpointManager(config) as manager:` or try/finally)",
            pytest.PytestWarning,
            stacklevel=1,
        )
    if drops and request.node.get_closest_marker(MARKER) is None:
        pytest.fail(
            f"this test dropped {len(drops)} CheckpointManager(s) without close(): each was collected unclosed and "
            f"its finalizer logged 'was dropped without close()' (in a reference cycle, at whatever later test's "
            f"garbage collection came first, had this check not collected it). Close it: `with "
            f"CheckpointManager(config) as manager:`, a fixture, or try/finally; a test that drops one on purpose "
            f"says so with @pytest.mark.{MARKER}.",
            pytrace=False,
        )
