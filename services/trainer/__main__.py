"""Run the trainer service.

    rlpipe run trainer        (or: python -m services.trainer)
    torchrun --standalone --nproc-per-node 2 -m services.trainer    # sharded over 2 ranks

Configured by RLPIPE_TRAINER_* environment variables (see settings.py). Under torchrun,
rank 0 is the service (bus, health, metrics) and the other ranks follow it
(libs/trainer/ranks.py).
"""

from libs.service import run_service
from libs.settings import settings_or_exit
from libs.trainer.ranks import die_with_launcher, follow, this_rank, world_size
from libs.trainer.sharded import exit_rank
from services.trainer.service import TrainerService
from services.trainer.settings import TrainerSettings


def main() -> None:
    settings = settings_or_exit(TrainerSettings)
    if world_size() > 1:
        die_with_launcher()
    if this_rank() > 0:
        follow(settings.policy, settings.log_level, settings.log_format)
    else:
        run_service(TrainerService(settings), settings)
    if world_size() > 1:
        exit_rank()  # the process group outlives main (see exit_rank)


if __name__ == "__main__":
    main()
