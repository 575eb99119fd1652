"""A config's once-only warning is noted as given only where it was given (as Python's filters decide it),
and only on that config object.

`config.warn_once` notes each warning on the config so that the managers built from it do not repeat it. The note
was taken even where a filter in force ignored the warning (a config built inside `warnings.catch_warnings()` with
"ignore", as a library wrapping it does): every later check was quiet, so the user, whose own filters show it, was
never told (Python itself forgets what a filter ignored once the filters change). And a `copy.copy` of a config
shared its note: a field warned about on the copy was taken as said on the original, whose own edit of it was
never told.
"""

from __future__ import annotations

import copy
import warnings

from torch_checkpointing.config import CheckpointWriterConfig, recheck, snapshot

_TIMEOUT = "checkpoint_write_barrier_timeout_sec is ignored"


def _told(caught: list[warnings.WarningMessage], said: str) -> int:
    return sum(1 for w in caught if issubclass(w.category, FutureWarning) and said in str(w.message))


def test_a_warning_ignored_by_a_filter_is_given_at_the_next_check_outside_it() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recheck(config)
        recheck(config)
    assert _told(caught, _TIMEOUT) == 1


def test_a_warning_ignored_for_its_category_only_is_given_once_that_filter_is_gone() -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*barrier_timeout")
        config = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recheck(config)
    assert _told(caught, _TIMEOUT) == 1


def test_a_warning_ignored_for_the_users_module_only_is_given_once_that_filter_is_gone() -> None:
    """The filter is matched against the user's line, where the warning is given, as `warnings` matches it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=__name__)
        config = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recheck(config)
    assert _told(caught, _TIMEOUT) == 1


def test_a_shown_warning_is_not_repeated() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=5)
        recheck(config)
    assert _told(caught, _TIMEOUT) == 1


def test_a_copy_warned_about_a_field_leaves_the_original_to_be_told_of_its_own_edit() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        original = CheckpointWriterConfig(barrier_config=object())
        duplicate = copy.copy(original)
        duplicate.checkpoint_write_barrier_timeout_sec = 7
        recheck(duplicate)
        original.checkpoint_write_barrier_timeout_sec = 9
        recheck(original)
    assert _told(caught, _TIMEOUT) == 2
    # a user's copy is a new object (as a `dataclasses.replace` is): told at its own check, once
    assert _told(caught, "barrier_config is ignored") == 2


def test_a_snapshot_keeps_what_was_said_before_it() -> None:
    """The copy a manager builds its parts from (`snapshot`) is checked again: it says nothing said already."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        original = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=5)
        recheck(snapshot(original))
        recheck(snapshot(snapshot(original)))
    assert _told(caught, _TIMEOUT) == 1
