"""Settings of the rollout-worker service, from RLPIPE_ROLLOUT_WORKER_* variables."""

from typing import ClassVar, Self

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from libs.engine.factory import EngineConfig
from libs.fleet.config import LendingConfig
from libs.policy import PolicyConfig
from libs.rollout.agent import AgentSettings
from libs.rollout.episode import RunnerSettings
from libs.serve.config import ServeConfig
from libs.settings import NESTED_SETTINGS, ServiceSettings, env_prefix
from libs.trainer.checkpoint import checkpoint_version
from libs.weights.receiver import ReceiverConfig
from libs.weights.same_host import SameHostTakeConfig


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
    weights: ReceiverConfig = Field(
        default_factory=ReceiverConfig,
        description="How the trainer's versions are received and whose signature they need "
        "(RLPIPE_ROLLOUT_WORKER_WEIGHTS_SIGNERS, _NATS_URL, _FETCH_PARALLEL, _DECODE_THREADS, "
        "_DECODE_PROCESS, _VERIFY_FULL, ...)",
    )
    same_host: SameHostTakeConfig = Field(
        default_factory=SameHostTakeConfig,
        description="Versions taken from the trainer's memory when it runs on this host "
        "(RLPIPE_ROLLOUT_WORKER_SAME_HOST_ENABLED, _VERIFY, ...)",
    )
    follow_weights: bool = Field(
        True,
        description="Follow the trainer's versions; false: keep the loaded weights (policy_path "
        "or seed), e.g. a fixed judge in serve mode",
    )

    # What this replica does: roll out tasks, serve an OpenAI-compatible API, or both.
    consume_tasks: bool = Field(
        True, description="Pull and roll out tasks; false: a serving replica only serves"
    )
    # Serve mode (libs.serve): the engine behind /v1/chat/completions and /v1/completions.
    serve: ServeConfig = Field(
        default_factory=ServeConfig,
        description="The OpenAI-compatible API (RLPIPE_ROLLOUT_WORKER_SERVE_PORT, _HOST, "
        "_MODEL_NAME, _API_KEY, ...); off while serve.port is 0",
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
    lending: LendingConfig = Field(
        default_factory=LendingConfig,
        description="A serve replica the capacity controller may lend to RL "
        "(RLPIPE_ROLLOUT_WORKER_LENDING_ENABLED, _RECALL_GRACE_S, ...; docs/fleet.md)",
    )

    def engine_config(self) -> EngineConfig:
        """`engine`; a replica that follows no trainer and serves one of its checkpoints
        reports that checkpoint's version (its state.json), not 0."""
        version = checkpoint_version(self.policy.path)
        if self.follow_weights or version is None or self.engine.initial_policy_version:
            return self.engine
        return self.engine.model_copy(update={"initial_policy_version": version})

    @model_validator(mode="after")
    def _verifies_weights(self) -> Self:
        weights = self.weights
        if self.follow_weights and not weights.signers and not weights.allow_unsigned:
            raise ValueError(
                "weights.signers is empty: a worker applies only weight versions signed by the "
                "trainer's side. Set RLPIPE_ROLLOUT_WORKER_WEIGHTS_SIGNERS to its public key "
                "(`rlpipe weights keygen`; `rlpipe demo` makes one per run), or, where every "
                "publisher on the bus is trusted, RLPIPE_ROLLOUT_WORKER_WEIGHTS_ALLOW_UNSIGNED=true"
            )
        return self

    @model_validator(mode="after")
    def _serves_locally(self) -> Self:
        if self.serve.port and self.engine.type == "remote":
            raise ValueError(
                "serve.port is set with engine.type remote: serve mode answers with a local "
                "engine; point clients at the fleet itself, or run this replica's own engine"
            )
        return self

    @model_validator(mode="after")
    def _lendable(self) -> Self:
        if not self.lending.enabled:
            return self
        needs = {
            "RLPIPE_ROLLOUT_WORKER_SERVE_PORT (serve mode)": self.serve.port > 0,
            "RLPIPE_ROLLOUT_WORKER_CONSUME_TASKS=false (it pulls tasks only while lent)": (
                not self.consume_tasks
            ),
            "RLPIPE_ROLLOUT_WORKER_WEIGHTS_PROMOTED_ONLY=true (it restores the promoted version)": (
                self.weights.promoted_only
            ),
            "RLPIPE_ROLLOUT_WORKER_FOLLOW_WEIGHTS=true": self.follow_weights,
        }
        missing = [setting for setting, met in needs.items() if not met]
        if missing:
            raise ValueError(f"lending.enabled needs {'; '.join(missing)}")
        return self

    @model_validator(mode="after")
    def _has_work(self) -> Self:
        if not self.consume_tasks and not self.serve.port:
            raise ValueError(
                "consume_tasks is false and serve.port is 0: the worker would do nothing; "
                "set RLPIPE_ROLLOUT_WORKER_SERVE_PORT or consume tasks"
            )
        return self
