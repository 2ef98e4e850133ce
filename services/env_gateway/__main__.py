"""Run the env-gateway service.

    rlpipe run env-gateway        (or: python -m services.env_gateway)

Configured by RLPIPE_ENV_GATEWAY_* environment variables (see settings.py).
"""

from libs.service import IdleService, run_service
from services.env_gateway.settings import EnvGatewaySettings

IDLE_REASON = "idle: environments (built-in task #3, sandboxed tool episodes #5) are not served yet"


def main() -> None:
    run_service(IdleService("env-gateway", IDLE_REASON), EnvGatewaySettings())


if __name__ == "__main__":
    main()
