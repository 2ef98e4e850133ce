"""Settings of the reward service, from RLPIPE_REWARD_* variables or the `[reward]` table of
the TOML file named by RLPIPE_CONFIG.

Judge criteria are off until `judge.criteria` lists some, e.g. in TOML:

    [reward.judge]
    url = "http://127.0.0.1:8000/v1"
    model = "rlpipe-policy"
    api_key = ""                            # required with criteria; "" for no auth
    verdict_mode = "guided_choice"
    [[reward.judge.criteria]]
    name = "explains"
    weight = 0.2
    description = "The final answer states how it was computed."
    group = "style"                         # one judge request per group and rollout
    envs = ["calc"]                         # [] or absent: every env

or as JSON: RLPIPE_REWARD_JUDGE_CRITERIA='[{"name": "explains", "weight": 0.2, ...}]'.
"""

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.reward.judge import JudgeConfig
from libs.settings import NESTED_SETTINGS, ServiceSettings, env_prefix


class RewardSettings(ServiceSettings):
    """Configuration of the reward service."""

    SERVICE: ClassVar[str] = "reward"
    model_config = SettingsConfigDict(env_prefix=env_prefix("reward"), **NESTED_SETTINGS)

    http_port: int = Field(9104, ge=0, le=65535, description="Port of /healthz and /metrics")
    batch_size: int = Field(64, ge=1, description="Raw rollouts fetched per pull")
    concurrency: int = Field(
        256,
        ge=1,
        description="Rollouts held at once (scoring, or waiting for the rest of their group: "
        "keep it several group sizes large when group criteria are on)",
    )
    fetch_timeout_s: float = Field(1.0, gt=0, description="Longest wait of one pull")
    mean_window_rollouts: int = Field(
        256, ge=1, description="Latest rollouts per env that the mean-reward gauges average"
    )
    group_timeout_s: float = Field(
        120.0, gt=0, description="Wait for the rest of a group before scoring it partial"
    )
    shortest_correct_weight: float = Field(
        0.0,
        ge=0,
        description="Weight of the shortest-correct-answer group criterion in every rubric "
        "that has a correctness criterion; 0 = off (rollouts are not held for their group)",
    )
    judge: JudgeConfig = Field(
        default_factory=JudgeConfig,
        description="The LLM judge and its criteria (RLPIPE_REWARD_JUDGE_URL, _MODEL, "
        "_API_KEY, _CRITERIA, ...); off while judge.criteria is empty",
    )
