"""The rollout-worker's logic: batching generation across tasks, running episodes, and
following weight versions (see each module's docstring)."""

from libs.rollout.batcher import GenerationBatcher, ThroughputMeter
from libs.rollout.episode import RunnerSettings, rollout_id
from libs.rollout.weights_follower import WeightsFollower, WeightsMismatchError

__all__ = [
    "GenerationBatcher",
    "RunnerSettings",
    "ThroughputMeter",
    "WeightsFollower",
    "WeightsMismatchError",
    "rollout_id",
]
