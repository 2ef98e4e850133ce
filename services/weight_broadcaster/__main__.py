"""Run the weight-broadcaster service.

    rlpipe run weight-broadcaster        (or: python -m services.weight_broadcaster)

Configured by RLPIPE_WEIGHT_BROADCASTER_* environment variables (see settings.py).
"""

from libs.service import IdleService, run_service
from services.weight_broadcaster.settings import WeightBroadcasterSettings

IDLE_REASON = (
    "idle: the delta transport over the bus arrives with issue #4 (the codec exists: "
    "rlpipe weights)"
)


def main() -> None:
    run_service(IdleService("weight-broadcaster", IDLE_REASON), WeightBroadcasterSettings())


if __name__ == "__main__":
    main()
