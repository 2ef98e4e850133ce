"""The eval gate: a version is promoted to serving only if held-out tasks do not regress.

    gate = EvalGate(EvalGateConfig(every_versions=10), policy, tokenizer, EnvClient(nc))
    await gate.setup(js)                          # the last decision on the bus, if any
    if gate.due(version):
        decision = await gate.decide_on(model, version, publisher, js)

Held-out tasks are tasks 0..num_tasks-1 of the eval environment's TaskSource (`env`,
default `arith`) under `task_seed`, a seed the env-gateway's feeder does not use (its
default is 0; the gate's 1_000_003): task `i` is drawn from a generator seeded by (seed,
difficulty, i), so the held-out stream is fixed and its task ids never name a training task.
Problem texts can still coincide where the problem space is small (arith difficulty 0 has
ten), so the gate measures regression there, not generalization.

Each candidate is scored with the trainer's weights, greedy, by the domain's own rubric
(`libs.domains.registry.rubric_for`, without the reward service's judge criteria), the score
being the mean reward. The episodes run the way rollouts do: an engine from the engine
factory over the trainer's live model and the policy's own tokenizer, the one harness
(`libs.rollout.agent`) under the domain's harness limits (max turns, context budget,
summaries: `libs.domains.registry.harness_for`, what the workers roll the domain out with),
env-gateway serving the environment. If the episodes cannot run (no
gateway), the gate decides nothing this time, says so, and tries again at the next
published version: nothing is promoted unevaluated.
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

import structlog
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel

from libs.bus import wire
from libs.bus.publisher import Publisher
from libs.chat.template import chat_template_for
from libs.domains.registry import harness_for, make_env
from libs.engine.base import InferenceEngine
from libs.engine.factory import EngineConfig, build_engine
from libs.envs.client import EnvClient, EnvError
from libs.policy import PolicyConfig
from libs.rollout.agent import AgentSettings
from libs.rollout.evaluate import evaluate, mean_reward
from libs.rollout.transcripts import EpisodeText, held_out_transcripts
from libs.tokenizer import Tokenizer
from proto import streams, subjects
from proto.messages import PromotionDecision, ScoredRollout, Task

log = structlog.get_logger(__name__)

DEFAULT_EVAL_SEED = 1_000_003

CANDIDATE_SCORE = Gauge("rlpipe_trainer_eval_candidate_score", "Held-out score, last candidate")
PROMOTED_SCORE = Gauge("rlpipe_trainer_eval_promoted_score", "Held-out score, promoted version")
PROMOTED_VERSION = Gauge("rlpipe_trainer_promoted_policy_version", "Version promoted to serving")
DECISIONS = Counter("rlpipe_trainer_eval_decisions_total", "Eval-gate decisions", ["outcome"])


class EvalGateConfig(BaseModel):
    """When and how strictly versions are gated (the trainer's `eval` settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    every_versions: int = Field(
        10, ge=0, description="Gate a published version every N versions (0: no gate)"
    )
    num_tasks: int = Field(32, ge=1, description="Held-out tasks per evaluation")
    margin: float = Field(
        0.02, description="Allowed held-out score drop vs the promoted version (<0: must improve)"
    )
    difficulty: int = Field(0, ge=0, description="Difficulty of the held-out tasks")
    task_seed: int = Field(
        DEFAULT_EVAL_SEED, description="Seed of the held-out tasks; never the feeder's seed"
    )
    env: str = Field("arith", description="Domain of the held-out tasks (env-gateway)")
    transcripts: int = Field(
        3,
        ge=0,
        description="Held-out episodes of each decision written as text for `rlpipe report` "
        "(the first tasks, the same each time)",
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
        self,
        config: EvalGateConfig,
        policy: PolicyConfig,
        tokenizer: Tokenizer,
        env_client: EnvClient,
    ) -> None:
        self.config = config
        self.policy = policy
        self.tokenizer = tokenizer
        self.env_client = env_client
        self.tasks = held_out_tasks(config)
        # The workers' harness limits for this domain, in the policy's tokens.
        self.agent = harness_for(config.env, chat_template_for(tokenizer))
        self.last: PromotionDecision | None = None
        # The last decision's first held-out episodes, rendered.
        self.last_transcripts: list[EpisodeText] = []

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
        engine = await asyncio.to_thread(build_engine, EngineConfig(), self.policy, model)
        try:
            episodes = await self.held_out_episodes(engine)
        except EnvError as exc:
            DECISIONS.labels("not_evaluated").inc()
            log.error(
                "eval gate could not run its held-out episodes; no decision this time",
                version=version,
                env=self.config.env,
                error=str(exc),
            )
            return None
        self.last_transcripts = held_out_transcripts(
            episodes, self.tokenizer, self.config.transcripts
        )
        decision = decide(
            version,
            mean_reward(episodes),
            self.last,
            margin=self.config.margin,
            num_tasks=len(self.tasks),
            now=time.time(),
        )
        await record_decision(publisher, js, decision)
        self.last = decision
        log.info("eval gate ran", version=version, eval_s=round(time.monotonic() - started_s, 3))
        return decision

    def harness(self, engine: InferenceEngine) -> AgentSettings:
        """The domain's harness limits, the context budget capped at what `engine` holds (as
        a rollout-worker caps it)."""
        limit = engine.max_context_tokens
        if limit is None or self.agent.context_budget_tokens <= limit:
            return self.agent
        return self.agent.model_copy(update={"context_budget_tokens": limit})

    async def held_out_episodes(self, engine: InferenceEngine) -> list[ScoredRollout]:
        """The held-out tasks' episodes under `engine`'s policy, greedy, scored (EnvError
        when env-gateway does not serve them)."""
        agent = self.harness(engine)
        return await evaluate(engine, self.tokenizer, self.tasks, self.env_client, agent)


def _export(decision: PromotionDecision, count: bool = True) -> None:
    CANDIDATE_SCORE.set(decision.candidate_score)
    if count:
        DECISIONS.labels("promoted" if decision.promoted else "rejected").inc()
    if decision.serving_version is not None and decision.serving_score is not None:
        PROMOTED_VERSION.set(decision.serving_version)
        PROMOTED_SCORE.set(decision.serving_score)
