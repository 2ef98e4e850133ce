"""The versions an engine generated with lately, each named by its number and hash.

A local engine knows the number of the version it runs; the weights follower knows, as it
applies a version, the target hash of its signed manifest. The book joins the two, so a
rollout's turns and a served choice name their versions as the rollout contract does
(proto.rollout_contract: number and hash):

    book = VersionBook()
    book.record(7, announcement.version_hash)      # the follower, as it applies version 7
    book.ref(7)                                    # PolicyVersionRef(version=7, hash=...)
    generate = book.stamped(batcher.generate)      # completions with their hashes

It keeps the last `keep` versions: a completion names the version it started on, which a
long generation may have left several versions behind.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from libs.engine.base import Completion, SamplingParams
from proto.rollout_contract import PolicyVersionRef

GenerateFn = Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]]
DEFAULT_KEEP = 256


class VersionBook:
    """Version number -> target hash, of the last `keep` versions recorded."""

    def __init__(self, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._hashes: OrderedDict[int, str] = OrderedDict()

    def record(self, version: int, version_hash: str) -> None:
        """The engine generates with `version` (whose hash is `version_hash`, or "" when
        unknown) from now on; a number recorded again takes the newer hash."""
        self._hashes.pop(version, None)
        self._hashes[version] = version_hash
        while len(self._hashes) > self.keep:
            self._hashes.popitem(last=False)

    def hash_of(self, version: int) -> str:
        """The hash recorded for `version`; "" when unknown."""
        return self._hashes.get(version, "")

    def ref(self, version: int) -> PolicyVersionRef:
        return PolicyVersionRef(version=version, hash=self.hash_of(version))

    def stamp(self, completion: Completion) -> Completion:
        """`completion` with the hashes of its versions (those it names already kept)."""
        start = completion.policy_version_hash or self.hash_of(completion.policy_version)
        end = completion.policy_version_end_hash
        if completion.policy_version_end is not None and not end:
            end = self.hash_of(completion.policy_version_end)
        return dataclasses.replace(
            completion, policy_version_hash=start, policy_version_end_hash=end
        )

    def stamped(self, generate: GenerateFn) -> GenerateFn:
        """`generate`, its completions stamped with their versions' hashes."""

        async def generate_stamped(
            prompts: list[list[int]], params: SamplingParams
        ) -> list[Completion]:
            return [self.stamp(c) for c in await generate(prompts, params)]

        return generate_stamped
