"""Round 17: loads never return wrong data. Neighbours of issue 10's points that earlier fixes missed.

Each test failed on the code before its fix.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.cli import main as cli_main
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import export_hf
from torch_checkpointing.schema import ItemSpec


def _manager(items: dict[str, ItemSpec] | None = None, **load: Any) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            items=items or {}, save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig(**load)
        )
    )


@pytest.fixture
def mgr() -> Iterator[CheckpointManager]:
    m = _manager()
    yield m
    m.close()


def _edit_manifest(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    d = json.loads((root / "manifest.json").read_text())
    edit(d)
    (root / "manifest.json").write_text(json.dumps(d))


# ------------------------------------------------------------ 1. a recorded format no load reads


_BAD_FORMATS = [
    {"type": "Bogus"},
    {"type": None},
    {"type": "SafetensorsSerialization", "metadata": 5},
    {"type": "SafetensorsSerialization", "metadata": {"a": 1}},
]


@pytest.mark.parametrize("fmt", _BAD_FORMATS, ids=["unknown", "null", "metadata-int", "metadata-value-int"])
def test_a_load_without_templates_refuses_a_recorded_format_naming_the_manifest_field(
    mgr: CheckpointManager, tmp_path: Path, fmt: dict[str, Any]
) -> None:
    """The self-describing load turned the record into a format with the config's parser: a bare `ConfigError`
    ("Unknown SerializationFormat type"), a caller's error that named no file, for a damaged manifest."""
    root = tmp_path / "ck"
    mgr.save(str(root), {"model": {"w": torch.ones(3)}})
    _edit_manifest(root, lambda d: d["items"]["model"]["0"].update(format=fmt))
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json: field 'items\.model\.0\.format'.*model_0\.pt"):
        mgr.load(str(root))


def test_export_and_diff_refuse_a_recorded_format_naming_the_manifest_field(
    mgr: CheckpointManager, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`export --to hf` and `diff` read the record the same way and raised the same bare `ConfigError`."""
    root, other = tmp_path / "ck", tmp_path / "other"
    mgr.save(str(root), {"model": {"w": torch.ones(3)}})
    mgr.save(str(other), {"model": {"w": torch.ones(3)}})
    _edit_manifest(root, lambda d: d["items"]["model"]["0"].update(format={"type": "Bogus"}))
    with pytest.raises(CorruptCheckpointError, match=r"field 'items\.model\.0\.format'"):
        export_hf(str(root), "model", str(tmp_path / "out"))
    assert cli_main(["diff", str(root), str(other)]) == 2
    assert "field 'items.model.0.format'" in capsys.readouterr().err


# ------------------------------------------------------------ 2. import_hf: every template and shard checked first


def _hf_dir(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.ones(3), "b": torch.full((3,), 2.0)}, str(hf / "model.safetensors"))
    return hf


def _inference_zeros() -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(3)


@pytest.mark.parametrize(
    "second",
    [lambda: torch.zeros(1).expand(3), lambda: torch.empty(3, device="meta"), _inference_zeros],
    ids=["expanded-view", "meta", "inference"],
)
def test_import_hf_refuses_a_template_it_cannot_fill_before_copying_anything(
    tmp_path: Path, second: Callable[[], torch.Tensor]
) -> None:
    """The loader's template checks were not made: an expanded view or an inference tensor failed in copy_() with
    a bare RuntimeError after 'a' had been filled, and a meta template was returned unfilled, silently."""
    from torch_checkpointing.errors import TemplateMismatchError
    from torch_checkpointing.hf import import_hf

    first = torch.zeros(3)
    with pytest.raises(TemplateMismatchError, match=r"'b'"):
        import_hf(_hf_dir(tmp_path), into={"a": first, "b": second()})
    assert torch.equal(first, torch.zeros(3)), "'a' was filled before the refusal"


def test_import_hf_refuses_tied_template_entries_that_receive_different_values(tmp_path: Path) -> None:
    """Two entries sharing one tensor were filled one after the other: the last copy won silently."""
    from torch_checkpointing.errors import TemplateMismatchError
    from torch_checkpointing.hf import import_hf

    hf = _hf_dir(tmp_path)
    tied = torch.zeros(3)
    with pytest.raises(TemplateMismatchError, match=r"share memory"):
        import_hf(hf, into={"a": tied, "b": tied})
    assert torch.equal(tied, torch.zeros(3))
    from safetensors.torch import save_file

    save_file({"a": torch.ones(3), "b": torch.ones(3)}, str(hf / "model.safetensors"))
    assert torch.equal(import_hf(hf, into={"a": tied, "b": tied})["a"], torch.ones(3))  # equal values: fine


def _dup_header(path: Path) -> None:
    """Rewrite the shard's header to name 'a' twice: first as its F32 bytes, then as the same bytes read as I32."""
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    first = json.dumps(header["a"])
    second = json.dumps({**header["a"], "dtype": "I32"})
    text = ('{"a":' + first + ',"a":' + second + ',"b":' + json.dumps(header["b"]) + "}").encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


@pytest.mark.parametrize(
    "damage",
    ["truncated", "garbage", "name-twice", "index-names-absent-tensor"],
)
def test_import_hf_refuses_a_damaged_shard_naming_it(tmp_path: Path, damage: str) -> None:
    """A truncated or crafted shard raised safetensors' bare `SafetensorError` (no file named); a header naming a
    tensor twice was read as its last entry (an int32 view of float bytes); an index naming a tensor its shard
    lacks raised it too (an import without templates left it out of the result, silently)."""
    from torch_checkpointing.hf import INDEX_FILE_NAME, import_hf

    hf = _hf_dir(tmp_path)
    shard = hf / "model.safetensors"
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-4])
    elif damage == "garbage":
        shard.write_bytes(b"\x00\x01\x02")
    elif damage == "name-twice":
        _dup_header(shard)
    else:
        index = {"metadata": {}, "weight_map": dict.fromkeys(["a", "b", "c"], "model.safetensors")}
        (hf / INDEX_FILE_NAME).write_text(json.dumps(index))
    template = torch.zeros(3)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors|'c'"):
        import_hf(hf, into={"a": template, "c": torch.zeros(3)} if damage.startswith("index") else {"a": template})
    assert torch.equal(template, torch.zeros(3))
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors|'c'"):
        import_hf(hf)


def test_import_hf_refuses_a_shard_holding_a_tensor_the_index_places_elsewhere(tmp_path: Path) -> None:
    """Without templates every tensor of every shard was returned, so a tensor in two shards came back as the one
    in the shard last in name order, whatever the index said (a templated import read the index's)."""
    from safetensors.torch import save_file

    from torch_checkpointing.hf import INDEX_FILE_NAME, import_hf

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.ones(3)}, str(hf / "m-1.safetensors"))
    save_file({"a": torch.full((3,), 9.0), "b": torch.zeros(1)}, str(hf / "m-2.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}
    (hf / INDEX_FILE_NAME).write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=r"m-2\.safetensors holds tensor 'a'.*places it in 'm-1"):
        import_hf(hf)
    save_file({"b": torch.zeros(1)}, str(hf / "m-2.safetensors"))
    assert torch.equal(import_hf(hf)["a"], torch.ones(3))


# ------------------------------------------------------------ 3. a resharding source safetensors refuses


def _forge_file(root: Path, rel: str, data: bytes) -> None:
    """Replace a file and forge its manifest record to match (an attacker controls both)."""
    import zlib

    (root / rel).write_bytes(data)

    def forge(d: dict[str, Any]) -> None:
        for per_rank in d["items"].values():
            for rec in per_rank.values():
                if rec["path"] == rel:
                    rec.update(size=len(data), crc32=zlib.crc32(data))
                    rec.pop("blocks", None)

    _edit_manifest(root, forge)


def test_a_resharding_load_refuses_a_safetensors_source_safetensors_cannot_open(tmp_path: Path) -> None:
    """safetensors' own `SafetensorError` (no ValueError) was not among the decode errors, so a resharding load
    of a source with bytes past its last tensor raised it bare, naming no file (a direct load named it)."""
    import warnings

    from tests.test_verified_loads import AlwaysReshard
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization

    spec = ItemSpec(layout=LayoutInfo("m_{rank}.safetensors", SafetensorsSerialization()), resharder=AlwaysReshard())
    m = _manager({"m": spec})
    root = tmp_path / "ck"
    template = torch.zeros(16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.save(str(root), {"m": {"w": torch.arange(16.0)}})
        _forge_file(root, "m_0.safetensors", (root / "m_0.safetensors").read_bytes() + b"xx")
        # Named with the file; since round 25 the engine's own header check (the library's rules) says why.
        with pytest.raises(CorruptCheckpointError, match=r"m_0\.safetensors.*(SafetensorError|no tensor covers)"):
            m.load(str(root), into={"m": {"w": template}})
    m.close()
    assert torch.equal(template, torch.zeros(16))


# ------------------------------------------------------------ 4. a custom resharder's damage before any other copy


def test_a_custom_resharder_meeting_damage_raises_before_any_other_item_is_copied(tmp_path: Path) -> None:
    """A custom resharder's `load` reads its source in the copy phase (the check phase cannot know what it will
    read), and it ran in item order: its CRC32 failure came after item 'aaa' had been copied into its template."""
    import warnings

    from tests.test_verified_loads import WholeFileResharder, _flip, _offset_of

    m = _manager({"model": ItemSpec(resharder=WholeFileResharder()), "aaa": ItemSpec(), "zzz": ItemSpec()})
    root = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.save(
            str(root), {"model": {"w": torch.arange(4096.0)}, "aaa": {"x": torch.ones(3)}, "zzz": {"x": torch.ones(3)}}
        )
        a, z, w = torch.zeros(3), torch.zeros(3), torch.zeros(4096)
        loaded = m.load(str(root), into={"aaa": {"x": a}, "model": {"w": w}, "zzz": {"x": z}})
        assert list(loaded) == ["aaa", "model", "zzz"]  # the items' order, whatever the copy order
        assert torch.equal(a, torch.ones(3)) and torch.equal(w, torch.arange(4096.0))
        path = root / "model_0.pt"
        _flip(path, _offset_of(path.read_bytes(), torch.arange(100, 104, dtype=torch.float32).numpy().tobytes()) + 2)
        a, z, w = torch.zeros(3), torch.zeros(3), torch.zeros(4096)
        with pytest.raises(CorruptCheckpointError, match=r"model_0\.pt.*CRC32"):
            m.load(str(root), into={"aaa": {"x": a}, "model": {"w": w}, "zzz": {"x": z}})
    m.close()
    assert torch.equal(a, torch.zeros(3)), "item 'aaa' was restored before the refusal"
    assert torch.equal(z, torch.zeros(3)) and torch.equal(w, torch.zeros(4096))


def test_a_strict_load_refuses_what_a_custom_resharder_could_not_fill_before_other_items_are_copied(
    tmp_path: Path,
) -> None:
    """strict=True refused the paths a custom resharder reported unfilled only once every item had been copied."""
    import warnings

    from tests.test_verified_loads import WholeFileResharder
    from torch_checkpointing.errors import TemplateMismatchError

    class Unfilled(WholeFileResharder):
        def load(self, *args: Any) -> list[Any]:
            super().load(*args)
            return [("not_there",)]

    m = _manager({"model": ItemSpec(resharder=Unfilled()), "aaa": ItemSpec()})
    root = tmp_path / "ck"
    a, w = torch.zeros(3), torch.zeros(4096)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.save(str(root), {"model": {"w": torch.arange(4096.0)}, "aaa": {"x": torch.ones(3)}})
        with pytest.raises(TemplateMismatchError, match=r"model::not_there.*no other item"):
            m.load(str(root), into={"aaa": {"x": a}, "model": {"w": w}}, strict=True)
    m.close()
    assert torch.equal(a, torch.zeros(3)), "item 'aaa' was restored before the refusal"


# ------------------------------------------------------------ 5. an optional item held under another path


@pytest.mark.parametrize("strict", [False, True])
def test_an_optional_item_held_under_another_layout_is_refused_not_dropped(tmp_path: Path, strict: bool) -> None:
    """`required=False` excuses a rank without a copy of an item. A load whose layout missed this rank's own copy
    (saved to `sub/opt_0.pt`, read at `opt_0.pt`) took it for one: the item was left out of the result and its
    template unrestored, with no warning, even under strict=True."""
    from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
    from torch_checkpointing.errors import TemplateMismatchError

    saver = _manager({"opt": ItemSpec(layout=LayoutInfo("sub/opt_{rank}.pt", TorchSerialization()), required=False)})
    root = tmp_path / "ck"
    saver.save(str(root), {"opt": {"x": torch.ones(3)}})
    saver.close()
    m = _manager({"opt": ItemSpec(required=False)})
    x = torch.zeros(3)
    with pytest.raises(TemplateMismatchError, match=r"'opt' of rank 0 in file 'sub/opt_0\.pt'.*reads 'opt_0\.pt'"):
        m.load(str(root), into={"opt": {"x": x}}, strict=strict)
    with pytest.raises(TemplateMismatchError, match=r"sub/opt_0\.pt"):
        m.load(str(root))  # into=None: every configured item
    m.close()


# ------------------------------------------------------------ 6. one template container reached at two places


def test_one_template_container_at_two_places_with_different_saved_values_is_refused(
    mgr: CheckpointManager, tmp_path: Path
) -> None:
    """Template dicts and lists are filled in place. One object passed for two items (or under two keys) was
    filled twice, and the load returned the second saved value at both places, silently: item 'a' came back
    holding item 'b''s values. (Tensors sharing memory were already refused; containers were not.)"""
    from torch_checkpointing.errors import TemplateMismatchError

    root = tmp_path / "ck"
    mgr.save(str(root), {"a": {"n": 1, "l": [1, 2]}, "b": {"n": 2, "l": [3, 4]}, "x": {"p": [1], "q": [2]}})
    shared = {"n": 0, "l": [0, 0]}
    with pytest.raises(TemplateMismatchError, match=r"a and b are one dict"):
        mgr.load(str(root), into={"a": shared, "b": shared})
    assert shared == {"n": 0, "l": [0, 0]}
    tied: list[int] = [0]
    with pytest.raises(TemplateMismatchError, match=r"x::p and x::q are one list"):
        mgr.load(str(root), into={"x": {"p": tied, "q": tied}})
    assert tied == [0]


def test_one_template_container_at_two_places_with_equal_saved_values_loads(
    mgr: CheckpointManager, tmp_path: Path
) -> None:
    """The same value saved at both places (a pickle keeps such sharing; or two equal items) fills it once."""
    root = tmp_path / "ck"
    inner = {"w": torch.arange(3.0), "n": [1, 2]}
    mgr.save(str(root), {"a": {"p": inner, "q": inner}, "b": {"w": torch.arange(3.0), "n": [1, 2]}})
    shared = {"w": torch.zeros(3), "n": [0, 0]}
    loaded = mgr.load(str(root), into={"a": {"p": shared, "q": shared}, "b": shared})
    assert loaded["a"]["p"] is shared and torch.equal(shared["w"], torch.arange(3.0)) and shared["n"] == [1, 2]


# ------------------------------------------------------------ 7. a load without templates at another world size


def test_a_load_without_templates_of_per_rank_files_at_another_world_size_is_a_checkpoint_error(
    mgr: CheckpointManager, tmp_path: Path
) -> None:
    """The same refusal with templates is a TemplateMismatchError; without them it was a bare ValueError, which a
    caller falling back on `except CheckpointError` did not catch."""
    import shutil

    from torch_checkpointing.errors import TemplateMismatchError

    root = tmp_path / "ck"
    mgr.save(str(root), {"model": {"w": torch.ones(3)}})
    shutil.copy(root / "model_0.pt", root / "model_1.pt")  # as two ranks save it

    def two_ranks(d: dict[str, Any]) -> None:
        d["world_size"] = 2
        d["items"]["model"]["1"] = {**d["items"]["model"]["0"], "rank": 1, "path": "model_1.pt"}

    _edit_manifest(root, two_ranks)
    with pytest.raises(TemplateMismatchError, match=r"per-rank files by 2 rank\(s\) and this job has 1"):
        mgr.load(str(root))


def test_import_hf_names_the_tensors_the_template_did_not_receive(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A template without one of the directory's tensors imported the others and left it out, silently (a load
    names what it did not restore)."""
    import logging

    from torch_checkpointing.hf import import_hf

    hf = _hf_dir(tmp_path)
    a = torch.zeros(3)
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        import_hf(hf, into={"a": a})
    assert torch.equal(a, torch.ones(3))
    said = [r.getMessage() for r in caplog.records if r.name.startswith("torch_checkpointing")]
    assert any("not in the template" in m and "'b'" in m for m in said), said


# ------------------------------------------------------------ 8. JSON fields the declared class has no field for


@dataclasses.dataclass
class _NewCfg:
    lr: float
    names: list[str]


@dataclasses.dataclass
class _OldCfg:
    lr: float


def test_json_fields_the_declared_class_lacks_are_named_and_refused_by_a_strict_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A JSON item rebuilt with a class lacking one of its saved fields dropped that field, silently, even under
    strict=True (which refuses entries the template lacks)."""
    import logging

    from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo
    from torch_checkpointing.errors import TemplateMismatchError

    def spec(cls: type) -> dict[str, ItemSpec]:
        return {"cfg": ItemSpec(layout=LayoutInfo("cfg.json", JsonSerialization(cls=cls)))}

    root = tmp_path / "ck"
    saver = _manager(spec(_NewCfg))
    saver.save(str(root), {"cfg": _NewCfg(0.1, ["a"])})
    saver.close()
    m = _manager(spec(_OldCfg))
    with pytest.raises(TemplateMismatchError, match=r"cfg::names"):
        m.load(str(root), strict=True)
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        assert m.load(str(root))["cfg"] == _OldCfg(0.1)  # still ignored (API_SURFACE), now named
    m.close()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("torch_checkpointing")]
    assert any("cfg::names" in s and "not restored" in s for s in said), said


@dataclasses.dataclass
class _GrownCfg:
    lr: float
    names: list[str] = dataclasses.field(default_factory=list)
    depth: int | None = None
    derived: float = dataclasses.field(init=False, default=0.0)


def test_json_fields_the_checkpoint_lacks_are_named_and_refused_by_a_strict_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fields of the declared class the JSON lacks took their default (None if optional), silently, even under
    strict=True (which refuses template entries the checkpoint lacks). A field(init=False), written by the save
    and rebuilt by the class, is neither."""
    import logging

    from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo
    from torch_checkpointing.errors import TemplateMismatchError

    def spec(cls: type) -> dict[str, ItemSpec]:
        return {"cfg": ItemSpec(layout=LayoutInfo("cfg.json", JsonSerialization(cls=cls)))}

    root = tmp_path / "ck"
    saver = _manager(spec(_OldCfg))
    saver.save(str(root), {"cfg": _OldCfg(0.1)})
    saver.close()
    m = _manager(spec(_GrownCfg))
    with pytest.raises(TemplateMismatchError, match=r"cfg::names.*cfg::depth"):
        m.load(str(root), strict=True)
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        assert m.load(str(root))["cfg"] == _GrownCfg(0.1)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("torch_checkpointing")]
    assert any("cfg::names" in s and "cfg::depth" in s for s in said), said
    m.save(str(tmp_path / "same"), {"cfg": _GrownCfg(0.2, ["a"], 3)})
    assert m.load(str(tmp_path / "same"), strict=True)["cfg"] == _GrownCfg(0.2, ["a"], 3)  # a round trip: no gap
    m.close()


def test_one_template_container_in_a_resharded_item_and_another_place_is_refused(tmp_path: Path) -> None:
    """A resharded item's tensor-free entries are merged into the template in place too: one list under two of
    its keys, or shared with another item, came back holding the values saved at the last place filled."""
    import warnings

    from tests.test_verified_loads import AlwaysReshard
    from torch_checkpointing.errors import TemplateMismatchError

    m = _manager({"model": ItemSpec(resharder=AlwaysReshard()), "aaa": ItemSpec()})
    root = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.save(str(root), {"model": {"w": torch.arange(8.0), "p": [1], "q": [2]}, "aaa": {"r": [3]}})
        shared = [0]
        w = torch.zeros(8)
        with pytest.raises(TemplateMismatchError, match=r"model::p and model::q are one list"):
            m.load(str(root), into={"model": {"w": w, "p": shared, "q": shared}, "aaa": {"r": [0]}})
        with pytest.raises(TemplateMismatchError, match=r"model::p and aaa::r are one list"):
            m.load(str(root), into={"model": {"w": w, "p": shared, "q": [0]}, "aaa": {"r": shared}})
    m.close()
    assert shared == [0] and torch.equal(w, torch.zeros(8))
