"""`python -m torch_checkpointing ...`: the operations CLI (see torch_checkpointing.cli)."""

import sys

from torch_checkpointing.cli import main

sys.exit(main())
