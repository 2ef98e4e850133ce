"""Settings of the rollout-worker service, from RLPIPE_ROLLOUT_WORKER_* variables."""

import os
import socket
from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from libs.engine.factory import EngineConfig, EngineType
from libs.policy import DTypeName, PolicyConfig
from libs.settings import ServiceSettings, env_prefix


def default_worker_id() -> str:
    """`<hostname>-<pid>`: unique per process on a host."""
    return f"{socket.gethostname()}-{os.getpid()}"


class RolloutWorkerSettings(ServiceSettings):
    """Configuration of the rollout-worker service."""

    SERVICE: ClassVar[str] = "rollout-worker"
    model_config = SettingsConfigDict(env_prefix=env_prefix("rollout-worker"), extra="ignore")

    http_port: int = Field(9102, ge=0, le=65535, description="Port of /healthz and /metrics")
    worker_id: str = Field(
        default_factory=default_worker_id, description="Name in rollouts and logs"
    )
    # The engine and its policy.
    engine_type: EngineType = Field("hf", description="Inference backend (vllm, openai: planned)")
    policy_preset: str = Field("tiny", description="Architecture preset (libs.policy)")
    policy_path: str | None = Field(
        None, description="Local model folder (config.json + safetensors); overrides the preset"
    )
    vocab_size: int | None = Field(None, ge=1, description="Override of the preset's vocabulary")
    tokenizer: str = Field("byte", description="'byte' or a local folder with tokenizer files")
    dtype: DTypeName = Field("auto", description="Parameter dtype; auto: fp32 CPU, bf16 GPU")
    device: str = Field("auto", description="torch device; auto: cuda when available")
    seed: int = Field(0, description="Seed of the random init used until weights arrive")
    max_batch_rows: int = Field(64, ge=1, description="Most sequences the engine decodes at once")
    # Sampling.
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass")
    # Batching across tasks.
    max_batch_tasks: int = Field(
        8, ge=1, description="Tasks handled at once; their prompts share one generate call"
    )
    batch_window_s: float = Field(
        0.005, ge=0, description="How long a first request waits for others to join its call"
    )
    throughput_window_s: float = Field(
        60.0, gt=0, description="Wall time over which busy fraction and tokens/s are measured"
    )
    # Bus and environment.
    fetch_timeout_s: float = Field(1.0, gt=0, description="Longest wait of one task fetch")
    env_reset_timeout_s: float = Field(10.0, gt=0, description="Longest wait for a reset reply")
    env_step_timeout_s: float = Field(30.0, gt=0, description="Longest wait for a step reply")
    # Weights.
    weights_fetch_parallel: int = Field(8, ge=1, description="Chunk fetches in flight")
    weights_fetch_timeout_s: float = Field(10.0, gt=0, description="Longest wait for one chunk")
    weights_verify_full: bool = Field(
        True, description="Rehash the whole model after each swap (inside the pause)"
    )

    def engine_config(self) -> EngineConfig:
        """The engine these settings describe."""
        policy = PolicyConfig(
            preset=self.policy_preset,
            path=self.policy_path,
            vocab_size=self.vocab_size,
            dtype=self.dtype,
            device=self.device,
            seed=self.seed,
        )
        return EngineConfig(
            type=self.engine_type,
            policy=policy,
            tokenizer=self.tokenizer,
            max_batch_rows=self.max_batch_rows,
        )
