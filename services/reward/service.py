"""The reward service object: raw rollouts in, scored rollouts (with breakdown) out.

Each raw rollout is scored by its domain's rubric (libs.domains), extended with the
configured judge criteria and group criteria, and published to ROLLOUTS_SCORED with msg id =
rollout_id, then acked: a redelivered rollout is scored again but stored once. A rollout of an
unknown domain, or without its task, is dead-lettered.

When the rubric has group criteria, a rollout's handler waits (libs.reward.group_gate) until
its whole group arrived, or `group_timeout_s` passed (the partial group is scored and its
reasons say so); the group is scored and published, and only then do the handlers return and
their messages get acked. A crash before that leaves them unacked: the whole group is
redelivered and rescored, and the scored stream keeps the first copy of each.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import structlog
from prometheus_client import Counter, Gauge

from libs.bus.connection import Bus
from libs.bus.consumer import Delivery, PermanentError, PullConsumer
from libs.bus.publisher import Publisher
from libs.domains.registry import UnknownDomainError, rubric_for
from libs.reward import GroupCriterion, Rubric, score_group, score_rollout
from libs.reward.group_criteria import shortest_correct
from libs.reward.group_gate import GroupGate
from libs.reward.judge import Judge, build_judge, judge_criteria_sets
from libs.service import Service
from proto import streams, subjects
from proto.messages import Rollout, ScoredRollout
from services.reward.settings import RewardSettings

log = structlog.get_logger(__name__)

SCORED = Counter("rlpipe_reward_rollouts_scored_total", "Rollouts scored", ["env"])
UNSCORED = Counter(
    "rlpipe_reward_rollouts_unscored_total", "Rollouts a criterion could not score", ["env"]
)
MEAN_REWARD = Gauge(
    "rlpipe_reward_mean_reward", "Mean reward of the latest scored rollouts", ["env"]
)
MEAN_CRITERION = Gauge(
    "rlpipe_reward_criterion_mean_score",
    "Mean score of each criterion over the latest scored rollouts",
    ["env", "criterion"],
)


class RewardWindow:
    """Running means over the latest `size` scored rollouts of one env."""

    def __init__(self, size: int) -> None:
        self.rewards: deque[float] = deque(maxlen=size)
        self.criteria: dict[str, deque[float]] = {}
        self._size = size

    def add(self, scored: ScoredRollout) -> None:
        self.rewards.append(scored.reward)
        for criterion in scored.criteria:
            self.criteria.setdefault(criterion.name, deque(maxlen=self._size)).append(
                criterion.score
            )

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0

    def criterion_means(self) -> dict[str, float]:
        return {name: sum(v) / len(v) for name, v in self.criteria.items() if v}


class RewardService(Service):
    """Scores every raw rollout of the bus."""

    name = "reward"

    def __init__(self, settings: RewardSettings) -> None:
        super().__init__()
        self.settings = settings
        self.consumer: PullConsumer[Rollout] | None = None
        self.publisher: Publisher | None = None
        self.num_scored = 0
        self.num_unscored = 0
        self.windows: dict[str, RewardWindow] = {}
        self._rubrics: dict[str, Rubric] = {}
        self.judge: Judge | None = None
        self.groups = GroupGate(self.on_group, timeout_s=settings.group_timeout_s)

    async def start(self, bus: Bus) -> None:
        await super().start(bus)
        if self.settings.judge.criteria:
            self.judge = build_judge(self.settings.judge)
        self.publisher = Publisher(bus.js)
        self.consumer = PullConsumer(
            bus.js,
            streams.REWARD_ROLLOUTS,
            Rollout,
            self.on_rollout,
            self.publisher,
            batch_size=self.settings.batch_size,
            concurrency=self.settings.concurrency,
            fetch_timeout_s=self.settings.fetch_timeout_s,
        )
        self.status = "ok"
        self.detail = "scoring raw rollouts"

    async def run(self) -> None:
        assert self.consumer is not None, "start() first"
        await self.consumer.run()

    async def stop(self) -> None:
        await super().stop()
        if self.consumer is not None:
            await self.consumer.stop(grace_s=self.settings.drain_timeout_s)
        await self.groups.stop()
        if self.judge is not None:
            await self.judge.aclose()

    async def on_rollout(self, rollout: Rollout, delivery: Delivery) -> None:
        """Score (with its group, when the rubric has group criteria), publish, and only then
        (on return) let the consumer ack."""
        if rollout.task is None:
            raise PermanentError(f"rollout {rollout.rollout_id} carries no task to score against")
        rubric = self._rubric(rollout.env)
        if rubric.needs_group:
            await self.groups.add(rollout)
            return
        await self._publish(await score_rollout(rubric, rollout, rollout.task, time.time()))

    async def on_group(self, rollouts: list[Rollout], note: str) -> None:
        """Score the rollouts of one group together and publish each."""
        task = rollouts[0].task
        assert task is not None, "on_rollout refuses rollouts without a task"
        rubric = self._rubric(rollouts[0].env)
        for scored in await score_group(rubric, rollouts, task, time.time(), note):
            await self._publish(scored)

    async def _publish(self, scored: ScoredRollout) -> None:
        assert self.publisher is not None, "start() first"
        ack = await self.publisher.publish(
            subjects.ROLLOUTS_SCORED, scored, msg_id=scored.rollout.rollout_id
        )
        if not ack.duplicate:
            self._record(scored)

    def _rubric(self, env: str) -> Rubric:
        if env not in self._rubrics:
            try:
                self._rubrics[env] = self._extended(rubric_for(env), env)
            except UnknownDomainError as exc:
                raise PermanentError(str(exc)) from exc
        return self._rubrics[env]

    def _extended(self, rubric: Rubric, env: str) -> Rubric:
        """The env's rubric with the configured judge criteria and group criteria."""
        sets = []
        if self.judge is not None:
            s = self.settings
            sets = judge_criteria_sets(self.judge, s.judge.criteria, env, s.judge.max_episode_chars)
        group = []
        if self.settings.shortest_correct_weight > 0 and rubric.correct_criterion is not None:
            bonus = shortest_correct(rubric.correct_criterion)
            group.append(
                GroupCriterion("shortest_correct", self.settings.shortest_correct_weight, bonus)
            )
        extended = rubric.extended(sets=sets, group=group)
        log.info(
            "rubric",
            env=env,
            criteria={c.name: c.weight for c in extended.criteria},
            judged={name: w for js in extended.sets for name, w in js.weights.items()},
            group={c.name: c.weight for c in extended.group},
        )
        return extended

    def _record(self, scored: ScoredRollout) -> None:
        env = scored.rollout.env
        if not scored.scored:
            self.num_unscored += 1
            UNSCORED.labels(env).inc()
            return
        self.num_scored += 1
        SCORED.labels(env).inc()
        window = self.windows.setdefault(env, RewardWindow(self.settings.mean_window_rollouts))
        window.add(scored)
        MEAN_REWARD.labels(env).set(window.mean_reward)
        for name, mean in window.criterion_means().items():
            MEAN_CRITERION.labels(env, name).set(mean)

    def health(self) -> dict[str, Any]:
        return {
            **super().health(),
            "rollouts_scored": self.num_scored,
            "rollouts_unscored": self.num_unscored,
            "groups_waiting": self.groups.num_open,
            "groups_partial": self.groups.num_partial,
            "mean_reward": {env: round(w.mean_reward, 4) for env, w in self.windows.items()},
        }
