"""Subject names: the one place a service finds where a message goes.

Wildcard tokens follow NATS rules: `*` matches one token, `>` the rest.
"""

PREFIX = "rl"

# Work: tasks to roll out, one subject per environment.
TASKS_ALL = "rl.tasks.>"

# Finished episodes before and after the reward service.
ROLLOUTS_RAW_ALL = "rl.rollouts.raw.>"
ROLLOUTS_SCORED = "rl.rollouts.scored"

# Weights: announcements (small) and chunks (large, one subject per version).
WEIGHTS_ANNOUNCE = "rl.weights.announce"
WEIGHT_CHUNKS_ALL = "rl.weights.chunks.>"

# The real-time path.
SERVING_GENERATIONS = "rl.serving.generations"
FEEDBACK_EVENTS = "rl.feedback.events"
ROLLOUTS_ONLINE = "rl.rollouts.online"

# Dead letters: `rl.dead.<origin stream>`.
DEAD_ALL = "rl.dead.>"

# Env-gateway request/reply (core NATS, queue group per env).
ENV_QUEUE_GROUP = "env-gateway"


def task_subject(env: str) -> str:
    """Subject that carries tasks for environment `env`."""
    return f"rl.tasks.{_token(env)}"


def rollout_raw_subject(env: str) -> str:
    """Subject that carries unscored rollouts of environment `env`."""
    return f"rl.rollouts.raw.{_token(env)}"


def weight_chunk_subject(version: int, index: int) -> str:
    """Subject of chunk `index` of weight version `version` (one subject per chunk, so
    a fetcher reads any chunk directly by subject)."""
    return f"rl.weights.chunks.{version}.{index}"


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
