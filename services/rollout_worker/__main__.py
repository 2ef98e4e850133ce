"""Run the rollout-worker service.

    rlpipe run rollout-worker        (or: python -m services.rollout_worker)

Configured by RLPIPE_ROLLOUT_WORKER_* environment variables (see settings.py).
"""

from libs.service import IdleService, run_service
from services.rollout_worker.settings import RolloutWorkerSettings

IDLE_REASON = "idle: rolling out tasks with the hf engine arrives with issue #3"


def main() -> None:
    run_service(IdleService("rollout-worker", IDLE_REASON), RolloutWorkerSettings())


if __name__ == "__main__":
    main()
