"""Settings of the reward service, from RLPIPE_REWARD_* variables or the `[reward]` table of
the TOML file named by RLPIPE_CONFIG.

Judge criteria are off until `judge_criteria` lists some, e.g. in TOML:

    [reward]
    judge_url = "http://127.0.0.1:8000/v1"
    judge_model = "rlpipe-policy"
    judge_api_key = ""                      # required with criteria; "" for no auth
    judge_verdict_mode = "guided_choice"
    [[reward.judge_criteria]]
    name = "explains"
    weight = 0.2
    description = "The final answer states how it was computed."
    group = "style"                         # one judge request per group and rollout
    envs = ["calc"]                         # [] or absent: every env

or as JSON: RLPIPE_REWARD_JUDGE_CRITERIA='[{"name": "explains", "weight": 0.2, ...}]'.
"""

from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from libs.reward.judge import JUDGE_TYPES, JudgeConfig, JudgeCriterionConfig
from libs.settings import ServiceSettings, env_prefix


class RewardSettings(ServiceSettings):
    """Configuration of the reward service."""

    SERVICE: ClassVar[str] = "reward"
    model_config = SettingsConfigDict(env_prefix=env_prefix("reward"), extra="ignore")

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
    judge_type: str = Field("openai", description=f"Judge backend: {', '.join(JUDGE_TYPES)}")
    judge_url: str = Field("", description="Base URL of the judge's OpenAI-compatible API")
    judge_model: str = Field("", description="Model name sent to the judge")
    judge_api_key: str | None = Field(
        None, description="Bearer key of the judge; no default: set it, '' for no auth"
    )
    judge_verdict_mode: Literal["text", "guided_choice"] = Field(
        "text", description="Verdicts parsed from text, or constrained by guided_choice"
    )
    judge_choice_fields: Literal["both", "guided_choice", "structured_outputs"] = Field(
        "both",
        description="Body fields of a guided_choice verdict: vLLM's legacy guided_choice, "
        "structured_outputs.choice, or both",
    )
    judge_timeout_s: float = Field(60.0, gt=0, description="Timeout of one judge request")
    judge_max_attempts: int = Field(3, ge=1, description="Attempts per judge request")
    judge_backoff_s: float = Field(
        1.0, ge=0, description="Wait before the 2nd attempt; doubles after each (max 30 s)"
    )
    judge_max_concurrent_requests: int = Field(8, ge=1, description="Judge requests at once")
    judge_max_tokens: int = Field(1024, ge=1, description="Tokens the judge may write reasons in")
    judge_temperature: float = Field(0.0, ge=0, description="Sampling temperature of the judge")
    judge_max_episode_chars: int = Field(
        32_000, ge=100, description="Episode text shown to the judge; the middle is cut beyond"
    )
    judge_criteria: list[JudgeCriterionConfig] = Field(
        default_factory=list, description="Judge criteria (name, weight, description, group, envs)"
    )

    @model_validator(mode="after")
    def _judge_is_reachable(self) -> "RewardSettings":
        if not self.judge_criteria:
            return self
        unset = [
            f"RLPIPE_REWARD_{name.upper()}"
            for name in ("judge_url", "judge_model")
            if not getattr(self, name)
        ]
        if self.judge_api_key is None:
            unset.append("RLPIPE_REWARD_JUDGE_API_KEY (may be '' for a server without auth)")
        if unset:
            raise ValueError(f"judge_criteria are set, so set {', '.join(unset)}")
        if self.judge_type not in JUDGE_TYPES:
            raise ValueError(
                f"judge_type {self.judge_type!r} is unknown; known: {', '.join(JUDGE_TYPES)}"
            )
        return self

    def judge_config(self) -> JudgeConfig | None:
        """How to reach the judge; None when no judge criterion is configured."""
        if not self.judge_criteria:
            return None
        return JudgeConfig(
            type=self.judge_type,
            url=self.judge_url,
            model=self.judge_model,
            api_key=self.judge_api_key or "",
            verdict_mode=self.judge_verdict_mode,
            choice_fields=self.judge_choice_fields,
            timeout_s=self.judge_timeout_s,
            max_attempts=self.judge_max_attempts,
            backoff_s=self.judge_backoff_s,
            max_concurrent_requests=self.judge_max_concurrent_requests,
            max_tokens=self.judge_max_tokens,
            temperature=self.judge_temperature,
            max_episode_chars=self.judge_max_episode_chars,
        )
