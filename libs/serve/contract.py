"""Serve mode's side of the rollout contract (proto.rollout_contract, docs/rollout-contract.md).

A request's `rl_policy` names the version its completion must come from; the replica
refuses what it cannot serve with a retryable 409 `policy_version_unavailable`:

    requirement = requirement_of(request)              # 400 for a malformed rl_policy
    refuse_unless_held(requirement, held, 1)           # before generating: the version held
    refuse_unless_kept(requirement, completions, book, 1)   # after: no swap broke `exact`
    statement(completion, book, "processed_logprobs", raw=True)   # each choice's rl_policy

Versions are named by number and the hash of their signed manifest, from the worker's
VersionBook (the versions the weights follower applied). A version the replica cannot name
(loaded from a folder, copied from the trainer's memory) has hash "": it can serve a
`min_version` or an `exact_version` without `exact_hash`, never one with a hash.
"""

from __future__ import annotations

from typing import Any

import msgspec

from libs.engine.base import Completion
from libs.rollout.version_book import VersionBook
from libs.serve.protocol import ApiError, CommonRequest, LogprobsMode, invalid
from proto.rollout_contract import (
    CONTRACT_FIELD,
    VERSION_UNAVAILABLE,
    VERSION_UNAVAILABLE_STATUS,
    ChoicePolicy,
    PolicyRequirement,
    PolicyVersionRef,
    VersionUnavailable,
    parse_requirement,
)


class VersionRefusal(ApiError):
    """The retryable refusal: 409, Retry-After, and what the replica holds in the body."""

    def __init__(
        self,
        message: str,
        requirement: PolicyRequirement,
        held: PolicyVersionRef | None,
        retry_after_s: int,
    ) -> None:
        super().__init__(
            VERSION_UNAVAILABLE_STATUS,
            message,
            type="server_error",
            param=CONTRACT_FIELD,
            code=VERSION_UNAVAILABLE,
            retry_after_s=retry_after_s,
        )
        self.unavailable = VersionUnavailable(
            held=held, required=requirement, retry_after_s=retry_after_s
        )

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"][CONTRACT_FIELD] = msgspec.to_builtins(self.unavailable)
        return body


def requirement_of(request: CommonRequest) -> PolicyRequirement | None:
    """The request's `rl_policy`, or None; a 400 naming what is wrong with it."""
    if request.rl_policy is None:
        return None
    try:
        return parse_requirement(request.rl_policy)
    except ValueError as exc:
        raise invalid(f"{CONTRACT_FIELD}: {exc}", CONTRACT_FIELD) from exc


def describe(requirement: PolicyRequirement) -> str:
    if requirement.exact_version is not None:
        named = f" with hash {requirement.exact_hash}" if requirement.exact_hash else ""
        return f"exactly version {requirement.exact_version}{named}"
    return f"version {requirement.min_version or 0} or newer"


def refuse_unless_held(
    requirement: PolicyRequirement | None, held: PolicyVersionRef, retry_after_s: int
) -> None:
    """A VersionRefusal when a replica holding `held` cannot start on `requirement`."""
    if requirement is None or requirement.admits_start(held):
        return
    raise VersionRefusal(
        f"this replica holds version {held.version}; the request requires "
        f"{describe(requirement)}: retry later or on another replica",
        requirement,
        held,
        retry_after_s,
    )


def refuse_unless_kept(
    requirement: PolicyRequirement | None,
    completions: list[Completion],
    versions: VersionBook,
    retry_after_s: int,
) -> None:
    """A VersionRefusal when a generated choice breaks `requirement` (the weights changed
    while it was generated: an exact requirement is broken; the tokens are discarded)."""
    if requirement is None:
        return
    for completion in completions:
        start, end = _refs(completion, versions)
        if not (requirement.admits_token(start) and requirement.admits_token(end)):
            raise VersionRefusal(
                f"the weights changed from version {start.version} to {end.version} while "
                f"generating; the request requires {describe(requirement)}: retry on a "
                "replica that holds it",
                requirement,
                end,
                retry_after_s,
            )


def statement(
    completion: Completion, versions: VersionBook, mode: LogprobsMode, *, raw: bool
) -> dict[str, Any]:
    """A choice's `rl_policy`: the versions it started and ended on and where they changed,
    what its logprobs are."""
    start, end = _refs(completion, versions)
    stated = ChoicePolicy(
        start=start,
        end=end,
        switches=list(completion.version_switches),
        logprobs_mode=mode,
        raw_logprobs=list(completion.raw_logprobs) if raw else None,
    )
    body: dict[str, Any] = msgspec.to_builtins(stated)
    if not raw:
        del body["raw_logprobs"]
    return body


def _refs(
    completion: Completion, versions: VersionBook
) -> tuple[PolicyVersionRef, PolicyVersionRef]:
    """The versions the completion started and ended on, named with their hashes."""
    start = PolicyVersionRef(
        version=completion.policy_version,
        hash=completion.policy_version_hash or versions.hash_of(completion.policy_version),
    )
    end_version = completion.policy_version_end
    if end_version is None:
        return start, start
    end_hash = completion.policy_version_end_hash or versions.hash_of(end_version)
    return start, PolicyVersionRef(version=end_version, hash=end_hash)
