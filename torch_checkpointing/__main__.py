"""`python -m torch_checkpointing ...` and the `torch-checkpointing` command: the operations CLI (see
torch_checkpointing.cli)."""

import sys


def run() -> int:
    """The CLI, with a Ctrl-C during its start (importing torch takes seconds) ended as one inside it is: one
    line on stderr and exit code 130, no traceback."""
    try:
        from torch_checkpointing.cli import main
    except KeyboardInterrupt:
        print("torch-checkpointing: interrupted", file=sys.stderr)
        return 128 + 2
    return main()


if __name__ == "__main__":
    sys.exit(run())
