"""The capacity controller: lends serve replicas to RL at off-peak, recalls them ahead of load."""
