"""Run the weight-broadcaster service.

    rlpipe run weight-broadcaster        (or: python -m services.weight_broadcaster)

It consumes versions the trainer staged (libs/weights/handoff.py), encodes deltas and
snapshots, stores chunks and announces them (libs/weights/broadcaster.py). Configured by
RLPIPE_WEIGHT_BROADCASTER_* environment variables (see settings.py).
"""

from libs.service import run_service
from libs.settings import settings_or_exit
from services.weight_broadcaster.service import WeightBroadcasterService
from services.weight_broadcaster.settings import WeightBroadcasterSettings


def main() -> None:
    settings = settings_or_exit(WeightBroadcasterSettings)
    run_service(WeightBroadcasterService(settings), settings)


if __name__ == "__main__":
    main()
