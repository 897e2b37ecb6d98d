"""How bytes move between replicas: the communicator, cross-device ops, gradient buckets."""
