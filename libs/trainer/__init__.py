"""The trainer: consume scored rollouts and feedback, step the policy, publish its versions.

loop          the short loop composing the components below (fetch, step, publish, record,
              gate, checkpoint): `Trainer`
learner       the policy and its optimizer behind one protocol: `LocalLearner` (1 rank),
              `RankLearner` (N ranks, ranks.py over sharded.py's FSDP2 step)
samples       what each step trains on: readers, cursors, refusals, staleness, the online
              mix (mix.py, online_source.py), back-pressure on weights
versions      version numbers, progress in the KV bucket, weights staged (staging.py)
checkpointer  resume from the latest checkpoint, save one beside training (checkpoint.py)
recorder      one record per step and per gate decision (metrics.py)
step          one optimizer step on a batch of groups (pure: tensors in, stats out)
schedule      the learning rate of each step
"""
