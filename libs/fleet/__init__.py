"""The serving fleet: serve replicas lent to RL at off-peak and recalled ahead of load.

- `config`: the replica's `lending` and the controller's `fleet` settings;
- `load_meter`: a replica's product traffic (rate, latency) as its heartbeat reports it;
- `lending`: a replica's side of a loan (drain, take the trainer's version, pull tasks;
  recalled: finish or requeue the episodes, restore the promoted version bit-exactly);
- `controller`: the capacity controller's decisions, from the replicas' heartbeats;
- `ledger`: what each replica serves, and the decisions, as `rlpipe fleet` prints them;
- `balancer`: a client that sends product requests to ready replicas only.
"""
