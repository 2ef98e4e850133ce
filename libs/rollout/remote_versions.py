"""What a rollout-worker with a `remote` engine follows instead of weights: versions.

The fleet holds the weights; the worker fetches none. It reads the trainer's signed version
announcements (checked as a weight receiver checks them) and its staleness bound (the state
bucket's `trainer_max_staleness`), and tells the engine, at every request, the oldest
version whose rollouts the trainer can still train on:

    versions = RemoteVersions(engine, verifier, batcher)   # sets engine.requirement
    await versions.start(bus.js)                 # notes the newest version announced now
    asyncio.create_task(versions.run())          # polls announcements and the bound
    await versions.wait_caught_up()              # that version (or any) is announced
    with versions.requiring(task.min_policy_version):   # the synchronous baseline's tag
        rollouts = await runner.run(task)

The requirement is `min_version` = max(newest announced - bound, the min_policy_version of
every task rolling out now): a replica behind it refuses (409, retried by the engine). The
versions the fleet states on each choice become the turns' versions; a stated hash other than
the one the trainer signed for that number is refused (`engine.expected_hash`). The surface
the rollout-worker uses is the weights follower's (libs.rollout.weights_follower):
`has_version`, `wait_for_version`, `wait_caught_up`, `usable`, `policy_version`, `problem`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterator

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError

from libs.engine.remote import RemoteEngine
from libs.rollout.batcher import GenerationBatcher
from libs.weights.announcements import latest_announcement
from libs.weights.same_host_link import SameHostTaker
from libs.weights.signing import VersionVerifier
from proto import streams
from proto.rollout_contract import PolicyRequirement

log = structlog.get_logger(__name__)

POLL_S = 1.0
# The fleet failing this many requests in a row (each after all its attempts) is a problem.
FAILURES_FOR_PROBLEM = 3
KEEP_HASHES = 256


class RemoteVersions:
    """The announced versions and the floor a remote engine's requests require."""

    same_host: SameHostTaker | None = None  # the fleet takes versions its own way
    last_pause_s: float | None = None  # no swap here: the fleet's replicas swap
    num_applied = 0
    num_failed = 0

    def __init__(
        self,
        engine: RemoteEngine,
        verifier: VersionVerifier,
        batcher: GenerationBatcher,
        *,
        poll_s: float = POLL_S,
    ) -> None:
        self.engine = engine
        self.verifier = verifier
        self.batcher = batcher
        self.poll_s = poll_s
        self.announced: int | None = None
        self.bound: int | None = None  # the trainer's staleness bound; None: not known
        self.target_version: int | None = None
        self.usable = False
        self._hashes: dict[int, str] = {}  # replaced, never changed: read from the engine
        self._task_floors: Counter[int] = Counter()
        self._requirement = PolicyRequirement()
        self._js: JetStreamContext | None = None
        self._state_js: JetStreamContext | None = None
        self._changed = asyncio.Event()
        engine.requirement = lambda: self._requirement
        engine.expected_hash = lambda version: self._hashes.get(version, "")

    @property
    def policy_version(self) -> int | None:
        """The newest version the fleet stated; None before its first answer."""
        newest = self.engine.newest
        return None if newest is None else newest.version

    @property
    def floor(self) -> int:
        """The oldest version requests accept now."""
        return self._requirement.min_version or 0

    async def start(self, js: JetStreamContext, state_js: JetStreamContext | None = None) -> None:
        """Note the newest version announced now: `wait_caught_up` waits for it."""
        self._js, self._state_js = js, state_js or js
        await self.poll()
        self.target_version = self.announced
        log.info("following versions for a remote engine", target_version=self.target_version)

    async def run(self) -> None:
        """Poll the announcements and the bound every `poll_s`, until cancelled."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.poll()
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("cannot read the announced versions", error=repr(exc))

    async def poll(self) -> None:
        """Read the newest announcements and the trainer's bound; move the floor."""
        assert self._js is not None and self._state_js is not None, "start() first"
        for kind in ("delta", "snapshot"):
            found = await latest_announcement(self._js, kind, verifier=self.verifier)
            if found is not None:
                self._announced(found[1].version, found[1].version_hash)
        self.bound = await _read_bound(self._state_js)
        self._update()

    def _announced(self, version: int, version_hash: str) -> None:
        if self._hashes.get(version) != version_hash:
            kept = sorted(self._hashes.items())[-(KEEP_HASHES - 1) :]
            self._hashes = dict([*kept, (version, version_hash)])
        if self.announced is None or version > self.announced:
            self.announced = version

    def _update(self) -> None:
        """The requirement from what is known now; usable once the target is announced."""
        floors = [task for task, count in self._task_floors.items() if count > 0]
        staleness_floor = 0
        if self.announced is not None and self.bound is not None:
            staleness_floor = max(0, self.announced - self.bound)
        floor = max([staleness_floor, *floors])
        if floor != self.floor:
            log.info("remote requests require a newer version", min_version=floor)
        self._requirement = PolicyRequirement(min_version=floor)
        caught_up = self.announced is not None and self.announced >= (self.target_version or 0)
        if caught_up and not self.usable:
            self.usable = True
            self.batcher.open.set()
        self._notify()

    @contextlib.contextmanager
    def requiring(self, version: int) -> Iterator[None]:
        """Requests made meanwhile need at least `version` (a task's min_policy_version)."""
        self._task_floors[version] += 1
        self._update()
        try:
            yield
        finally:
            self._task_floors[version] -= 1
            if self._task_floors[version] == 0:
                del self._task_floors[version]
            self._update()

    def problem(self) -> str | None:
        """Why rollouts are not getting done: the fleet failing request after request."""
        failed = self.engine.num_failed_in_a_row
        if failed < FAILURES_FOR_PROBLEM:
            return None
        return f"the remote fleet failed {failed} requests in a row: {self.engine.last_error}"

    def use_loaded_weights(self) -> None:
        """Follow no trainer (follow_weights=false): whatever version the fleet holds."""
        self.usable = True
        self.batcher.open.set()
        self._notify()

    def has_version(self, version: int) -> bool:
        """True once `version` (or a newer one) is announced: the fleet can be asked for it."""
        return self.usable and (self.announced or 0) >= version

    async def wait_for_version(self, version: int) -> None:
        while not self.has_version(version):
            await self._changed.wait()

    async def wait_caught_up(self) -> None:
        """Until the version newest at `start` (or any version) is announced."""
        while not self.usable:
            await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


async def _read_bound(js: JetStreamContext) -> int | None:
    """The trainer's staleness bound from the state bucket; None before it wrote one."""
    try:
        kv = await js.key_value(streams.STATE.bucket)
        entry = await kv.get(streams.MAX_STALENESS_KEY)
    except (KeyNotFoundError, KeyDeletedError, NotFoundError):
        return None
    try:
        return int((entry.value or b"").decode())
    except ValueError:
        return None
