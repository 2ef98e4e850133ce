"""The trainer service: GRPO/PPO training on scored rollouts."""
