"""The command that starts the trainer service as N ranks, for every launcher (`rlpipe demo
--trainer-ranks N`, `rlpipe ray up --trainer-ranks N`). Imports nothing heavy: launchers build
their parsers without torch.

    trainer_command(1)   # python -m services.trainer
    trainer_command(2)   # python -m torch.distributed.run --standalone --nproc-per-node 2 ...

N > 1 runs the sharded trainer on this node (libs/trainer/ranks.py): torchrun's standalone
rendezvous on a free local port, one process per rank; rank 0 is the service.
"""

from __future__ import annotations

import sys

TRAINER_MODULE = "services.trainer"


def trainer_command(num_ranks: int, python: str = sys.executable) -> list[str]:
    """argv of the trainer service as `num_ranks` processes on one node."""
    if num_ranks < 1:
        raise ValueError(f"trainer ranks must be >= 1 (got {num_ranks})")
    if num_ranks == 1:
        return [python, "-m", TRAINER_MODULE]
    torchrun = [python, "-m", "torch.distributed.run", "--standalone"]
    return [*torchrun, "--nproc-per-node", str(num_ranks), "-m", TRAINER_MODULE]
