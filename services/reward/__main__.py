"""Run the reward service.

    rlpipe run reward        (or: python -m services.reward)

Configured by RLPIPE_REWARD_* environment variables (see settings.py).
"""

from libs.service import run_service
from libs.settings import settings_or_exit
from services.reward.service import RewardService
from services.reward.settings import RewardSettings


def main() -> None:
    settings = settings_or_exit(RewardSettings)
    run_service(RewardService(settings), settings)


if __name__ == "__main__":
    main()
