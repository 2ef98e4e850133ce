"""Run the trainer service.

    rlpipe run trainer        (or: python -m services.trainer)

Configured by RLPIPE_TRAINER_* environment variables (see settings.py).
"""

from libs.service import IdleService, run_service
from services.trainer.settings import TrainerSettings

IDLE_REASON = (
    "idle: the training loop (consume scored rollouts, GRPO step, publish weights) "
    "arrives with issue #3"
)


def main() -> None:
    run_service(IdleService("trainer", IDLE_REASON), TrainerSettings())


if __name__ == "__main__":
    main()
