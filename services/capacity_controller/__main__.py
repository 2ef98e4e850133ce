"""Run the capacity controller.

    rlpipe run capacity-controller        (or: python -m services.capacity_controller)

Configured by RLPIPE_CAPACITY_CONTROLLER_* environment variables (see settings.py).
"""

from libs.service import run_service
from libs.settings import settings_or_exit
from services.capacity_controller.service import CapacityControllerService
from services.capacity_controller.settings import CapacityControllerSettings


def main() -> None:
    settings = settings_or_exit(CapacityControllerSettings)
    run_service(CapacityControllerService(settings), settings)


if __name__ == "__main__":
    main()
