"""What a running swarm looks like from its DHT records: a snapshot as plain data, and its renderings."""
