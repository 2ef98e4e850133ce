"""Settings of the trainer service, from RLPIPE_TRAINER_* variables."""

from typing import ClassVar

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from libs.policy import DTypeName
from libs.rl.online import DEFAULT_CONTEXT_KEY, DEFAULT_SIGNAL_REWARDS, check_signal_rewards
from libs.settings import ServiceSettings, env_prefix
from libs.trainer.eval_gate import DEFAULT_EVAL_SEED


class TrainerSettings(ServiceSettings):
    """Configuration of the trainer service."""

    SERVICE: ClassVar[str] = "trainer"
    model_config = SettingsConfigDict(env_prefix=env_prefix("trainer"), extra="ignore")

    http_port: int = Field(9101, ge=0, le=65535, description="Port of /healthz and /metrics")
    policy_preset: str = Field("tiny", description="Architecture from libs.policy presets")
    policy_path: str | None = Field(None, description="Local model folder; overrides the preset")
    dtype: DTypeName = Field("auto", description="float32, bfloat16, float16 or auto (bf16 on GPU)")
    device: str = Field("auto", description="cpu, cuda, cuda:N, or auto")
    seed: int = Field(0, description="Seed of the random init")
    learning_rate: float = Field(5e-4, gt=0, description="AdamW learning rate")
    learning_rate_decay_steps: int | None = Field(
        400,
        ge=1,
        description="Steps over which the learning rate decays linearly (unset: constant)",
    )
    min_learning_rate_ratio: float = Field(
        0.1, gt=0, le=1, description="Learning rate at the end of the decay, as a fraction"
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    batch_groups: int = Field(16, ge=1, description="GRPO groups per optimizer step")
    max_staleness: int = Field(
        4, ge=0, description="Samples older than this many versions are dropped (0: synchronous)"
    )
    clip_eps_low: float = Field(0.2, gt=0, description="PPO clip below 1")
    clip_eps_high: float = Field(0.2, gt=0, description="PPO clip above 1")
    importance_weight_cap: float = Field(
        2.0, ge=1, description="Truncation of the behavior->trainer importance weight"
    )
    normalize_advantage_std: bool = Field(True, description="Divide advantages by group std")
    minibatches: int = Field(1, ge=1, description="Optimizer steps per batch (PPO minibatches)")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm")
    max_sequence_tokens: int | None = Field(None, ge=2, description="Truncate longer samples")
    checkpoint_every_steps: int = Field(10, ge=1, description="Steps between checkpoints")
    publish_every_steps: int = Field(
        1, ge=1, description="Stage weights for the broadcaster every N steps (sync mode: 1)"
    )
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps")
    incomplete_group_timeout_s: float = Field(
        120.0, gt=0, description="Train a group with missing samples after this long"
    )
    # Online training from product feedback (libs.rl.online, libs.trainer.mix).
    online_fraction: float = Field(
        0.0, ge=0, le=1, description="Share of steps on online samples (0: off, 1: online only)"
    )
    online_stream_wait_s: float = Field(
        5.0, ge=0, description="Wait for a step's scheduled stream before taking the other"
    )
    online_batch_samples: int = Field(32, ge=1, description="Most online samples per step")
    online_learning_rate_scale: float = Field(
        0.1, gt=0, le=1, description="Online steps' learning rate as a fraction of the trainer's"
    )
    online_signal_rewards: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_SIGNAL_REWARDS),
        description="Reward of each feedback signal (JSON object; every signal must be named)",
    )
    max_online_staleness: int = Field(
        8, ge=0, description="Online samples served more than this many versions ago are dropped"
    )
    online_baseline_decay: float = Field(
        0.9, ge=0, lt=1, description="EMA decay of the per-context-kind reward baseline"
    )
    online_context_key: str = Field(
        DEFAULT_CONTEXT_KEY, description="Generation metadata key that names the context kind"
    )
    # The eval gate (libs.trainer.eval_gate): promotion of versions to serving.
    eval_every_versions: int = Field(
        10, ge=0, description="Gate a published version every N versions (0: no gate)"
    )
    eval_env: str = Field(
        "arith",
        description="Environment of the held-out tasks (others than arith run their "
        "episodes through env-gateway)",
    )
    eval_max_turns: int = Field(8, ge=1, description="Most assistant turns of a held-out episode")
    eval_num_tasks: int = Field(32, ge=1, description="Held-out tasks per evaluation")
    eval_margin: float = Field(
        0.02, description="Allowed held-out score drop vs the promoted version (<0: must improve)"
    )
    eval_difficulty: int = Field(0, ge=0, description="Difficulty of the held-out tasks")
    eval_task_seed: int = Field(
        DEFAULT_EVAL_SEED, description="Seed of the held-out tasks; never the feeder's seed"
    )

    @field_validator("online_signal_rewards")
    @classmethod
    def _every_signal_has_a_reward(cls, value: dict[str, float]) -> dict[str, float]:
        return check_signal_rewards(value)
