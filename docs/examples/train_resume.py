"""Train, checkpoint every N steps with retention, and resume from the latest checkpoint after a crash.

    python docs/examples/train_resume.py --root /tmp/run --steps 40 --save-every 5

Kill it at any moment (even `kill -9` during a save) and run the same command again: it resumes from the
newest committed checkpoint and ends bit-identical to a run that was never interrupted, because everything
the next step depends on is in the checkpoint: model, optimizer (momentum buffers), the RNG (dropout) and
the step (which also seeds each step's batch). Retention keeps the last two checkpoints plus the best by
loss; a save killed half-way leaves a temporary directory that the next run's retention pass collects.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from torch_checkpointing import CheckpointManager, RetentionPolicy, latest_checkpoint


def build_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step depends on the step alone, so a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "progress": {"step": step},
    }


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def resume(manager: CheckpointManager, root: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Restore from the newest committed checkpoint under `root`; returns the step to continue from."""
    latest = latest_checkpoint(root)
    if latest is None:
        return 0
    # No into= and no Config.items: every item comes back as the checkpoint recorded it.
    saved = manager.load(latest.path)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    print(f"resumed from {latest.name} (step {latest.step})", flush=True)
    return int(saved["progress"]["step"])


def train(root: str, steps: int, save_every: int, step_delay: float) -> str:
    torch.set_num_threads(1)  # the same kernels in every run: bit-identical results
    model, opt = build_model()
    policy = RetentionPolicy(keep_last=2, keep_best=1, metric="loss")
    with CheckpointManager(CheckpointManager.Config(retention=policy)) as manager:
        start = resume(manager, root, model, opt)
        for step in range(start, steps):
            model.train()
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            done = step + 1
            if done % save_every == 0 or done == steps:
                # Async: returns once the state is staged; the write and the commit overlap the next steps.
                manager.save(f"{root}/step_{done:06d}", state(model, opt, done), metrics={"loss": loss.item()})
                print(f"saving step {done}", flush=True)
            time.sleep(step_delay)
    final = digest(model)
    print(f"final digest {final}", flush=True)
    return final


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", required=True, help="directory holding the run's checkpoints")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step (to kill it)")
    args = parser.parse_args(argv)
    train(args.root, args.steps, args.save_every, args.step_delay)


if __name__ == "__main__":
    main()
