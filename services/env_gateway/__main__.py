"""Run the env-gateway service.

    rlpipe run env-gateway        (or: python -m services.env_gateway)

Configured by RLPIPE_ENV_GATEWAY_* environment variables (see settings.py).
"""

from libs.service import run_service
from libs.settings import settings_or_exit
from services.env_gateway.service import EnvGatewayService
from services.env_gateway.settings import EnvGatewaySettings


def main() -> None:
    settings = settings_or_exit(EnvGatewaySettings)
    run_service(EnvGatewayService(settings), settings)


if __name__ == "__main__":
    main()
