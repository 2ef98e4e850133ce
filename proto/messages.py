"""Message schemas: typed msgspec Structs, encoded as msgpack on the wire.

Every message type has a schema name and version (`SCHEMA`, `SCHEMA_VERSION`); the bus
puts `<name>/<version>` in the `Rlpipe-Schema` header so a consumer can refuse what it
does not understand before decoding. Adding an optional field keeps the version (decoders
ignore unknown fields); removing or retyping a field bumps it.

Times are Unix seconds (float). Token ids are ints of the policy's tokenizer.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

from proto.moe import RoutedExperts


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Base of every wire message."""

    SCHEMA: ClassVar[str] = ""
    SCHEMA_VERSION: ClassVar[int] = 1

    @classmethod
    def schema_id(cls) -> str:
        """The value of the `Rlpipe-Schema` header for this type, e.g. `task/1`."""
        return f"{cls.SCHEMA}/{cls.SCHEMA_VERSION}"


class Task(Message, kw_only=True):
    """A task to roll out: one prompt, to be sampled `group_size` times (a GRPO group)."""

    SCHEMA: ClassVar[str] = "task"

    task_id: str
    env: str
    prompt: str
    group_size: int = 1
    # Environment-specific inputs (the expected answer...), opaque to the bus; never shown.
    spec: dict[str, Any] = msgspec.field(default_factory=dict)
    # Workers roll this task out only with weights of at least this version: the synchronous
    # baseline tags each batch with the version it must use; 0 means any version.
    min_policy_version: int = 0
    created_at: float = 0.0


class Turn(msgspec.Struct, kw_only=True):
    """One turn of an episode, with its tokens exactly as the engine produced or consumed them."""

    role: Literal["system", "user", "assistant", "tool"]
    token_ids: list[int]
    # The decoded text, for reward, judges and people; training uses token_ids only.
    text: str = ""
    # Logprob of each sampled token under the distribution it was sampled from; empty for
    # turns the policy did not generate (prompt, tool results).
    logprobs: list[float] = msgspec.field(default_factory=list)
    # Policy version that generated this turn (its first token); None: not generated.
    policy_version: int | None = None
    # The version its last tokens came from, when the worker swapped weights mid-turn (the
    # paged engine swaps between decode steps); None: policy_version throughout.
    policy_version_end: int | None = None
    # Which version sampled which token: (index of the first token sampled with a version,
    # that version) per change, the last one's policy_version_end (proto.version_switches).
    # Empty with policy_version_end set: not recorded (an older worker).
    version_switches: tuple[tuple[int, int], ...] = ()
    # The target hashes of those versions' signed manifests (proto.rollout_contract: a
    # version is named by its number and hash); empty where the engine could not name it.
    policy_version_hash: str = ""
    policy_version_end_hash: str = ""
    # MoE routing of this turn's tokens, for router replay; None: dense, or not recorded.
    routed_experts: RoutedExperts | None = None
    # Context segment of the episode: a self-summarizing episode restarts its context from the
    # task and a summary; each segment is its own training sequence (sharing the reward).
    segment: int = 0


class Rollout(Message, kw_only=True):
    """A finished episode of one sample of a task."""

    SCHEMA: ClassVar[str] = "rollout"

    rollout_id: str
    task_id: str
    group_id: str
    sample_index: int
    env: str
    turns: list[Turn]
    # "stop": the environment ended the episode; otherwise why the harness did: "length" (the
    # context budget), "max_turns", "env_error", "timeout". Turns cut by max_tokens are
    # counted in stats (EPISODE_STAT_TRUNCATED_TURNS).
    finish_reason: Literal["stop", "length", "max_turns", "env_error", "timeout"]
    worker_id: str = ""
    # The task as the worker received it, so reward needs no second lookup.
    task: Task | None = None
    created_at: float = 0.0
    # What the environment reported when the episode ended (e.g. hidden-test results), for
    # reward; written by the environment, never by the policy.
    env_info: dict[str, Any] = msgspec.field(default_factory=dict)
    # The error that ended the episode (`finish_reason == "env_error"`): ENV_ERROR_* kind and text.
    env_error: str = ""
    env_error_message: str = ""
    # Harness counts, for reward and logs: see EPISODE_STAT_* below.
    stats: dict[str, float] = msgspec.field(default_factory=dict)


# Keys of Rollout.stats written by the multi-turn harness.
EPISODE_STAT_TURNS = "num_turns"  # assistant turns generated (summaries not counted)
EPISODE_STAT_TOOL_CALLS = "num_tool_calls"  # well-formed tool calls sent to the environment
EPISODE_STAT_INVALID_TOOL_CALLS = (
    "num_invalid_tool_calls"  # unparsable calls, answered with an error
)
EPISODE_STAT_TOOL_ERRORS = "num_tool_errors"  # tool results the environment marked as errors
EPISODE_STAT_SEGMENTS = "num_segments"  # context segments (1 + summaries taken)
EPISODE_STAT_GENERATED_TOKENS = "num_generated_tokens"
# Assistant turns that max_tokens cut (the policy did not end them with a stop token).
EPISODE_STAT_TRUNCATED_TURNS = "num_truncated_turns"


class CriterionScore(msgspec.Struct, kw_only=True):
    """One named criterion of a rubric, as scored."""

    name: str
    weight: float
    score: float
    reason: str = ""


class ScoredRollout(Message, kw_only=True):
    """A rollout with its reward and the per-criterion breakdown that produced it."""

    SCHEMA: ClassVar[str] = "scored_rollout"

    rollout: Rollout
    reward: float
    criteria: list[CriterionScore] = msgspec.field(default_factory=list)
    # False when a criterion could not be scored (e.g. the judge kept failing); never a silent 0.
    scored: bool = True
    unscored_reason: str = ""
    scored_at: float = 0.0


# --- Weights -------------------------------------------------------------------------------
# The delta codec (libs/weights) uses these structs as its manifest: one definition, here.
# Hashes are XXH3-128 (16 bytes), as lowercase hex ("xxh3-128"): integrity against
# corruption, not against forgery. Format 1 used sha256 truncated to 16 bytes; format 3 adds
# the dense_add piece encoding (format 2 readers would meet it mid-version: they refuse it
# at the manifest instead); format 4 stores a stream uncompressed where zstd does not pay
# (its size equal to its raw size) and splits dense pieces into one stream per byte plane.

WEIGHT_FORMAT_VERSION = 4
WEIGHT_HASH_NAME = "xxh3-128"

# same: identical to the base (costs this entry only); delta: patched from the base;
# whole: sent in full (new, reshaped, retyped, or the version is a snapshot).
TensorChange = Literal["same", "delta", "whole"]


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor of a weight version and how it travels."""

    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: list[int]
    change: TensorChange
    digest: str  # hash of the tensor's bytes in the target version
    num_changed: int  # elements that differ from the base (numel for `whole`)


class ChunkRef(msgspec.Struct, frozen=True, kw_only=True):
    """What the manifest knows about a chunk before fetching it.

    Chunk `index` of a version is stored on subject `weight_chunk_subject(version, kind,
    index)` of the chunk stream (proto.subjects), one message per subject.
    """

    index: int
    num_bytes: int  # size of the msgpack-encoded chunk (the stored message body)
    payload_hash: str  # hash of the chunk's compressed payload
    tensors: list[str]  # names the chunk writes, in order


class WeightManifest(msgspec.Struct, frozen=True, kw_only=True):
    """A versioned delta or snapshot: the target's tensors, removed names and chunk list."""

    format_version: int
    version: int
    base_version: int | None  # None for a snapshot
    base_hash: str | None  # version hash of the base; None for a snapshot
    target_hash: str  # hash of the whole target version (names, dtypes, shapes, bytes)
    tensors: list[TensorEntry]
    removed: list[str]
    chunks: list[ChunkRef]
    hash_name: str = WEIGHT_HASH_NAME

    @property
    def is_snapshot(self) -> bool:
        """True when the manifest needs no base."""
        return self.base_version is None


WeightKind = Literal["delta", "snapshot"]


class WeightAnnouncement(Message, kw_only=True):
    """A new policy version is stored: a delta on `base_version`, or a snapshot.

    A version that is a snapshot point is announced twice: first as a delta (for workers
    holding the previous version), then as a snapshot (for late joiners). Chunks live on the
    chunk stream under `weight_chunk_subject(version, kind, index)`.
    """

    SCHEMA: ClassVar[str] = "weight_announcement"

    version: int
    # None for a snapshot (no base needed).
    base_version: int | None
    kind: WeightKind
    manifest: WeightManifest
    # Hash of the whole target version (the manifest's target_hash).
    version_hash: str
    # The snapshot the chain holding this version starts from (== version for a snapshot),
    # and the number of deltas after it up to this one (0 for a snapshot).
    snapshot_version: int
    chain_length: int
    # Bytes of the target version's tensors, and bytes of the stored chunks.
    model_bytes: int
    encoded_bytes: int
    encode_s: float = 0.0
    created_at: float = 0.0
    # The trainer's side signs what identifies the version (libs/weights/signing.py): the
    # fields above, the manifest's hashes and the policy; receivers verify before applying.
    # Empty: unsigned (taken only by a receiver configured with allow_unsigned).
    signature: bytes = b""
    key_id: str = ""  # which signing key (a digest of its public key)
    policy_digest: str = ""  # the trainer's PolicyIdentity, digested ("": not stated)


StagedKind = Literal["state", "delta"]


class WeightsStaged(Message, kw_only=True):
    """The trainer's handoff to the weight-broadcaster: a new version is on disk.

    The file is `<staging dir>/<file_name>`, written completely before this is published;
    the broadcaster owns it from then on. `kind` "state": the whole version (safetensors),
    which the broadcaster encodes against the last version it announced, and deletes when it
    is no longer the base of the next delta. `kind` "delta": the trainer already encoded the
    version against `base_version`, the version it handed over before (a delta file,
    libs/weights/container.py); the broadcaster stores it as it is, on that base only.
    """

    SCHEMA: ClassVar[str] = "weights_staged"

    version: int
    file_name: str
    num_bytes: int  # size of the file, to catch a truncated copy
    step: int | None = None  # trainer optimizer step, for logs
    created_at: float = 0.0
    kind: StagedKind = "state"
    base_version: int | None = None  # the delta's base (kind "delta")


class SamplingSettings(msgspec.Struct, kw_only=True):
    """Sampling parameters a generation was produced with."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    seed: int | None = None


# The `metadata` entry of a ServedGeneration that names the product it was served for (serve
# mode records a request's `metadata`): feedback on it is joined only when the event's
# product is this one, so a key for another product cannot rate it (libs/feedback/join.py).
GENERATION_PRODUCT_KEY = "product"


class ServedGeneration(Message, kw_only=True):
    """A generation served to a product user, recorded so feedback can train on it."""

    SCHEMA: ClassVar[str] = "served_generation"

    generation_id: str
    policy_version: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    sampling: SamplingSettings
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    training_eligible: bool = True
    created_at: float = 0.0
    # MoE routing of prompt + completion positions (router replay); None for dense models.
    routed_experts: RoutedExperts | None = None
    # Where the weights changed under the completion (swaps between decode steps), as on
    # Turn: the last token's version and proto.version_switches; None and (): one version.
    policy_version_end: int | None = None
    version_switches: tuple[tuple[int, int], ...] = ()


FeedbackSignal = Literal["accepted", "rejected", "edited", "ignored", "thumbs_up", "thumbs_down"]

# Ids a product chooses (a UUID, a ULID, ...): they become a Nats-Msg-Id header and a KV key,
# so only letters, digits, '-' and '_'. `(?!\n)` because Python's `$` also matches before a
# final newline; the pattern means the same in ECMA (JSON Schema) and Python regex.
FeedbackId = Annotated[
    str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+(?!\n)$")
]
ProductName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_-]*(?!\n)$")
]
# Unix seconds, finite: from 0 to year 2286.
UnixTime = Annotated[float, msgspec.Meta(ge=0.0, le=1e10)]
ShortText = Annotated[str, msgspec.Meta(max_length=128)]


class FeedbackEvent(Message, kw_only=True):
    """What a product user did with a served generation (posted to the feedback API)."""

    SCHEMA: ClassVar[str] = "feedback_event"

    # Chosen by the product, unique per event: a repeat with the same id is the same event.
    event_id: FeedbackId
    # The generation this rates, as the serving API returned it.
    generation_id: FeedbackId
    product: ProductName
    signal: FeedbackSignal
    # Optional magnitude (e.g. edit distance ratio for "edited"); meaning per signal.
    value: Annotated[float, msgspec.Meta(ge=-1e9, le=1e9)] | None = None
    occurred_at: UnixTime
    # Set by the feedback-ingester when it accepts the event; a client's value is replaced.
    received_at: UnixTime = 0.0
    # The API key that posted it (its name, and its id: the first 12 hex digits of its
    # sha256), set by the feedback-ingester like received_at: every event can be traced to
    # its key and purged with it (`rlpipe feedback-events`). Empty for events published on
    # the bus directly.
    key_name: ShortText = ""
    key_id: ShortText = ""
    # Hashed by the product: raw user or session ids never enter the system.
    user_hash: ShortText = ""
    session_hash: ShortText = ""
    experiment_arm: ShortText = ""


class OnlineSample(Message, kw_only=True):
    """A served generation joined with the feedback that rates it: one training sample.

    The reward is not here: the trainer maps signals to rewards by its own configuration.
    """

    SCHEMA: ClassVar[str] = "online_sample"

    sample_id: str
    generation: ServedGeneration
    feedback: FeedbackEvent
    joined_at: float = 0.0


class PromotionDecision(Message, kw_only=True):
    """The trainer's eval gate decided whether a policy version may serve product users.

    A candidate is promoted when `candidate_score >= baseline_score - margin` (scores are the
    mean reward on `num_tasks` held-out tasks, greedy decoding); the first version evaluated,
    with nothing promoted before it, is promoted with no baseline. After this decision the
    version serving is `version` if `promoted`, else `baseline_version`: the last decision on
    the stream alone says what serves and with what score.
    """

    SCHEMA: ClassVar[str] = "promotion_decision"

    version: int
    promoted: bool
    candidate_score: float
    # The promoted version compared with, and its score; None for the first decision.
    baseline_version: int | None = None
    baseline_score: float | None = None
    margin: float
    num_tasks: int
    reason: str
    decided_at: float = 0.0

    @property
    def serving_version(self) -> int | None:
        """The promoted version after this decision."""
        return self.version if self.promoted else self.baseline_version

    @property
    def serving_score(self) -> float | None:
        """The held-out score of `serving_version`."""
        return self.candidate_score if self.promoted else self.baseline_score


class PolicyIdentity(Message, kw_only=True):
    """What policy the trainer trains, so every process that loads it can check it agrees.

    The trainer stores it in the state bucket (`POLICY_IDENTITY_KEY`) before it announces
    weights; a rollout-worker whose own policy differs (another tokenizer, vocabulary or
    tensor layout) refuses to start instead of failing later on a weight delta or a token id.
    """

    SCHEMA: ClassVar[str] = "policy_identity"

    # The tokenizer as configured ("byte" or a folder) and a hash of its vocabulary (token ->
    # id, specials included): two folders with the same vocabulary agree.
    tokenizer: str
    tokenizer_hash: str
    tokenizer_vocab_size: int
    # The model family and a hash of its parameter names and shapes (not values or dtypes).
    model_type: str
    model_vocab_size: int
    tensors_hash: str


class DeadLetter(Message, kw_only=True):
    """A message that could not be handled, with why and where it came from.

    The same reason and origin also travel in headers (`Rlpipe-Dead-Reason`,
    `Rlpipe-Dead-Origin`) so operators can filter without decoding.
    """

    SCHEMA: ClassVar[str] = "dead_letter"

    origin_subject: str
    origin_stream: str
    consumer: str
    # unsigned, forged, replayed: a version refused by its signature (libs/weights/signing.py).
    reason: Literal[
        "undecodable",
        "invalid",
        "schema_mismatch",
        "max_deliver",
        "rejected",
        "unsigned",
        "forged",
        "replayed",
    ]
    error: str
    num_delivered: int
    stream_sequence: int
    payload: bytes
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    failed_at: float = 0.0


# --- Environments --------------------------------------------------------------------------
# Episodes over core NATS request/reply (not streams: a step is short-lived and retried by its
# episode, not by the bus). Requests go to `env_op_subject(env, op)` for op in reset, step,
# close, served by every env-gateway in queue group ENV_QUEUE_GROUP. A reset reply names the
# subjects of the gateway instance that holds the episode (`step_subject`, `close_subject`):
# send that episode's steps and close there, so replicas of env-gateway never see an episode
# they do not hold. Error replies carry a kind (ENV_ERROR_* below; a plain string so a newer
# gateway's kinds still decode) and end the episode: the gateway has forgotten it.

ENV_ERROR_UNKNOWN_ENV = "unknown_env"  # no gateway serves this environment
ENV_ERROR_UNKNOWN_EPISODE = "unknown_episode"  # never opened, already done, closed or expired
ENV_ERROR_BAD_REQUEST = "bad_request"  # undecodable request, wrong env, step already running
ENV_ERROR_ENV_CRASHED = "env_crashed"  # the environment raised
ENV_ERROR_TIMEOUT = "timeout"  # a step ran past its limit, or no reply came in time
ENV_ERROR_OVERLOADED = "overloaded"  # the gateway holds its maximum of open episodes
ENV_ERROR_KINDS: tuple[str, ...] = (
    ENV_ERROR_UNKNOWN_ENV,
    ENV_ERROR_UNKNOWN_EPISODE,
    ENV_ERROR_BAD_REQUEST,
    ENV_ERROR_ENV_CRASHED,
    ENV_ERROR_TIMEOUT,
    ENV_ERROR_OVERLOADED,
)


class ToolSpec(msgspec.Struct, kw_only=True):
    """A tool the policy may call: its name, what it does, and its arguments as JSON Schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message of an episode's opening conversation."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ToolCall(msgspec.Struct, kw_only=True):
    """A well-formed call the policy made, parsed by the harness from its generated text."""

    call_id: str
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)


# ToolResult.error kinds: the call ran and failed in a way the agent can see and react to.
TOOL_ERROR_INVALID_CALL = "invalid_call"  # unparsable: answered by the harness, never sent
TOOL_ERROR_UNKNOWN_TOOL = "unknown_tool"
TOOL_ERROR_BAD_ARGUMENTS = "bad_arguments"
TOOL_ERROR_FAILED = "failed"  # the tool ran and reported failure (e.g. file not found)
TOOL_ERROR_LIMIT = "limit_exceeded"  # a sandbox limit stopped it (CPU, memory, processes, size)
TOOL_ERROR_TIMEOUT = "timeout"  # it ran past its wall-clock limit and was killed
TOOL_ERROR_DENIED = "denied"  # the sandbox refused it (network, a path outside the workdir)


class ToolResult(msgspec.Struct, kw_only=True):
    """What one tool call returned; `error` is one of TOOL_ERROR_* or "" on success."""

    call_id: str
    name: str
    content: str
    error: str = ""


class EnvResetRequest(Message, kw_only=True):
    """Open episode `episode_id` (chosen by the caller, unique) on `task`.

    A repeated reset of an open episode (a retry after a lost reply) returns the same opening.
    """

    SCHEMA: ClassVar[str] = "env_reset_request"

    episode_id: str
    task: Task


class EnvResetReply(Message, kw_only=True):
    """The opening observation of an episode and how to generate the first action."""

    SCHEMA: ClassVar[str] = "env_reset_reply"

    episode_id: str
    # Single-turn text environments answer with `observation` (the prompt); tool-calling
    # environments with `messages` (the opening conversation) and the `tools` it may call.
    observation: str = ""
    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    # Most assistant turns the episode allows (0: the harness's own limit).
    max_turns: int = 0
    # Most tokens the policy may generate for its next action, and texts that end it.
    max_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    # Where this episode's steps and close go (the gateway instance holding it).
    step_subject: str = ""
    close_subject: str = ""
    # Unix time after which the gateway forgets the episode.
    deadline: float = 0.0
    error: str = ""  # one of ENV_ERROR_KINDS; "" when the reset succeeded
    error_message: str = ""


class EnvStepRequest(Message, kw_only=True):
    """The policy's action in an open episode."""

    SCHEMA: ClassVar[str] = "env_step_request"

    episode_id: str
    # The policy's generated text for this turn, decoded.
    action: str
    # The well-formed tool calls parsed from `action` (none: the policy gave its final answer).
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class EnvStepReply(Message, kw_only=True):
    """What the action led to. `done` ends the episode (the gateway forgets it)."""

    SCHEMA: ClassVar[str] = "env_step_reply"

    episode_id: str
    observation: str = ""
    # One result per tool call of the request, in order.
    tool_results: list[ToolResult] = msgspec.field(default_factory=list)
    done: bool = False
    # Environment-specific facts about the step, for logs and reward (never a reward itself);
    # the info of the step that ends the episode is kept in Rollout.env_info.
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    # For the next action when not done: 0 and [] mean "as in the reset reply".
    max_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    error: str = ""  # one of ENV_ERROR_KINDS; "" when the step succeeded
    error_message: str = ""


class EnvCloseRequest(Message, kw_only=True):
    """End an episode early (or make sure it is gone); closing twice is harmless."""

    SCHEMA: ClassVar[str] = "env_close_request"

    episode_id: str


class EnvCloseReply(Message, kw_only=True):
    """`closed` is False when the episode was not open (already done, closed or expired)."""

    SCHEMA: ClassVar[str] = "env_close_reply"

    episode_id: str
    closed: bool = False
    error: str = ""
    error_message: str = ""
