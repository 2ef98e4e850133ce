"""Settings of the rollout-worker service, from RLPIPE_ROLLOUT_WORKER_* variables."""

import os
from typing import ClassVar, Self

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from libs.engine.factory import EngineConfig
from libs.policy import PolicyConfig
from libs.rollout.agent import AgentSettings
from libs.rollout.episode import RunnerSettings
from libs.settings import NESTED_SETTINGS, ServiceSettings, env_prefix
from libs.trainer.checkpoint import checkpoint_version


class RolloutWorkerSettings(ServiceSettings, RunnerSettings, AgentSettings):
    """Configuration of the rollout-worker service: the runner's and the harness's settings
    (`libs.rollout`, declared once there) plus the worker's own."""

    SERVICE: ClassVar[str] = "rollout-worker"
    model_config = SettingsConfigDict(env_prefix=env_prefix("rollout-worker"), **NESTED_SETTINGS)

    http_port: int = Field(9102, ge=0, le=65535, description="Port of /healthz and /metrics")
    # The policy (shared description: libs.policy) and the engine that runs it.
    policy: PolicyConfig = Field(
        default_factory=PolicyConfig,
        description="The policy rolled out (RLPIPE_ROLLOUT_WORKER_POLICY_PATH, _PRESET, "
        "_TOKENIZER, ...); its weights until the trainer's arrive",
    )
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="Inference backend (RLPIPE_ROLLOUT_WORKER_ENGINE_TYPE, _MAX_BATCH_ROWS)",
    )
    # Batching across tasks.
    max_batch_tasks: int = Field(
        8, ge=1, description="Tasks rolled out at once; their turns share engine calls"
    )
    batch_window_s: float = Field(
        0.005, ge=0, description="How long a first request waits for others to join its call"
    )
    throughput_window_s: float = Field(
        60.0, gt=0, description="Wall time over which busy fraction and tokens/s are measured"
    )
    # Bus and environment.
    fetch_timeout_s: float = Field(1.0, gt=0, description="Longest wait of one task fetch")
    # A task waiting longer gives its slot back (retried later, dead-lettered after the
    # consumer's max_deliver attempts): a version that never comes cannot hold a slot forever.
    min_version_wait_s: float = Field(
        300.0, gt=0, description="Longest wait of a task for weights of its min_policy_version"
    )
    # Weights.
    weights_fetch_parallel: int = Field(8, ge=1, description="Chunk fetches in flight")
    # A 1 GB dense bf16 delta is ~1,000 chunks; decoded one at a time on a GPU worker it took
    # 11 s (H200 host, bench/gpu_loop.sh): the chunks' copies, zstd and numpy release the GIL.
    weights_decode_threads: int = Field(
        default_factory=lambda: min(8, os.cpu_count() or 1),
        ge=1,
        description="Threads decoding a version's chunks (default: up to 8, one per core)",
    )
    # In the worker's own process the decode threads wait for the GIL its event loop holds.
    weights_decode_process: bool = Field(
        True,
        description="Decode deltas for weights on a GPU in a process of its own, against a "
        "host copy of the weights in /dev/shm (off the worker's GIL and off the GPU); false: "
        "in the worker's threads (also where /dev/shm cannot hold the copy)",
    )
    weights_fetch_timeout_s: float = Field(10.0, gt=0, description="Longest wait for one chunk")
    weights_verify_full: bool = Field(
        True, description="Rehash the whole model after each swap (inside the pause)"
    )
    follow_weights: bool = Field(
        True,
        description="Follow the trainer's versions; false: keep the loaded weights (policy_path "
        "or seed), e.g. a fixed judge in serve mode",
    )
    weights_nats_url: str | None = Field(
        None,
        description="NATS to fetch weights from: a region's relay server (docs/weights-relay.md); "
        "unset: the service connection",
    )
    weights_chunk_wait_s: float = Field(
        600.0,
        gt=0,
        description="With weights_nats_url: longest wait for a version's chunks "
        "to reach the regional mirror",
    )
    weights_promoted_only: bool = Field(
        False, description="Apply only versions the trainer's eval gate promoted (serving)"
    )

    # What this replica does: roll out tasks, serve an OpenAI-compatible API, or both.
    consume_tasks: bool = Field(
        True, description="Pull and roll out tasks; false: a serving replica only serves"
    )
    # Serve mode (libs.serve): the engine behind /v1/chat/completions and /v1/completions.
    serve_port: int = Field(
        0, ge=0, le=65535, description="Port of the OpenAI-compatible API; 0: serve mode off"
    )
    serve_host: str = Field("127.0.0.1", description="Address the OpenAI-compatible API binds")
    served_model_name: str = Field(
        "rlpipe-policy", min_length=1, description="Model name the API serves (`model` field)"
    )
    serve_api_key: str | None = Field(
        None, description="Secret required as `Authorization: Bearer <key>`; unset: open"
    )
    serve_max_choices: int = Field(16, ge=1, description="Largest `n` of one request")
    serve_default_max_tokens: int = Field(
        256, ge=1, description="Chat completion tokens when a request sets no max"
    )
    record_generations: bool = Field(
        True, description="Store every served choice on rl.serving.generations before answering"
    )
    record_timeout_s: float = Field(
        2.0, gt=0, description="Longest wait for the stream to ack one record attempt"
    )
    record_attempts: int = Field(
        2, ge=1, description="Attempts at storing records before the answer goes out without"
    )

    def engine_config(self) -> EngineConfig:
        """`engine`; a replica that follows no trainer and serves one of its checkpoints
        reports that checkpoint's version (its state.json), not 0."""
        version = checkpoint_version(self.policy.path)
        if self.follow_weights or version is None or self.engine.initial_policy_version:
            return self.engine
        return self.engine.model_copy(update={"initial_policy_version": version})

    @model_validator(mode="after")
    def _has_work(self) -> Self:
        if not self.consume_tasks and not self.serve_port:
            raise ValueError(
                "consume_tasks is false and serve_port is 0: the worker would do nothing; "
                "set RLPIPE_ROLLOUT_WORKER_SERVE_PORT or consume tasks"
            )
        return self
