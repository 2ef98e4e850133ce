"""The rollout-worker's logic: batching generation across tasks (batcher), running episodes
(episode, agent), following weight versions (weights_follower), episode figures (figures).

Nothing is imported here: the light modules (figures) are read by every `rlpipe` command, the
engine-bound ones pull in torch."""
