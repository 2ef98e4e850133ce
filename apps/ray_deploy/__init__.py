"""The services on a Ray cluster: placed by resource request, restarted, the rollout tier
scaled with the task backlog (`rlpipe ray up|status|scale|down`, apps/ray_deploy/cli.py).

Ray is an optional extra (`pip install 'rlpipe[ray]'`): only this package imports it, and
only `plan` is safe to import without it. NATS stays the data plane; Ray places processes.
"""
