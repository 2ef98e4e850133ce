"""The eval gate: a version is promoted to serving only if held-out tasks do not regress.

    gate = EvalGate(EvalGateConfig(every_versions=10, num_tasks=32, margin=0.02), tokenizer)
    await gate.setup(js)                          # the last decision on the bus, if any
    if gate.due(version):
        decision = await gate.decide_on(model, version, publisher, js)

Held-out tasks are tasks 0..num_tasks-1 of the eval environment's TaskSource (`env`,
default `arith`) under `task_seed`, a seed the env-gateway's feeder does not use (its
default is 0; the gate's 1_000_003): task `i` is drawn from a generator seeded by (seed,
difficulty, i), so the held-out stream is fixed and its task ids never name a training task.
Problem texts can still coincide where the problem space is small (arith difficulty 0 has
ten), so the gate measures regression there, not generalization.

Each candidate is scored with the trainer's weights, greedy (the `hf` engine), by the
environment's own rubric (`libs.reward.rubric_for`, without the reward service's judge
criteria), the score being the mean reward. `arith` runs in-process; any other environment
runs its held-out episodes through env-gateway with the multi-turn harness (the gateway
must serve it). If the episodes cannot run (no gateway), the gate decides nothing this time,
says so, and tries again at the next published version: nothing is promoted unevaluated.
A candidate is promoted when `candidate >= promoted - margin` (a negative margin demands an
improvement); the first version evaluated, with nothing promoted yet, is promoted. Each
decision is published as a PromotionDecision on RL_PROMOTIONS (msg id
`promotion-<version>`), and a promotion then sets PROMOTED_VERSION_KEY in the state bucket.
The last decision alone says what serves, so a restarted trainer resumes the gate from it
(and repairs the KV key should a crash have come between the two writes).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import Counter, Gauge
from transformers import PreTrainedModel

from libs.bus import wire
from libs.bus.publisher import Publisher
from libs.engine.base import Completion, SamplingParams
from libs.engine.hf import HFEngine
from libs.envs.arithmetic import ArithmeticEnv
from libs.envs.base import make_env
from libs.envs.client import EnvClient, EnvError
from libs.reward import rubric_for
from libs.rollout.agent import AgentRunner, AgentSettings
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.episode import RunnerSettings
from libs.tokenizer import Tokenizer
from proto import streams, subjects
from proto.messages import PromotionDecision, Rollout, Task, Turn

log = structlog.get_logger(__name__)

DEFAULT_EVAL_SEED = 1_000_003

CANDIDATE_SCORE = Gauge("rlpipe_trainer_eval_candidate_score", "Held-out score, last candidate")
PROMOTED_SCORE = Gauge("rlpipe_trainer_eval_promoted_score", "Held-out score, promoted version")
PROMOTED_VERSION = Gauge("rlpipe_trainer_promoted_policy_version", "Version promoted to serving")
DECISIONS = Counter("rlpipe_trainer_eval_decisions_total", "Eval-gate decisions", ["outcome"])


@dataclass(frozen=True)
class EvalGateConfig:
    """When and how strictly versions are gated."""

    every_versions: int = 0
    """Evaluate a published version once this many versions passed the last one (0: off)."""
    num_tasks: int = 32
    margin: float = 0.02
    """Allowed drop of the held-out score below the promoted version's."""
    difficulty: int = 0
    task_seed: int = DEFAULT_EVAL_SEED
    env: str = ArithmeticEnv.name
    """Environment of the held-out tasks (arith in-process; others through env-gateway)."""
    max_turns: int = 8
    """Most assistant turns of a held-out episode (multi-turn environments)."""

    def __post_init__(self) -> None:
        if self.every_versions < 0 or self.num_tasks < 1:
            raise ValueError(
                f"eval gate: every_versions must be >= 0 (0: off) and num_tasks >= 1, got "
                f"{self.every_versions} and {self.num_tasks}"
            )

    @property
    def enabled(self) -> bool:
        return self.every_versions > 0


def held_out_tasks(config: EvalGateConfig) -> list[Task]:
    """The fixed held-out tasks: 0..num_tasks-1 of the eval env's source under `task_seed`."""
    source = make_env(config.env).task_source(
        difficulty=config.difficulty, group_size=1, seed=config.task_seed
    )
    return [source.task(index) for index in range(config.num_tasks)]


async def evaluate(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    tasks: list[Task],
    env_client: EnvClient | None = None,
    max_turns: int = 8,
) -> float:
    """Mean rubric reward of greedy episodes of `tasks`: arith in-process (a worker thread),
    other environments through env-gateway with `env_client` (EnvError when they cannot)."""
    env = tasks[0].env
    if env == ArithmeticEnv.name or env_client is None:
        rollouts = await asyncio.to_thread(greedy_rollouts, model, tokenizer, tasks)
    else:
        rollouts = await harness_rollouts(model, tokenizer, tasks, env_client, max_turns)
    rubric = rubric_for(env)
    rewards = [
        (await rubric.score(r, task)).reward for r, task in zip(rollouts, tasks, strict=True)
    ]
    return sum(rewards) / len(rewards)


async def harness_rollouts(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    tasks: list[Task],
    env_client: EnvClient,
    max_turns: int,
) -> list[Rollout]:
    """One greedy episode per task through env-gateway, generation batched across episodes."""
    batcher = GenerationBatcher(HFEngine(model, tokenizer), max_batch_tasks=len(tasks))
    batcher.open.set()
    running = asyncio.create_task(batcher.run(), name="eval-gate-batcher")
    runner = AgentRunner(
        env_client,
        tokenizer,
        batcher.generate,
        RunnerSettings(worker_id="eval-gate", temperature=0.0),
        AgentSettings(max_turns=max_turns),
    )
    try:
        groups = await asyncio.gather(*(runner.run(task) for task in tasks))
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    return [group[0] for group in groups]


def greedy_rollouts(
    model: PreTrainedModel, tokenizer: Tokenizer, tasks: list[Task]
) -> list[Rollout]:
    """One greedy completion per task, as a one-turn rollout, in task order (blocking)."""
    engine = HFEngine(model, tokenizer)
    rollouts: dict[str, Rollout] = {}
    # Tasks are decoded in batches of equal max_tokens: each gets the length it trains with.
    by_length: dict[int, list[Task]] = {}
    for task in tasks:
        by_length.setdefault(int(task.spec.get("max_tokens", 8)), []).append(task)
    for max_tokens, batch in by_length.items():
        prompts = [tokenizer.encode(task.prompt) for task in batch]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        completions = engine.generate(prompts, params)
        for task, prompt, completion in zip(batch, prompts, completions, strict=True):
            rollouts[task.task_id] = _rollout(task, prompt, completion, tokenizer)
    return [rollouts[task.task_id] for task in tasks]


def _rollout(
    task: Task, prompt: list[int], completion: Completion, tokenizer: Tokenizer
) -> Rollout:
    """A one-turn rollout of `completion`, for the rubric."""
    return Rollout(
        rollout_id=f"eval-{task.task_id}",
        task_id=task.task_id,
        group_id=task.task_id,
        sample_index=0,
        env=task.env,
        turns=[
            Turn(role="user", token_ids=prompt, text=task.prompt),
            Turn(
                role="assistant",
                token_ids=completion.token_ids,
                text=tokenizer.decode(completion.token_ids),
            ),
        ],
        finish_reason=completion.finish_reason,
        task=task,
    )


def decide(
    version: int,
    candidate_score: float,
    previous: PromotionDecision | None,
    *,
    margin: float,
    num_tasks: int,
    now: float,
) -> PromotionDecision:
    """Promote `version` when its score is within `margin` of what serves (or nothing does)."""
    baseline_version = previous.serving_version if previous is not None else None
    baseline_score = previous.serving_score if previous is not None else None
    if baseline_version is None or baseline_score is None:
        promoted, reason = True, "first version evaluated: nothing was promoted before"
    else:
        promoted = candidate_score >= baseline_score - margin
        relation = ">=" if promoted else "<"
        reason = (
            f"candidate {candidate_score:.4f} {relation} promoted v{baseline_version} "
            f"{baseline_score:.4f} - margin {margin:g}"
        )
    return PromotionDecision(
        version=version,
        promoted=promoted,
        candidate_score=candidate_score,
        baseline_version=baseline_version,
        baseline_score=baseline_score,
        margin=margin,
        num_tasks=num_tasks,
        reason=reason,
        decided_at=now,
    )


async def last_decision(js: JetStreamContext) -> PromotionDecision | None:
    """The newest decision on RL_PROMOTIONS, or None."""
    try:
        raw = await js.get_last_msg(streams.PROMOTIONS.name, subjects.PROMOTIONS)
    except NotFoundError:
        return None
    return wire.decode(PromotionDecision, raw.data or b"", raw.headers)


async def set_promoted_version(js: JetStreamContext, version: int) -> None:
    kv = await js.key_value(streams.STATE.bucket)
    await kv.put(streams.PROMOTED_VERSION_KEY, str(version).encode())


async def record_decision(
    publisher: Publisher, js: JetStreamContext, decision: PromotionDecision
) -> None:
    """Publish the decision, then (for a promotion) point the state bucket's key at it."""
    await publisher.publish(subjects.PROMOTIONS, decision, msg_id=f"promotion-{decision.version}")
    if decision.promoted:
        await set_promoted_version(js, decision.version)
    _export(decision)
    log.info(
        "version promoted" if decision.promoted else "version rejected",
        version=decision.version,
        candidate_score=round(decision.candidate_score, 4),
        baseline_version=decision.baseline_version,
        baseline_score=decision.baseline_score,
        reason=decision.reason,
    )


class EvalGate:
    """Decides, every `every_versions` published versions, whether the new one may serve."""

    def __init__(
        self, config: EvalGateConfig, tokenizer: Tokenizer, env_client: EnvClient | None = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.env_client = env_client
        self.tasks = held_out_tasks(config)
        self.last: PromotionDecision | None = None

    async def setup(self, js: JetStreamContext) -> None:
        """Resume from the last decision; repair the KV key if a crash left it behind."""
        self.last = await last_decision(js)
        if self.last is not None and self.last.serving_version is not None:
            await set_promoted_version(js, self.last.serving_version)
            _export(self.last, count=False)

    def due(self, version: int) -> bool:
        """True when the gate is on and `version` is far enough past the last decision."""
        if not self.config.enabled:
            return False
        return self.last is None or version - self.last.version >= self.config.every_versions

    async def decide_on(
        self, model: PreTrainedModel, version: int, publisher: Publisher, js: JetStreamContext
    ) -> PromotionDecision | None:
        """Evaluate `model` as `version`, decide, and record the decision on the bus; None
        (nothing decided, nothing promoted) when the held-out episodes cannot run."""
        started_s = time.monotonic()
        try:
            score = await evaluate(
                model, self.tokenizer, self.tasks, self.env_client, self.config.max_turns
            )
        except EnvError as exc:
            DECISIONS.labels("not_evaluated").inc()
            log.error(
                "eval gate could not run its held-out episodes; no decision this time",
                version=version,
                env=self.config.env,
                error=str(exc),
            )
            return None
        decision = decide(
            version,
            score,
            self.last,
            margin=self.config.margin,
            num_tasks=len(self.tasks),
            now=time.time(),
        )
        await record_decision(publisher, js, decision)
        self.last = decision
        log.info("eval gate ran", version=version, eval_s=round(time.monotonic() - started_s, 3))
        return decision


def _export(decision: PromotionDecision, count: bool = True) -> None:
    CANDIDATE_SCORE.set(decision.candidate_score)
    if count:
        DECISIONS.labels("promoted" if decision.promoted else "rejected").inc()
    if decision.serving_version is not None and decision.serving_score is not None:
        PROMOTED_VERSION.set(decision.serving_version)
        PROMOTED_SCORE.set(decision.serving_score)
