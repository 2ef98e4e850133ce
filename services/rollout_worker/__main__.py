"""Run the rollout-worker service.

    rlpipe run rollout-worker        (or: python -m services.rollout_worker)

Configured by RLPIPE_ROLLOUT_WORKER_* environment variables (see settings.py).
"""

from libs.service import run_service
from libs.settings import settings_or_exit
from services.rollout_worker.service import RolloutWorkerService
from services.rollout_worker.settings import RolloutWorkerSettings


def main() -> None:
    settings = settings_or_exit(RolloutWorkerSettings)
    run_service(RolloutWorkerService(settings), settings)


if __name__ == "__main__":
    main()
