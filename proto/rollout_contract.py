"""The versioned rollout contract: what a rollout request may ask of an inference replica
about the policy version, and what every completion states about it.

It extends the OpenAI-compatible completion APIs (`POST /v1/completions`,
`POST /v1/chat/completions`) with one object in the request body and one in each choice of
the response, so any fleet can speak it: our serve replicas (libs.serve), and vLLM or
SGLang behind a thin layer (docs/rollout-contract.md). JSON Schema: `python -m proto.schema`
writes proto/schema/rollout_contract.v1.json.

A version is named by its number and the hash of its signed manifest (the manifest's
`target_hash`, announced as `WeightAnnouncement.version_hash`): the same number can never
name other weights without the hash saying so.

Request, `rl_policy` (all fields optional):
- `min_version: N`: every token comes from version N or newer (a completion's versions only
  grow, so its start version >= N suffices);
- `exact_version: N` (and `exact_hash`, when given): every token of every choice comes from
  version N (with that hash): each choice starts and ends on N. A replica that holds
  another version refuses before generating; one whose weights changed while it generated
  (a swap between decode steps) refuses after, and discards what it generated;
- `return_raw_logprobs`: each choice also carries the plain-softmax logprobs of its tokens.

Refusal: a replica that cannot serve the requirement answers HTTP 409 with `Retry-After`
(seconds) and OpenAI's error shape, `error.code` = `policy_version_unavailable` and
`error.rl_policy` = `VersionUnavailable` (the version it holds now). The refusal is
retryable: later, or on another replica.

Response: every choice carries `rl_policy` = `ChoicePolicy`: the versions its first and
last tokens came from, where between them the version changed (`switches`: a replica that
swaps weights between decode steps names the first token of each new version), and which
kind of logprobs its `logprobs` are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

CONTRACT_VERSION = 1
CONTRACT_FIELD = "rl_policy"
"""The request body's and each choice's field that carries the contract."""
VERSION_UNAVAILABLE = "policy_version_unavailable"
"""`error.code` of the refusal."""
VERSION_UNAVAILABLE_STATUS = 409

Version = Annotated[int, msgspec.Meta(ge=0)]
TokenIndex = Annotated[int, msgspec.Meta(ge=0)]
VersionHash = Annotated[str, msgspec.Meta(max_length=128)]
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


class PolicyVersionRef(msgspec.Struct, frozen=True, kw_only=True):
    """One policy version: its number and the target hash of its signed manifest."""

    version: Version
    hash: VersionHash = ""
    """Empty when the replica's weights did not come with a manifest it could name (weights
    loaded from a folder, or copied from the trainer's memory on its host)."""


class PolicyRequirement(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`rl_policy` of a request: the version the completion must come from."""

    min_version: Version | None = None
    """Every token from this version or a newer one."""
    exact_version: Version | None = None
    """Every token of every choice from this version: each choice starts and ends on it."""
    exact_hash: VersionHash = ""
    """With `exact_version`: the version's hash too (empty: any hash)."""
    return_raw_logprobs: bool = False
    """Each choice's `rl_policy.raw_logprobs`: its tokens' logprobs under the model's plain
    softmax (temperature 1, no top-p), besides the processed ones in `logprobs`."""

    def __post_init__(self) -> None:
        if self.min_version is not None and self.exact_version is not None:
            raise ValueError("give min_version or exact_version, not both")
        if self.exact_hash and self.exact_version is None:
            raise ValueError("exact_hash needs exact_version")

    def admits_start(self, held: PolicyVersionRef) -> bool:
        """Whether a replica holding `held` may start generating for this requirement."""
        if self.exact_version is not None:
            return self.admits_token(held)
        return self.min_version is None or held.version >= self.min_version

    def admits_token(self, version: PolicyVersionRef) -> bool:
        """Whether a token of `version` fulfils this requirement."""
        if self.exact_version is not None:
            same_hash = not self.exact_hash or version.hash == self.exact_hash
            return version.version == self.exact_version and same_hash
        return self.min_version is None or version.version >= self.min_version

    def admits(self, stated: ChoicePolicy) -> bool:
        """Whether a finished choice that states `stated` fulfils this requirement."""
        return self.admits_token(stated.start) and self.admits_token(stated.end)


class ChoicePolicy(msgspec.Struct, frozen=True, kw_only=True):
    """`rl_policy` of each choice of a response: the versions it came from."""

    start: PolicyVersionRef
    """The version its first token came from."""
    end: PolicyVersionRef
    """The version its last token came from (== start unless the weights changed while it
    was generated)."""
    switches: list[tuple[TokenIndex, Version]] = msgspec.field(default_factory=list)
    """[index of the first token sampled with a version, that version] for every change
    from `start`, in token order, the last one's version `end`'s (proto.version_switches).
    Empty when one version sampled every token, or when the replica does not say where the
    versions changed (then a token between the first and last is known only to come from a
    version in start..end)."""
    logprobs_mode: LogprobsMode
    """What the choice's `logprobs` are: `processed_logprobs` (under the distribution each
    token was sampled from, after temperature and top-p: what the trainer corrects
    against) or `raw_logprobs` (the model's plain softmax)."""
    raw_logprobs: list[float] | None = None
    """With `return_raw_logprobs`: the plain-softmax logprob of each token."""


class VersionUnavailable(msgspec.Struct, frozen=True, kw_only=True):
    """`error.rl_policy` of the refusal: what the replica holds and what was asked."""

    held: PolicyVersionRef | None
    """The version the replica generates with now; None while it holds none."""
    required: PolicyRequirement
    retry_after_s: Annotated[int, msgspec.Meta(ge=0)]
    """Also sent as the `Retry-After` header."""


def parse_requirement(value: Any) -> PolicyRequirement:
    """The request's `rl_policy` (decoded JSON); ValueError naming what is wrong."""
    try:
        return msgspec.convert(value, PolicyRequirement)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from exc


def contract_schema() -> dict[str, Any]:
    """JSON Schema of the contract's three objects, as `$defs`."""
    roots = (PolicyRequirement, ChoicePolicy, VersionUnavailable)
    _, components = msgspec.json.schema_components(roots, ref_template="#/$defs/{name}")
    return {
        "$comment": (
            f"rlpipe rollout contract v{CONTRACT_VERSION}: request body field "
            f"'{CONTRACT_FIELD}' (PolicyRequirement), each choice's '{CONTRACT_FIELD}' "
            f"(ChoicePolicy), refusal HTTP {VERSION_UNAVAILABLE_STATUS} with error.code "
            f"'{VERSION_UNAVAILABLE}' and error.{CONTRACT_FIELD} (VersionUnavailable); "
            "see docs/rollout-contract.md"
        ),
        "$defs": components,
    }
