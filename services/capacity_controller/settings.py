"""Settings of the capacity controller, from RLPIPE_CAPACITY_CONTROLLER_* variables or the
`[capacity_controller]` table of the TOML file named by RLPIPE_CONFIG.

The lending policy is `fleet` (libs/fleet/config.py), e.g. in TOML:

    [capacity_controller.fleet]
    replica_capacity_rps = 6.0        # what one replica serves within its latency target
    headroom = 0.5
    min_serving = 1
    lend_after_s = 120
    recall_lead_s = 300
    [[capacity_controller.fleet.schedule]]
    start = "08:00"                   # UTC
    end = "20:00"
    min_serving = 3
"""

from typing import ClassVar, Self

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from libs.fleet.config import ControllerConfig
from libs.settings import NESTED_SETTINGS, ServiceSettings, env_prefix


class CapacityControllerSettings(ServiceSettings):
    """Configuration of the capacity controller."""

    SERVICE: ClassVar[str] = "capacity-controller"
    model_config = SettingsConfigDict(
        env_prefix=env_prefix("capacity-controller"), **NESTED_SETTINGS
    )

    http_port: int = Field(9107, ge=0, le=65535, description="Port of /healthz and /metrics")
    fleet: ControllerConfig = Field(
        default_factory=ControllerConfig,
        description="When to lend and recall (RLPIPE_CAPACITY_CONTROLLER_FLEET_"
        "REPLICA_CAPACITY_RPS, _HEADROOM, _MIN_SERVING, _SCHEDULE, ...; docs/fleet.md)",
    )
    tick_s: float = Field(2.0, gt=0, description="Seconds between two decisions")
    stale_s: float = Field(
        15.0,
        gt=0,
        description="A replica whose last heartbeat is older is neither counted nor commanded",
    )
    settle_s: float = Field(
        10.0,
        gt=0,
        description="How long an accepted command counts as done before the replica's "
        "heartbeat shows it",
    )
    command_timeout_s: float = Field(
        5.0, gt=0, description="Longest wait for a replica's answer to a command"
    )

    @model_validator(mode="after")
    def _sees_its_replicas(self) -> Self:
        if self.stale_s <= self.tick_s:
            raise ValueError(
                f"stale_s ({self.stale_s}) must exceed tick_s ({self.tick_s}): every replica "
                "would look stale between two ticks"
            )
        return self
