"""The trainer: consume scored rollouts, GRPO step, publish weights, checkpoint.

cursor      how far the scored stream was consumed (part of every checkpoint)
groups      scored rollouts gathered into complete GRPO groups
step        one optimizer step on a batch of groups (pure: tensors in, stats out)
checkpoint  model, optimizer and cursor, written atomically; resume from the latest
metrics     one record per step: JSON lines, Prometheus, logs
loop        the recipe that ties them together (fetch, advantages, loss, step, publish)
"""
