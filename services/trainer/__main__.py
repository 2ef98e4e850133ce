"""Run the trainer service.

    rlpipe run trainer        (or: python -m services.trainer)

Configured by RLPIPE_TRAINER_* environment variables (see settings.py).
"""

from libs.service import run_service
from libs.settings import settings_or_exit
from services.trainer.service import TrainerService
from services.trainer.settings import TrainerSettings


def main() -> None:
    settings = settings_or_exit(TrainerSettings)
    run_service(TrainerService(settings), settings)


if __name__ == "__main__":
    main()
