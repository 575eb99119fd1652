"""requires_copy: staging copies for async saves, the bypass, the pickling requirement."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from conformance.helpers import WRITE_TIMEOUT_S, Where, layout, save, spec

clause = pytest.mark.clause
Factory = Callable[..., Any]
BIG = 1 << 22  # 16 MiB of float32: large enough that a lazy copy would still be running


class NoDeepCopy(dict):  # type: ignore[type-arg]
    """Picklable, JSON-serializable, but refuses copy.deepcopy."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError("NoDeepCopy refuses deepcopy")


class Unpicklable(dict):  # type: ignore[type-arg]
    """JSON-serializable and deep-copyable, but not picklable (so only the async pickling rule can fail it).

    ``copy.deepcopy`` of a dict subclass falls back to ``__reduce_ex__``; without ``__deepcopy__`` the
    staging copy of ``requires_copy=True`` would fail first, and COPY-PICKLE-2 would pass on a backend
    that never asks for pickling.
    """

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("Unpicklable refuses pickling")

    def __deepcopy__(self, memo: dict[int, Any]) -> Unpicklable:
        return Unpicklable(copy.deepcopy(dict(self), memo))


def _wait(result: Any) -> None:
    if isinstance(result, Future):
        result.result(timeout=WRITE_TIMEOUT_S)


@clause("COPY-STAGE-1")
def test_async_copy_isolates_tensors(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"model": spec()}, mode="async")
    big = torch.zeros(BIG)
    result = m.save(str(ckpt_root / "c"), {"model": {"w": big}})
    big.add_(1.0)  # the training loop's in-place update, right after save() returns
    _wait(result)
    out = m.load(str(ckpt_root / "c"), into={"model": {"w": torch.empty(BIG)}})
    assert torch.count_nonzero(out["model"]["w"]).item() == 0, "in-place mutation after save() leaked in"


@clause("COPY-STAGE-2")
def test_every_async_save_isolates_the_live_value(manager_factory: Factory, ckpt_root: Where) -> None:
    """The staging copy is owed on every save of a job, not only the first (which may wait for a writer to
    start): successive saves, never waited on, each hold the value as it was when their save() was called."""
    m = manager_factory({"model": spec()}, mode="async")
    w, hist = torch.zeros(BIG), [0]
    results = []
    for step in range(4):
        w.fill_(float(step))
        hist[0] = step
        results.append(m.save(str(ckpt_root / f"s{step}"), {"model": {"w": w, "hist": hist}}))
        w.fill_(-1.0)  # the training loop's in-place update, right after save() returns
        hist[0] = -1
    for result in results:
        _wait(result)
    for step in range(4):
        out = m.load(str(ckpt_root / f"s{step}"), into={"model": {"w": torch.empty(BIG), "hist": [0]}})["model"]
        leaked = torch.count_nonzero(out["w"] != float(step)).item()
        assert leaked == 0, f"save {step}: {leaked} elements are not the value at save() (mutation leaked in)"
        assert list(out["hist"]) == [step], f"save {step}: nested list holds {list(out['hist'])}"


@clause("COPY-STAGE-3")
def test_staging_copies_whatever_the_layout(manager_factory: Factory, ckpt_root: Where) -> None:
    """ "staging deep-copies the value" is a property of `requires_copy`, not of the file the value goes to: a
    safetensors item's tensor and a JSON item's nested containers, mutated in place right after `save()`
    returns, leave the checkpoint as it was at `save()`."""
    items = {
        "st": spec(layout=layout("st.safetensors", "SafetensorsSerialization")),
        "js": spec(layout=layout("js.json", "JsonSerialization")),
    }
    m = manager_factory(items, mode="async")
    big = torch.zeros(BIG)
    hist, cfg = [1, 2], {"lr": 0.1}
    live = {"hist": hist, "cfg": cfg, "pad": list(range(200_000))}
    result = m.save(str(ckpt_root / "c"), {"st": {"w": big}, "js": live})
    big.add_(1.0)
    hist.append(3)
    cfg["lr"] = 0.2
    _wait(result)
    out = m.load(str(ckpt_root / "c"), into={"st": {"w": torch.empty(BIG)}, "js": None})
    assert torch.count_nonzero(out["st"]["w"]).item() == 0, "safetensors item: mutation after save() leaked in"
    assert out["js"]["hist"] == [1, 2] and out["js"]["cfg"] == {"lr": 0.1}, "JSON item: mutation leaked in"


@clause("COPY-DEEP-1")
def test_async_copy_is_deep(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"model": spec()}, mode="async")
    hist, cfg = [1, 2], {"lr": 0.1}
    live = {"hist": hist, "cfg": cfg, "pad": list(range(200_000))}
    result = m.save(str(ckpt_root / "c"), {"model": live})
    hist.append(3)
    cfg["lr"] = 0.2
    _wait(result)
    out = m.load(str(ckpt_root / "c"), into={"model": None})
    assert list(out["model"]["hist"]) == [1, 2], "nested list mutation leaked in (copy was not deep)"
    assert out["model"]["cfg"] == {"lr": 0.1}, "nested dict mutation leaked in (copy was not deep)"


@clause("COPY-HOST-1")
def test_device_tensors_are_staged_to_host(manager_factory: Factory, ckpt_root: Where) -> None:
    if not torch.cuda.is_available():
        pytest.skip("capability missing: CUDA (COPY-HOST-1 is about device tensors)")
    m = manager_factory({"model": spec()}, mode="async")
    w = torch.zeros(BIG, device="cuda")
    result = m.save(str(ckpt_root / "c"), {"model": {"w": w}})
    w.add_(1.0)
    _wait(result)
    out = m.load(str(ckpt_root / "c"), into={"model": {"w": torch.empty(BIG)}})
    assert torch.count_nonzero(out["model"]["w"]).item() == 0


@clause("COPY-BYPASS-1")
def test_bypass_leaves_the_value_unchanged(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"snap": spec(requires_copy=False)}, mode="async")
    t = torch.arange(1024.0)
    ptr, shared = t.untyped_storage().data_ptr(), t.untyped_storage().is_shared()
    save(m, ckpt_root / "c", {"snap": {"t": t}})
    ptr_after, shared_after = t.untyped_storage().data_ptr(), t.untyped_storage().is_shared()
    assert ptr_after == ptr, "the saved tensor's storage was replaced"
    assert shared_after == shared, "the saved tensor was moved into shared memory"
    assert torch.equal(t, torch.arange(1024.0))


@clause("COPY-BYPASS-2")
def test_bypass_does_not_deep_copy(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory(
        {"snap": spec(requires_copy=False, layout=layout("snap_{rank}.json", "JsonSerialization"))}, mode="async"
    )
    save(m, ckpt_root / "c", {"snap": NoDeepCopy(epoch=2, offset=40)})
    assert m.load(str(ckpt_root / "c"), into={"snap": None})["snap"] == {"epoch": 2, "offset": 40}


@clause("CONFIG-DEFAULT-4")
def test_default_requires_copy_false_applies_to_unlisted_keys(manager_factory: Factory, ckpt_root: Where) -> None:
    """ "Config.default is the spec applied to any key not listed there": a default of `requires_copy=False`
    makes an un-listed value bypass staging, so a picklable value that refuses `copy.deepcopy` saves async."""
    default = spec(requires_copy=False, layout=layout("snap_{rank}.json", "JsonSerialization"))
    m = manager_factory({}, default=default, mode="async")
    save(m, ckpt_root / "c", {"snap": NoDeepCopy(epoch=2, offset=40)})
    assert m.load(str(ckpt_root / "c"), into={"snap": None})["snap"] == {"epoch": 2, "offset": 40}


@clause("COPY-STABLE-1")
def test_bypass_value_stable_until_write_completes(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory({"snap": spec(requires_copy=False)}, mode="async")
    t = torch.full((256,), 3.0)
    save(m, ckpt_root / "c", {"snap": {"t": t, "pos": 5}})  # waits for the write Future
    t.fill_(-1.0)
    out = m.load(str(ckpt_root / "c"), into={"snap": {"t": torch.empty(256), "pos": 0}})
    assert torch.equal(out["snap"]["t"], torch.full((256,), 3.0)) and out["snap"]["pos"] == 5


@clause("COPY-PICKLE-1")
def test_async_requires_pickle_without_copy(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory(
        {"snap": spec(requires_copy=False, layout=layout("snap_{rank}.json", "JsonSerialization"))}, mode="async"
    )
    with pytest.raises(Exception):
        save(m, ckpt_root / "c", {"snap": Unpicklable(a=1)})


@clause("COPY-PICKLE-2")
def test_async_requires_pickle_with_copy(manager_factory: Factory, ckpt_root: Where) -> None:
    m = manager_factory(
        {"snap": spec(requires_copy=True, layout=layout("snap_{rank}.json", "JsonSerialization"))}, mode="async"
    )
    value = Unpicklable(a=1)
    assert copy.deepcopy(value) == value, "premise: the value is deep-copyable (staging can copy it)"
    with pytest.raises(TypeError):
        pickle.dumps(value)
    with pytest.raises(Exception):
        save(m, ckpt_root / "c", {"snap": value})


@clause("COPY-SYNC-1")
@pytest.mark.parametrize("requires_copy", [True, False])
def test_sync_save_is_complete_on_return(manager_factory: Factory, ckpt_root: Where, requires_copy: bool) -> None:
    m = manager_factory({"model": spec(requires_copy=requires_copy)}, mode="sync")
    w = torch.zeros(4096)
    m.save(str(ckpt_root / "c"), {"model": {"w": w}})  # not waited on: a sync save is done when it returns
    w.add_(5.0)
    out = m.load(str(ckpt_root / "c"), into={"model": {"w": torch.empty(4096)}})
    assert torch.count_nonzero(out["model"]["w"]).item() == 0
