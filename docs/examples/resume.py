"""Checkpoint and resume a real model and optimizer with the async preset, on CPU.

Run: python docs/examples/resume.py [checkpoint_root]
"""

from __future__ import annotations

import sys
import tempfile

import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo


def train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, manager: CheckpointManager, root: str, steps: range
) -> None:
    torch.manual_seed(0)
    for step in steps:
        loss = model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        with manager.lock():  # blocks only while a save is copying the state it reads
            optimizer.step()
            optimizer.zero_grad()
        manager.save(
            f"{root}/step_{step}",
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "misc_state": {"step": step},
            },
        )


def main(root: str) -> None:
    config = CheckpointManager.Config.with_async_save()
    config.items = {
        "misc_state": ItemSpec(requires_copy=False, layout=LayoutInfo("misc_{rank}.json", JsonSerialization()))
    }

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointManager(config) as manager:  # close() waits until the last save is durable
        train(model, optimizer, manager, root, range(1, 4))

    # A fresh process would rebuild these from scratch; the checkpoint restores them in place.
    resumed = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    with CheckpointManager(config) as manager:
        restored = manager.load(
            f"{root}/step_3",
            into={
                "model": resumed.state_dict(),
                "optimizer": None,  # a fresh optimizer has no state to fill in place: take the stored one whole
                "misc_state": None,
            },
        )
    resumed_opt.load_state_dict(restored["optimizer"])
    pairs = zip(model.state_dict().values(), resumed.state_dict().values(), strict=True)
    same = all(torch.equal(a, b) for a, b in pairs)
    saved_state, resumed_state = optimizer.state_dict()["state"], resumed_opt.state_dict()["state"]
    same_opt = saved_state.keys() == resumed_state.keys() and all(
        torch.equal(saved_state[i]["exp_avg"], resumed_state[i]["exp_avg"]) for i in saved_state
    )
    print(
        f"resumed at step {restored['misc_state']['step']}; weights identical: {same}; optimizer identical: {same_opt}"
    )


if __name__ == "__main__":  # the async writer is a spawned process that re-imports this module
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
