"""The kombu transport (``zk://``): queues of sequential znodes, claims,
acks, hand-off, owner liveness, routing, publishing."""
