"""Subject names: the one place a service finds where a message goes.

Wildcard tokens follow NATS rules: `*` matches one token, `>` the rest.
"""

PREFIX = "rl"

# Work: tasks to roll out, one subject per environment.
TASKS_ALL = "rl.tasks.>"

# Finished episodes before and after the reward service.
ROLLOUTS_RAW_ALL = "rl.rollouts.raw.>"
ROLLOUTS_SCORED = "rl.rollouts.scored"

# Weights. The trainer hands a staged version to the weight-broadcaster (WeightsStaged);
# the broadcaster announces deltas and snapshots on two subjects (so the latest snapshot
# is one last-by-subject read) and stores chunks one subject per chunk.
WEIGHTS_STAGED = "rl.weights.staged"
WEIGHTS_ANNOUNCE_ALL = "rl.weights.announce.>"
WEIGHTS_ANNOUNCE_DELTA = "rl.weights.announce.delta"
WEIGHTS_ANNOUNCE_SNAPSHOT = "rl.weights.announce.snapshot"
WEIGHT_CHUNKS_ALL = "rl.weights.chunks.>"

# The real-time path.
SERVING_GENERATIONS = "rl.serving.generations"
FEEDBACK_EVENTS = "rl.feedback.events"
ROLLOUTS_ONLINE = "rl.rollouts.online"

# The trainer's eval gate: one PromotionDecision per evaluated version.
PROMOTIONS = "rl.promotions"

# The serving fleet (proto/fleet.py): commands to one replica (core NATS request/reply,
# `rl.fleet.command.<replica_id>`) and the capacity controller's decisions (a stream).
FLEET_COMMANDS_ALL = "rl.fleet.command.*"
FLEET_DECISIONS = "rl.fleet.decisions"

# Dead letters: `rl.dead.<origin stream>`.
DEAD_ALL = "rl.dead.>"

# Env-gateway request/reply (core NATS, queue group per env): `rl.env.<env>.<op>`.
ENV_ALL = "rl.env.>"
ENV_QUEUE_GROUP = "env-gateway"


def task_subject(env: str) -> str:
    """Subject that carries tasks for environment `env`."""
    return f"rl.tasks.{_token(env)}"


def rollout_raw_subject(env: str) -> str:
    """Subject that carries unscored rollouts of environment `env`."""
    return f"rl.rollouts.raw.{_token(env)}"


def weights_announce_subject(kind: str) -> str:
    """Announcement subject of a `delta` or a `snapshot`."""
    if kind not in ("delta", "snapshot"):
        raise ValueError(f"weight kind {kind!r}: use 'delta' or 'snapshot'")
    return f"rl.weights.announce.{kind}"


def weight_chunk_subject(version: int, kind: str, index: int) -> str:
    """Subject of chunk `index` of the `delta` or `snapshot` of weight version `version`
    (one subject per chunk, so a fetcher reads any chunk directly by subject)."""
    if kind not in ("delta", "snapshot"):
        raise ValueError(f"weight kind {kind!r}: use 'delta' or 'snapshot'")
    return f"rl.weights.chunks.{int(version)}.{kind}.{int(index)}"


def weight_chunks_filter(version: int, kind: str = "*") -> str:
    """Filter matching every chunk of a version (of one kind, or of both with `*`)."""
    return f"rl.weights.chunks.{int(version)}.{kind}.*"


def env_op_subject(env: str, op: str) -> str:
    """Request/reply subject for operation `op` (reset, step, close) on environment `env`."""
    return f"rl.env.{_token(env)}.{_token(op)}"


def dead_letter_subject(origin_stream: str) -> str:
    """Dead-letter subject for messages that failed on a consumer of `origin_stream`."""
    return f"rl.dead.{_token(origin_stream.lower())}"


def _token(name: str) -> str:
    """Validate one subject token: no dots, wildcards or whitespace."""
    if not name or any(c in name for c in ".*> \t\r\n"):
        raise ValueError(
            f"{name!r} cannot be a subject token: use letters, digits, '-' or '_' only"
        )
    return name
