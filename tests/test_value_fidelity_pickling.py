"""`pickling.dumps_out_of_band`: what a requires_copy=False value travels to the async writer process as (a
header and its tensors' bytes), read back whole there, for every dtype a Torch file holds.

Plain `pickle.dumps` of a tensor of dtype uint16/32/64, a float8 type, complex32 or a bits type gives bytes that
`pickle.loads` cannot read (torch's legacy storage loader has no class for them): an async save of such an item
failed in the writer with a bare AttributeError, where a sync save kept it. These tests pin the helper the
saver's `_pickle_item` calls.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import torch

from tests.test_value_fidelity_harness import TORCH_DTYPES, Gen, tensor_bits
from torch_checkpointing.pickling import OutOfBand, dumps_out_of_band


def _as_sent(value: object) -> tuple[bytes, list[int], list[bytes]]:
    """What the writer process receives for `value`: the header, the buffer sizes and the buffers' bytes."""
    sent, views, _ = dumps_out_of_band(value)
    return sent.header, sent.sizes, [bytes(v) for v in views]


_READ_BACK = """
import pickle, sys, torch
from torch_checkpointing.pickling import OutOfBand
header, sizes, buffers = pickle.loads(open(sys.argv[1], "rb").read())
value = OutOfBand(header, sizes, [bytearray(b) for b in buffers]).loads()
torch.save({"value": value, "tied": value["a"] is value["b"]}, sys.argv[2])
"""


def test_every_dtype_a_torch_file_holds_travels_to_another_process_whole(tmp_path: Path) -> None:
    g = Gen(7, TORCH_DTYPES)
    value = {}
    for dtype in TORCH_DTYPES:
        t = g.bits((3, 2), dtype)
        value[str(dtype)] = {"t": t, "view": t.t(), "empty": g.bits((0,), dtype)}
    value["a"] = value["b"] = g.bits((2,), torch.uint16)
    (tmp_path / "in.pkl").write_bytes(pickle.dumps(_as_sent(value)))
    subprocess.run(
        [sys.executable, "-c", _READ_BACK, str(tmp_path / "in.pkl"), str(tmp_path / "out.pt")], check=True, timeout=120
    )
    back = torch.load(tmp_path / "out.pt", weights_only=False)
    assert back["tied"], "one tensor under two keys came back as two"
    for dtype in TORCH_DTYPES:
        for k, t in value[str(dtype)].items():
            got = back["value"][str(dtype)][k]
            assert got.dtype == dtype and got.shape == t.shape and tensor_bits(got) == tensor_bits(t), (dtype, k)


def test_it_changes_nothing_of_the_callers_and_pickles_other_values_plainly() -> None:
    t = torch.ones(3, dtype=torch.float8_e4m3fn)
    value = {"t": t, "n": [1, "x", None], "p": torch.nn.Parameter(torch.ones(2))}
    header, sizes, buffers = _as_sent(value)
    back = OutOfBand(header, sizes, [bytearray(b) for b in buffers]).loads()
    assert not t.is_shared() and back["n"] == [1, "x", None]
    assert type(back["p"]) is torch.nn.Parameter and back["p"].requires_grad
    assert tensor_bits(back["t"]) == tensor_bits(t)
