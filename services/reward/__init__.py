"""The reward service: scores raw rollouts into scored rollouts."""
