"""The rollout-worker service: rolls out tasks with an inference engine and hot-swaps weights."""
