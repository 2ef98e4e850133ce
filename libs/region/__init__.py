"""Self-sufficient regions: a region's own NATS server keeps its workers going through a link
outage (proto/regions.py says what crosses the link; docs/regions.md how to run one)."""
