"""The trainer service: the trainer loop (libs.trainer) behind the service lifecycle."""

from __future__ import annotations

from typing import Any

from libs.bus.connection import Bus
from libs.bus.publisher import Publisher
from libs.policy import PolicyConfig
from libs.service import Service
from libs.tokenizer import ByteTokenizer
from libs.trainer.eval_gate import EvalGateConfig
from libs.trainer.loop import Trainer, TrainerConfig
from libs.trainer.online_step import OnlineConfig
from libs.trainer.step import StepConfig
from services.trainer.settings import TrainerSettings


def trainer_config(settings: TrainerSettings) -> TrainerConfig:
    """The loop's configuration from the service's settings."""
    return TrainerConfig(
        policy=PolicyConfig(
            preset=settings.policy_preset,
            path=settings.policy_path,
            dtype=settings.dtype,
            device=settings.device,
            seed=settings.seed,
        ),
        step=StepConfig(
            pad_id=ByteTokenizer().pad_id,
            clip_eps_low=settings.clip_eps_low,
            clip_eps_high=settings.clip_eps_high,
            is_cap=settings.importance_weight_cap,
            normalize_std=settings.normalize_advantage_std,
            minibatches=settings.minibatches,
            max_grad_norm=settings.max_grad_norm,
            max_length=settings.max_sequence_tokens,
        ),
        run_dir=settings.run_dir,
        learning_rate=settings.learning_rate,
        learning_rate_decay_steps=settings.learning_rate_decay_steps,
        min_learning_rate_ratio=settings.min_learning_rate_ratio,
        weight_decay=settings.weight_decay,
        batch_groups=settings.batch_groups,
        max_staleness=settings.max_staleness,
        checkpoint_every_steps=settings.checkpoint_every_steps,
        publish_every_steps=settings.publish_every_steps,
        max_steps=settings.max_steps,
        incomplete_group_timeout_s=settings.incomplete_group_timeout_s,
        online_fraction=settings.online_fraction,
        stream_wait_s=settings.online_stream_wait_s,
        online=OnlineConfig(
            signal_rewards=settings.online_signal_rewards,
            baseline_decay=settings.online_baseline_decay,
            context_key=settings.online_context_key,
            max_staleness=settings.max_online_staleness,
            batch_samples=settings.online_batch_samples,
            learning_rate_scale=settings.online_learning_rate_scale,
        ),
        eval_gate=EvalGateConfig(
            every_versions=settings.eval_every_versions,
            num_tasks=settings.eval_num_tasks,
            margin=settings.eval_margin,
            difficulty=settings.eval_difficulty,
            task_seed=settings.eval_task_seed,
            env=settings.eval_env,
            max_turns=settings.eval_max_turns,
        ),
    )


class TrainerService(Service):
    name = "trainer"

    def __init__(self, settings: TrainerSettings) -> None:
        super().__init__()
        self._config = trainer_config(settings)
        self.trainer: Trainer | None = None

    async def start(self, bus: Bus) -> None:
        await super().start(bus)
        self.trainer = Trainer(self._config, bus, Publisher(bus.js))
        await self.trainer.setup()

    async def run(self) -> None:
        assert self.trainer is not None, "start() first"
        await self.trainer.run()

    async def stop(self) -> None:
        await super().stop()
        if self.trainer is not None:
            await self.trainer.stop()

    def health(self) -> dict[str, Any]:
        if self.trainer is None:
            return super().health()
        return {"service": self.name, **self.trainer.health()}
