"""Run the reward service.

    rlpipe run reward        (or: python -m services.reward)

Configured by RLPIPE_REWARD_* environment variables (see settings.py).
"""

from libs.service import IdleService, run_service
from services.reward.settings import RewardSettings

IDLE_REASON = (
    "idle: scoring raw rollouts arrives with issue #3 (verifiable task) and #5 (rubrics, judges)"
)


def main() -> None:
    run_service(IdleService("reward", IDLE_REASON), RewardSettings())


if __name__ == "__main__":
    main()
